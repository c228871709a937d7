"""Tensor-parallel sharding rules: logical axes -> mesh axes, for weights, activations, KV pages.

Every array the step touches is described once here by its logical axes ("q_heads", "ffn", ...);
LOGICAL_RULES maps the ones that are split to the mesh axis "tp" (Megatron layout: wq/wk/wv and
w_gate/w_up split on their output columns, wo and w_down on their input rows, so the only
communication in a layer is the all-reduce after wo and after w_down). "q_heads" and "kv_heads"
name the flattened heads-major [heads * head_dim] columns, so an even split hands each device
whole heads. Quantized matrices (model/quant.py: [..., out, in] with their scales) are split the
same way on their transposed axes (quantized_specs). This module only describes shardings and
builds the mesh; it places no arrays (runner/tensor_parallel.py does) and must not import the
model.
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxserve.model.config import ModelConfig

TP_AXIS = "tp"

# Logical axes of every parameter, in ModelConfig.param_shapes() layout (layers stacked first).
PARAM_AXES: dict[str, tuple[str, ...]] = {
    "embed": ("vocab", "embed"),
    "layers.attn_norm": ("layers", "embed"),
    "layers.wq": ("layers", "embed", "q_heads"),
    "layers.wk": ("layers", "embed", "kv_heads"),
    "layers.wv": ("layers", "embed", "kv_heads"),
    "layers.wo": ("layers", "q_heads", "embed"),
    "layers.bq": ("layers", "q_heads"),
    "layers.bk": ("layers", "kv_heads"),
    "layers.bv": ("layers", "kv_heads"),
    "layers.bo": ("layers", "embed"),           # added after wo's all-reduce
    "layers.sinks": ("layers", "q_heads"),      # one attention-sink logit per query head
    "layers.q_norm": ("layers", "head_dim"),    # one head's scale, shared by every head
    "layers.k_norm": ("layers", "head_dim"),
    "layers.post_attn_norm": ("layers", "embed"),
    "layers.post_mlp_norm": ("layers", "embed"),
    "layers.mlp_norm": ("layers", "embed"),
    "layers.w_gate": ("layers", "embed", "ffn"),
    "layers.w_up": ("layers", "embed", "ffn"),
    "layers.w_down": ("layers", "ffn", "embed"),
    "final_norm": ("embed",),
    "lm_head": ("embed", "vocab"),
}

# K and V pages, each [L, N, page_size, Hkv, Dh]: a device holds its KV heads of every page,
# so the page table and the scheduler's page accounting are the same on every device.
KV_PAGE_AXES = ("layers", "pages", "page_offset", "kv_heads", "head_dim")

# Activations inside the step. Attention runs under shard_map with these specs (each device
# attends with its own heads, no communication); the hidden state and every step input
# (token ids, page table, sampling settings) are replicated.
ACTIVATION_AXES: dict[str, tuple[str, ...]] = {
    "hidden": ("tokens", "embed"),             # [T, D]
    "q": ("tokens", "q_heads", "head_dim"),    # [T, Hq, Dh]
    "attention_out": ("tokens", "q_heads", "head_dim"),
    "sinks": ("q_heads",),                     # [Hq] one layer's attention sinks
    "logits": ("rows", "vocab"),               # [R, V]
    "step_input": (),                          # replicated whatever its rank
}

# Logical axis -> mesh axis; an axis not named here is replicated.
LOGICAL_RULES: dict[str, str] = {"q_heads": TP_AXIS, "kv_heads": TP_AXIS, "ffn": TP_AXIS,
                                 "vocab": TP_AXIS}


def check_tensor_parallel(config: ModelConfig, tensor_parallel_size: int) -> None:
    """Raise ValueError unless tp splits heads, KV heads and the FFN into equal whole parts."""
    tp = tensor_parallel_size
    for field, size in (("num_heads", config.num_heads), ("num_kv_heads", config.num_kv_heads),
                        ("intermediate_size", config.intermediate_size)):
        if size % tp:
            raise ValueError(f"tensor_parallel_size={tp} does not divide {field}={size} of "
                             f"{config.name}: each device must hold whole heads, so "
                             f"tensor_parallel_size must be a divisor of {size}")


def rules_for(config: ModelConfig, tensor_parallel_size: int) -> dict[str, str]:
    """LOGICAL_RULES for this model: the vocabulary stays replicated when tp does not divide it
    (heads and FFN must divide: check_tensor_parallel)."""
    rules = dict(LOGICAL_RULES)
    if config.vocab_size % tensor_parallel_size:
        del rules["vocab"]
    return rules


def spec(axes: tuple[str, ...], rules: dict[str, str]) -> PartitionSpec:
    return PartitionSpec(*(rules.get(axis) for axis in axes))


def param_specs(config: ModelConfig, tensor_parallel_size: int,
                per_layer: bool = False) -> dict[str, PartitionSpec]:
    """{param name: PartitionSpec}. per_layer: specs of one layer's slice (no leading L axis)."""
    rules = rules_for(config, tensor_parallel_size)
    specs = {}
    for name in config.param_shapes():
        axes = PARAM_AXES[name]
        if per_layer and name.startswith("layers."):
            axes = axes[1:]
        specs[name] = spec(axes, rules)
    return specs


