"""Every decision has an identity: its judgment's id and the hashes that pin it (issue 20).

The id is a UUID version 7; ``tokens_sha256`` hashes the token ids the pass feeds (recomputed
here from the tokenizer, by its documented definition); ``model_sha256`` the weights (the GGUF
file's, else the parameters'); ``policy_sha256`` the policy in force; ``profile_etag`` the
profile's version, the ETag its store serves. Mechanics on the fake engine, and on the real
default model the hashes a user would check by hand.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest
import torch
from fakes import FakeEngine, Scored, judgment_of
from litestar.testing import TestClient
from server import wait_app_ready
from transformers import LlamaConfig, LlamaForCausalLM

from calibration import (
    CalibrationProfile,
    FitSettings,
    LabeledScores,
    PolicyDefaults,
    Provenance,
    fit_profile,
    make_policy,
    save_profile,
)
from calibration.gate import Gate
from calibration.maps.map_types import Temperature
from calibration.profile import etag_of
from judge import Judge, Query
from judge.engine import parameters_sha256
from judge.identity import new_judgment_id, tokens_sha256
from judge.loading import default_model_path
from service import ServiceConfig, create_app

SPAM = "Is this SMS spam? WINNER!! Claim your free prize now, text WIN to 80082."
SHA256_HEX = r"^[0-9a-f]{64}$"


def is_uuid7(value: str) -> bool:
    u = uuid.UUID(value)
    return str(u) == value and u.version == 7 and u.variant == uuid.RFC_4122


def uuid7_ms(value: str) -> int:
    """The Unix time in milliseconds a version 7 id carries in its first 48 bits."""
    return uuid.UUID(value).int >> 80


# --- judgment_id ----------------------------------------------------------------------------


def test_judgment_ids_are_uuid7_unique_and_ordered_by_time() -> None:
    batches: list[list[str]] = []
    for _ in range(5):
        before = time.time_ns() // 1_000_000
        batch = [new_judgment_id() for _ in range(2000)]
        after = time.time_ns() // 1_000_000
        assert all(is_uuid7(i) for i in batch)
        assert all(before <= uuid7_ms(i) <= after for i in batch)
        batches.append(batch)
        time.sleep(0.003)  # the next batch starts in a later millisecond
    ids = [i for batch in batches for i in batch]
    assert len(set(ids)) == len(ids)
    # Sorted as strings, ids made in different milliseconds keep their order of creation.
    ranks = {i: r for r, i in enumerate(sorted(ids))}
    for earlier, later in itertools.pairwise(batches):
        assert max(ranks[i] for i in earlier) < min(ranks[i] for i in later)
    # The random bits differ even within one millisecond.
    assert len({uuid.UUID(i).int & ((1 << 62) - 1) for i in ids}) == len(ids)


def test_every_judgment_of_an_engine_gets_a_fresh_id() -> None:
    engine = FakeEngine()
    q = Query(prompt="x", choices=["a", "b"])
    judgments = engine.judge_batch([q, q]) + engine.run([engine.prepare(q)])
    judgments.append(engine.judge("x", ["a", "b"]))
    ids = [j.judgment_id for j in judgments]
    assert all(is_uuid7(i) for i in ids) and len(set(ids)) == len(ids)


# --- tokens_sha256 --------------------------------------------------------------------------


def test_tokens_sha256_is_the_documented_hash() -> None:
    # Compact JSON of [prompt_ids, [path_0, ...]], hashed as UTF-8: json here, msgspec there.
    expected = hashlib.sha256(b"[[1,2],[[1,2,3],[1,2,40]]]").hexdigest()
    assert tokens_sha256([1, 2], [[1, 2, 3], [1, 2, 40]]) == expected
    assert tokens_sha256((1, 2), ((1, 2, 3), (1, 2, 40))) == expected
    assert tokens_sha256([1, 2], [[1, 2, 40], [1, 2, 3]]) != expected  # order counts
    # The grammar-exact mode reads the same tokens another way: a third element says so.
    grammar = hashlib.sha256(b'[[1,2],[[1,2,3],[1,2,40]],"grammar"]').hexdigest()
    assert tokens_sha256([1, 2], [[1, 2, 3], [1, 2, 40]], "grammar") == grammar


@pytest.mark.slow
def test_the_tokens_hash_pins_every_part_of_the_query(judge: Judge) -> None:
    """No model work: ``prepare`` tokenizes, and the hash is made there."""
    base = Query(prompt=SPAM, choices=["spam", "ham"])

    def tokens(**change: Any) -> str:
        return judge.prepare(msgspec.structs.replace(base, **change)).tokens_sha256

    same = tokens()
    assert same == tokens() and same == judge.prepare(msgspec.to_builtins(base)).tokens_sha256
    variants = {
        "one character of the prompt": tokens(prompt=SPAM[:-1] + "!"),
        "a choice": tokens(choices=["spam", "hams"]),
        "the choices' order": tokens(choices=["ham", "spam"]),
        "the system prompt": tokens(system="You grade texts."),
        "the response prefix": tokens(response_prefix='{"label": "'),
        "the response suffix": tokens(response_suffix='" }'),
    }
    for what, value in variants.items():
        assert value != same, what
    assert len(set(variants.values())) == len(variants)


@pytest.mark.slow
def test_real_judgments_carry_hashes_a_user_can_recompute(judge: Judge) -> None:
    choices = ["spam", "ham", 'not "sure"']  # the quote is escaped in what the model reads
    one = judge.judge(SPAM, choices)
    again = judge.judge(SPAM, choices)
    batch: list[Query | dict[str, Any]] = [
        Query(prompt="Hello?", choices=["yes", "no"]),
        {"prompt": SPAM, "choices": choices},
    ]
    batched = judge.judge_batch(batch)[1]
    ids = [one.judgment_id, again.judgment_id, batched.judgment_id]
    assert all(is_uuid7(i) for i in ids) and len(set(ids)) == 3
    assert one.tokens_sha256 == again.tokens_sha256 == batched.tokens_sha256
    # By hand, from the tokenizer: the rendered prompt, then each choice's full text.
    tok = judge.tokenizer
    prompt_ids = tok(one.prompt, add_special_tokens=False).input_ids
    escaped = [json.dumps(c, ensure_ascii=False)[1:-1] + judge.response_suffix for c in choices]
    paths = [tok(one.prompt + e, add_special_tokens=False).input_ids for e in escaped]
    payload = json.dumps([prompt_ids, paths], separators=(",", ":")).encode()
    assert one.tokens_sha256 == hashlib.sha256(payload).hexdigest()
    # The weights: the GGUF file the default model was loaded from.
    digest = hashlib.sha256()
    with open(default_model_path(), "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    assert one.model_sha256 == batched.model_sha256 == judge.model_sha256 == digest.hexdigest()


# --- model_sha256 ---------------------------------------------------------------------------


def tiny_llama(seed: int = 0) -> LlamaForCausalLM:
    """A random two-layer Llama whose vocabulary covers the default tokenizer's ids."""
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=49152,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=256,
        tie_word_embeddings=True,
    )
    return LlamaForCausalLM(config).eval()


