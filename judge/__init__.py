"""judge: calibrated finite-choice judgments from one forward pass of a language model."""

from judge.engine import (
    DEFAULT_RESPONSE_PREFIX,
    DEFAULT_RESPONSE_SUFFIX,
    MAX_CHOICES,
    Judge,
    Judgment,
    Query,
)
from judge.errors import (
    AmbiguousChoicesError,
    ChoicesError,
    ChoiceTypeError,
    DuplicateChoiceError,
    EmptyChoiceError,
    EmptyContextError,
    InvalidQueryError,
    JudgeError,
    ModelLoadError,
    PromptTooLongError,
    TokenizerRoundTripError,
    TooFewChoicesError,
    TooManyChoicesError,
)

__version__ = "0.1.0"

__all__ = [
    "DEFAULT_RESPONSE_PREFIX",
    "DEFAULT_RESPONSE_SUFFIX",
    "MAX_CHOICES",
    "AmbiguousChoicesError",
    "ChoiceTypeError",
    "ChoicesError",
    "DuplicateChoiceError",
    "EmptyChoiceError",
    "EmptyContextError",
    "InvalidQueryError",
    "Judge",
    "JudgeError",
    "Judgment",
    "ModelLoadError",
    "PromptTooLongError",
    "Query",
    "TokenizerRoundTripError",
    "TooFewChoicesError",
    "TooManyChoicesError",
    "__version__",
]
