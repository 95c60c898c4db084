"""Batch-invariant arithmetic for the one pass: a token's numbers do not depend on its batch.

A judgment must be a function of its item, not of the traffic around it. In an ordinary pass
a token's hidden state depends, in its last bits, on what else is in the pass: a matrix
product's kernel (and so its order of summation) is picked by the product's shape, which is
the number of tokens in the batch; attention sums over a row whose length and padding depend
on the longest neighbour and on how much of the prompt came from the prefix cache. In
bfloat16 a last-bit difference in one activation is a rounding flip of 2**-8, and thirty
layers carry it to the probabilities (0.024 measured on the default model).

Inside ``invariant_ops()`` two operations are replaced, on this thread only (a torch function
mode is thread-local):

* ``F.linear`` (and ``torch.addmm`` with a bias vector, GPT-2's ``Conv1D``) runs on chunks
  of exactly ``ROWS`` tokens, the last one padded with zeros. A
  product of one fixed shape is one kernel with one order of summation, so each token's row
  is the same whatever its neighbours. Whichever slot of the chunk it lands in is measured,
  not assumed (``measured_rows``): with AVX2 kernels a product computes rows six at a time
  and a tail of one to three rows another way, so the last slots of a 32-row chunk get other
  bits for some weight shapes; then another chunk size is taken.
* ``F.scaled_dot_product_attention`` is computed by its reference definition (softmax of
  scaled scores plus mask, times values) in float64 and rounded once to the input's dtype.
  Masked keys weigh exactly zero; the keys that count are summed in float64, whose rounding
  (2**-53) sits far below the float32 or bfloat16 rounding of the result, so the rounded
  result no longer depends on the row's length, padding or split between cache and pass.

The price is time: float64 attention, the padding of the last chunk, and products of 32 rows
that run a little slower per row than one large product (``benchmarks/bench_invariance.py``
measures it against the ordinary arithmetic). Elementwise operations and per-token reductions
(norms, activations, rotary embeddings) already give one result per token: not assumed but
measured: ``tests/test_invariance.py`` compares lone, batched, cached and shared passes on
the default model to 1e-6.

This covers models whose attention goes through ``scaled_dot_product_attention`` (the
default ``sdpa`` implementation of transformers); for another, ``Judge`` raises a
``ModelLoadError`` unless it is built with ``batch_invariant=False``.
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch.nn import functional as F
from torch.overrides import TorchFunctionMode

__all__ = [
    "GENERIC_INVARIANT",
    "ORDINARY",
    "QUERY_ROWS",
    "ROOT_ROWS",
    "ROWS",
    "invariant_addmm",
    "invariant_linear",
    "invariant_ops",
    "invariant_sdpa",
    "kernel_setting",
    "measured_rows",
    "measured_sizes",
    "runs_in_words",
    "slot_invariant",
    "span_mean",
    "split_rows",
]

log = logging.getLogger("judge")

# Tokens per matrix product: every product has this shape, so one kernel and one order of
# summation. 32 keeps the padding of a short pass small; on the machine measured (2 EPYC cores),
# passes with chunks of 16 to 64 rows ran within noise of each other.
ROWS = 32
# Rows per product for the LM head over the whole vocabulary, read at one root per question.
ROOT_ROWS = 8
# Queries per block of float64 attention: (heads, 256, keys) scores at a time.
QUERY_ROWS = 256
# Chunk sizes tried, in order, after the preferred one where a slot of it gives other bits:
# multiples of 6 first (AVX2 kernels compute rows six at a time), and 1 last (one row a
# product is the same product whatever the batch). Only those up to twice the preferred size.
ROW_CANDIDATES = (24, 48, 12, 6, 1)
# Chunks' worth of random rows a smaller product size is measured on (``measured_sizes``):
# more in 16-bit floats, whose rounding of a product's result hides most changes of the order
# of summation (float32 shows them on nearly every row).
SIZE_PROBE_CHUNKS = {2: 4, 4: 1}

Product = Callable[[torch.Tensor], torch.Tensor]
_MEASURED_ROWS: dict[tuple[object, ...], int] = {}
_MEASURED_SIZES: dict[tuple[object, ...], tuple[int, ...]] = {}


def slot_invariant(product: Product, rows: int, weight: torch.Tensor) -> bool:
    """Whether ``product`` of ``rows`` rows gives each row the same bits at every slot:
    a seeded random input rolled through every slot, the output rolled back."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(rows, weight.shape[1], generator=g).to(weight)
    want = product(x)
    return all(torch.equal(product(x.roll(s, 0)), want.roll(s, 0)) for s in range(1, rows))


