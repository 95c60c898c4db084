"""A lean decoder pass for Llama-family models, on the model's own modules and weights.

A judgment is one pass, and most of a short pass is not arithmetic: transformers' decoder
builds a 4-D mask and a cache object, repeats keys for grouped-query attention and runs seven
matrix products a layer, each of which re-lays its weight out for the kernel on every call. This
pass does what a judgment needs and nothing else:

* tokens are flat, one after the other, with no padding between rows; attention reads each
  lane's keys (``judge.attention``), so nothing is masked that was not fed;
* the query, key and value products are one product, and so are the gate and up products
  (the modules' weights become views of the fused weight: no second copy);
* every product runs on a weight packed once for the kernel where this build of torch can
  (oneDNN; MKL for float32 on an Intel CPU: ``packing_library``), instead of being laid out
  again on every call (0.6-0.8x the time of ``F.linear``, measured);
* in the batch-invariant arithmetic, every product runs on chunks of exactly ``rows`` tokens
  (its input padded, its output cut back: the norms and activations between products run on
  the fed tokens only, 0.87x the time of a one-token pass that carried 64 rows throughout),
  and attention is ``attention.blocked_attention``;
* only the rows that are read leave the pass: the final norm runs on the scored rows, the
  requested layers keep their roots, and keys and values come back only for the prefix cache.

It covers the architectures whose blocks are Llama's (``LEAN_MODEL_TYPES``) with every layer
attending to the whole past; ``lean_unsupported`` says why another model takes the generic path
(``judge.forward``), which is exact too, only slower. The norms, the activation and the rotary
embedding are the model's own modules, so their variants (rope scaling, norm epsilon) come along.
"""

from __future__ import annotations

import copy
import logging
import threading
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch.nn import functional as F

import judge.attention as attention
from judge.attention import Lanes
from judge.batch_invariant import (
    ORDINARY,
    ROOT_ROWS,
    kernel_setting,
    measured_rows,
    measured_sizes,
    runs_in_words,
    span_mean,
    split_rows,
)

if TYPE_CHECKING:
    from transformers import PreTrainedModel

__all__ = [
    "LEAN_MODEL_TYPES",
    "LeanDecoder",
    "LeanOutput",
    "full_attention",
    "lean_decoder",
    "lean_unsupported",
    "packed_linear",
    "packing_library",
    "product_rows",
]

log = logging.getLogger("judge")

# model_type values whose decoder block is Llama's: pre-norm attention and SwiGLU MLP with
# residuals, rotary positions, q/k/v/o and gate/up/down linears (Qwen2 adds q/k/v biases,
# Qwen3 a norm on each query and key head).
LEAN_MODEL_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen3"})

# Tokens per matrix product in the batch-invariant arithmetic, by dtype. One shape per product
# is what makes a token's numbers independent of its batch; the size trades the padding of a
# short pass against the per-row speed of a long one (benchmarks/bench_pass.py measures it).
_ROWS = {torch.bfloat16: 64, torch.float16: 64, torch.float32: 32}


def product_rows(dtype: torch.dtype) -> int:
    """Tokens per matrix product of the batch-invariant lean pass in ``dtype``."""
    return _ROWS.get(dtype, 32)


def full_attention(model: PreTrainedModel) -> bool:
    """Whether every layer attends to the whole past (no sliding window)."""
    config = model.config
    types = getattr(config, "layer_types", None) or []
    return getattr(config, "sliding_window", None) is None and all(
        t == "full_attention" for t in types
    )


