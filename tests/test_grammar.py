"""Grammar-exact probabilities (``judge.grammar``) against a real grammar engine.

llguidance (guidance-ai/llguidance, from PyPI) builds its own token mask for the grammar "one
of the choices, then the response suffix" over the default model's tokenizer. Walking its
matcher along every token path, the tests check that the engine allows exactly the tokens of
``GrammarTree`` at each node, that once a choice is determined it allows only continuations of
that choice (so the rest of the decoding sums to one), and that the distribution a masked
decoder gives (the engine's masks, the model's logits from plain forward passes, every path
enumerated) is what ``grammar_probabilities`` returns, within 1e-6. EOS, the only special token
llguidance ever allows, is never allowed at a tree node (asserted); it comes only once a choice
and its suffix are complete.

llguidance by default tokenizes bytes that the grammar forces canonically and allows only that
token (its documented ``no_forcing`` option turns this off). The exact comparison runs with
``no_forcing``, whose masks are every-path masks; the default runs beside it and must agree
wherever no bytes are forced, which covers every node of the shared sets (one test pins the
case where it does not). Toy vocabularies check the tree's mechanics and, with Hypothesis, the
tree's evaluation against brute-force decoding to the end of every path.

The engine's grammar-exact mode (``Judge(choice_paths="grammar")``) packs the tree into its
one pass (``GrammarTree.packed``): its probabilities must match the distribution enumerated
with the engine's masks within 1e-4 on every case, and the packed tree's reading
(``ChoiceTrie.choice_logprobs``) must equal the reference's on toy vocabularies.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from judge import Judge
from judge.errors import AmbiguousChoicesError, EmptyContextError, TooManyPathsError
from judge.grammar import (
    MAX_POSITIONS,
    GrammarVocabulary,
    bytes_to_unicode,
    choice_targets,
    grammar_probabilities,
    masked_distribution,
)

DATA = Path(__file__).resolve().parents[2] / "shared" / "data"
ITEMS_PER_SET = 2
# The engine tests' own hard cases (tests/test_exactness.py): choices that share leading
# bytes, so the tree has nodes below the root.
HARD = {
    "digits": ("How many legs does a spider have?", ["1", "10", "100", "8"]),
    "korean": ("하늘은 파란색입니까?", ["예", "아니오"]),
    "quotes and backslashes": ("Pick the odd one.", ['quo"te', '"', "\\", "back\\slash"]),
}


# --- toy vocabularies: the tree's mechanics, no model --------------------------------------

TOY = [b"1", b"0", b"10", b'"', b'"}', b"}", b"x", None]  # None: a special token


def test_gpt2_byte_table() -> None:
    table = bytes_to_unicode()
    assert sorted(table) == list(range(256))
    assert len(set(table.values())) == 256
    assert table[ord(" ")] == "Ġ" and table[ord("\n")] == "Ċ" and table[0] == "Ā"
    assert all(table[b] == chr(b) for b in b"azAZ09!~")


def test_shared_prefix_gives_a_two_level_tree() -> None:
    tree = GrammarVocabulary(TOY).tree((b'1"}', b'10"}'))
    assert list(tree.nodes) == [b"", b"1"]
    root, one = tree.nodes[b""], tree.nodes[b"1"]
    # "10" settles on choice 1 at once; "1" still fits both choices.
    assert root.determines == {1: (2,)}
    assert root.children == {b"1": (0,)}
    # After "1": the closing quote (alone or with its brace) is choice 0, "0" is choice 1.
    assert one.determines == {0: (3, 4), 1: (1,)}
    assert one.children == {}
    assert one.allowed == {1, 3, 4}
    assert tree.positions == {b"": 1, b"1": 1}
    assert tree.determining_tokens() == [2, 2]


def test_uniform_logits_on_the_toy_tree() -> None:
    tree = GrammarVocabulary(TOY).tree((b'1"}', b'10"}'))
    probs = masked_distribution(tree, lambda path: np.zeros(len(TOY)))
    # Root: "1" and "10" alike; then after "1", two of the three allowed tokens close "1".
    assert probs.tolist() == pytest.approx([1 / 2 * 2 / 3, 1 / 2 + 1 / 2 * 1 / 3], abs=1e-15)


def test_positions_over_the_limit_are_an_error_naming_it() -> None:
    tree = GrammarVocabulary(TOY).tree((b'1"}', b'10"}'))
    with pytest.raises(TooManyPathsError, match="max_positions=1") as info:
        masked_distribution(tree, lambda path: np.zeros(len(TOY)), max_positions=1)
    assert info.value.field == "choices"
    with pytest.raises(TooManyPathsError, match="max_positions=1"):
        tree.packed([5], max_positions=1)
    with pytest.raises(EmptyContextError):
        tree.packed([])


def test_the_toy_tree_packed() -> None:
    """The root reads after the context; "1" is a tree token whose node reads again."""
    trie = GrammarVocabulary(TOY).tree((b'1"}', b'10"}')).packed([7, 8])
    assert trie.context == [7, 8]
    assert (trie.tree_tokens, trie.tree_parents, trie.tree_depths) == ([0], [-1], [1])
    assert trie.node_positions == [-1, 0]
    # Root: "10" settles on choice 1, "1" leads to node 1; there, '"' and '"}' close "1".
    assert trie.node_children == [[2, 0], [3, 4, 1]]
    assert trie.slot_next == [[-2, 1], [-1, -1, -2]]
    with pytest.raises(ValueError, match="more than one token path"):
        trie.choice_steps  # noqa: B018  # choice 1 has two paths


def test_a_choice_that_is_a_prefix_of_another_is_ambiguous() -> None:
    with pytest.raises(AmbiguousChoicesError, match="response suffix"):
        GrammarVocabulary(TOY).tree((b"1", b"10"))


def test_a_node_no_token_continues_is_an_error() -> None:
    with pytest.raises(ValueError, match="no token of this vocabulary continues"):
        GrammarVocabulary([b"a"]).tree((b'ab"}', b'ac"}'))


def _brute_force(
    pieces: list[bytes], targets: list[bytes], logprobs: Callable[[tuple[int, ...]], np.ndarray]
) -> list[float]:
    """Masked decoding run to the end of every path: no tree, no early stop."""
    probs = [0.0] * len(targets)

    def walk(path: tuple[int, ...], output: bytes, logp: float) -> None:
        if output in targets:
            probs[targets.index(output)] += math.exp(logp)
            return
        allowed = [
            t for t, p in enumerate(pieces) if any(x.startswith(output + p) for x in targets)
        ]
        lp = logprobs(path)
        norm = math.log(sum(math.exp(lp[t]) for t in allowed))
        for t in allowed:
            walk((*path, t), output + pieces[t], logp + lp[t] - norm)

    walk((), b"", 0.0)
    return probs


@settings(max_examples=60, deadline=None)
@given(
    words=st.lists(st.text("ab", min_size=1, max_size=3), min_size=2, max_size=4, unique=True),
    extra=st.lists(
        st.binary(min_size=2, max_size=3).map(lambda b: bytes(b'ab"}'[x % 4] for x in b)),
        max_size=6,
    ),
    seed=st.integers(0, 2**32 - 1),
)
def test_tree_evaluation_equals_decoding_to_the_end(
    words: list[str], extra: list[bytes], seed: int
) -> None:
    pieces = list(dict.fromkeys([b"a", b"b", b'"', b"}", *extra]))
    targets = [w.encode() + b'"}' for w in words]
    draws: dict[tuple[int, ...], np.ndarray] = {}

    def logprobs(path: tuple[int, ...]) -> np.ndarray:
        if path not in draws:
            z = np.random.default_rng([seed, *path]).normal(size=len(pieces)) * 3
            draws[path] = z - np.log(np.exp(z).sum())
        return draws[path]

    tree = GrammarVocabulary(pieces).tree(tuple(targets))
    probs = masked_distribution(tree, logprobs, max_positions=10**6)
    assert probs.sum() == pytest.approx(1.0, abs=1e-12)
    assert probs.tolist() == pytest.approx(_brute_force(pieces, targets, logprobs), abs=1e-12)
    # The packed tree, read as the engine reads it: each scored node's logits of its
    # children, at the token path that reaches it.
    trie = tree.packed([0], max_positions=10**6)
    node_logits = [
        logprobs(_path_to(trie.tree_tokens, trie.tree_parents, at))[children]
        for at, children in zip(trie.node_positions, trie.node_children, strict=True)
    ]
    packed = np.exp(trie.choice_logprobs(node_logits))
    assert packed.tolist() == pytest.approx(probs.tolist(), abs=1e-12)


def _path_to(tokens: list[int], parents: list[int], at: int) -> tuple[int, ...]:
    """The tree tokens from the root down to and including ``tokens[at]`` (-1: none)."""
    path: list[int] = []
    while at >= 0:
        path.append(tokens[at])
        at = parents[at]
    return tuple(reversed(path))


# --- the real model and a real grammar engine -----------------------------------------------


def _items() -> Iterator[tuple[str, str, list[str]]]:
    """The first items of each shared set (none where the sets are not beside this checkout),
    then the hard cases."""
    from calibration.tasks import load_split, load_task, task_prompt

    shared = DATA.iterdir() if DATA.is_dir() else iter(())
    names = sorted(p.name for p in shared if (p / "task.json").is_file())
    for name in names:
        task = load_task(DATA / name)
        items, _ = load_split(task, "test", ITEMS_PER_SET)
        for k, item in enumerate(items):
            yield f"{name}-{k}", task_prompt(task, item.text), list(task.choices)
    for name, (prompt, choices) in HARD.items():
        yield name, prompt, choices


CASES = list(_items())


@dataclass
class Engine:
    """llguidance with the default model's tokenizer, and each token's bytes as it sees them
    (empty for its special tokens)."""

    llguidance: Any
    tokenizer: Any
    pieces: list[bytes]
    eos: set[int]

    def matcher(self, targets: Sequence[bytes], forcing: bool) -> Any:
        """The engine's matcher for "one of ``targets``", as a user writes that grammar (one
        literal per choice, suffix included). ``forcing=False`` turns off llguidance's default
        of tokenizing bytes the grammar forces canonically (its ``no_forcing`` option): the mask
        then keeps every token that continues the output, the semantics of ``judge.grammar``."""
        head = "" if forcing else '%llguidance {"no_forcing": true}\n'
        body = " | ".join(json.dumps(t.decode(), ensure_ascii=False) for t in targets)
        matcher = self.llguidance.LLMatcher(self.tokenizer, f"{head}start: {body}")
        assert not matcher.is_error(), matcher.get_error()
        return matcher

    def mask(self, matcher: Any) -> set[int]:
        bias = np.frombuffer(matcher.compute_logit_bias(), dtype=np.uint8)  # (V,): 0 or 200
        return set(np.flatnonzero(bias).tolist())


@pytest.fixture(scope="module")
def grammar_judge(judge: Judge) -> Judge:
    """The session's model, judging in the grammar-exact mode."""
    return judge.with_choice_paths("grammar")


