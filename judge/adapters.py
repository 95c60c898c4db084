"""Low-rank adapters as plain data: what a profile carries and an engine serves.

An ``Adapter`` is LoRA (Hu et al. 2021) on a contiguous run of a model's decoder blocks:
for each adapted linear ``W`` (out, in), two matrices ``A`` (rank, in) and ``B`` (out, rank),
and the served weight is ``W + (alpha / rank) B A``. Its weights are one safetensors blob
(float32, tensors named ``"{block}.{target}.A"`` and ``"{block}.{target}.B"``, ``block``
counted from 0) whose sha256 names the adapter everywhere: in the profile, in every judgment
made under it, and in the engine's table of merged adapters. ``calibration.tasks.adapter.training`` trains
one; ``Judge`` serves it (``Query.adapter``). No torch here, so that ``calibration`` keeps
one inside a profile.
"""

from __future__ import annotations

import hashlib
from typing import Annotated, Literal, get_args

import msgspec
from msgspec import Meta

__all__ = ["ADAPTER_TARGETS", "Adapter", "AdapterTarget", "weights_sha256"]

# The linears of a Llama-family block an adapter may change: attention's four and the MLP's
# three (the lean pass fuses q/k/v and gate/up, so a merged adapter costs nothing per pass).
AdapterTarget = Literal["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ADAPTER_TARGETS: tuple[AdapterTarget, ...] = get_args(AdapterTarget)
# Standard base64 (RFC 4648, padded), as msgspec writes and reads bytes in JSON.
BASE64 = "^(?:[A-Za-z0-9+/]{4})*(?:[A-Za-z0-9+/]{2}==|[A-Za-z0-9+/]{3}=)?$"


def weights_sha256(weights: bytes) -> str:
    """The sha256 (hex) of an adapter's safetensors bytes: its name."""
    return hashlib.sha256(weights).hexdigest()


class Adapter(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """LoRA on ``blocks`` (0-based, ascending, contiguous) of one model, merged when served."""

    blocks: Annotated[list[Annotated[int, Meta(ge=0)]], Meta(min_length=1)]
    rank: Annotated[int, Meta(ge=1, le=256)]
    alpha: Annotated[float, Meta(gt=0)]
    targets: Annotated[list[AdapterTarget], Meta(min_length=1)]
    # safetensors, float32; base64 in JSON (the pattern tells a schema's reader so: a string
    # that is not base64 is not this field's, and is refused as the JSON is read).
    weights: Annotated[bytes, Meta(extra_json_schema={"pattern": BASE64})]
    sha256: str  # of ``weights``
    # The blocks' model: its parameters' sha256 (``Judge.model_sha256``), so that an adapter
    # is never merged into other weights than it was trained on.
    model_sha256: str

    def problems(self) -> list[str]:
        """What breaks a rule its types cannot state, each naming its field: a profile
        refuses to load with any (``CalibrationProfile``), an engine to merge it."""
        problems = []
        b = self.blocks
        if b != list(range(b[0], b[0] + len(b))) if b else True:
            problems.append(f"adapter.blocks must be ascending and contiguous, got {b!r}")
        if len(set(self.targets)) != len(self.targets):
            problems.append(f"adapter.targets must not repeat, got {self.targets!r}")
        if weights_sha256(self.weights) != self.sha256:
            problems.append(
                "adapter.sha256 is not the sha256 of adapter.weights: the adapter's weights "
                "were changed or cut short"
            )
        return problems

    @property
    def scale(self) -> float:
        """What ``B A`` is multiplied by before it is added to a weight."""
        return self.alpha / self.rank

    @property
    def short(self) -> str:
        """The first 12 hex digits of its sha256, for messages."""
        return self.sha256[:12]
