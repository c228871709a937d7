"""Tensor- and expert-parallel sharding rules: logical axes -> mesh axes, for weights,
activations, KV pages.

Every array the step touches is described once here by its logical axes ("q_heads", "ffn", ...);
LOGICAL_RULES maps the ones that are split to the mesh axis "tp" (Megatron layout: wq/wk/wv and
w_gate/w_up split on their output columns, wo and w_down on their input rows, so the only
communication in a layer is the all-reduce after wo and after w_down). "q_heads" and "kv_heads"
name the flattened heads-major [heads * head_dim] columns, so an even split hands each device
whole heads. Quantized matrices (model/quant/formats.py: [..., out, in] with their scales) are
split the
same way on their transposed axes (quantized_specs).

Mixture-of-experts weights: the router is replicated; each expert's matrices [L, E, in, out]
are split on their width F ("expert_ffn") like the dense MLP. With expert parallelism of size
N the mesh is 2-D, ("ep", "tp") of shape (N, tp / N): the experts are split over "ep" (N groups
of devices), each expert's F over "tp" within its group, and every axis the 1-D mesh splits
over "tp" (heads, dense FFN, vocabulary, KV heads) is split over both axes, i.e. over all
devices in the same order as the 1-D mesh. This module only describes shardings and builds the
mesh; it places no arrays (runner/tensor_parallel.py does) and must not import the model.
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxserve.model.config import ModelConfig

TP_AXIS = "tp"
EP_AXIS = "ep"

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
    # Mixture of experts: "expert_scores" (the router's outputs) is never split.
    "layers.router": ("layers", "embed", "expert_scores"),
    "layers.router_bias": ("layers", "expert_scores"),
    "layers.e_gate": ("layers", "experts", "embed", "expert_ffn"),
    "layers.e_up": ("layers", "experts", "embed", "expert_ffn"),
    "layers.e_down": ("layers", "experts", "expert_ffn", "embed"),
    "layers.e_gate_bias": ("layers", "experts", "expert_ffn"),
    "layers.e_up_bias": ("layers", "experts", "expert_ffn"),
    "layers.e_down_bias": ("layers", "experts", "embed"),  # added once per expert: moe_shard
}

# The MoE FFN's expert weights (one layer's keys): what runs under shard_map.
EXPERT_KEYS = ("e_gate", "e_up", "e_down", "e_gate_bias", "e_up_bias", "e_down_bias")

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

# Logical axis -> mesh axis on the 1-D ("tp",) mesh; an axis not named here is replicated
# ("experts" too: plain tensor parallelism keeps every expert on every device).
LOGICAL_RULES: dict[str, str] = {"q_heads": TP_AXIS, "kv_heads": TP_AXIS, "ffn": TP_AXIS,
                                 "vocab": TP_AXIS, "expert_ffn": TP_AXIS}
_ALL_DEVICES = ("q_heads", "kv_heads", "ffn", "vocab")  # split over every device of the mesh


def mesh_rules(expert_parallel_size: int = 1) -> dict[str, str | tuple[str, ...]]:
    """Logical axis -> mesh axis (or axes) of make_mesh's mesh: LOGICAL_RULES on the 1-D mesh;
    with expert parallelism ("ep", "tp"), the all-device axes over both, the experts over
    "ep", each expert's width over "tp"."""
    if expert_parallel_size == 1:
        return dict(LOGICAL_RULES)
    rules: dict = {axis: (EP_AXIS, TP_AXIS) for axis in _ALL_DEVICES}
    rules.update(experts=EP_AXIS, expert_ffn=TP_AXIS)
    return rules


def parallel_sizes(mesh: Mesh) -> tuple[int, int]:
    """(tensor_parallel_size: every device of the mesh, expert_parallel_size)."""
    return int(mesh.devices.size), int(dict(mesh.shape).get(EP_AXIS, 1))


def _expert_width_split(tensor_parallel_size: int, expert_parallel_size: int) -> str:
    tp, ep = tensor_parallel_size, expert_parallel_size
    return f"tensor_parallel_size={tp}" if ep == 1 else \
        f"tensor_parallel_size={tp} / expert_parallel_size={ep} = {tp // ep}"


