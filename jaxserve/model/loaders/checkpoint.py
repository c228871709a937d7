"""jaxserve's own checkpoint: params in Orbax, next to config.json and the tokenizer files.

`save_checkpoint` writes a directory that `load_checkpoint` restores bit for bit: numpy on the
host by default, or straight into given shardings (each device reads only its shards). Quantized
matrices (model/quant/formats.py) are saved as their q / scale / zero arrays, so they are restored
in
their small form, already in the device (and tensor-parallel) layout. The marker file
`jaxserve_checkpoint.json` tells the loader what the directory is and how each quantized
matrix is stored, and holds the fp8 KV pages' per-layer scales when the source had them
(LoadedModel.kv_scales). This module must not
decide shardings itself or touch any other weight format.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from jaxserve.model.config import ModelConfig
from jaxserve.model.quant.formats import QuantizedTensor
from jaxserve.model.text.tokenizer import Tokenizer
from jaxserve.model.loaders.weights import LoadedModel, validate_params

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


def flatten_tree(tree, prefix: str = "") -> dict:
    """A nested mapping as one dict keyed by dotted paths ("layers.wq")."""
    from collections.abc import Mapping
    flat = {}
    for key, value in tree.items():
        if isinstance(value, Mapping):
            flat.update(flatten_tree(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def _parts(params: dict) -> dict:
    """A quantized "layers.wq" -> "layers.wq.q", "layers.wq.scale" (and ".zero")."""
    flat = {}
    for name, value in params.items():
        if isinstance(value, QuantizedTensor):
            flat.update({f"{name}.{part}": getattr(value, part) for part in _QUANT_PARTS
                         if getattr(value, part) is not None})
        else:
            flat[name] = value
    return flat


_QUANT_PARTS = ("q", "scale", "zero")


def _quant_layout(params: dict) -> dict:
    return {name: {"bits": v.bits, "group": v.group, "transposed": v.transposed,
                   "parts": {part: [list(getattr(v, part).shape), str(getattr(v, part).dtype)]
                             for part in _QUANT_PARTS if getattr(v, part) is not None}}
            for name, v in params.items() if isinstance(v, QuantizedTensor)}


def quantized_stand_ins(directory: str | Path) -> dict[str, QuantizedTensor]:
    """{name: a zero-stride QuantizedTensor of each quantized matrix's stored shapes and dtypes}
    (what sharding.param_shardings needs before the restore)."""
    marker = json.loads((Path(directory) / MARKER).read_text())
    out = {}
    for name, layout in marker.get("quantized", {}).items():
        parts = {part: np.broadcast_to(np.zeros((), np.dtype(dtype)), tuple(shape))
                 for part, (shape, dtype) in layout["parts"].items()}
        out[name] = QuantizedTensor(parts["q"], parts["scale"], parts.get("zero"),
                                    layout["bits"], layout["group"], layout["transposed"])
    return out


def _join_parts(flat: dict, layouts: dict) -> dict:
    params = {k: v for k, v in flat.items() if k.rpartition(".")[0] not in layouts}
    for name, layout in layouts.items():
        params[name] = QuantizedTensor(flat[f"{name}.q"], flat[f"{name}.scale"],
                                       flat.get(f"{name}.zero"), layout["bits"],
                                       layout["group"], layout["transposed"])
    return params


def save_checkpoint(directory: str | Path, model: LoadedModel) -> None:
    """Write `model` to a new (or empty) directory."""
    import orbax.checkpoint as ocp

    directory = Path(directory).absolute()
    if directory.exists() and any(directory.iterdir()):
        raise FileExistsError(f"checkpoint directory is not empty: {directory}")
    validate_params(model.config, model.params)
    directory.mkdir(parents=True, exist_ok=True)
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(directory / _PARAMS_DIR, _nest(_parts(model.params)))
    model.config.save(directory)
    model.tokenizer.save(directory)
    marker = {"format_version": FORMAT_VERSION, "name": model.config.name, "source": model.source,
              "dtypes": {k: str(v.dtype) for k, v in _parts(model.params).items()},
              "quantized": _quant_layout(model.params)}
    if getattr(model, "kv_scales", None) is not None:  # fp8 KV pages' per-layer scales
        marker["kv_scales"] = np.asarray(model.kv_scales, np.float32).tolist()
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
                config, marker, shardings))
    flat = flatten_tree(restored)
    if shardings is None:
        flat = {k: np.asarray(v) for k, v in flat.items()}
    params = _join_parts(flat, marker.get("quantized", {}))
    validate_params(config, params)
    kv_scales = marker.get("kv_scales")
    return LoadedModel(config=config, params=params, tokenizer=Tokenizer.load(directory),
                       source=str(directory), kv_scales=None if kv_scales is None
                       else np.asarray(kv_scales, np.float32))


def _abstract_tree(config: ModelConfig, marker: dict, shardings: dict) -> dict:
    """shardings: {name: Sharding}, and {name: {part: Sharding}} for quantized matrices."""
    import jax
    import jax.numpy as jnp

    missing = set(config.param_shapes()) - set(shardings)
    if missing:
        raise ValueError(f"no sharding given for {sorted(missing)}")
    dtypes, layouts = marker["dtypes"], marker.get("quantized", {})
    leaves = {}
    for name, shape in config.param_shapes().items():
        if name in layouts:
            for part, (part_shape, dtype) in layouts[name]["parts"].items():
                leaves[f"{name}.{part}"] = jax.ShapeDtypeStruct(
                    tuple(part_shape), jnp.dtype(dtype), sharding=shardings[name][part])
        else:
            leaves[name] = jax.ShapeDtypeStruct(shape, jnp.dtype(dtypes[name]),
                                                sharding=shardings[name])
    return _nest(leaves)
