"""The errors the calibration package raises on purpose.

    CalibrationError
    ├── FitError                     the labeled examples cannot support a profile
    ├── ProfileError                 a profile file is missing, unreadable or invalid
    │   └── ProfileNotFoundError     no profile by that name
    ├── ProfileMismatchError         a profile does not fit the judgment it is applied to
    ├── NoCertificateError           a certified threshold overridden where there is none
    └── RuleError                    a decoded value breaks a rule its type cannot state

    judge.ValuesError                a score's values or its max_std cannot be used

``ValuesError`` is the engine's (``judge.scores``), not a CalibrationError: values are checked
by one set of rules whether the probabilities are raw or calibrated, so there is one class to
catch (a ValueError, and to the service an InvalidQueryError naming ``values`` or ``max_std``).

Input validation of arrays (shapes, labels) raises ValueError with the bad value named.
"""

from __future__ import annotations

from judge.scores import ValuesError

__all__ = [
    "CalibrationError",
    "FitError",
    "NoCertificateError",
    "ProfileError",
    "ProfileMismatchError",
    "ProfileNotFoundError",
    "ValuesError",
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


class NoCertificateError(CalibrationError, ValueError):
    """A request overrides a certified threshold where there is none (no profile, or one that
    certified none): accepting there is the explicit opt-in ``uncertified_threshold``."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field  # the request's field, for the service's error body


class RuleError(CalibrationError):
    """A value of the right type that breaks a rule its type cannot state: a number that is not
    finite, two fields that disagree (a bias with one entry per choice, split counts that add up
    to at most the examples).

    Deliberately not a ValueError: msgspec turns a ValueError raised while decoding into a
    ValidationError like any type mismatch, whereas this one passes through as itself, so a
    server can tell "breaks the schema" (400) from "fits the schema, breaks a rule" (422).
    """
