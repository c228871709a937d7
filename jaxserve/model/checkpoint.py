"""jaxserve's own checkpoint: params in Orbax, next to config.json and the tokenizer files.

`save_checkpoint` writes a directory that `load_checkpoint` restores bit for bit: numpy on the
host by default, or straight into given shardings (each device reads only its shards). The marker
file `jaxserve_checkpoint.json` tells the loader what the directory is. This module must not
decide shardings itself or touch any other weight format.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from jaxserve.model.config import ModelConfig
from jaxserve.model.tokenizer import Tokenizer
from jaxserve.model.weights import LoadedModel, validate_params

MARKER = "jaxserve_checkpoint.json"
FORMAT_VERSION = 1
_PARAMS_DIR = "params"


def is_checkpoint(path: Path) -> bool:
    return (path / MARKER).is_file()


def _nest(params: dict[str, np.ndarray]) -> dict:
    """"layers.wq" -> {"layers": {"wq": ...}}: Orbax joins tree keys with dots itself."""
    tree: dict = {}
    for name, value in params.items():
        node = tree
        *parents, leaf = name.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return tree


def _flatten(tree: dict, prefix: str = "") -> dict:
    flat = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def save_checkpoint(directory: str | Path, model: LoadedModel) -> None:
    """Write `model` to a new (or empty) directory."""
    import orbax.checkpoint as ocp

    directory = Path(directory).absolute()
    if directory.exists() and any(directory.iterdir()):
        raise FileExistsError(f"checkpoint directory is not empty: {directory}")
    validate_params(model.config, model.params)
    directory.mkdir(parents=True, exist_ok=True)
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(directory / _PARAMS_DIR, _nest(model.params))
    model.config.save(directory)
    model.tokenizer.save(directory)
    marker = {"format_version": FORMAT_VERSION, "name": model.config.name, "source": model.source,
              "dtypes": {k: str(v.dtype) for k, v in model.params.items()}}
    # written last: a directory with the marker is a complete checkpoint
    (directory / MARKER).write_text(json.dumps(marker, indent=2))


def load_checkpoint(directory: str | Path, *, shardings: dict | None = None) -> LoadedModel:
    """Restore a checkpoint. With `shardings` ({param name: jax Sharding}) params come back as jax
    arrays placed in those shardings; otherwise as numpy arrays."""
    import orbax.checkpoint as ocp

    directory = Path(directory).absolute()
    if not is_checkpoint(directory):
        raise FileNotFoundError(f"not a jaxserve checkpoint (no {MARKER}): {directory}")
    marker = json.loads((directory / MARKER).read_text())
    if marker.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"checkpoint {directory} has format_version "
                         f"{marker.get('format_version')}, this jaxserve reads {FORMAT_VERSION}")
    config = ModelConfig.load(directory, name=marker.get("name"))
    with ocp.StandardCheckpointer() as checkpointer:
        if shardings is None:
            restored = checkpointer.restore(directory / _PARAMS_DIR)
        else:
            restored = checkpointer.restore(directory / _PARAMS_DIR, _abstract_tree(
                config, marker["dtypes"], shardings))
    params = _flatten(restored)
    validate_params(config, params)
    if shardings is None:
        params = {k: np.asarray(v) for k, v in params.items()}
    return LoadedModel(config=config, params=params, tokenizer=Tokenizer.load(directory),
                       source=str(directory))


def _abstract_tree(config: ModelConfig, dtypes: dict[str, str], shardings: dict) -> dict:
    import jax
    import jax.numpy as jnp

    missing = set(config.param_shapes()) - set(shardings)
    if missing:
        raise ValueError(f"no sharding given for {sorted(missing)}")
    return _nest({name: jax.ShapeDtypeStruct(shape, jnp.dtype(dtypes[name]),
                                             sharding=shardings[name])
                  for name, shape in config.param_shapes().items()})
