"""What the commands share: the usage error, argument types and the model's and task's
arguments, engine loading, profile loading, JSON output.

No torch here, nor in any command module's imports: the parser (``judge --help``) is built
from every command module, where only the client's packages may be installed.
"""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import MISSING, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast, get_args

import msgspec

from calibration.fit_settings import FitSettings
from judge import DEFAULT_RESPONSE_PREFIX, DEFAULT_RESPONSE_SUFFIX
from judge.engines import open_engine
from judge.fingerprint import CHOICE_PATHS
from judge.limits import DType
from judge.protocol import Engine
from judge.server_engine import is_server_model
from service.config import FlagKind, ServiceConfig, flags

if TYPE_CHECKING:
    from calibration import CalibrationProfile
    from service.cascade.stages import LocalModel

__all__ = [
    "DTYPES",
    "SETTING_TYPES",
    "UsageError",
    "add_settings",
    "api_key",
    "audit_rates",
    "batch_size_argument",
    "check_stage_names",
    "choice_paths_argument",
    "choice_value",
    "device_argument",
    "dtype_argument",
    "fit_settings",
    "load_engine",
    "load_profile",
    "load_stages",
    "model_arguments",
    "non_negative",
    "open_probability",
    "positive_int",
    "probability",
    "profile_dtype",
    "profiles_dir_argument",
    "seconds",
    "settings_of",
    "task_arguments",
    "to_json",
]

DTYPES: tuple[str, ...] = get_args(DType)


class UsageError(Exception):
    """The command line asks for something that cannot be done as given (exit status 2)."""

    def __init__(self, message: str, *, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field  # the input at fault (``questions.q1``), where there is one


def _number(text: str, expected: str) -> float:
    """``text`` as a float, or the argparse error that says what was ``expected``."""
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}") from None


def probability(text: str) -> float:
    """An argparse type for a number in [0, 1], so a bad value stops before any model loads."""
    value = _number(text, "a number in [0, 1]")
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be in [0, 1], got {text}")
    return value


def open_probability(text: str) -> float:
    """An argparse type for a number strictly between 0 and 1 (a precision target, a level)."""
    value = probability(text)
    if value in (0.0, 1.0):
        raise argparse.ArgumentTypeError(f"must be strictly between 0 and 1, got {text}")
    return value


def positive_number(text: str) -> float:
    """An argparse type for a finite number > 0 (days, a rate's horizon)."""
    value = _number(text, "a number > 0")
    if not (value > 0 and value != float("inf")):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
    return value


def non_negative(text: str) -> float:
    """An argparse type for a finite number >= 0 (a score's bound on its spread)."""
    value = _number(text, "a number >= 0")
    if not (value >= 0 and value != float("inf")):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text}")
    return value


def choice_value(text: str) -> tuple[str, float]:
    """An argparse type for ``CHOICE=NUMBER``: a score's number for one choice."""
    name, sep, number = text.rpartition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"give CHOICE=NUMBER, got {text!r}")
    value = _number(number, "a number")
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {number}")
    return name, value


def check_stage_names(first: str, given: Sequence[tuple[str, str]]) -> None:
    """A cascade's stages (``--stage-name`` and each ``--cascade NAME=...``), each with a name
    of its own: refused before any model loads."""
    names = [first, *(name for name, _ in given)]
    if len(set(names)) != len(names):
        raise UsageError(
            f"each stage needs a name of its own (--stage-name and --cascade), got {names}",
            field="--cascade",
        )


def load_stages(given: Sequence[tuple[str, str]], dtype: str) -> dict[str, LocalModel | str]:
    """A cascade's later stages (``--cascade NAME=MODEL|URL``), in order: a URL as it is, a
    model loaded here (in the first stage's dtype)."""
    from service.cascade.stages import LocalModel, is_remote

    return {
        name: target if is_remote(target) else LocalModel(open_engine(target, dtype=dtype))  # type: ignore[arg-type]
        for name, target in given
    }


