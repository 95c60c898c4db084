"""The server's settings, checked once when the server is built."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from calibration import PolicyDefaults
from calibration.validation import check_probability

__all__ = ["ServiceConfig"]


@dataclass(frozen=True)
class ServiceConfig:
    profiles_dir: Path = Path("profiles")
    max_batch_size: int = 16
    max_wait_ms: float = 5.0
    max_queue: int = 256
    request_timeout_s: float = 60.0
    api_key: str | None = None
    max_body_bytes: int = 1_000_000
    default_threshold: float = 0.9  # used when neither the request nor a profile sets one
    min_choice_mass: float = 0.0  # escalate below this; 0 disables the check
    fit_chunk: int = 16  # examples per model job while fitting, so judgments interleave
    # The two defaults above, as the policy takes them; built once, here.
    policy_defaults: PolicyDefaults = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for name in ("default_threshold", "min_choice_mass"):
            check_probability(getattr(self, name), name)  # named as the server's settings
        if self.fit_chunk < 1:
            raise ValueError(f"fit_chunk must be at least 1, got {self.fit_chunk!r}")
        defaults = PolicyDefaults(
            threshold=self.default_threshold, min_choice_mass=self.min_choice_mass
        )
        object.__setattr__(self, "policy_defaults", defaults)  # frozen: set once, here