def lean_unsupported(model: PreTrainedModel) -> str | None:
    """Why ``model`` cannot take the lean pass, or None where it can."""
    config = model.config
    model_type = getattr(config, "model_type", None)
    if model_type not in LEAN_MODEL_TYPES:
        return f"model_type {model_type!r} is not one of {sorted(LEAN_MODEL_TYPES)}"
    if not full_attention(model):
        return "some layers attend to a sliding window only"
    rope = getattr(config, "rope_parameters", None) or {}
    rope_type = rope.get("rope_type", "default") if isinstance(rope, dict) else None
    if not isinstance(rope_type, str) or "dynamic" in rope_type or rope_type == "longrope":
        # The lean pass computes the rotary table from fixed frequencies.
        return f"rope_type {rope_type!r} changes its frequencies with the sequence"
    if getattr(config, "hidden_act", None) != "silu":
        return f"hidden_act {getattr(config, 'hidden_act', None)!r} is not 'silu'"
    get_decoder = getattr(model, "get_decoder", None)
    decoder = get_decoder() if callable(get_decoder) else None
    if decoder is None:
        return f"{type(model).__name__} has no decoder to run"
    for name in ("embed_tokens", "layers", "norm", "rotary_emb"):
        if not hasattr(decoder, name):
            return f"{type(decoder).__name__} has no {name}"
    for layer in decoder.layers:
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        parts = [getattr(attn, n, None) for n in ("q_proj", "k_proj", "v_proj", "o_proj")]
        parts += [getattr(mlp, n, None) for n in ("gate_proj", "up_proj", "down_proj")]
        if not all(isinstance(p, torch.nn.Linear) for p in parts):
            return f"{type(layer).__name__} lacks a q/k/v/o or gate/up/down linear"
        if not all(hasattr(layer, n) for n in ("input_layernorm", "post_attention_layernorm")):
            return f"{type(layer).__name__} lacks its norms"
    return None


def cpu_vendor() -> str:
    """The CPU's vendor as Linux names it (``GenuineIntel``, ``AuthenticAMD``), or ``""``."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("vendor_id"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def packing_library(dtype: torch.dtype) -> str | None:
    """Which library's packed product runs a weight of ``dtype`` here: "oneDNN" or "MKL", or
    None where this build of torch has neither.

    oneDNN for bfloat16. For float32, MKL on an Intel CPU and oneDNN on any other: on 2 cores
    of an AMD EPYC, MKL's float32 products (packed or not) took 2.7x oneDNN's with AVX-512
    kernels and 1.4x with AVX2 kernels (a layer's four products on 117 rows, in chunks of 32:
    6.8 against 2.6 ms, and 6.5 against 4.7), because MKL does not run its fast kernels on a
    CPU that is not Intel's. MKL stays where it was measured fast: on 2 cores of an Intel Xeon
    with AMX, oneDNN's packed products took 1.23x MKL's (1.24x with AVX2 kernels) and a
    117-token judgment 1.15x (1.17x) (``benchmarks/bench_packing.py``, side by side).
    """
    if dtype == torch.bfloat16:
        return "oneDNN" if torch.backends.mkldnn.is_available() else None
    if dtype != torch.float32:
        return None
    if cpu_vendor() == "GenuineIntel" and torch.backends.mkl.is_available():
        return "MKL"
    return "oneDNN" if torch.backends.mkldnn.is_available() else None


def packed_linear(
    weight: torch.Tensor, bias: torch.Tensor | None, rows: int | None
) -> Callable | None:
    """``F.linear`` with ``weight`` laid out once for this kernel (``packing_library``):
    oneDNN's (any number of input rows) or MKL's (float32, inputs of at most ``rows`` rows, so
    none where ``rows`` is None); None where neither applies. The packed copy's results are
    checked against ``F.linear`` before it is used."""
    library = packing_library(weight.dtype)
    try:
        if library == "oneDNN":
            w = torch.ops.mkldnn._reorder_linear_weight(weight, rows)

            def op(x: torch.Tensor) -> torch.Tensor:
                return torch.ops.mkldnn._linear_pointwise(x, w, bias, "none", [], "")

        elif library == "MKL" and rows:
            w = torch.ops.mkl._mkl_reorder_linear_weight(weight, rows)

            def op(x: torch.Tensor) -> torch.Tensor:
                # Packed for ``rows`` rows, computed for as many as x has (up to ``rows``):
                # torch's op takes the packed weight only when told x's own row count.
                out = torch.ops.mkl._mkl_linear(x, w, weight, None, x.shape[0])
                return out if bias is None else out + bias

        else:
            return None
        # A probe of our own generator, so the caller's random stream is not moved.
        seeded = torch.Generator().manual_seed(0)
        probe = torch.randn(rows or 1, weight.shape[1], generator=seeded).to(weight)
        got, want = op(probe).float(), F.linear(probe, weight, bias).float()
        return op if torch.allclose(got, want, rtol=1e-2, atol=0.1) else None
    except (RuntimeError, AttributeError):  # no such op in this build, or not for this device
        return None


class _Product:
    """``x @ weight.T + bias`` over the rows of x: in chunks of exactly ``rows`` rows (the
    batch-invariant arithmetic; the size ``measured_rows`` finds gives each row the same bits
    at every slot of its chunk, ``rows`` where it does), or in one product (``rows`` None); on
    a packed copy of the weight unless ``pack`` is False."""

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        rows: int | None,
        pack: bool = True,
    ) -> None:
        self.weight, self.bias = weight, bias
        self._splits: dict[int, list[int]] = {}  # split_rows of each number of rows seen
        pack = pack and weight.device.type == "cpu"
        library = packing_library(weight.dtype) if pack else None
        # What computes the product: the library whose packed weight ``op`` runs, or F.linear.
        self.library = "F.linear"

        def make(n: int | None) -> Callable[[torch.Tensor], torch.Tensor]:
            packed = packed_linear(weight, bias, n) if library else None
            self.library = library if packed and library else "F.linear"
            return packed or (lambda x: F.linear(x, weight, bias))

        if rows is None:
            self.rows, self.op = None, make(None)
            self.sizes: tuple[int, ...] = ()
        else:
            kind = f"packed product ({library})" if library else "product"
            self.rows, self.op = measured_rows(make, rows, weight, kind)
            self.sizes = measured_sizes(self.op, self.rows, weight, kind)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # (N, in) -> (N, out)
        n = x.shape[0]
        if self.rows is None or n == self.rows:
            return self.op(x)
        # Whole chunks of ``rows``, the rest in the smaller sizes measured to give a row the
        # same bits; padded with zero rows only where those cannot make it exactly.
        sizes = self._splits.get(n)
        if sizes is None:
            sizes = self._splits[n] = split_rows(n, self.sizes)
        if sum(sizes) > n:
            x = F.pad(x, (0, 0, 0, sum(sizes) - n))
        if len(sizes) == 1:
            return self.op(x)[:n]
        return torch.cat([self.op(chunk) for chunk in x.split(sizes)])[:n]


def _fused(
    linears: Sequence[torch.nn.Linear], known: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One weight (and bias) for several linears that read the same input. The modules keep
    views of it, so the model holds one copy and still runs as before; ``known``, a fused
    weight made before, is taken again while the modules' weights are still its views."""
    if known is None or not _views_of(linears, known):
        known = torch.cat([lin.weight.detach() for lin in linears])
        start = 0
        for lin in linears:
            n = lin.weight.shape[0]
            lin.weight.data = known[start : start + n]
            start += n
    if all(lin.bias is None for lin in linears):
        return known, None
    biases = [
        lin.bias.detach() if lin.bias is not None else known.new_zeros(lin.weight.shape[0])
        for lin in linears
    ]
    return known, torch.cat(biases)