def audit_rate(text: str) -> tuple[str | None, float]:
    """An argparse type for ``--audit-rate``: ``RATE`` (every decision) or ``PROFILE=RATE``."""
    name, sep, rate = text.rpartition("=")
    if sep and not name:
        raise argparse.ArgumentTypeError(f"give PROFILE=RATE or RATE, got {text!r}")
    return (name or None), probability(rate)


def stage(text: str) -> tuple[str, str]:
    """An argparse type for ``--cascade``: ``NAME=MODEL`` or ``NAME=URL``."""
    name, sep, target = text.partition("=")
    if not (sep and name and target):
        raise argparse.ArgumentTypeError(f"give NAME=MODEL or NAME=URL, got {text!r}")
    return name, target


def megabytes(text: str) -> float:
    """An argparse type for a memory budget in MB, 0 or more."""
    value = _number(text, "a number of MB")
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be 0 (off) or more, got {text}")
    return value


def seconds(text: str) -> float:
    """An argparse type for a finite duration in seconds, 0 or more."""
    value = _number(text, "a number of seconds")
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text}")
    return value


def positive_int(text: str) -> int:
    """An argparse type for a count of at least 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def model_arguments(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup, *, dtype_help: str = ""
) -> None:
    """--model, --dtype (default None: the profile's, else auto) and --device."""
    parser.add_argument(
        "--model",
        default=None,
        help="model id, directory or .gguf (default: SmolLM2-135M-Instruct)",
    )
    dtype_argument(parser, default=None, default_help=dtype_help)
    device_argument(parser)
    choice_paths_argument(parser, default=None)


def dtype_argument(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup,
    *,
    default: str | None = "auto",
    default_help: str = "",
) -> None:
    """--dtype: the arithmetic the model's weights are loaded in (default None: the
    profile's, else auto)."""
    shown = default_help or ("(default: the profile's, else auto)" if default is None else "")
    parser.add_argument(
        "--dtype",
        default=default,
        choices=DTYPES,
        help="the model's arithmetic; auto: bfloat16 where the CPU computes it natively "
        "(AVX-512 BF16, AMX) or the GPU does, else float32 " + (shown or f"(default: {default})"),
    )


def device_argument(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """--device: where torch runs the model."""
    parser.add_argument(
        "--device",
        default="cpu",
        help="the torch device the model runs on: cpu, or cuda (cuda:N) on a machine with an "
        "NVIDIA GPU and a CUDA build of torch (default: cpu)",
    )


def profiles_dir_argument(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """--profiles-dir: where a profile given by name is looked up."""
    parser.add_argument(
        "--profiles-dir",
        type=Path,
        default=Path("profiles"),
        help="the directory of calibration profiles, where a profile given by name is "
        "looked up and a fitted one is written (default: profiles)",
    )


def batch_size_argument(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup, default: int = 8
) -> None:
    """--batch-size: items per forward pass when a file or a split is judged."""
    parser.add_argument(
        "--batch-size",
        type=positive_int,
        default=default,
        help=f"items judged per forward pass (default: {default})",
    )


def choice_paths_argument(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup, *, default: str | None = "canonical"
) -> None:
    """--choice-paths: which token paths spell a choice (``Judge(choice_paths=)``)."""
    parser.add_argument(
        "--choice-paths",
        default=default,
        choices=CHOICE_PATHS,
        help="canonical: each choice's own tokenization (the trie); grammar: every token path "
        "a grammar engine's mask allows, what constrained decoding emits"
        + (" (default: the profile's, else canonical)" if default is None else ""),
    )


def task_arguments(
    parser: argparse.ArgumentParser,
    *,
    split: str,
    dtype: bool = True,
    either: argparse._MutuallyExclusiveGroup | None = None,
) -> None:
    """A task directory's split to judge, and the model that judges it. --task is required,
    or one of ``either``'s arguments (a required group) when that is given."""
    task_help = "task directory with task.json"
    if either is None:
        parser.add_argument("--task", type=Path, required=True, help=task_help)
    else:
        either.add_argument("--task", type=Path, help=task_help)
    parser.add_argument("--split", default=split, help=f"which <split>.jsonl (default: {split})")
    parser.add_argument("--limit", type=positive_int, help="use only the first N items")
    parser.add_argument("--model", default=None, help="model id, directory or .gguf")
    device_argument(parser)
    choice_paths_argument(parser, default=None)
    batch_size_argument(parser)
    if dtype:
        dtype_argument(parser)


def load_profile(path: str | os.PathLike[str]) -> CalibrationProfile:
    """``calibration.load_profile``; a missing or invalid file raises ProfileError (exit 2)."""
    from calibration import load_profile as load

    return load(path)


def profile_dtype(requested: str | None, profile: CalibrationProfile | None) -> DType:
    """The dtype to load: the one asked for, else the profile's (it must match), else auto."""
    if requested is not None:
        return cast(DType, requested)
    if profile is None:
        return "auto"
    if profile.fingerprint.dtype not in DTYPES:
        raise UsageError(
            f"profile {profile.name!r} was fitted in dtype {profile.fingerprint.dtype!r}, which "
            f"cannot be loaded here (one of {', '.join(DTYPES)}); refit it"
        )
    return cast(DType, profile.fingerprint.dtype)


def load_engine(
    args: argparse.Namespace,
    profile: CalibrationProfile | None = None,
    *,
    dtype: str | None = None,
    response_prefix: str | None = None,
    response_suffix: str | None = None,
) -> Engine:
    """``open_engine`` with the command's --model and --device: a model loaded here, or one
    served over HTTP (``judge.engines``).

    Anything given as None is the profile's when there is one, else the engine's default, so
    that a profile works without repeating its dtype and template on the command line.
    """
    if response_prefix is None:
        response_prefix = (
            profile.fingerprint.response_prefix if profile else DEFAULT_RESPONSE_PREFIX
        )
    if response_suffix is None:
        response_suffix = (
            profile.fingerprint.response_suffix if profile else DEFAULT_RESPONSE_SUFFIX
        )
    choice_paths = getattr(args, "choice_paths", None)
    if choice_paths is None:
        choice_paths = profile.fingerprint.choice_paths if profile else "canonical"
    return open_engine(
        args.model,
        # A served model's dtype is the server's: a profile fitted on one says "server".
        dtype=None if is_server_model(args.model) else profile_dtype(dtype, profile),
        device=args.device,
        response_prefix=response_prefix,
        response_suffix=response_suffix,
        choice_paths=choice_paths,
    )


def audit_rates(given: list[tuple[str | None, float]]) -> dict[str, Any]:
    """``--audit-rate`` as ServiceConfig's ``audit_rate`` and ``audit_rates``."""
    rates: dict[str, float] = {}
    server = 0.0
    for name, rate in given:
        if name is None:
            server = rate
        else:
            rates[name] = rate
    return {"audit_rate": server, "audit_rates": rates}


# How each kind of setting (service.config.FlagKind) is read from the command line; a
# switch takes no value.
SETTING_TYPES: dict[FlagKind, Callable[[str], Any]] = {
    "count": positive_int,
    "duration": seconds,
    "probability": probability,
    "positive": positive_number,
    "path": Path,
    "text": str,
    "key_file": Path,
    "rates": audit_rate,
    "stages": stage,
}


def add_settings(
    groups: Mapping[str | None, argparse._ActionsContainer], names: Sequence[str] | None = None
) -> None:
    """Flags for the server's settings (``service.config.ServiceConfig``, each with its
    ``Flag``): every one, or those ``names`` (``judge mcp`` takes the decision log's), each in
    its flag's group, with its own default. ``settings_of`` reads them back."""
    defaults = {f.name: f.default for f in fields(ServiceConfig)}
    added: set[str] = set()
    for name, flag in flags().items():
        if flag.name in added or (names is not None and name not in names):
            continue  # a flag that sets two settings (--audit-rate) is added once
        added.add(flag.name)
        default = defaults[name]
        if flag.kind == "switch":
            groups[flag.group].add_argument(flag.name, action="store_true", help=flag.help)
            continue
        shown = _shown(default)
        groups[flag.group].add_argument(
            flag.name,
            type=SETTING_TYPES[flag.kind],
            # Parsed as given, else None: --api-key-file falls back to $JUDGE_API_KEY, and
            # --audit-rate is repeated; settings_of makes the settings of both.
            default=None if flag.kind in ("key_file", "rates", "stages") else default,
            action="append" if flag.kind in ("rates", "stages") else "store",
            metavar=flag.metavar,
            help=flag.help if shown is None else f"{flag.help} (default: {shown})",
        )


def _shown(default: object) -> str | None:
    """A setting's default as its help states it; None where the help says it in words."""
    if default is None or default is MISSING or isinstance(default, bool):
        return None
    if isinstance(default, int):
        return f"{default:,}"
    if isinstance(default, float):
        return f"{default:g}"
    return str(default)


def settings_of(args: argparse.Namespace, names: Sequence[str] | None = None) -> dict[str, Any]:
    """The settings the flags of ``add_settings`` give (each setting's own default where not
    given): every one, or those ``names``."""
    settings: dict[str, Any] = {}
    for name, flag in flags().items():
        if names is not None and name not in names:
            continue
        given = getattr(args, flag.dest)
        if flag.kind == "key_file":
            settings[name] = api_key(given)
        elif flag.kind == "rates":
            settings[name] = audit_rates(given or [])[name]
        elif flag.kind == "stages":
            settings[name] = dict(given or [])
            if len(settings[name]) < len(given or []):
                raise UsageError("--cascade: each stage needs a name of its own")
        else:
            settings[name] = given
    return settings


def api_key(path: Path | None) -> str | None:
    """The API key: the first line of ``path``, else $JUDGE_API_KEY, else None (no auth)."""
    if path is None:
        return os.environ.get("JUDGE_API_KEY") or None
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise UsageError(f"--api-key-file: cannot read {path}: {exc.strerror}") from None
    key = lines[0].strip() if lines else ""
    if not key:
        raise UsageError(f"--api-key-file: {path} is empty; its first line is the key")
    return key


def to_json(value: object, *, indent: int = 0) -> str:
    """``value`` as JSON text (Structs, dicts, numbers); indented when ``indent`` > 0."""
    data = msgspec.json.encode(value)
    return (msgspec.json.format(data, indent=indent) if indent else data).decode()


def fit_settings(
    args: argparse.Namespace, *, values: Mapping[str, float] | None, max_std: float | None
) -> FitSettings:
    """``judge calibrate``'s --target-precision, --delta, --alpha and --method/--methods as
    the fit's settings, with a score task's ``values`` and std bound: the one reading of them
    for each of its fits (``--task`` and ``--unlabeled`` in ``service.cli.calibrate``,
    ``--from-log`` in ``service.cli.log``)."""
    return FitSettings(
        target_precision=args.target_precision,
        delta=args.delta,
        alpha=args.alpha,
        values=values,
        max_std=max_std,
        methods=_methods(args),
        per_class=getattr(args, "per_class", False),
    )


def _methods(args: argparse.Namespace) -> Sequence[str] | str:
    """--method or --methods as ``fit_profile``'s methods; "auto" when neither is given."""
    if args.method is not None and args.methods is not None:
        raise UsageError("give --method or --methods, not both")
    if args.methods is not None:
        return list(args.methods)
    if args.method in (None, "auto"):
        return "auto"
    if args.method == "bias_temperature":
        return ["temperature", "bias_temperature"]
    return [args.method]
