"""The errors the calibration package raises on purpose.

    CalibrationError
    ├── FitError                     the labeled examples cannot support a profile
    ├── ProfileError                 a profile file is missing, unreadable or invalid
    │   └── ProfileNotFoundError     no profile by that name
    └── ProfileMismatchError         a profile does not fit the judgment it is applied to

Input validation of arrays (shapes, labels) raises ValueError with the bad value named.
"""

from __future__ import annotations

__all__ = [
    "CalibrationError",
    "FitError",
    "ProfileError",
    "ProfileMismatchError",
    "ProfileNotFoundError",
]


class CalibrationError(Exception):
    """Base class of the calibration package's own errors."""


class FitError(CalibrationError, ValueError):
    """Too few labeled examples, or too little variety in them, to fit a profile."""


class ProfileError(CalibrationError, ValueError):
    """A calibration profile is unreadable or fails validation."""


class ProfileNotFoundError(ProfileError, LookupError):
    """No calibration profile exists under the given name or path."""


class ProfileMismatchError(CalibrationError, ValueError):
    """The profile was fitted for another model, template or set of choices."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field  # which property differs, for the service's error body
