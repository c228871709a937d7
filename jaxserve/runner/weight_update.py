"""New weights for a built step: a trainer's parameters checked, quantized and placed leaf by
leaf where the compiled step's weights live, so swapping them in compiles nothing.

Three layouts are taken:
* the engine's own state pytree (`LLM.get_weights()` gives it: one leaf per weight the step
  reads, per layer when the layer loop is unrolled, a quantized matrix as its q / scale / zero);
* our parameter names (`ModelConfig.param_shapes()`: "embed", "layers.wq" [L, in, out], ...), a
  flat dict or the same names nested ({"layers": {"wq": ...}}), as the loaders return them;
* a flat dict of Hugging Face tensor names ("model.layers.0.self_attn.q_proj.weight", ...),
  read through the safetensors loader's own name mapping (model/loaders/safetensors_loader.py).
Every weight must be given, each with the engine's shape; a mismatch is a ValueError naming
the parameter. Host (numpy) floats are cast to the engine's dtype on the host; device arrays
must already have the engine's dtype (a cast on the device would compile), and are copied on
the device into the step's sharding (so a trainer may donate or delete its own arrays later).
Float matrices for a quantized engine go through the loader's quantizer (model/quant/formats.py).
This module builds arrays only: swapping them in is runner/rollout_memory.py's job, and when
to do it the engine's (engine/rollout.py).
"""

from __future__ import annotations

from collections.abc import Mapping

import jax
import numpy as np

from jaxserve.model.quant import formats as quant
from jaxserve.model.loaders.checkpoint import flatten_tree
from jaxserve.model.config import ModelConfig
from jaxserve.model.quant.formats import QuantizedTensor
from jaxserve.runner.tensor_parallel import param_of


def weight_paths(state, config: ModelConfig) -> list[tuple[str, str | None, int | None] | None]:
    """Per leaf of the step's flat weights: (param name, quantized part or None, layer or None),
    or None for a leaf that is no weight (RoPE frequencies: computed from the config)."""
    shapes = config.param_shapes()
    out = []
    for path, _ in jax.tree_util.tree_flatten_with_path(state)[0]:
        name, part, layer = param_of(path, shapes)
        out.append((name, part, layer) if name in shapes else None)
    return out


def describe(where: tuple[str, str | None, int | None]) -> str:
    name, part, layer = where
    return name + ("" if layer is None else f"[layer {layer}]") + (f".{part}" if part else "")


def quantization_of(state) -> str:
    """'none', 'int8' or 'int4': how the step's matrices are stored (from the q parts' dtypes)."""
    for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]:
        keys = [getattr(k, "key", None) for k in path]
        if "q" in keys:
            return "int8" if leaf.dtype == np.int8 else "int4"
    return "none"


def _is_hf(names) -> bool:
    return any(n.startswith("model.") or n == "lm_head.weight" for n in names)


def as_param_layout(params: Mapping, config: ModelConfig, quantization: str) -> dict:
    """Our parameter names -> values (numpy, jax arrays or QuantizedTensors), every name of
    the config present and nothing else; float matrices quantized when the engine is."""
    from jaxserve.model.loaders.safetensors_loader import params_from_hf

    flat = flatten_tree(params)
    if _is_hf(flat):
        flat = params_from_hf(config, {k: np.asarray(v) for k, v in flat.items()})
    shapes = config.param_shapes()
    missing, extra = sorted(set(shapes) - set(flat)), sorted(set(flat) - set(shapes))
    if missing or extra:
        raise ValueError(f"weights do not match the engine's parameters: missing {missing}, "
                         f"unexpected {extra}")
    for name, shape in shapes.items():
        if tuple(flat[name].shape) != tuple(shape):
            raise ValueError(f"parameter {name} has shape {tuple(flat[name].shape)}, the "
                             f"engine's is {tuple(shape)}")
    if quantization != "none":
        flat = {name: quant.quantize(np.asarray(v), quantization, name)
                if name in quant.MATRIX_NAMES and not isinstance(v, QuantizedTensor) else v
                for name, v in flat.items()}
    return flat


