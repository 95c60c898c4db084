"""The server's settings, checked once when the server is built.

Each setting that ``judge serve`` takes carries its flag in its annotation
(``Annotated[int, Flag("--max-queue", "count", "...")] = 64``); ``service.web.command`` makes
the flags from them, with the settings' defaults, so a setting and its flag are one edit.
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Annotated, Any, Literal, get_args, get_type_hints

from calibration import PolicyDefaults
from calibration.profile import NAME_PATTERN
from calibration.validation import check_probability
from judge.packing import DEFAULT_MAX_BATCH_SIZE, DEFAULT_MAX_BATCH_TOKENS
from service.profiles import ProfileBackend

__all__ = ["Flag", "FlagKind", "ServiceConfig", "flags"]

# What a flag's value is on the command line, and how it is checked there:
#   count        a whole number >= 1              duration   a finite number >= 0
#   probability  a number in [0, 1]               positive   a finite number > 0
#   path, text   a path, any string               switch     on when given, else off
#   key_file     a file whose first line is the value (else $JUDGE_API_KEY; neither: None)
#   rates        [PROFILE=]RATE, repeated: sets audit_rate (no PROFILE) and audit_rates
#   stages       NAME=MODEL or NAME=URL, repeated, in order: a cascade's later stages
FlagKind = Literal[
    "count",
    "duration",
    "probability",
    "positive",
    "path",
    "text",
    "switch",
    "key_file",
    "rates",
    "stages",
]


@dataclass(frozen=True)
class Flag:
    """How ``judge serve`` takes a setting: its flag, its kind of value, and its help.

    The flag's default is the setting's; the help says it. Settings that share a flag
    (``--audit-rate``: ``audit_rate`` and ``audit_rates``) carry the same Flag.
    """

    name: str  # "--max-queue"
    kind: FlagKind
    help: str
    metavar: str | None = None
    group: Literal["log"] | None = None  # shown under the decision log's heading

    @property
    def dest(self) -> str:
        """The flag's attribute on the parsed arguments: ``--max-queue`` -> ``max_queue``."""
        return self.name.removeprefix("--").replace("-", "_")


_AUDIT_RATE = Flag(
    "--audit-rate",
    "rates",
    "mark this share of decisions (of PROFILE's, or of all) audit: true, a uniform sample for "
    "people to label; repeat for each profile",
    metavar="[PROFILE=]RATE",
    group="log",
)