def _views_of(linears: Sequence[torch.nn.Linear], fused: torch.Tensor) -> bool:
    start = 0
    for lin in linears:
        if lin.weight.dtype != fused.dtype or lin.weight.data_ptr() != fused[start:].data_ptr():
            return False
        start += lin.weight.shape[0]
    return start == fused.shape[0]


# Per model decoder: each layer's fused q/k/v and gate/up weights, shared by its LeanDecoders.
_FUSED: weakref.WeakKeyDictionary[torch.nn.Module, list[tuple[torch.Tensor | None, ...]]] = (
    weakref.WeakKeyDictionary()
)
_DECODERS: weakref.WeakKeyDictionary[torch.nn.Module, dict[int | None, LeanDecoder]] = (
    weakref.WeakKeyDictionary()
)
_LOCK = threading.Lock()


def lean_decoder(model: PreTrainedModel, batch_invariant: bool) -> LeanDecoder:
    """The model's lean pass (one per model and arithmetic: the packed weights are not made
    twice)."""
    rows = product_rows(model.dtype) if batch_invariant else None
    with _LOCK:
        made = _DECODERS.setdefault(model, {})
        if rows not in made:
            made[rows] = LeanDecoder(model, rows)
    made[rows].refresh()
    return made[rows]


@dataclass(frozen=True)
class LeanOutput:
    hidden: torch.Tensor  # (R, H) after the final norm, at the read rows
    features: dict[int, torch.Tensor]  # per inner layer: (n_roots, H) float32
    kv: list[tuple[torch.Tensor, torch.Tensor]] | None  # per layer: fed (Hkv, N, D) keys, values
    # Per span layer (the last one after the final norm): (n_spans, H) float32 means.
    span_means: dict[int, torch.Tensor] = field(default_factory=dict)