@pytest.fixture(scope="module")
def engine(judge: Judge) -> Engine:
    llguidance = pytest.importorskip("llguidance")
    hf = pytest.importorskip("llguidance.hf")

    tokenizer = hf.from_tokenizer(judge.tokenizer)
    pieces = [
        b"" if tokenizer.is_special_token(t) else tokenizer.decode_bytes([t])
        for t in range(tokenizer.vocab_size)
    ]
    return Engine(llguidance, tokenizer, pieces, set(tokenizer.eos_tokens))


@dataclass
class Walk:
    """Masked decoding enumerated with the engine's masks: each choice's probability with
    forcing off (``pure``) and with llguidance's default (``forcing``), and the nodes where
    the default mask kept fewer tokens."""

    pure: list[float]
    forcing: list[float]
    narrowed: set[bytes]


def _walk(judge: Judge, engine: Engine, prompt: str, choices: list[str]) -> Walk:
    """Every token path the engine allows, down to where one choice is left, checked against
    ``GrammarTree`` on the way; the model's logits come from plain forward passes."""
    import torch

    targets = choice_targets(choices, judge.response_suffix)
    tree = GrammarVocabulary.of(judge.tokenizer).tree(targets)
    prompt_ids = judge.tokenizer(judge.render(prompt), add_special_tokens=False).input_ids

    def logprobs(path: tuple[int, ...]) -> np.ndarray:
        with torch.inference_mode():
            logits = judge.model(torch.tensor([[*prompt_ids, *path]])).logits[0, -1].double()
        return torch.log_softmax(logits, dim=-1).numpy()  # (V,)

    def logsumexp(lp: np.ndarray, tokens: set[int]) -> float:
        return math.log(sum(math.exp(lp[t]) for t in tokens))

    walk = Walk([0.0] * len(choices), [0.0] * len(choices), set())
    visited = 0
    # (pure matcher, default matcher or None once it has left the path, path, log p for each)
    start = (engine.matcher(targets, False), engine.matcher(targets, True), (), 0.0, 0.0)
    stack: list[tuple[Any, Any, tuple[int, ...], float, float]] = [start]
    while stack:
        pure, forcing, path, logp, logq = stack.pop()
        visited += 1
        output = engine.tokenizer.decode_bytes(list(path))
        allowed = engine.mask(pure)
        assert not allowed & engine.eos, f"EOS allowed at {output!r}, where no choice is done"
        assert output in tree.nodes, f"the engine reached {output!r}, which is not a node"
        assert allowed == tree.nodes[output].allowed, f"masks differ at {output!r}"
        kept = engine.mask(forcing) if forcing is not None else set()
        if forcing is not None and kept != allowed:
            # Only where the grammar forces bytes: the tokenizer's own token for them.
            assert forcing.compute_ff_bytes() != b"" and kept < allowed, output
            walk.narrowed.add(output)
        lp = logprobs(path)
        norm, norm_kept = logsumexp(lp, allowed), logsumexp(lp, kept) if kept else 0.0
        for t in sorted(allowed):
            after = output + engine.pieces[t]
            consistent = [i for i, x in enumerate(targets) if x.startswith(after)]
            step = pure.deep_copy()
            assert step.consume_token(t)
            step_forcing = None
            if t in kept:
                step_forcing = forcing.deep_copy()
                assert step_forcing.consume_token(t)
            if len(consistent) > 1:
                p, q = logp + lp[t] - norm, logq + lp[t] - norm_kept
                stack.append((step, step_forcing, (*path, t), p, q))
                continue
            # Determined: from here the engine allows only what continues this choice (EOS
            # once it is complete), so the rest of decoding has probability one.
            rest = targets[consistent[0]][len(after) :]
            expected = {
                u for u, piece in enumerate(engine.pieces) if piece and rest.startswith(piece)
            }
            assert engine.mask(step) - engine.eos == expected
            assert (engine.eos <= engine.mask(step)) == (rest == b"")
            walk.pure[consistent[0]] += math.exp(logp + lp[t] - norm)
            if step_forcing is not None:
                narrowed = engine.mask(step_forcing)
                assert narrowed and narrowed <= engine.mask(step)
                walk.forcing[consistent[0]] += math.exp(logq + lp[t] - norm_kept)
    assert visited == sum(tree.positions.values())
    return walk


