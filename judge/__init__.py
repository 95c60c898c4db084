"""judge: calibrated finite-choice judgments from one forward pass of a language model.

The engine only: it imports nothing from ``calibration``, ``tasks``, ``service`` or ``cli``
(a test enforces it), so it can be used, and tested, on its own.
"""

from judge.engine import (
    DEFAULT_PREFIX_CACHE_MB,
    DEFAULT_RESPONSE_PREFIX,
    DEFAULT_RESPONSE_SUFFIX,
    MAX_CHOICES,
    Configuration,
    Judge,
    Judgment,
    Query,
    TokenCount,
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
from judge.prefix_cache import PrefixCache, PrefixCacheStats
from judge.protocol import Engine
from judge.scores import Score, ValuesError, default_values, score_of

__version__ = "0.1.0"

__all__ = [
    "DEFAULT_PREFIX_CACHE_MB",
    "DEFAULT_RESPONSE_PREFIX",
    "DEFAULT_RESPONSE_SUFFIX",
    "MAX_CHOICES",
    "AmbiguousChoicesError",
    "ChoiceTypeError",
    "ChoicesError",
    "Configuration",
    "DuplicateChoiceError",
    "EmptyChoiceError",
    "EmptyContextError",
    "Engine",
    "InvalidQueryError",
    "Judge",
    "JudgeError",
    "Judgment",
    "ModelLoadError",
    "PrefixCache",
    "PrefixCacheStats",
    "PromptTooLongError",
    "Query",
    "Score",
    "TokenCount",
    "TokenizerRoundTripError",
    "TooFewChoicesError",
    "TooManyChoicesError",
    "ValuesError",
    "__version__",
    "default_values",
    "score_of",
]
