"""The engine agrees with an independent brute-force reference on the real default model."""

from __future__ import annotations

import pytest
from reference import reference_probabilities

from judge import Judge

CASES = {
    "distinct single tokens": ("Is this SMS spam? WINNER! Claim your prize now.", ["spam", "ham"]),
    "shared prefix": ("Label this message.", ["spam", "spam_risky", "ham"]),
    "choice is a prefix of another": ("Is it?", ["yes", "yes!", "no"]),
    "digits": ("How many legs does a spider have?", ["1", "10", "100", "8"]),
    "korean": ("하늘은 파란색입니까?", ["예", "아니오"]),
    "quotes backslashes emoji spaces": (
        "Pick the odd one.",
        [" leading", "two  spaces", 'quo"te', "back\\slash", "🎉 party", '"', "\\"],
    ),
}


@pytest.mark.parametrize("name", list(CASES))
def test_matches_reference(judge: Judge, name: str) -> None:
    prompt, choices = CASES[name]
    result = judge.judge(prompt, choices)
    expected = reference_probabilities(judge, prompt, choices)
    for choice in choices:
        assert result.probabilities[choice] == pytest.approx(expected[choice], abs=1e-4)
    assert result.forward_passes == 1


def test_255_numbered_choices(judge: Judge) -> None:
    choices = [str(i) for i in range(255)]
    prompt = "Pick a number between 0 and 254 that is a perfect square."
    result = judge.judge(prompt, choices)
    expected = reference_probabilities(judge, prompt, choices)
    worst = max(abs(result.probabilities[c] - expected[c]) for c in choices)
    assert worst < 1e-4


def test_prefix_that_merges_with_the_choice(judge: Judge) -> None:
    # "Answer: " ends in a space that the tokenizer merges into " yes" / " no": the decision
    # point must move back before the space, not split the merged token.
    prefix = "Answer: "
    rendered = judge.render("Is the sky blue?", response_prefix=prefix)
    tok = judge.tokenizer
    prompt_ids = tok(rendered, add_special_tokens=False).input_ids
    path_ids = tok(rendered + "yes", add_special_tokens=False).input_ids
    assert path_ids[: len(prompt_ids)] != prompt_ids, "this case must exercise a boundary merge"

    result = judge.judge(
        "Is the sky blue?", ["yes", "no"], response_prefix=prefix, response_suffix=""
    )
    expected = reference_probabilities(
        judge, "Is the sky blue?", ["yes", "no"], response_prefix=prefix, response_suffix=""
    )
    for choice in ("yes", "no"):
        assert result.probabilities[choice] == pytest.approx(expected[choice], abs=1e-4)


def test_choice_mass_is_full_vocabulary_probability(judge: Judge) -> None:
    import torch

    result = judge.judge("Is this SMS spam? Hi mum, home soon.", ["spam", "ham"])
    tok = judge.tokenizer
    ids = tok(result.prompt, add_special_tokens=False).input_ids
    with torch.inference_mode():
        logprobs = torch.log_softmax(judge.model(torch.tensor([ids])).logits[0, -1].double(), -1)
    first = {
        tok(result.prompt + c + '"}', add_special_tokens=False).input_ids[len(ids)]
        for c in ("spam", "ham")
    }
    expected = float(sum(logprobs[t].exp() for t in first))
    assert result.choice_mass == pytest.approx(expected, rel=1e-4)