def quantized_specs(config: ModelConfig, name: str, quantized, tensor_parallel_size: int,
                    per_layer: bool = False) -> dict[str, PartitionSpec]:
    """{"q" | "scale" | "zero": PartitionSpec} of a quantized param (model/quant.py layout
    [..., out, in], groups along in): q, scale and zero split like the matrix, except that one
    scale per output channel (a single group) is not split on the inputs. Raises ValueError
    when a device's share of the inputs would cut a group (or an int4 byte) in two."""
    tp = tensor_parallel_size
    rules = rules_for(config, tp)
    axes = PARAM_AXES[name][1:] if per_layer and name.startswith("layers.") else PARAM_AXES[name]
    if quantized.transposed:
        axes = (*axes[:-2], axes[-1], axes[-2])
    inputs = quantized.matrix_shape[-1]
    num_groups = inputs // quantized.group
    split_inputs = rules.get(axes[-1]) is not None
    if split_inputs and num_groups > 1 and (inputs // tp) % quantized.group:
        raise ValueError(f"tensor_parallel_size={tp} splits the {inputs} inputs of {name} into "
                         f"{inputs // tp} per device, which cuts its quantization groups of "
                         f"{quantized.group}: use a tensor_parallel_size that keeps whole groups")
    scale_axes = axes if num_groups > 1 else (*axes[:-1], None)
    specs = {"q": spec(axes, rules), "scale": spec(scale_axes, rules)}
    if quantized.zero is not None:
        specs["zero"] = specs["scale"]
    return specs


def param_shardings(config: ModelConfig, mesh: Mesh, quantized: dict | None = None
                    ) -> dict[str, NamedSharding | dict[str, NamedSharding]]:
    """{param name: NamedSharding} of the stacked layout: what load_checkpoint restores into.
    quantized: {param name: its QuantizedTensor (or a stand-in of its shapes)}; those names map
    to {"q" | "scale" | "zero": NamedSharding}."""
    tp = mesh.shape[TP_AXIS]
    check_tensor_parallel(config, tp)
    out: dict = {name: NamedSharding(mesh, s) for name, s in param_specs(config, tp).items()}
    for name, t in (quantized or {}).items():
        out[name] = {part: NamedSharding(mesh, s)
                     for part, s in quantized_specs(config, name, t, tp).items()}
    return out


def kv_sharding(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, spec(KV_PAGE_AXES, LOGICAL_RULES))


def activation_spec(name: str) -> PartitionSpec:
    return spec(ACTIVATION_AXES[name], LOGICAL_RULES)


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())


def make_mesh(tensor_parallel_size: int) -> Mesh | None:
    """The 1-D ("tp",) mesh, or None for one device in one process (the unsharded path).

    With several processes the mesh must span every device of the cluster: each process then
    holds part of every weight and runs the same step.
    """
    tp = tensor_parallel_size
    num_devices = jax.device_count()
    if jax.process_count() > 1 and tp != num_devices:
        raise ValueError(f"tensor_parallel_size={tp} must equal the cluster's device count "
                         f"({num_devices} devices in {jax.process_count()} processes): every "
                         f"process runs a share of the same step")
    if tp == 1 and jax.process_count() == 1:
        return None
    if tp > num_devices:
        raise ValueError(f"tensor_parallel_size={tp} exceeds the {num_devices} "
                         f"{jax.default_backend()} device(s) available")
    devices = jax.devices()[:tp]
    if tp == num_devices:  # the whole slice: let JAX order it along the physical topology
        from jax.experimental import mesh_utils
        devices = mesh_utils.create_device_mesh((tp,))
    return Mesh(np.asarray(devices), (TP_AXIS,))
