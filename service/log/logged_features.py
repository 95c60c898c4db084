"""A decision's hidden states, kept in the decision log so that a probe can be refitted from it.

With ``judge serve --log-features`` each logged decision made under a profile keeps the hidden
states, at the decision point, of the layers ``log_layers`` names: a probe profile's own layers
(its refit chooses the regularisation again, on the same layer), else the layers a probe is
chosen among (``calibration.maps.probe.candidate_layers``), so that a log gathered under a
temperature profile can grow the first probe. ``judge calibrate --from-log`` reads them back.

Compactly: float16, one row of the model's width per layer, as raw bytes (base64 in the log's
JSON record). For the default model (width 576) that is 1,152 bytes a layer: 1.5 KB of JSON a
decision for a probe's one layer, 7.7 KB for the five candidate layers. float16 keeps 11
significant bits (relative error at most 2^-11, far below what moves a probe's probabilities)
and numbers up to 65,504; a state with a larger number is kept in float32 instead (measured
on the default model over 80 items of four shared tasks: the largest magnitude was 344).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Literal

import msgspec
import numpy as np
import numpy.typing as npt

__all__ = ["LoggedFeatures", "log_layers"]

_FLOAT16_MAX = float(np.finfo(np.float16).max)


class LoggedFeatures(msgspec.Struct, frozen=True, kw_only=True):
    """Hidden states at the decision point of ``layers``, one row of ``width`` each."""

    layers: list[int]
    width: int
    dtype: Literal["float16", "float32"]  # float32 only where float16 would overflow
    data: bytes  # (len(layers), width) little-endian, layer by layer

    @classmethod
    def of(
        cls, features: Mapping[int, Sequence[float]] | None, layers: Sequence[int]
    ) -> LoggedFeatures | None:
        """The states of ``layers`` from a judgment's ``features``; None when no layers are
        asked for. A ValueError when the judgment lacks one (the gate asked the engine for
        every layer it logs, so that is a bug, not a request's fault)."""
        if not layers:
            return None
        missing = [n for n in layers if not features or n not in features]
        if missing:
            raise ValueError(f"the judgment carries no hidden state of layer(s) {missing}")
        assert features is not None
        rows = np.array([features[n] for n in layers], dtype=np.float32)
        small = bool(np.all(np.abs(rows) <= _FLOAT16_MAX))
        dtype: Literal["float16", "float32"] = "float16" if small else "float32"
        return cls(
            layers=[int(n) for n in layers],
            width=int(rows.shape[1]),
            dtype=dtype,
            data=rows.astype(np.dtype(dtype).newbyteorder("<")).tobytes(),
        )

    def array(self) -> npt.NDArray[np.float32]:
        """The (len(layers), width) states as float32."""
        flat = np.frombuffer(self.data, dtype=np.dtype(self.dtype).newbyteorder("<"))
        if flat.shape[0] != len(self.layers) * self.width:
            raise ValueError(
                f"logged features hold {flat.shape[0]} numbers, not {len(self.layers)} layers "
                f"x {self.width}"
            )
        return flat.reshape(len(self.layers), self.width).astype(np.float32)


def log_layers(
    probe_layers: Sequence[int], num_layers: int | None, *, enabled: bool
) -> tuple[int, ...]:
    """The layers a decision under a profile keeps (see the module docstring): none unless
    ``enabled``; a probe's own; else the candidate layers of a model ``num_layers`` deep (none
    where the depth is unknown)."""
    if not enabled:
        return ()
    if probe_layers:
        return tuple(probe_layers)
    if not num_layers:
        return ()
    from calibration.maps.probe import candidate_layers  # numpy only: no fitter is loaded

    return candidate_layers(num_layers)
