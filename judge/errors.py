"""The errors the engine raises, all under one root.

    JudgeError
    ├── ChoicesError                 the choices cannot be judged
    │   ├── TooFewChoicesError
    │   ├── TooManyChoicesError
    │   ├── ChoiceTypeError
    │   ├── EmptyChoiceError
    │   ├── DuplicateChoiceError
    │   ├── AmbiguousChoicesError
    │   └── TooManyPathsError
    ├── InvalidQueryError            a query is not a prompt string with a list of choices
    ├── PromptTooLongError           prompt + response prefix + choice exceeds the context window
    ├── TokenizerRoundTripError      the tokenizer does not encode the rendered text back to itself
    ├── EmptyContextError            nothing precedes the decision point
    ├── ModelLoadError               the model or tokenizer could not be loaded
    └── ModelServerError             a model served over HTTP gave no usable answer

Every message names the offending value and says how to fix it; the service maps each class
to an HTTP status in one place.
"""

from __future__ import annotations

__all__ = [
    "AmbiguousChoicesError",
    "ChoiceTypeError",
    "ChoicesError",
    "DuplicateChoiceError",
    "EmptyChoiceError",
    "EmptyContextError",
    "InvalidQueryError",
    "JudgeError",
    "ModelLoadError",
    "ModelServerError",
    "PromptTooLongError",
    "TokenizerRoundTripError",
    "TooFewChoicesError",
    "TooManyChoicesError",
    "TooManyPathsError",
]


class JudgeError(Exception):
    """Base class of every error the engine raises on purpose.

    ``field`` names the query field at fault where the engine can tell (``"choices"``,
    ``"system"``, ...), so that a server can point at it; None where it cannot.
    """

    def __init__(self, message: str = "", *, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


class ChoicesError(JudgeError, ValueError):
    """The list of choices cannot be judged as given."""


class TooFewChoicesError(ChoicesError):
    """Fewer than two choices were given."""


class TooManyChoicesError(ChoicesError):
    """More choices than the engine accepts in one judgment."""


class ChoiceTypeError(ChoicesError, TypeError):
    """A choice is not a string."""


class EmptyChoiceError(ChoicesError):
    """A choice is the empty string."""


class DuplicateChoiceError(ChoicesError):
    """The same choice appears twice."""


class AmbiguousChoicesError(ChoicesError):
    """One choice's token path is a prefix of another's, so decoding could not tell them apart."""


class TooManyPathsError(ChoicesError):
    """The grammar-exact tree of these choices has more token paths than one judgment reads
    (``judge.grammar.MAX_POSITIONS``): choices that share a long prefix."""


class InvalidQueryError(JudgeError, TypeError):
    """A query is malformed: a missing or mistyped field."""


class PromptTooLongError(JudgeError, ValueError):
    """The rendered prompt plus a choice does not fit in the model's context window."""


class TokenizerRoundTripError(JudgeError, ValueError):
    """Decoding the tokenized prompt does not give back the rendered text."""


class EmptyContextError(JudgeError, ValueError):
    """The rendered prompt produces no token before the decision point."""


class ModelLoadError(JudgeError, OSError):
    """The model or its tokenizer could not be found or loaded."""


class ModelServerError(JudgeError, ConnectionError):
    """A model served over HTTP (``judge.server_engine``) gave no usable answer: unreachable,
    past its deadline, an error status, or log-probabilities that are malformed, partial or
    of another tokenization. Never a made-up probability."""