def _source(params: dict, where, cache: dict):
    """The value of one leaf in the param layout: its part, then its layer (a device array
    that must be sliced comes to the host once: slicing it on the device would compile)."""
    name, part, layer = where
    value = params[name]
    if part is not None:
        if not isinstance(value, QuantizedTensor):
            raise ValueError(f"parameter {name} is quantized in this engine ({part} part "
                             f"expected), got a {type(value).__name__}")
        value = getattr(value, part)
        if value is None:
            raise ValueError(f"parameter {name} has no {part} part, the engine's has one")
    elif isinstance(value, QuantizedTensor):
        raise ValueError(f"parameter {name} is quantized ({value.format}), the engine's is "
                         f"float")
    if layer is None:
        return value
    key = (name, part)
    if isinstance(value, jax.Array):
        if key not in cache:
            cache[key] = np.asarray(value)
        value = cache[key]
    return value[layer]


def _placed(value, old: jax.Array, where) -> jax.Array:
    """value with old's shape and dtype, on the device in old's sharding; never an alias of
    the caller's array (nor a view of one)."""
    label = describe(where)
    if tuple(value.shape) != tuple(old.shape):
        raise ValueError(f"parameter {label} has shape {tuple(value.shape)}, the engine's is "
                         f"{tuple(old.shape)}")
    if isinstance(value, jax.Array):
        if value.dtype != old.dtype:
            raise ValueError(f"parameter {label} is {value.dtype} on the device, the engine's "
                             f"is {old.dtype}: cast it first (a cast here would compile)")
        return jax.device_put(value, old.sharding, may_alias=False)
    host = np.asarray(value)
    if host.dtype != old.dtype:
        floats = np.issubdtype(host.dtype, np.floating) or host.dtype.name == "bfloat16"
        if not floats or not jax.numpy.issubdtype(old.dtype, jax.numpy.floating):
            raise ValueError(f"parameter {label} is {host.dtype}, the engine's is {old.dtype}")
    # a copy: on the CPU device_put may alias a numpy array, and the caller's (or a view of
    # the caller's device array) must not back the engine's weights
    return jax.device_put(np.array(host, dtype=old.dtype, order="C"), old.sharding)


def build_leaves(params, state, leaves, config: ModelConfig) -> list[jax.Array | None]:
    """The step's new weight leaves from `params` (any layout above), checked before any is
    placed; None where a leaf is no weight (kept as it is). leaves: the current flat weights
    (their shapes, dtypes and shardings are the targets; they may be deleted: a discarded
    engine's metadata still reads)."""
    paths = weight_paths(state, config)
    treedef = jax.tree.structure(state)
    if not isinstance(params, Mapping) or jax.tree.structure(params) == treedef:
        given = jax.tree.leaves(params)
        if len(given) != len(leaves) or jax.tree.structure(params) != treedef:
            raise ValueError("weights are neither the engine's state pytree (LLM.get_weights()"
                             "'s structure) nor a dict of parameter names")
        new = [None if where is None else _shape_checked(value, old, where)
               for value, old, where in zip(given, leaves, paths)]
    else:
        flat = as_param_layout(params, config, quantization_of(state))
        cache: dict = {}
        new = [None if where is None else _shape_checked(_source(flat, where, cache), old, where)
               for old, where in zip(leaves, paths)]
    return [None if where is None else _placed(value, old, where)
            for value, old, where in zip(new, leaves, paths)]


def _shape_checked(value, old, where):
    if tuple(value.shape) != tuple(old.shape):
        raise ValueError(f"parameter {describe(where)} has shape {tuple(value.shape)}, the "
                         f"engine's is {tuple(old.shape)}")
    if isinstance(value, jax.Array) and value.dtype != old.dtype:
        raise ValueError(f"parameter {describe(where)} is {value.dtype} on the device, the "
                         f"engine's is {old.dtype}: cast it first (a cast here would compile)")
    return value