@pytest.mark.slow
def test_token_bytes_are_the_engines(judge: Judge, engine: Engine) -> None:
    """Every token but the special ones spells what llguidance says it spells."""
    ours = GrammarVocabulary.of(judge.tokenizer).pieces
    assert len(ours) == engine.tokenizer.vocab_size
    specials = [t for t in range(len(ours)) if engine.tokenizer.is_special_token(t)]
    assert specials == [t for t, p in enumerate(ours) if p is None]
    assert all(p == engine.pieces[t] for t, p in enumerate(ours) if p is not None)


@pytest.mark.slow
@pytest.mark.parametrize(("name", "prompt", "choices"), CASES, ids=[c[0] for c in CASES])
def test_engine_masks_and_distribution(
    judge: Judge, grammar_judge: Judge, engine: Engine, name: str, prompt: str, choices: list[str]
) -> None:
    walk = _walk(judge, engine, prompt, choices)
    ours = grammar_probabilities(judge, prompt, choices)
    assert list(ours) == choices
    assert sum(ours.values()) == pytest.approx(1.0, abs=1e-9)
    assert list(ours.values()) == pytest.approx(walk.pure, abs=1e-6)
    # The engine's one pass in the grammar-exact mode gives the same distribution.
    one_pass = grammar_judge.judge(prompt, choices)
    assert one_pass.forward_passes == 1
    assert one_pass.probs == pytest.approx(walk.pure, abs=1e-4)
    # No node of these choices has bytes forced while a token choice remains, so the
    # engine's default decoding is the same distribution.
    assert walk.narrowed == set()
    assert list(ours.values()) == pytest.approx(walk.forcing, abs=1e-6)