class _Layer:
    def __init__(self, block: Any, fused: tuple[torch.Tensor | None, ...], rows: int | None):
        attn, mlp = block.self_attn, block.mlp
        self.ln1, self.ln2 = block.input_layernorm, block.post_attention_layernorm
        self.q_norm = getattr(attn, "q_norm", None)
        self.k_norm = getattr(attn, "k_norm", None)
        self.qkv = _Product(*_fused([attn.q_proj, attn.k_proj, attn.v_proj], fused[0]), rows)
        self.o = _Product(attn.o_proj.weight.detach(), _detached(attn.o_proj.bias), rows)
        self.gate_up = _Product(*_fused([mlp.gate_proj, mlp.up_proj], fused[1]), rows)
        self.down = _Product(mlp.down_proj.weight.detach(), _detached(mlp.down_proj.bias), rows)
        self.act = mlp.act_fn
        self.scale = float(attn.scaling)


def _detached(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.detach()


def _rotary(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding, ``x * cos + rotate_half(x) * sin`` with the sign of rotate_half's
    negated half folded into ``signed_sin`` (negation is exact, so nothing rounds otherwise)."""
    half = x.shape[-1] // 2
    swapped = torch.cat((x[..., half:], x[..., :half]), dim=-1)
    return torch.addcmul(x * cos, swapped, signed_sin)


class LeanDecoder:
    """The pass of one Llama-family model, in one arithmetic (``rows``: tokens per product,
    None for the ordinary arithmetic).

    The packed weights are copies. Each pass first checks that the parameters it packed
    still hold what they held (same storage, and version counters that count in-place writes:
    an optimizer's step, ``load_state_dict``, ``model.to``), and packs again where not; a new
    Judge on the model also notices a parameter replaced by another (``refresh``).
    """

    def __init__(self, model: PreTrainedModel, rows: int | None) -> None:
        reason = lean_unsupported(model)
        if reason is not None:
            raise ValueError(f"no lean pass for {type(model).__name__}: {reason}")
        decoder: Any = model.get_decoder()
        config = model.config
        self.rows = rows
        self._decoder = decoder
        self.embed, self.norm, self.rotary = decoder.embed_tokens, decoder.norm, decoder.rotary_emb
        self.heads = int(config.num_attention_heads)
        self.kv_heads = int(getattr(config, "num_key_value_heads", None) or self.heads)
        self.head_dim = int(decoder.layers[0].self_attn.head_dim)
        # The batch-invariant attention's blocks, measured for these heads on this machine.
        self.blocking = (
            attention.measured_blocking(self.heads, self.kv_heads, self.head_dim, model.dtype)
            if rows
            else None
        )
        self._output = model.get_output_embeddings()
        self._lock = threading.Lock()
        self._pack()

    def _parameters(self) -> list[torch.Tensor]:
        """Each weight and bias of the blocks' linears and the LM head: what the packed copies
        are made of."""
        blocks = self._decoder.layers
        linears = [m for b in blocks for m in b.modules() if isinstance(m, torch.nn.Linear)]
        linears.append(self._output)
        return [p for m in linears for p in (m.weight, m.bias) if p is not None]

    def _signature(self) -> list[tuple[int, int]]:
        """Where each packed parameter lives and how often it was written in place (28 us
        for the default model's 210, checked before every pass)."""
        return [(p.data_ptr(), p._version) for p in self._params]

    def _pack(self) -> None:
        with torch.no_grad():
            blocks = self._decoder.layers
            known: list[tuple[torch.Tensor | None, ...]] = [(None, None)] * len(blocks)
            known = _FUSED.get(self._decoder) or known
            self.layers = [_Layer(b, f, self.rows) for b, f in zip(blocks, known, strict=True)]
            _FUSED[self._decoder] = [(x.qkv.weight, x.gate_up.weight) for x in self.layers]
            # The vocabulary-wide product at the roots, ROOT_ROWS at a time (one root per
            # question, so small chunks). Packed in float32 only: 8 rows of the default
            # model's head then take 6.4 ms on MKL (Intel Xeon) against 9-12 unpacked, and
            # 4.2 ms on oneDNN (AMD EPYC) against 17; oneDNN's bfloat16 product was no faster
            # packed (2.4 against 2.1 ms).
            out = self._output
            self.head = _Product(
                out.weight.detach(),
                _detached(getattr(out, "bias", None)),
                ROOT_ROWS if self.rows else None,
                pack=out.weight.dtype == torch.float32,
            )
        self._params = self._parameters()
        self._packed_as = self._signature()

    def with_model(self, model: PreTrainedModel) -> LeanDecoder:
        """This pass over ``model``, a copy of this one's model in which some blocks are other
        modules (``judge.adapted.model_with_blocks``): the layers whose blocks are the same
        objects keep their packed weights (shared, not copied: the base pass and this one
        repack nothing of each other's), the others are packed here."""
        decoder: Any = model.get_decoder()
        with self._lock:
            other = copy.copy(self)
            other._lock = threading.Lock()
            other._decoder = decoder
            own = self._decoder.layers
            other.layers = [
                layer if block is own[i] else _Layer(block, (None, None), self.rows)
                for i, (block, layer) in enumerate(zip(decoder.layers, self.layers, strict=True))
            ]
            _FUSED[decoder] = [(x.qkv.weight, x.gate_up.weight) for x in other.layers]
            other._params = other._parameters()
            other._packed_as = other._signature()
        return other

    def product_rows(self) -> list[int]:
        """The chunk sizes of the blocks' products (``measured_rows``: one per weight shape
        unless a shape's slots round otherwise at the preferred size)."""
        return sorted({p.rows for p in self._products() if p.rows is not None})

    def smaller_sizes(self) -> list[int]:
        """The sizes below the chunk that every block product measured to give a row its
        chunk's bits (``measured_sizes``): what a pass's last rows run in, unpadded."""
        sizes = [set(p.sizes) - {p.rows} for p in self._products()]
        return sorted(set.intersection(*sizes), reverse=True) if sizes else []

    def _products(self) -> list[_Product]:
        return [p for layer in self.layers for p in (layer.qkv, layer.o, layer.gate_up, layer.down)]

    def libraries(self) -> list[str]:
        """What computes the pass's products (``packing_library``, or F.linear where no packed
        weight could be made), the LM head's included."""
        return sorted({p.library for p in [*self._products(), self.head]})

    def arithmetic(self) -> str:
        """The batch-invariant arithmetic's sizes, as measured, in words."""
        if self.blocking is None:
            return ORDINARY
        rows = " or ".join(str(r) for r in self.product_rows())
        smaller = runs_in_words(self.smaller_sizes())
        rest = f" (a pass's last rows in products of {smaller} rows)" if smaller else ""
        keys = self.blocking.describe()
        threads, capability = kernel_setting()
        on = " and ".join(self.libraries())
        return (
            f"batch-invariant: products ({on}) in chunks of {rows} rows{rest}, attention in "
            f"blocks of {self.blocking.queries} queries, {keys} (measured for {capability} "
            f"kernels, {threads} threads)"
        )

    def refresh(self, replaced: bool = True) -> None:
        """Pack again if a parameter was written to since the last packing, or (``replaced``,
        dearer: the modules are walked) if a module holds another parameter than it did."""
        with self._lock:
            changed = self._signature() != self._packed_as
            if replaced and not changed:
                now = self._parameters()
                changed = len(now) != len(self._params) or any(
                    a is not b for a, b in zip(now, self._params, strict=False)
                )
            if changed:
                log.info("the model's weights changed since they were packed: packing again")
                self._pack()

    def _rotary_table(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin of the rotary angles at ``positions``: (n, 1, D) each, as the
        model's rotary module computes them (its frequencies and scaling), but with numpy's
        cos and sin. torch's float32 cos hands large tensors to MKL's threaded VML, whose
        first calls in a process gave some positions other bits than later calls (3 fresh
        processes in 4 judged an item twice with different probabilities; none with
        MKL_NUM_THREADS=1): numpy's run on this thread, the same bits every time."""
        angles = positions.float()[:, None].cpu() * self.rotary.inv_freq.float().cpu()[None]
        a = angles.numpy()  # (n, D/2) float32, the module's own product
        half_cos = torch.from_numpy(np.cos(a)) * self.rotary.attention_scaling
        half_sin = torch.from_numpy(np.sin(a)) * self.rotary.attention_scaling
        cos = torch.cat((half_cos, half_cos), dim=-1).to(dtype)
        sin = torch.cat((-half_sin, half_sin), dim=-1).to(dtype)  # rotate_half's sign folded in
        device = positions.device
        return cos[:, None].to(device), sin[:, None].to(device)

    @torch.inference_mode()
    def run(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor,
        lanes: Lanes,
        past: Sequence[tuple[torch.Tensor, torch.Tensor]] | None,
        read: torch.Tensor,
        roots: torch.Tensor,
        layers: Sequence[int] = (),
        keep_kv: bool = False,
        spans: Sequence[torch.Tensor] = (),
        span_layers: Sequence[int] = (),
    ) -> LeanOutput:
        """One pass over the fed tokens ``ids`` (N,) at ``positions`` (N,), each query reading
        its lane of keys: ``past`` (per layer, cached (Hkv, P, D) keys and values, the first
        part of the key bank) then the fed tokens' own. Returns the final hidden state at the
        ``read`` rows, the ``layers``' (1-based, below the last) residual stream at ``roots``,
        with ``keep_kv`` every layer's fed keys and values, and for each of ``span_layers`` the
        mean over each of ``spans`` (fed rows) of the residual stream (``span_mean``)."""
        self.refresh(replaced=False)
        N = ids.shape[0]
        Hq, Hkv, D = self.heads, self.kv_heads, self.head_dim
        x = self.embed(ids)  # (N, H)
        cos, sin = self._rotary_table(positions, x.dtype)  # (N, 1, D) each
        zero = x.new_zeros(Hkv, lanes.pad_keys, D)  # the bank's padding
        kept: list[tuple[torch.Tensor, torch.Tensor]] = []
        features: dict[int, torch.Tensor] = {}
        wanted = set(layers)
        means: dict[int, torch.Tensor] = {}
        span_wanted = set(span_layers) if spans else set()
        for i, layer in enumerate(self.layers):
            h = layer.ln1(x)
            qkv = layer.qkv(h).view(N, Hq + 2 * Hkv, D)
            qk, v = qkv[:, : Hq + Hkv], qkv[:, Hq + Hkv :]
            if layer.q_norm is not None and layer.k_norm is not None:
                qk = torch.cat([layer.q_norm(qk[:, :Hq]), layer.k_norm(qk[:, Hq:])], dim=1)
            qk = _rotary(qk, cos, sin)  # queries and keys rotated together
            q, k = qk[:, :Hq], qk[:, Hq:]
            fed_k, fed_v = k.transpose(0, 1), v.transpose(0, 1)  # (Hkv, N, D)
            if keep_kv:
                kept.append((fed_k, fed_v))
            before = [past[i][0]] if past else []
            bank_k = torch.cat([*before, fed_k, zero], dim=1)  # (Hkv, P + N + pad, D)
            before = [past[i][1]] if past else []
            bank_v = torch.cat([*before, fed_v, zero], dim=1)
            if self.rows:  # the batch-invariant arithmetic
                a = attention.blocked_attention(q, bank_k, bank_v, lanes, layer.scale)
            else:
                a = attention.lane_sdpa(q, bank_k, bank_v, lanes, layer.scale)
            x = x + layer.o(a)  # (N, H)
            gate, up = layer.gate_up(layer.ln2(x)).chunk(2, dim=-1)
            x = x + layer.down(layer.act(gate) * up)
            if i + 1 in wanted:
                features[i + 1] = x[roots].float()
            if i + 1 in span_wanted:
                # The last layer's states are read after the final norm, as the head reads.
                last = i + 1 == len(self.layers)
                means[i + 1] = torch.stack(
                    [span_mean(self.norm(x[s]) if last else x[s]) for s in spans]
                )
        return LeanOutput(self.norm(x[read]), features, kept if keep_kv else None, means)