def measured_rows(
    make: Callable[[int], Product], preferred: int, weight: torch.Tensor, kind: str
) -> tuple[int, Product]:
    """The chunk size whose product (``make(rows)``, in its own ``kind`` of kernel) gives
    every slot the same bits, and that product: ``preferred`` where it does, else the first
    of ``ROW_CANDIDATES`` up to twice it that does. Measured once per process for each weight
    shape and dtype, kind, number of threads and kernel capability."""
    key = (kind, tuple(weight.shape), weight.dtype, preferred, *kernel_setting())
    known = _MEASURED_ROWS.get(key)
    if known is not None:
        return known, make(known)
    candidates = [preferred, *(r for r in ROW_CANDIDATES if r != preferred and r <= 2 * preferred)]
    for rows in candidates:  # the last, one row, holds by definition: it has one slot
        product = make(rows)
        if slot_invariant(product, rows, weight):
            break
    if rows != preferred:
        log.info(
            "%s %s %s: %d-row products give other bits at some slots here; %d rows",
            kind,
            list(weight.shape),
            weight.dtype,
            preferred,
            rows,
        )
    _MEASURED_ROWS[key] = rows
    return rows, product


def measured_sizes(product: Product, rows: int, weight: torch.Tensor, kind: str) -> tuple[int, ...]:
    """The product sizes, largest first, that give a row the bits it gets in a product of
    ``rows`` rows, at every slot: ``rows`` itself and each size below it where ``product``
    (which takes any number of rows up to ``rows``) measures so on this machine. A pass then
    needs no padding: its rows are whole products of ``rows``, the rest one product of its own
    size where that holds (``split_rows``). Measured once per process for each weight shape
    and dtype, kind, size and kernel setting, as ``measured_rows``.

    A size is tried on ``SIZE_PROBE_CHUNKS`` chunks' worth of seeded random rows (four in
    bfloat16 or float16), each row at two slots of its product, against the rows' bits in
    whole chunks. So many rows, because a kernel that sums in another order shows it on few
    rows once its result is rounded to bfloat16: on an Intel Xeon with AMX, oneDNN's bfloat16 products of up to ~32 rows sum
    otherwise than those of 64, and that showed on ~1 row in 15 (a one-row product), often
    on none of the 2 rows per size an earlier check tried, which then took those sizes and
    gave a warm-cache judgment other probabilities (0.0055) than the same judgment cold."""
    key = ("sizes", kind, tuple(weight.shape), weight.dtype, rows, *kernel_setting())
    if key not in _MEASURED_SIZES:
        g = torch.Generator().manual_seed(2)
        chunks = SIZE_PROBE_CHUNKS.get(weight.element_size(), 1)
        x = torch.randn(chunks * rows, weight.shape[1], generator=g).to(weight)
        want = torch.cat([product(chunk) for chunk in x.split(rows)])
        sizes = [rows, *(s for s in range(rows - 1, 0, -1) if _size_holds(product, x, want, s))]
        _MEASURED_SIZES[key] = tuple(sizes)
    return _MEASURED_SIZES[key]


def _size_holds(product: Product, x: torch.Tensor, want: torch.Tensor, size: int) -> bool:
    """Whether products of ``size`` rows give the rows of ``x`` their bits in ``want``: the
    rows cut into products from the first row, and again from half a product on (so each row
    sits at another slot)."""
    for offset in sorted({0, size // 2}):
        for start in range(offset, x.shape[0] - size + 1, size):
            if not torch.equal(product(x[start : start + size]), want[start : start + size]):
                return False
    return True


def span_mean(states: torch.Tensor) -> torch.Tensor:
    """The mean of (n, H) hidden states over their n tokens, (H,) float32: summed in float64
    and rounded once, so that it rounds the same whatever order a kernel sums in. Each row is
    batch-invariant already, so the mean of the same rows is too."""
    return states.double().mean(dim=0).float()


def split_rows(n: int, sizes: Sequence[int]) -> list[int]:
    """``n`` rows as products of ``sizes`` (largest first): whole products of the largest,
    then the rest greedily in smaller ones; where the sizes cannot make the rest exactly, the
    last product is the smallest size that holds it (its extra rows padded)."""
    out: list[int] = []
    left = n
    for size in sizes:
        out += [size] * (left // size)
        left %= size
    if left:
        out.append(min(s for s in sizes if s >= left))
    return out


def runs_in_words(sizes: Sequence[int], step: int = 1) -> str:
    """Sizes in words, ascending, each run of sizes ``step`` apart joined: "1, 3-31"."""
    runs: list[list[int]] = []
    for size in sorted(sizes):
        if runs and size == runs[-1][-1] + step:
            runs[-1].append(size)
        else:
            runs.append([size])
    return ", ".join(f"{r[0]}-{r[-1]}" if len(r) > 1 else str(r[0]) for r in runs)


# What ``Judge.arithmetic`` says of the passes that do not measure their sizes.
ORDINARY = "ordinary (a judgment's last bits may depend on its batch)"
GENERIC_INVARIANT = (
    "batch-invariant: products in chunks measured per weight shape (32 rows where that "
    "holds), float64 attention"
)


def kernel_setting() -> tuple[int, str]:
    """What decides which kernels run, besides the shapes: the threads and the CPU capability
    torch dispatches to (AVX2, AVX512, ...). A measurement holds for this setting only."""
    return torch.get_num_threads(), str(torch.backends.cpu.get_cpu_capability())


def invariant_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, rows: int = ROWS
) -> torch.Tensor:
    """``F.linear`` on chunks of exactly ``rows`` rows (or the size ``measured_rows`` takes
    instead for this weight): each row's result is independent of how many rows came with it
    and of its slot among them."""
    product = functools.partial(F.linear, weight=weight, bias=bias)
    rows, _ = measured_rows(lambda _: product, rows, weight, "F.linear")
    out = _chunked(product, x.reshape(-1, x.shape[-1]), rows)
    return out.reshape(*x.shape[:-1], weight.shape[0])


def invariant_addmm(
    bias: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, rows: int = ROWS
) -> torch.Tensor:
    """``torch.addmm(bias, x, weight)`` (the product of GPT-2's ``Conv1D``: x (n, in), weight
    (in, out), a bias per output) as ``invariant_linear`` computes a product."""
    product = functools.partial(torch.addmm, bias, mat2=weight)
    rows, _ = measured_rows(lambda _: product, rows, weight.T, "torch.addmm")
    return _chunked(product, x, rows)


def _chunked(product: Product, flat: torch.Tensor, rows: int) -> torch.Tensor:
    """``product`` of (n, in) ``flat`` on chunks of exactly ``rows`` rows, the last one padded
    with zero rows, the padding's results cut off."""
    n = flat.shape[0]
    pad = -n % rows
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad, flat.shape[1])])
    return torch.cat([product(chunk) for chunk in flat.split(rows)])[:n]


