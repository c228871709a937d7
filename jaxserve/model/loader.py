"""load_model: one entry point for every weight source; convert: any source -> Orbax checkpoint.

A spec is "default" (the embedded SmolLM2-135M-Instruct GGUF), a .gguf file, a Hugging Face
directory (config.json + *.safetensors + tokenizer.json), a jaxserve checkpoint directory
(written by `convert`), or a Hugging Face hub id `org/name[@revision][/file.gguf]` from the
local hub cache, downloaded there first unless offline (hub_cache; a local path of the same
name wins). Every path returns the same
LoadedModel layout, so the model never knows where its weights came from; with a quantization
mode its matrices come back quantized (model/quant.py; a GGUF's blocks are mapped tensor by
tensor, model/gguf_quant.py). This module only
dispatches: format details live in gguf_loader, safetensors_loader and checkpoint, and it must
not import jax.
"""

from __future__ import annotations

import copy
import dataclasses
import os
from pathlib import Path

from jaxserve.model import (checkpoint, default_model, gguf_loader, hub_cache, quant,
                            safetensors_loader)
from jaxserve.model.safetensors_loader import save_hf_directory
from jaxserve.model.weights import LoadedModel

__all__ = ["LoadedModel", "load_model", "save_hf_directory", "convert"]


def load_model(spec: str = "default", *, progress: bool = True,
               quantization: str = "none") -> LoadedModel:
    """Load config, host params and tokenizer from `spec` (see the module docstring), the
    matrices quantized to `quantization` ('none', 'int8', 'int4')."""
    return quantize(_load(spec, progress, quantization), quantization)


def quantize(model: LoadedModel, quantization: str) -> LoadedModel:
    """model with its float matrices quantized to `quantization`. Weights already stored
    quantized (a quantized checkpoint) stay as they are; asking for another form is an error."""
    stored = quant.stored_mode(model.params)
    if stored != "none" and quantization not in ("none", stored):
        raise ValueError(f"quantization={quantization!r}, but {model.source} is stored as "
                         f"{stored}: load it with quantization={stored!r} (or 'none')")
    if quantization == "none" or stored == quantization:
        return model
    quantized = copy.copy(model)  # the caller's model (any LoadedModel-like) stays float
    quantized.params = quant.quantize_params(model.params, quantization)
    return quantized


def _load(spec: str, progress: bool, quantization: str) -> LoadedModel:
    if spec == "default":
        path = default_model.default_model_path()
        model = gguf_loader.load_gguf(path, progress=progress, quantization=quantization)
        if not os.environ.get(default_model.ENV_MODEL):
            # the embedded file's general.name is a training-run label, not the model's name
            model.config = dataclasses.replace(model.config, name=default_model.DEFAULT_MODEL_NAME)
        model.source = f"default ({path})"
        return model
    path = Path(spec).expanduser()
    if not path.exists() and hub_cache.looks_like_hub_id(spec):
        model = _load_path(hub_cache.resolve_hub_id(spec, download=True), progress,
                           quantization)
        # a snapshot directory is named by its commit hash: the hub id is the model's name
        model.config = dataclasses.replace(model.config, name=hub_cache.hub_repo_id(spec))
        model.source = f"{spec} ({model.source})"
        return model
    return _load_path(path, progress, quantization)


def _load_path(path: Path, progress: bool, quantization: str = "none") -> LoadedModel:
    if not path.exists():
        raise FileNotFoundError(f"model not found: {path} (give a .gguf file, a Hugging Face "
                                f"directory, a jaxserve checkpoint, a Hugging Face hub id "
                                f"org/name in the local cache, or 'default')")
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ValueError(f"{path} is a file but not a .gguf; a Hugging Face model is loaded "
                             f"from its directory")
        return gguf_loader.load_gguf(path, progress=progress, quantization=quantization)
    if checkpoint.is_checkpoint(path):
        return checkpoint.load_checkpoint(path)
    if safetensors_loader.is_hf_directory(path):
        return safetensors_loader.load_hf_directory(path, progress=progress)
    ggufs = sorted(path.glob("*.gguf"))
    if len(ggufs) == 1:
        return gguf_loader.load_gguf(ggufs[0], progress=progress, quantization=quantization)
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
