"""Which engine a model names: one loaded here, or one served over HTTP.

A model spec that starts with ``openai+http://`` or ``openai+https://`` names a model behind
an OpenAI-compatible completions endpoint (``judge.server_engine``); anything else is loaded
here (``Judge.load``: the embedded default, a packaged name, a .gguf file, a directory or a
Hugging Face id). Every command that takes ``--model`` opens its engine through
``open_engine``, so a served model can be judged, calibrated, qualified, served and used as a
cascade stage wherever a loaded one can.
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Any

from judge.server_engine import is_server_model

if TYPE_CHECKING:
    from judge.engine import Judge
    from judge.loading import DType
    from judge.server_engine import ServerEngine

__all__ = ["SERVER_OPTIONS", "open_engine"]

log = logging.getLogger("judge")

# The options a served model takes; the others (prefix cache, arithmetic, pass) shape the
# local pass and mean nothing for it.
SERVER_OPTIONS = frozenset(
    {
        "system",
        "response_prefix",
        "response_suffix",
        "max_batch_size",
        "max_batch_tokens",
        "choice_paths",
        "timeout_s",
        "concurrency",
    }
)


def open_engine(
    model: str | os.PathLike[str] | None = None,
    *,
    dtype: DType | None = "auto",
    device: str = "cpu",
    **options: Any,
) -> Judge | ServerEngine:
    """The engine for ``model``: a ``ServerEngine`` for a served model's spec (``dtype`` and
    ``device`` are the server's business there), else ``Judge.load``."""
    if is_server_model(model):
        from judge.server_engine import ServerEngine

        ignored = sorted(set(options) - SERVER_OPTIONS)
        if ignored:
            log.info("a served model's engine does not take %s: ignored", ", ".join(ignored))
        return ServerEngine.open(
            str(model), **{k: options[k] for k in SERVER_OPTIONS & set(options)}
        )
    from judge.engine import Judge

    return Judge.load(model, dtype=dtype or "auto", device=device, **options)
