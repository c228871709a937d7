"""load_model: one entry point for every weight source; convert: any source -> Orbax checkpoint.

A spec is "default" (the embedded SmolLM2-135M-Instruct GGUF), a .gguf file, a Hugging Face
directory (config.json + *.safetensors + tokenizer.json), a jaxserve checkpoint directory
(written by `convert`), or a Hugging Face hub id `org/name[@revision][/file.gguf]` from the
local hub cache, downloaded there first unless offline (hub_cache; a local path of the same
name wins). Every path returns the same
LoadedModel layout, so the model never knows where its weights came from; with a quantization
mode its matrices come back quantized (model/quant/formats.py; a GGUF's blocks are mapped tensor by
tensor, model/quant/gguf.py; with int8_per_channel, int8 is per channel whatever the source:
what int8 activations multiply, model/quant/select.py). With a cache_dir, weights quantized at
load are kept there and read back at the next load of the same files (model/quant/cache.py).
This module only dispatches: format details live in gguf_loader, safetensors_loader and
checkpoint, and it must not import jax.
"""

from __future__ import annotations

import copy
import dataclasses
import os
from pathlib import Path

from jaxserve.model.loaders import checkpoint
from jaxserve.model.loaders import default_model
from jaxserve.model.loaders import gguf_loader
from jaxserve.model.loaders import hub_cache
from jaxserve.model.quant import formats as quant
from jaxserve.model.quant import cache as quant_cache
from jaxserve.model.loaders import safetensors_loader
from jaxserve.model.loaders.safetensors_loader import save_hf_directory
from jaxserve.model.loaders.weights import LoadedModel

__all__ = ["LoadedModel", "load_model", "save_hf_directory", "convert"]


def load_model(spec: str = "default", *, progress: bool = True, quantization: str = "none",
               int8_per_channel: bool = False, cache_dir: str | Path | None = None
               ) -> LoadedModel:
    """Load config, host params and tokenizer from `spec` (see the module docstring), the
    matrices quantized to `quantization` ('none', 'int8', 'int4'); int8_per_channel: int8
    per output channel for every source (a GGUF's blocks and grouped int8 checkpoints are
    requantized); cache_dir: where weights quantized here are kept for the next load (None:
    quantized at every call; a jaxserve checkpoint is never cached, it is one already)."""
    def build() -> LoadedModel:
        return quantize(_load(spec, progress, quantization, int8_per_channel), quantization,
                        int8_per_channel)

    files = None if cache_dir is None or quantization == "none" else _source_files(spec)
    if files is None:
        return build()
    form = "int8 per channel" if quantization == "int8" and int8_per_channel else quantization
    return quant_cache.load_or_build(cache_dir, files, form, build)


def quantize(model: LoadedModel, quantization: str,
             int8_per_channel: bool = False) -> LoadedModel:
    """model with its float matrices quantized to `quantization` (int8 per channel); with
    int8_per_channel, int8 matrices stored in groups (a GGUF mapping, a checkpoint of one) are
    requantized per channel too. Weights already stored quantized otherwise stay as they are;
    asking for another mode is an error."""
    stored = quant.stored_mode(model.params)
    if stored != "none" and quantization not in ("none", stored):
        raise ValueError(f"quantization={quantization!r}, but {model.source} is stored as "
                         f"{stored}: load it with quantization={stored!r} (or 'none')")
    if quantization == "none":
        return model
    params = model.params
    if stored != quantization:
        params = quant.quantize_params(params, quantization)
    if quantization == "int8" and int8_per_channel:
        params = quant.int8_per_channel(params)
    if params is model.params:
        return model
    quantized = copy.copy(model)  # the caller's model (any LoadedModel-like) stays float
    quantized.params = params
    return quantized


def _resolve(spec: str) -> Path:
    """The file or directory `spec` names (not checked to exist)."""
    if spec == "default":
        return default_model.default_model_path()
    path = Path(spec).expanduser()
    if not path.exists() and hub_cache.looks_like_hub_id(spec):
        return hub_cache.resolve_hub_id(spec)
    return path


def _source_files(spec: str) -> list[Path] | None:
    """The files a load of `spec` reads weights from (a .gguf, or a Hugging Face directory's
    files); None for a jaxserve checkpoint (stored as it is restored) or a missing spec (the
    load then says what is wrong)."""
    try:
        path = _resolve(spec)
    except (FileNotFoundError, ValueError):
        return None
    if path.is_file():
        return [path]
    if not path.is_dir() or checkpoint.is_checkpoint(path):
        return None
    return sorted(f for f in path.iterdir() if f.is_file())


def _load(spec: str, progress: bool, quantization: str,
          int8_per_channel: bool = False) -> LoadedModel:
    blocks = quantization if not (quantization == "int8" and int8_per_channel) else "int8pc"
    if spec == "default":
        path = default_model.default_model_path()
        model = _load_gguf(path, progress, blocks)
        if not os.environ.get(default_model.ENV_MODEL):
            # the embedded file's general.name is a training-run label, not the model's name
            model.config = dataclasses.replace(model.config, name=default_model.DEFAULT_MODEL_NAME)
        model.source = f"default ({path})"
        return model
    path = Path(spec).expanduser()
    if not path.exists() and hub_cache.looks_like_hub_id(spec):
        model = _load_path(hub_cache.resolve_hub_id(spec, download=True), progress, blocks)
        # a snapshot directory is named by its commit hash: the hub id is the model's name
        model.config = dataclasses.replace(model.config, name=hub_cache.hub_repo_id(spec))
        model.source = f"{spec} ({model.source})"
        return model
    return _load_path(path, progress, blocks)


def _load_gguf(path: Path, progress: bool, blocks: str) -> LoadedModel:
    """blocks: the quantization a GGUF's blocks are mapped to ('int8pc': int8 per channel)."""
    if blocks == "int8pc":
        return gguf_loader.load_gguf(path, progress=progress, quantization="int8",
                                     int8_per_channel=True)
    return gguf_loader.load_gguf(path, progress=progress, quantization=blocks)


def _load_path(path: Path, progress: bool, blocks: str = "none") -> LoadedModel:
    if not path.exists():
        raise FileNotFoundError(f"model not found: {path} (give a .gguf file, a Hugging Face "
                                f"directory, a jaxserve checkpoint, a Hugging Face hub id "
                                f"org/name in the local cache, or 'default')")
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ValueError(f"{path} is a file but not a .gguf; a Hugging Face model is loaded "
                             f"from its directory")
        return _load_gguf(path, progress, blocks)
    if checkpoint.is_checkpoint(path):
        return checkpoint.load_checkpoint(path)
    if safetensors_loader.is_hf_directory(path):
        return safetensors_loader.load_hf_directory(path, progress=progress)
    ggufs = sorted(path.glob("*.gguf"))
    if len(ggufs) == 1:
        return _load_gguf(ggufs[0], progress, blocks)
    raise FileNotFoundError(
        f"{path} holds no model: expected {checkpoint.MARKER}, config.json with *.safetensors, "
        f"or a single .gguf file" + (f" (found {len(ggufs)} .gguf files)" if ggufs else ""))


def convert(src_spec: str, dst_dir: str | Path, *, progress: bool = True,
            quantization: str = "none") -> Path:
    """Load `src_spec` and write it as a jaxserve Orbax checkpoint in `dst_dir`, its matrices
    quantized to `quantization` (restored later in that form, straight into the device)."""
    model = load_model(src_spec, progress=progress, quantization=quantization)
    checkpoint.save_checkpoint(dst_dir, model)
    return Path(dst_dir)