@dataclass(frozen=True)
class ServiceConfig:
    # A directory on this machine, or any service.profiles.ProfileBackend: with replicas,
    # a SharedDirectory that every replica mounts, so that they all serve the same profiles.
    profiles_dir: Annotated[
        Path | ProfileBackend,
        Flag("--profiles-dir", "path", "the directory of calibration profiles (/profiles)"),
    ] = Path("profiles")
    max_batch_size: Annotated[
        int, Flag("--max-batch-size", "count", "judgments per forward pass")
    ] = DEFAULT_MAX_BATCH_SIZE
    # Tokens one pass may hold (``judge.packing.pass_tokens``). A judgment of about 4,000
    # tokens takes about 3-4 s on 2 cores of this CPU (SmolLM2-135M, bfloat16), so this keeps
    # any one pass to a few seconds. The one budget: the batcher coalesces to it, and the
    # engine packs to it (built with ``engine_options``; the service refuses an engine built
    # with another).
    max_batch_tokens: Annotated[
        int,
        Flag(
            "--max-batch-tokens",
            "count",
            "tokens per forward pass, so no pass holds the model for long",
        ),
    ] = DEFAULT_MAX_BATCH_TOKENS
    max_wait_ms: Annotated[
        float, Flag("--max-wait-ms", "duration", "milliseconds to wait for a batch to fill")
    ] = 5.0
    # Requests that need the model (judge, batch, fit) admitted at once; more wait at the door
    # for up to ``admission_wait_s``, unread, then get a 503.
    max_queue: Annotated[
        int,
        Flag(
            "--max-queue",
            "count",
            "requests needing the model admitted at once; the rest wait at the door",
        ),
    ] = 64
    admission_wait_s: Annotated[
        float,
        Flag(
            "--admission-wait",
            "duration",
            "seconds a request waits at the door for a slot before its 503",
        ),
    ] = 2.0
    max_jobs: Annotated[
        int,
        Flag("--max-jobs", "count", "model jobs queued at once, over all admitted requests"),
    ] = 16_384
    request_timeout_s: Annotated[
        float,
        Flag(
            "--request-timeout",
            "duration",
            "seconds a judgment request may take; clients may ask for less with the "
            "X-Request-Timeout header",
        ),
    ] = 60.0
    fit_timeout_s: Annotated[
        float, Flag("--fit-timeout", "duration", "the same for a fit (POST /profiles/{name}/fit)")
    ] = 1800.0
    # Tokens one judgment (or a batch item, or a shared question with its context) may feed the
    # model; larger ones are refused with a 413 before any work. See max_batch_tokens.
    max_request_tokens: Annotated[
        int,
        Flag(
            "--max-request-tokens",
            "count",
            "tokens one judgment (a request, a batch item, a shared question with its context) "
            "may feed the model; larger ones get a 413 before any work (4,000 tokens take about "
            "3-4 s on 2 CPU cores)",
        ),
    ] = 4096
    # Questions one POST /v1/systemone may ask about its state; more are refused with a 413.
    max_questions: Annotated[
        int,
        Flag(
            "--max-questions", "count", "questions one POST /v1/systemone may ask; more get a 413"
        ),
    ] = 64
    read_timeout_s: Annotated[
        float,
        Flag("--read-timeout", "duration", "seconds a client may take to send its body, else 408"),
    ] = 30.0
    api_key: Annotated[
        str | None,
        Flag(
            "--api-key-file",
            "key_file",
            "require 'Authorization: Bearer KEY' on every endpoint but /health, KEY being this "
            "file's first line (default: $JUDGE_API_KEY; neither: no auth). A key is not taken "
            "on the command line, where any user can read it in `ps`.",
        ),
    ] = None
    max_body_bytes: Annotated[
        int, Flag("--max-body-bytes", "count", "the largest request body; larger get a 413")
    ] = 1_000_000
    # PUT /profiles/{name} only: a probe profile may hold MAX_PROBE_WEIGHTS (2**18) weights,
    # about 6 MB of compact JSON (8 MB pretty-printed), far over max_body_bytes. Larger
    # bodies get a 413 that names this limit.
    max_profile_bytes: Annotated[
        int,
        Flag(
            "--max-profile-bytes",
            "count",
            "the largest body PUT /profiles/{name} takes (a probe's profile: about 6 MB)",
        ),
    ] = 16 * 2**20
    # A cascade (calibration.cascade): where this server's engine escalates, the item goes to
    # each later stage in turn, a model loaded in this process (a .gguf file, a directory or
    # a hub id) or another judge server (an http(s):// URL), by name, in order. A request's
    # profile P is this engine's; a later stage NAME decides with the profile "P-NAME" (its
    # own store's, for a remote one), as calibration.tasks.fit_cascade names them.
    cascade: Annotated[
        Mapping[str, str],
        Flag(
            "--cascade",
            "stages",
            "a later stage of a cascade: NAME=MODEL (a .gguf, directory or hub id, loaded "
            "here) or NAME=URL (another judge serve); repeat in order. POST /judge and batch "
            "items escalated here go to each in turn, under the request's profile P-NAME",
            metavar="NAME=TARGET",
        ),
    ] = field(default_factory=dict)
    stage_name: Annotated[
        str,
        Flag("--stage-name", "text", "this server's engine's name as a cascade's first stage"),
    ] = "local"
    # No accept without a certificate: a request with no profile, or whose profile certified
    # no threshold, escalates (uncalibrated, no_certified_threshold) unless the server opts in
    # here (or the request does, with its own uncertified_threshold). Off by default: raw
    # confidence at 0.9 was right 33% of the time on ag_news with the default model.
    uncertified_threshold: Annotated[
        float | None,
        Flag(
            "--uncertified-threshold",
            "probability",
            "OPT-IN, NO GUARANTEE: accept at this confidence where no certified threshold "
            "exists (no profile, or one that certified none); default: escalate those",
        ),
    ] = None
    min_choice_mass: Annotated[
        float,
        Flag(
            "--min-choice-mass",
            "probability",
            "escalate when the choices' share of the next-token distribution is below this, "
            "where neither the request nor its profile sets one (0: no check)",
        ),
    ] = 0.0
    # Where every decision is appended (service.log.decision_log): a SQLite file (a path or
    # sqlite:///path) or a postgresql:// URL; None: no log, and no feedback or health.
    decision_log: Annotated[
        str | None,
        Flag(
            "--decision-log",
            "text",
            "a SQLite file (created if missing) or a postgresql:// URL (the "
            "postgres extra), shared by every replica",
            metavar="TARGET",
            group="log",
        ),
    ] = None
    # Keep each decision's request (its prompt text) in the log, for ``judge replay`` and
    # ``judge calibrate --from-log``. Off by default: prompts may hold what must not be kept.
    log_requests: Annotated[
        bool,
        Flag(
            "--log-requests",
            "switch",
            "keep each decision's request (its prompt text) too, for judge replay",
            group="log",
        ),
    ] = False
    # Keep each decision's hidden states (service.log.logged_features) in the log, for
    # ``judge calibrate --from-log`` to refit a probe: a probe profile's layers, else the
    # candidate layers; float16, 1.5-7.7 KB a decision on the default model. Off by default.
    log_features: Annotated[
        bool,
        Flag(
            "--log-features",
            "switch",
            "keep each decision's hidden states (float16; a probe profile's layers, else the "
            "probe's candidate layers) too, so that judge calibrate --from-log can fit a probe",
            group="log",
        ),
    ] = False
    # Retention of the log: decisions older than this many days, and beyond this many rows
    # the oldest, are deleted (service.log.decision_log.Retention). None: no bound of that kind.
    log_max_age_days: Annotated[
        float | None,
        Flag(
            "--log-max-age-days",
            "positive",
            "delete logged decisions older than this",
            group="log",
        ),
    ] = 90.0
    log_max_rows: Annotated[
        int | None,
        Flag(
            "--log-max-rows",
            "count",
            "keep at most this many logged decisions, the newest",
            group="log",
        ),
    ] = 1_000_000
    # Refit a profile from the log in the background once this many new labels of its
    # decisions have arrived (service.web.background_refit); None: never (a person runs
    # judge calibrate --from-log).
    refit_every: Annotated[
        int | None,
        Flag(
            "--refit-every",
            "count",
            "refit a profile from the log in the background after this many new labels of its "
            "decisions (or a quarter of those the last refit read, if more: a refit reads them "
            "all); the refit is served only when it certifies at least the coverage of the "
            "version it refits (every version kept: POST /profiles/{name}/rollback)",
            metavar="LABELS",
            group="log",
        ),
    ] = None
    # With refit_every: an adapter profile's refit retrains its adapter too, not only its head.
    refit_adapters: Annotated[
        bool,
        Flag(
            "--refit-adapters",
            "switch",
            "with --refit-every: retrain an adapter profile's adapter on the logged items too "
            "(needs --log-requests; minutes of the machine's cores, in the background), not "
            "only its head on the logged scores",
            group="log",
        ),
    ] = False
    # Every this many logged decisions of a profile version, the class mix of its answers is
    # tested against its certificate's (service.log.shift_watch); once it moved, the version's
    # decisions escalate (prior_shift) until the profile is re-certified.
    shift_check_every: Annotated[
        int,
        Flag(
            "--shift-check-every",
            "count",
            "test each profile version's answers' mix against its certificate's every this "
            "many logged decisions (a sequential test: a false hold at most --alpha-prior over "
            "all time); once it moved, that version escalates everything (prior_shift) until "
            "re-certified",
            metavar="DECISIONS",
            group="log",
        ),
    ] = 50
    alpha_prior: Annotated[
        float,
        Flag(
            "--alpha-prior",
            "probability",
            "the mix test's false-hold rate while nothing shifts, over all checks",
            group="log",
        ),
    ] = 0.01
    correct_prior: Annotated[
        bool,
        Flag(
            "--correct-prior",
            "switch",
            "while a version is held for a moved mix, serve its probabilities moved to the "
            "live class prior estimated without labels (EM); they still escalate",
            group="log",
        ),
    ] = False
    # The share of decisions marked for audit (calibration.Policy.audit_rate), for the server
    # and per profile name (which wins).
    audit_rate: Annotated[float, _AUDIT_RATE] = 0.0
    audit_rates: Annotated[Mapping[str, float], _AUDIT_RATE] = field(default_factory=dict)
    # The two defaults above, as the policy takes them; built once, here.
    policy_defaults: PolicyDefaults = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for name, (kind, optional) in _bounded().items():
            _check_kind(name, getattr(self, name), kind, optional)
        check_probability(self.audit_rate, "audit_rate")  # named as the server's setting
        for profile, rate in self.audit_rates.items():
            check_probability(rate, f"audit_rates[{profile!r}]")
        if not 0 < self.alpha_prior < 1:
            raise ValueError(f"alpha_prior must be in (0, 1), got {self.alpha_prior!r}")
        if self.refit_every is not None and self.decision_log is None:
            raise ValueError("refit_every refits from the decision log: set decision_log")
        if self.refit_adapters and (self.refit_every is None or not self.log_requests):
            raise ValueError(
                "refit_adapters retrains from the logged items: set refit_every and log_requests"
            )
        for name in [self.stage_name, *self.cascade]:
            if not re.fullmatch(NAME_PATTERN, name):
                raise ValueError(f"a stage's name must match {NAME_PATTERN}, got {name!r}")
        if self.stage_name in self.cascade:
            raise ValueError(f"stage {self.stage_name!r} is this server's; name the others apart")
        for name, target in self.cascade.items():
            if not target:
                raise ValueError(f"cascade stage {name!r} needs a model or a URL")
        if self.max_request_tokens > self.max_batch_tokens:
            raise ValueError(
                f"max_request_tokens ({self.max_request_tokens}) must not exceed "
                f"max_batch_tokens ({self.max_batch_tokens}): a judgment must fit in one pass"
            )
        defaults = PolicyDefaults(
            uncertified_threshold=self.uncertified_threshold,
            min_choice_mass=self.min_choice_mass,
        )
        object.__setattr__(self, "policy_defaults", defaults)  # frozen: set once, here

    @property
    def engine_options(self) -> dict[str, int]:
        """What the engine is built with (``Judge.load(..., **engine_options)``) so that it
        packs its passes to this server's bounds."""
        return {"max_batch_size": self.max_batch_size, "max_batch_tokens": self.max_batch_tokens}