def check_tensor_parallel(config: ModelConfig, tensor_parallel_size: int,
                          expert_parallel_size: int = 1) -> None:
    """Raise ValueError unless tp splits heads, KV heads and the FFN into equal whole parts
    (a MoE model: unless expert_parallel_size divides tp and the experts, and each group's
    tp / ep devices divide every expert's width)."""
    tp, ep = tensor_parallel_size, expert_parallel_size
    sizes = [("num_heads", config.num_heads), ("num_kv_heads", config.num_kv_heads)]
    if not config.num_experts:
        sizes.append(("intermediate_size", config.intermediate_size))
    for field, size in sizes:
        if size % tp:
            raise ValueError(f"tensor_parallel_size={tp} does not divide {field}={size} of "
                             f"{config.name}: each device must hold whole heads, so "
                             f"tensor_parallel_size must be a divisor of {size}")
    if ep < 1 or tp % ep:
        raise ValueError(f"expert_parallel_size={ep} does not divide tensor_parallel_size="
                         f"{tp}: the experts are split over groups of equally many devices")
    if not config.num_experts:
        return
    if config.num_experts % ep:
        raise ValueError(f"expert_parallel_size={ep} does not divide num_experts="
                         f"{config.num_experts} of {config.name}: each group of devices must "
                         f"hold whole experts, so expert_parallel_size must be a divisor of "
                         f"{config.num_experts}")
    if config.moe_intermediate_size % (tp // ep):
        raise ValueError(f"{_expert_width_split(tp, ep)} does not divide moe_intermediate_size="
                         f"{config.moe_intermediate_size} of {config.name}: each expert's "
                         f"width is split over that many devices")


def rules_for(config: ModelConfig, tensor_parallel_size: int,
              expert_parallel_size: int = 1) -> dict[str, str | tuple[str, ...]]:
    """mesh_rules for this model: the vocabulary stays replicated when tp does not divide it
    (heads and FFN must divide: check_tensor_parallel)."""
    rules = mesh_rules(expert_parallel_size)
    if config.vocab_size % tensor_parallel_size:
        del rules["vocab"]
    return rules


def _ways(mesh_axes, tensor_parallel_size: int, expert_parallel_size: int) -> int:
    """How many parts mesh_rules' mesh axis (or axes) cuts an array axis into."""
    if mesh_axes is None:
        return 1
    if mesh_axes == EP_AXIS:
        return expert_parallel_size
    if mesh_axes == TP_AXIS:
        return tensor_parallel_size // expert_parallel_size
    return tensor_parallel_size  # ("ep", "tp"): every device


def spec(axes: tuple[str, ...], rules: dict[str, str]) -> PartitionSpec:
    return PartitionSpec(*(rules.get(axis) for axis in axes))


def param_specs(config: ModelConfig, tensor_parallel_size: int, per_layer: bool = False,
                expert_parallel_size: int = 1) -> dict[str, PartitionSpec]:
    """{param name: PartitionSpec}. per_layer: specs of one layer's slice (no leading L axis)."""
    rules = rules_for(config, tensor_parallel_size, expert_parallel_size)
    specs = {}
    for name in config.param_shapes():
        axes = PARAM_AXES[name]
        if per_layer and name.startswith("layers."):
            axes = axes[1:]
        specs[name] = spec(axes, rules)
    return specs


def lora_specs(config: ModelConfig, targets, tensor_parallel_size: int,
               per_layer: bool = False, expert_parallel_size: int = 1
               ) -> dict[str, tuple[PartitionSpec, PartitionSpec]]:
    """{target: (A's spec, B's spec)} of the LoRA stacks (model/decoder/lora.py: A [L, in, N * R],
    B [L, N * R, out]; per_layer: without L), consistent with the base weight's: A takes the
    base's input axis, B its output axis, the slots' rank columns are never split. So a
    column-split projection (wq, wk, wv, w_gate, w_up) has A replicated and B split on its
    output columns, and a row-split one (wo, w_down) A split on its input rows and B
    replicated: x @ A is then a partial sum per device, added into the base matmul's partial
    sums before their all-reduce."""
    rules = rules_for(config, tensor_parallel_size, expert_parallel_size)
    lead = () if per_layer else ("layers",)
    specs = {}
    for name in targets:
        _, d_in, d_out = PARAM_AXES[f"layers.{name}"]
        specs[name] = (spec((*lead, d_in, "lora_rank"), rules),
                       spec((*lead, "lora_rank", d_out), rules))
    return specs


def quantized_specs(config: ModelConfig, name: str, quantized, tensor_parallel_size: int,
                    per_layer: bool = False, expert_parallel_size: int = 1
                    ) -> dict[str, PartitionSpec]:
    """{"q" | "scale" | "zero": PartitionSpec} of a quantized param (model/quant/formats.py layout
    [..., out, in], groups along in; expert stacks [L, E, out, in]): q, scale and zero split
    like the matrix, except that one scale per output channel (a single group) is not split on
    the inputs. Raises ValueError when a device's share of the inputs would cut a group (or an
    int4 byte) in two."""
    tp = tensor_parallel_size
    rules = rules_for(config, tp, expert_parallel_size)
    axes = PARAM_AXES[name][1:] if per_layer and name.startswith("layers.") else PARAM_AXES[name]
    if quantized.transposed:
        axes = (*axes[:-2], axes[-1], axes[-2])
    inputs = quantized.matrix_shape[-1]
    num_groups = inputs // quantized.group
    ways = _ways(rules.get(axes[-1]), tp, expert_parallel_size)
    if ways > 1 and num_groups > 1 and (inputs // ways) % quantized.group:
        raise ValueError(f"{_expert_width_split(tp, expert_parallel_size)} splits the {inputs} "
                         f"inputs of {name} into {inputs // ways} per device, which cuts its "
                         f"quantization groups of {quantized.group}: use a "
                         f"tensor_parallel_size that keeps whole groups")
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
    tp, ep = parallel_sizes(mesh)
    check_tensor_parallel(config, tp, ep)
    out: dict = {name: NamedSharding(mesh, s)
                 for name, s in param_specs(config, tp, expert_parallel_size=ep).items()}
    for name, t in (quantized or {}).items():
        out[name] = {part: NamedSharding(mesh, s) for part, s in quantized_specs(
            config, name, t, tp, expert_parallel_size=ep).items()}
    return out


def kv_sharding(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, spec(KV_PAGE_AXES, mesh_rules(parallel_sizes(mesh)[1])))


def activation_spec(name: str, mesh: Mesh | None = None) -> PartitionSpec:
    """The spec of an activation on `mesh` (None: the 1-D ("tp",) mesh)."""
    ep = 1 if mesh is None else parallel_sizes(mesh)[1]
    return spec(ACTIVATION_AXES[name], mesh_rules(ep))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())


def flat_mesh(mesh: Mesh) -> Mesh:
    """The 1-D ("tp",) mesh over `mesh`'s devices in the same order: an all-device axis is
    split the same way on both, so arrays placed for one are already placed for the other."""
    return Mesh(mesh.devices.reshape(-1), (TP_AXIS,))


def make_mesh(tensor_parallel_size: int, expert_parallel_size: int = 1) -> Mesh | None:
    """The 1-D ("tp",) mesh, or None for one device in one process (the unsharded path); with
    expert_parallel_size N > 1, the same devices as a 2-D ("ep", "tp") mesh of shape
    (N, tensor_parallel_size / N).

    With several processes the mesh must span every device of the cluster: each process then
    holds part of every weight and runs the same step.
    """
    tp, ep = tensor_parallel_size, expert_parallel_size
    if ep < 1 or tp % ep:
        raise ValueError(f"expert_parallel_size={ep} does not divide tensor_parallel_size="
                         f"{tp}: the experts are split over groups of equally many devices")
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
    shape, axes = ((tp,), (TP_AXIS,)) if ep == 1 else ((ep, tp // ep), (EP_AXIS, TP_AXIS))
    devices = np.asarray(jax.devices()[:tp]).reshape(shape)
    if tp == num_devices:  # the whole slice: let JAX order it along the physical topology
        from jax.experimental import mesh_utils
        devices = mesh_utils.create_device_mesh(shape)
    return Mesh(np.asarray(devices), axes)
