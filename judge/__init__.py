"""judge: calibrated finite-choice judgments from one forward pass of a language model.

The engine, and the leaves every layer uses (``judge.atomicio``, ``judge.scores``,
``judge.fingerprint``): it imports nothing from ``calibration`` or ``service`` (a test
enforces it), so it can be used, and tested, on its own.

The names below load on first use (PEP 562), so ``import judge.atomicio``,
``import judge.scores`` or ``import judge.fingerprint`` does not pull in torch: ``calibration``
and the client use those.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from judge.lazy import exports

if TYPE_CHECKING:
    from judge.answers import ChoiceAnswer, NoulAnswer, PairAnswer, ScoreAnswer
    from judge.engine import (
        DEFAULT_PREFIX_CACHE_MB,
        DEFAULT_RESPONSE_PREFIX,
        DEFAULT_RESPONSE_SUFFIX,
        Judge,
        Judgment,
        Prepared,
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
        ModelServerError,
        PromptTooLongError,
        TokenizerRoundTripError,
        TooFewChoicesError,
        TooManyChoicesError,
        TooManyPathsError,
    )
    from judge.fingerprint import Fingerprint
    from judge.judgments import TokenCount
    from judge.limits import MAX_CHOICES
    from judge.prefix_cache import PrefixCache, PrefixCacheStats
    from judge.protocol import Engine
    from judge.questions import ChoiceQuestion, NoulQuestion, PairQuestion, ScoreQuestion
    from judge.scores import Score, ValuesError, default_values, score_of

__version__ = "0.1.0"

# name -> the module that defines it
_EXPORTS = {
    "ChoiceAnswer": "judge.answers",
    "ChoiceQuestion": "judge.questions",
    "NoulAnswer": "judge.answers",
    "NoulQuestion": "judge.questions",
    "PairAnswer": "judge.answers",
    "PairQuestion": "judge.questions",
    "ScoreAnswer": "judge.answers",
    "ScoreQuestion": "judge.questions",
    "AmbiguousChoicesError": "judge.errors",
    "ChoiceTypeError": "judge.errors",
    "ChoicesError": "judge.errors",
    "DEFAULT_PREFIX_CACHE_MB": "judge.engine",
    "DEFAULT_RESPONSE_PREFIX": "judge.engine",
    "DEFAULT_RESPONSE_SUFFIX": "judge.engine",
    "DuplicateChoiceError": "judge.errors",
    "EmptyChoiceError": "judge.errors",
    "EmptyContextError": "judge.errors",
    "Engine": "judge.protocol",
    "Fingerprint": "judge.fingerprint",
    "InvalidQueryError": "judge.errors",
    "Judge": "judge.engine",
    "JudgeError": "judge.errors",
    "Judgment": "judge.engine",
    "MAX_CHOICES": "judge.limits",
    "ModelLoadError": "judge.errors",
    "ModelServerError": "judge.errors",
    "PrefixCache": "judge.prefix_cache",
    "PrefixCacheStats": "judge.prefix_cache",
    "Prepared": "judge.engine",
    "PromptTooLongError": "judge.errors",
    "Query": "judge.engine",
    "Score": "judge.scores",
    "TokenCount": "judge.judgments",
    "TokenizerRoundTripError": "judge.errors",
    "TooFewChoicesError": "judge.errors",
    "TooManyChoicesError": "judge.errors",
    "TooManyPathsError": "judge.errors",
    "ValuesError": "judge.scores",
    "default_values": "judge.scores",
    "score_of": "judge.scores",
}

__all__ = [
    "DEFAULT_PREFIX_CACHE_MB",
    "DEFAULT_RESPONSE_PREFIX",
    "DEFAULT_RESPONSE_SUFFIX",
    "MAX_CHOICES",
    "AmbiguousChoicesError",
    "ChoiceAnswer",
    "ChoiceQuestion",
    "ChoiceTypeError",
    "ChoicesError",
    "DuplicateChoiceError",
    "EmptyChoiceError",
    "EmptyContextError",
    "Engine",
    "Fingerprint",
    "InvalidQueryError",
    "Judge",
    "JudgeError",
    "Judgment",
    "ModelLoadError",
    "ModelServerError",
    "NoulAnswer",
    "NoulQuestion",
    "PairAnswer",
    "PairQuestion",
    "PrefixCache",
    "PrefixCacheStats",
    "Prepared",
    "PromptTooLongError",
    "Query",
    "Score",
    "ScoreAnswer",
    "ScoreQuestion",
    "TokenCount",
    "TokenizerRoundTripError",
    "TooFewChoicesError",
    "TooManyChoicesError",
    "TooManyPathsError",
    "ValuesError",
    "__version__",
    "default_values",
    "score_of",
]


__getattr__, __dir__ = exports(__name__, _EXPORTS)