def test_the_parameters_hash_follows_every_value_and_the_dtype() -> None:
    first = parameters_sha256(tiny_llama())
    assert first == parameters_sha256(tiny_llama())  # the same parameters, another model
    assert first != parameters_sha256(tiny_llama(seed=1))
    perturbed = tiny_llama()
    with torch.no_grad():
        perturbed.model.layers[1].mlp.down_proj.weight[3, 7] += 1e-3  # one element of many
    assert parameters_sha256(perturbed) != first
    # No numpy bfloat16: hashed as bytes all the same, and not as the float32 values.
    halved = tiny_llama()
    halved.bfloat16()  # in place
    assert parameters_sha256(halved) != first


@pytest.mark.slow
def test_a_model_from_parameters_is_identified_by_them(judge: Judge) -> None:
    model = tiny_llama()
    tiny = Judge(model, judge.tokenizer, model_id="tiny", prefix_cache_mb=0)
    assert tiny.weights_sha256 is None
    assert tiny.model_sha256 == parameters_sha256(tiny_llama())
    judgment = tiny.judge("Is it?", ["yes", "no"])
    assert judgment.model_sha256 == tiny.model_sha256 and is_uuid7(judgment.judgment_id)
    # The fingerprint (what profiles match) is unchanged: it still names no weights' hash.
    assert tiny.fingerprint().model_sha256 is None


