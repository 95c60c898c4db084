"""The server's settings, checked once when the server is built."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from calibration import PolicyDefaults
from calibration.validation import check_probability
from judge.packing import DEFAULT_MAX_BATCH_SIZE, DEFAULT_MAX_BATCH_TOKENS
from service.profiles import ProfileBackend

__all__ = ["ServiceConfig"]


@dataclass(frozen=True)
class ServiceConfig:
    # A directory on this machine, or any service.profiles.ProfileBackend: with replicas,
    # a SharedDirectory that every replica mounts, so that they all serve the same profiles.
    profiles_dir: Path | ProfileBackend = Path("profiles")
    max_batch_size: int = DEFAULT_MAX_BATCH_SIZE  # judgments coalesced into one pass
    # Tokens one pass may hold, padding included. A judgment of about 4,000 tokens takes about
    # 3-4 s on 2 cores of this CPU (SmolLM2-135M, bfloat16), so this keeps any one pass to a
    # few seconds. The one budget: the batcher coalesces to it, and the engine packs to it
    # (built with ``engine_options``; the service refuses an engine built with another).
    max_batch_tokens: int = DEFAULT_MAX_BATCH_TOKENS
    max_wait_ms: float = 5.0
    # Requests that need the model (judge, batch, fit) admitted at once; more wait at the door
    # for up to ``admission_wait_s``, unread, then get a 503.
    max_queue: int = 64
    admission_wait_s: float = 2.0
    max_jobs: int = 16_384  # model jobs queued at once, over all admitted requests
    request_timeout_s: float = 60.0  # the longest deadline; a request may ask for a shorter one
    fit_timeout_s: float = 1800.0  # the same for POST /profiles/{name}/fit
    # Tokens one judgment (or a batch item, or a shared question with its context) may feed the
    # model; larger ones are refused with a 413 before any work. See max_batch_tokens.
    max_request_tokens: int = 4096
    # Questions one POST /v1/systemone may ask about its state; more are refused with a 413.
    max_questions: int = 64
    read_timeout_s: float = 30.0  # the longest a client may take to send its body
    api_key: str | None = None
    max_body_bytes: int = 1_000_000
    # PUT /profiles/{name} only: a probe profile may hold MAX_PROBE_WEIGHTS (2**18) weights,
    # about 6 MB of compact JSON (8 MB pretty-printed), far over max_body_bytes. Larger
    # bodies get a 413 that names this limit.
    max_profile_bytes: int = 16 * 2**20
    default_threshold: float = 0.9  # used when neither the request nor a profile sets one
    min_choice_mass: float = 0.0  # escalate below this; 0 disables the check
    # Where every decision is appended (service.decision_log): a SQLite file (a path or
    # sqlite:///path) or a postgresql:// URL; None: no log, and no feedback or health.
    decision_log: str | None = None
    # Keep each decision's request (its prompt text) in the log, for ``judge replay`` and
    # ``judge calibrate --from-log``. Off by default: prompts may hold what must not be kept.
    log_requests: bool = False
    # Retention of the log: decisions older than this many days, and beyond this many rows
    # the oldest, are deleted (service.decision_log.Retention). None: no bound of that kind.
    log_max_age_days: float | None = 90.0
    log_max_rows: int | None = 1_000_000
    # The share of decisions marked for audit (calibration.Policy.audit_rate), for the server
    # and per profile name (which wins).
    audit_rate: float = 0.0
    audit_rates: Mapping[str, float] = field(default_factory=dict)
    # The two defaults above, as the policy takes them; built once, here.
    policy_defaults: PolicyDefaults = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for name in ("default_threshold", "min_choice_mass", "audit_rate"):
            check_probability(getattr(self, name), name)  # named as the server's settings
        for profile, rate in self.audit_rates.items():
            check_probability(rate, f"audit_rates[{profile!r}]")
        if self.log_max_age_days is not None and not (
            isinstance(self.log_max_age_days, int | float)
            and math.isfinite(self.log_max_age_days)
            and self.log_max_age_days > 0
        ):
            raise ValueError(
                f"log_max_age_days must be a number of days > 0 or None, "
                f"got {self.log_max_age_days!r}"
            )
        if self.log_max_rows is not None and (
            not isinstance(self.log_max_rows, int) or self.log_max_rows < 1
        ):
            raise ValueError(
                f"log_max_rows must be a whole number >= 1 or None, got {self.log_max_rows!r}"
            )
        for name in (
            "max_batch_size",
            "max_batch_tokens",
            "max_queue",
            "max_jobs",
            "max_request_tokens",
            "max_questions",
            "max_body_bytes",
            "max_profile_bytes",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a whole number >= 1, got {value!r}")
        for name in (
            "request_timeout_s",
            "fit_timeout_s",
            "read_timeout_s",
            "admission_wait_s",
            "max_wait_ms",
        ):
            value = getattr(self, name)
            if not (isinstance(value, int | float) and math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
        if self.max_request_tokens > self.max_batch_tokens:
            raise ValueError(
                f"max_request_tokens ({self.max_request_tokens}) must not exceed "
                f"max_batch_tokens ({self.max_batch_tokens}): a judgment must fit in one pass"
            )
        defaults = PolicyDefaults(
            threshold=self.default_threshold, min_choice_mass=self.min_choice_mass
        )
        object.__setattr__(self, "policy_defaults", defaults)  # frozen: set once, here

    def audit_rate_for(self, profile: str | None) -> float:
        """The audit rate of decisions made with ``profile`` (None: without one)."""
        if profile is not None and profile in self.audit_rates:
            return self.audit_rates[profile]
        return self.audit_rate

    @property
    def engine_options(self) -> dict[str, int]:
        """What the engine is built with (``Judge.load(..., **engine_options)``) so that it
        packs its passes to this server's bounds."""
        return {"max_batch_size": self.max_batch_size, "max_batch_tokens": self.max_batch_tokens}