def flags() -> dict[str, Flag]:
    """Each setting that ``judge serve`` takes, by name, and its flag (in declaration order)."""
    hints = get_type_hints(ServiceConfig, include_extras=True)
    found: dict[str, Flag] = {}
    for setting in fields(ServiceConfig):
        for meta in getattr(hints[setting.name], "__metadata__", ()):
            if isinstance(meta, Flag):
                found[setting.name] = meta
    return found


# What a number of each kind must be (the bounds in ``FlagKind``'s table): a test, and its
# words. The command line reads each kind to the same bounds (``service.command_line``); these
# hold a ServiceConfig built in Python to them too.
_BOUNDS: dict[FlagKind, tuple[Callable[[Any], bool], str]] = {
    "count": (lambda v: isinstance(v, int) and v >= 1, "a whole number >= 1"),
    "duration": (lambda v: _finite(v) and v >= 0, "a finite number >= 0"),
    "positive": (lambda v: _finite(v) and v > 0, "a finite number > 0"),
    "probability": (lambda v: _finite(v) and 0 <= v <= 1, "a number in [0, 1]"),
}


def _finite(value: object) -> bool:
    return isinstance(value, int | float) and math.isfinite(value)


@functools.cache
def _bounded() -> dict[str, tuple[FlagKind, bool]]:
    """Each setting whose flag's kind bounds a number, with that kind and whether it may be
    None (no bound of that kind: its type says so)."""
    hints = get_type_hints(ServiceConfig, include_extras=True)
    return {
        name: (flag.kind, type(None) in get_args(get_args(hints[name])[0]))
        for name, flag in flags().items()
        if flag.kind in _BOUNDS
    }


def _check_kind(name: str, value: object, kind: FlagKind, optional: bool) -> None:
    """A ValueError naming setting ``name`` where ``value`` is not a number of its ``kind``
    (a bool is not a number here)."""
    if value is None and optional:
        return
    holds, words = _BOUNDS[kind]
    if isinstance(value, bool) or not holds(value):
        alternative = " or None" if optional else ""
        raise ValueError(f"{name} must be {words}{alternative}, got {value!r}")