@pytest.mark.slow
def test_llguidance_default_forces_shared_bytes(judge: Judge, engine: Engine) -> None:
    """Where the choices left share bytes ("spam" and "spam_risky" after "s"), llguidance's
    default allows only the tokenizer's own token for the forced bytes ("p", not "pa"): a
    different distribution from every-path masking, which its ``no_forcing`` gives."""
    prompt, choices = "Label this message.", ["spam", "spam_risky", "ham"]
    walk = _walk(judge, engine, prompt, choices)
    assert walk.narrowed == {b"s", b"sp"}
    ours = grammar_probabilities(judge, prompt, choices)
    assert list(ours.values()) == pytest.approx(walk.pure, abs=1e-6)
    assert sum(walk.forcing) == pytest.approx(1.0, abs=1e-9)


# --- the engine's grammar-exact mode ---------------------------------------------------------


def test_canonical_and_grammar_modes_differ_where_other_paths_spell_a_choice(
    judge: Judge, grammar_judge: Judge
) -> None:
    """sms_spam's choices: "s" and "spa" spell "spam" too, so the modes disagree; the
    fingerprint says which mode a judgment was made in."""
    prompt, choices = "Is this spam? 'WIN a free prize now!!!'", ["ham", "spam"]
    canonical, grammar = judge.judge(prompt, choices), grammar_judge.judge(prompt, choices)
    assert abs(canonical.probs[0] - grammar.probs[0]) > 0.01
    assert grammar.probs == pytest.approx(
        list(grammar_probabilities(judge, prompt, choices).values()), abs=1e-4
    )
    assert judge.fingerprint().choice_paths == "canonical"
    assert grammar_judge.fingerprint().choice_paths == "grammar"
    # The same tokens read the other way are another judgment: their identity says so.
    assert canonical.tokens_sha256 != grammar.tokens_sha256
    # Only the paths' positions are added to the pass: none here, every node is the root.
    assert grammar_judge.prepare({"prompt": prompt, "choices": choices}).trie.tree_tokens == []


def test_a_long_shared_prefix_is_too_many_paths(grammar_judge: Judge) -> None:
    """Every way to spell 40 shared characters is a position: refused before any model work,
    naming the limit and the field."""
    choices = ["x" * 40 + "a", "x" * 40 + "b"]
    with pytest.raises(TooManyPathsError, match=f"max_positions={MAX_POSITIONS}") as info:
        grammar_judge.prepare({"prompt": "Pick one.", "choices": choices})
    assert info.value.field == "choices"


def test_an_unknown_mode_is_refused(judge: Judge) -> None:
    with pytest.raises(ValueError, match="choice_paths must be one of canonical, grammar"):
        Judge(judge.model, judge.tokenizer, choice_paths="every")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="choice_paths must be one of canonical, grammar"):
        judge.with_choice_paths("every")  # type: ignore[arg-type]
    assert judge.choice_paths == "canonical"  # the copy's mode is its own