def invariant_sdpa(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> torch.Tensor:
    """``F.scaled_dot_product_attention`` by its definition, in float64 (no dropout).

    Queries go ``QUERY_ROWS`` at a time, so the float64 scores of a long prompt never exist
    all at once, and each block reads keys only up to the last one any of its queries may
    see: in a causal pass that skips the masked half of the work. A key left out weighs
    exactly zero where it is kept, so neither changes a result.
    """
    if dropout_p:
        raise ValueError("the batch-invariant attention runs in inference only (no dropout)")
    *batch, heads, L, D = query.shape
    S = key.shape[-2]
    if is_causal:  # top-left aligned, as scaled_dot_product_attention defines it
        attn_mask = torch.ones(L, S, dtype=torch.bool, device=query.device).tril()
    k, v = key.double(), value.double()
    # Grouped-query attention: each key head serves ``groups`` query heads. The query heads
    # are folded onto their key head instead of copying the keys ``groups`` times.
    groups = heads // k.shape[-3] if enable_gqa else 1
    scale = 1 / math.sqrt(D) if scale is None else scale
    out = []
    for a in range(0, L, QUERY_ROWS):
        b = min(a + QUERY_ROWS, L)
        mask = None if attn_mask is None else attn_mask[..., a:b, :]
        n = S if mask is None else _keys_seen(mask)
        q = query[..., a:b, :].double().reshape(*batch, heads // groups, groups * (b - a), D)
        scores = (q @ k[..., :n, :].transpose(-2, -1)) * scale
        scores = scores.reshape(*batch, heads, b - a, n)
        if mask is not None:
            mask = mask[..., :n]
            if mask.dtype == torch.bool:
                scores = scores.masked_fill(~mask, -math.inf)
            else:
                scores = scores + mask.double()
        weights = scores.softmax(dim=-1).reshape(*batch, heads // groups, groups * (b - a), n)
        out.append((weights @ v[..., :n, :]).reshape(*batch, heads, b - a, D))
    return torch.cat(out, dim=-2).to(query.dtype)


def _keys_seen(mask: torch.Tensor) -> int:
    """How many leading keys some query under ``mask`` may see: past the last such key, every
    key is masked out (False, or an additive mask at the dtype's minimum or -inf)."""
    seen = mask if mask.dtype == torch.bool else mask > torch.finfo(mask.dtype).min / 2
    columns = seen.reshape(-1, seen.shape[-1]).any(dim=0).nonzero()
    return int(columns[-1]) + 1 if len(columns) else mask.shape[-1]


class _InvariantMode(TorchFunctionMode):
    def __init__(self, rows: int) -> None:
        super().__init__()
        self.rows = rows

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        # Inside __torch_function__ the mode is off, so the replacements' own calls reach
        # the kernels.
        kwargs = kwargs or {}
        if func is F.linear:
            x, weight, *rest = args
            bias = rest[0] if rest else kwargs.get("bias")
            return invariant_linear(x, weight, bias, rows=self.rows)
        if func is torch.addmm and len(args) == 3 and not kwargs and args[0].dim() == 1:
            return invariant_addmm(*args, rows=self.rows)
        if func is F.scaled_dot_product_attention:
            return invariant_sdpa(*args, **kwargs)
        return func(*args, **kwargs)


@contextmanager
def invariant_ops(rows: int = ROWS) -> Iterator[None]:
    """Within the block, on this thread, ``F.linear`` (in chunks of ``rows`` tokens) and
    scaled dot-product attention give each token a result that does not depend on the rest
    of its batch."""
    with _InvariantMode(rows):
        yield