# --- policy_sha256 --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def profile() -> CalibrationProfile:
    """A real fitted profile (synthetic scores) that applies to the fake engine."""
    rng = np.random.default_rng(0)
    z = rng.normal(0, 3, size=(200, 2))
    y = (rng.random(200) > np.exp(z[:, 0] / 2) / np.exp(z / 2).sum(1)).astype(int)
    logp = z - np.log(np.exp(z).sum(1, keepdims=True))
    return fit_profile(
        "sms",
        LabeledScores(logp, np.ones(len(y)), y),
        ["ham", "spam"],
        Provenance(fingerprint=FakeEngine().fingerprint(), dataset="d", dataset_sha256="0"),
        FitSettings(n_bootstrap=10),
    ).profile


def test_the_policy_hash_changes_with_every_setting(profile: CalibrationProfile) -> None:
    base = make_policy(profile)
    assert base.sha256 == make_policy(profile).sha256  # equal policies, separate objects
    # The documented definition: the profile's ETag stands for its map; the audit rate, which
    # picks what people label and not what is decided, is left out.
    left_out = ("calibration_map", "audit_rate")
    fields = {f: getattr(base, f) for f in base.__struct_fields__ if f not in left_out}
    payload = msgspec.json.encode([profile.etag, fields])
    assert base.sha256 == hashlib.sha256(payload).hexdigest()
    assert make_policy(profile, audit_rate=0.5).sha256 == base.sha256
    hotter = msgspec.structs.replace(
        profile, calibration_map=Temperature(temperature=profile.calibration_map.temperature * 2)
    )
    changed = {
        "threshold": make_policy(profile, threshold=0.77),
        "min_choice_mass": make_policy(profile, min_choice_mass=0.3),
        "max_std": make_policy(profile, max_std=0.5, values={"ham": 0.0, "spam": 1.0}),
        "temperature": make_policy(hotter),
        "no profile": make_policy(None),
        "a map without a profile": msgspec.structs.replace(
            base, profile_etag=None, calibration_map=hotter.calibration_map
        ),
        "the server's uncertified threshold": make_policy(
            None, defaults=PolicyDefaults(uncertified_threshold=0.8)
        ),
        "the request's uncertified threshold": make_policy(None, uncertified_threshold=0.8),
    }
    hashes = {what: p.sha256 for what, p in changed.items()}
    for what, value in hashes.items():
        assert value != base.sha256, what
    assert len(set(hashes.values())) == len(hashes)


def test_every_decision_carries_the_policy_and_its_judgment(profile: CalibrationProfile) -> None:
    engine = FakeEngine()
    judged = engine.judge_batch([Query(prompt=p, choices=["spam", "ham"]) for p in "abc"])
    policy = make_policy(profile, threshold=0.6)
    decisions = policy.decide_many(judged)
    for d, j in zip(decisions, judged, strict=True):
        assert d.policy_sha256 == policy.sha256 and d.profile_etag == profile.etag
        assert (d.judgment_id, d.tokens_sha256, d.model_sha256) == (
            j.judgment_id,
            j.tokens_sha256,
            engine.model_sha256,
        )
    assert len({d.judgment_id for d in decisions}) == 3
    assert len({d.tokens_sha256 for d in decisions}) == 3  # three prompts
    # A judgment that carries no identity (any ScoredJudgment) still gets a decision.
    plain = make_policy(None).decide_many(
        [Scored({"a": -0.1, "b": -2.4}), judgment_of({"a": 0.9, "b": 0.1})]
    )
    for d in plain:
        assert (d.judgment_id, d.tokens_sha256, d.model_sha256, d.profile_etag) == (None,) * 4
        assert d.policy_sha256 == make_policy(None).sha256


