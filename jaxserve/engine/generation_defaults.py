"""A model's own sampling defaults (its generation_config.json), applied as vLLM applies them.

vLLM's `--generation-config auto`: temperature, top_k, top_p, min_p, repetition_penalty and
max_new_tokens (as max_tokens) from the model's generation_config.json replace SamplingParams'
defaults; whatever the caller sets explicitly wins over both. A GGUF file or the embedded
default model has no generation_config.json: SamplingParams' defaults apply unchanged. This
module reads one small JSON file and builds SamplingParams; it loads no weights and never
imports jax.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

log = logging.getLogger(__name__)

# generation_config.json key -> SamplingParams field (vLLM's get_diff_sampling_param)
KEYS = {"temperature": "temperature", "top_k": "top_k", "top_p": "top_p", "min_p": "min_p",
        "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


def model_directory(spec: str) -> Path | None:
    """The directory a model spec loads from (a local directory or a hub id in the local
    cache), or None (a .gguf file, 'default', an unknown spec)."""
    path = Path(spec).expanduser()
    if path.is_dir():
        return path
    from jaxserve.model.loaders import hub_cache
    if not path.exists() and hub_cache.looks_like_hub_id(spec) and not spec.endswith(".gguf"):
        try:
            return hub_cache.resolve_hub_id(spec)
        except (OSError, ValueError):
            return None
    return None


def read_generation_defaults(spec: str | None) -> dict:
    """SamplingParams keywords from the model's generation_config.json ({} when it has none)."""
    directory = model_directory(spec) if spec else None
    path = directory / "generation_config.json" if directory is not None else None
    if path is None or not path.is_file():
        return {}
    config = json.loads(path.read_text())
    defaults = {ours: config[theirs] for theirs, ours in KEYS.items()
                if config.get(theirs) is not None}
    if defaults:
        log.info("sampling defaults from %s: %s (explicit settings win)", path, defaults)
    return defaults


def sampling_params(overrides: dict, model_defaults: dict | None = None):
    """SamplingParams: SamplingParams' defaults < the model's < the caller's overrides."""
    from jaxserve.core.request import SamplingParams
    return SamplingParams(**{**(model_defaults or {}), **overrides})