# --- profile_etag ---------------------------------------------------------------------------


def test_a_profile_s_etag_is_the_etag_of_its_saved_bytes(
    profile: CalibrationProfile, tmp_path: Path
) -> None:
    saved = save_profile(profile, tmp_path / "sms.json").read_bytes()
    assert profile.etag == etag_of(saved) == f'"{hashlib.sha256(saved).hexdigest()}"'
    judgment = FakeEngine().judge(SPAM, profile.choices)
    assert Gate(profile).decide(judgment).profile_etag == profile.etag
    assert Gate(profile).decide_many([judgment])[0].profile_etag == profile.etag
    other = msgspec.structs.replace(profile, note=profile.note + " (edited)")
    assert other.etag != profile.etag
    assert Gate(other).decide(judgment).profile_etag == other.etag


@pytest.fixture
def fake_client(tmp_path: Path) -> Iterator[TestClient[Any]]:
    app = create_app(FakeEngine(), config=ServiceConfig(profiles_dir=tmp_path))
    with TestClient(app=app) as c:
        yield wait_app_ready(c)


def test_responses_carry_the_identity_and_the_profile_s_etag(
    fake_client: TestClient[Any], profile: CalibrationProfile, tmp_path: Path
) -> None:
    c = fake_client
    ask = {"prompt": SPAM, "choices": ["spam", "ham"]}
    plain = c.post("/judge", json=ask).json()
    assert plain["profile_etag"] is None and plain["profile"] is None
    assert is_uuid7(plain["judgment_id"])
    assert plain["tokens_sha256"] == FakeEngine().prepare(ask).tokens_sha256
    assert plain["model_sha256"] == FakeEngine.model_sha256
    assert plain["policy_sha256"] == make_policy(None, defaults=PolicyDefaults()).sha256

    put = c.put("/profiles/sms", content=msgspec.json.encode(profile))
    assert put.status_code == 200
    tag = c.get("/profiles/sms").headers["etag"]
    assert tag == put.headers["etag"] == profile.etag
    gated = c.post("/judge", json={**ask, "profile": "sms"}).json()
    assert gated["profile_etag"] == tag
    assert gated["tokens_sha256"] == plain["tokens_sha256"]
    assert gated["judgment_id"] != plain["judgment_id"]
    assert gated["policy_sha256"] == make_policy(profile).sha256 != plain["policy_sha256"]
    batch = c.post(
        "/judge/batch", json={"items": [{**ask, "profile": "sms"}, {**ask, "prompt": "x"}]}
    ).json()["results"]
    assert [r["profile_etag"] for r in batch] == [tag, None]
    assert batch[0]["tokens_sha256"] == plain["tokens_sha256"] != batch[1]["tokens_sha256"]
    assert len({gated["judgment_id"], *(r["judgment_id"] for r in batch)}) == 3

    # A new version of the profile: a new ETag, and the next decision carries it.
    edited = msgspec.to_builtins(msgspec.structs.replace(profile, note="refitted"))
    new_tag = c.put("/profiles/sms", json=edited).headers["etag"]
    assert new_tag != tag and c.get("/profiles/sms").headers["etag"] == new_tag
    regated = c.post("/judge", json={**ask, "profile": "sms"}).json()
    assert regated["profile_etag"] == new_tag
    assert regated["policy_sha256"] != gated["policy_sha256"]  # the policy names its version

    # A file written by other means (compact JSON): the ETag is of its own bytes, as served.
    (tmp_path / "compact.json").write_bytes(
        msgspec.json.encode(msgspec.structs.replace(profile, name="compact"))
    )
    served = c.get("/profiles/compact").headers["etag"]
    assert served != msgspec.structs.replace(profile, name="compact").etag
    assert c.post("/judge", json={**ask, "profile": "compact"}).json()["profile_etag"] == served


def test_the_identity_module_loads_no_torch() -> None:
    code = "import sys, judge.identity; assert 'torch' not in sys.modules, 'torch loaded'"
    subprocess.run([sys.executable, "-c", code], check=True)
