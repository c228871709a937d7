"""The loaded-model record and the parameter plumbing every weight format shares.

`LoadedModel` is what every loader returns. `ParamBuilder` gathers tensors into the stacked
[in, out] layout of `ModelConfig.param_shapes()`, checking each shape as it arrives, so no loader
can hand the model a tensor of the wrong shape. Hugging Face tensor names live here too, because
both the safetensors reader and writer need them (Llama's, with each Family's renames and fused
tensors on top). This module must not read files or import jax.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from jaxserve.model.config import ModelConfig
from jaxserve.model.quant.formats import QuantizedTensor
from jaxserve.model.text.tokenizer import Tokenizer


@dataclass
class LoadedModel:
    config: ModelConfig
    params: dict[str, np.ndarray]  # ModelConfig.param_shapes() layout, host arrays
    tokenizer: Tokenizer
    source: str  # where the weights came from: a path, or "default (<path>)"
    # [2, L] float32 k_scale, v_scale per layer for fp8 KV pages, where the checkpoint has them
    kv_scales: np.ndarray | None = None


# Our stacked per-layer name -> the tensor under HF's `model.layers.{i}.`.
HF_LAYER_NAMES = {
    "attn_norm": "input_layernorm.weight",
    "wq": "self_attn.q_proj.weight", "wk": "self_attn.k_proj.weight",
    "wv": "self_attn.v_proj.weight", "wo": "self_attn.o_proj.weight",
    "bq": "self_attn.q_proj.bias", "bk": "self_attn.k_proj.bias", "bv": "self_attn.v_proj.bias",
    "mlp_norm": "post_attention_layernorm.weight",
    "w_gate": "mlp.gate_proj.weight", "w_up": "mlp.up_proj.weight",
    "w_down": "mlp.down_proj.weight",
    "bo": "self_attn.o_proj.bias",
    "q_norm": "self_attn.q_norm.weight", "k_norm": "self_attn.k_norm.weight",
}
HF_GLOBAL_NAMES = {"embed": "model.embed_tokens.weight", "final_norm": "model.norm.weight",
                   "lm_head": "lm_head.weight"}
# Matrices HF stores as nn.Linear [out, in]; we keep their transpose (of the last two axes).
TRANSPOSED = {"wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down", "lm_head", "router",
              "e_gate", "e_up", "e_down"}


def hf_layer_names(config: ModelConfig) -> dict[str, str]:
    """Our per-layer name -> its own HF tensor under `model.layers.{i}.`, for this config's family
    (names that live inside a fused HF tensor are left out: see hf_fused_parts)."""
    family = config.family
    fused = {name for parts in family.hf_fused.values() for name in parts}
    names = {**HF_LAYER_NAMES, **family.hf_layer_names}
    return {ours: hf for ours, hf in names.items() if ours not in fused}


def hf_expert_names(config: ModelConfig) -> dict[str, tuple[str, int]]:
    """HF suffix under `model.layers.{i}.` -> (our per-layer name, expert) of every per-expert
    tensor of a MoE family ({} for a dense model)."""
    return {hf.format(e=e): (ours, e) for ours, hf in config.family.hf_expert_names.items()
            for e in range(config.num_experts)}


def hf_fused_parts(config: ModelConfig, hf_suffix: str) -> list[tuple[str, int]]:
    """(our per-layer name, its rows) of each part of a fused HF [out, in] tensor, in order."""
    shapes = config.param_shapes()
    return [(name, shapes[f"layers.{name}"][-1]) for name in config.family.hf_fused[hf_suffix]]


def shape_error(name: str, shape, expected) -> ValueError:
    return ValueError(f"tensor {name!r} has shape {tuple(shape)}, expected {tuple(expected)}")


class ParamBuilder:
    """Collects per-layer tensors into stacked [L, ...] arrays, checking every shape on arrival.

    Stacks are allocated on first use with that tensor's dtype, so a 1 GB model never exists
    twice in memory.
    """

    def __init__(self, config: ModelConfig):
        self.config = config
        self.shapes = config.param_shapes()
        self.params: dict[str, np.ndarray] = {}
        self._filled: dict[str, set[int]] = {}
        self._experts: dict[tuple[str, int], set[int]] = {}  # (name, layer) -> experts set

    def expected_shape(self, name: str, *, transposed: bool) -> tuple[int, ...]:
        """The shape the source must store `name` in: one layer's slice, [out, in] if transposed."""
        if name not in self.shapes:
            raise ValueError(f"unexpected parameter {name!r} for this config "
                             f"(expected: {', '.join(self.shapes)})")
        shape = self.shapes[name][1:] if name.startswith("layers.") else self.shapes[name]
        return (*shape[:-2], shape[-1], shape[-2]) if transposed else tuple(shape)

    def set(self, name: str, value, *, layer: int | None = None, expert: int | None = None,
            transpose: bool = False, source_name: str | None = None) -> None:
        """value: a float array, or a QuantizedTensor [out, in] (model/quant/formats.py), which is
        kept
        in that layout (transpose says the param layout is [in, out]). expert: value is that one
        expert's matrix of a [L, E, ...] stack (float only)."""
        if expert is not None:
            return self._set_expert(name, value, layer, expert, transpose, source_name)
        expected = self.expected_shape(name, transposed=transpose)
        quantized = isinstance(value, QuantizedTensor)
        shape = value.matrix_shape if quantized else value.shape
        if tuple(shape) != expected:
            raise shape_error(source_name or name, shape, expected)
        if transpose and not quantized:
            value = np.swapaxes(value, -1, -2)
        if layer is None:
            self.params[name] = value if quantized else np.ascontiguousarray(value)
            return
        if not 0 <= layer < self.config.num_layers:
            raise ValueError(f"tensor {source_name or name!r} is for layer {layer}, but the model "
                             f"has {self.config.num_layers} layers")
        if name not in self.params:
            self.params[name] = _empty_stack(value, self.config.num_layers) if quantized \
                else np.empty(self.shapes[name], dtype=value.dtype)
            self._filled[name] = set()
        stack = self.params[name]
        if quantized:
            if (value.bits, value.group, value.zero is None) != (stack.bits, stack.group,
                                                                  stack.zero is None):
                raise ValueError(f"tensor {source_name or name!r} is {value.format}, but "
                                 f"earlier layers of {name} are {stack.format}")
            for part in ("q", "scale", "zero"):
                if getattr(value, part) is not None:
                    getattr(stack, part)[layer] = getattr(value, part)
        else:
            stack[layer] = value
        self._filled[name].add(layer)

    def _set_expert(self, name, value, layer, expert, transpose, source_name) -> None:
        """One expert's matrix into its layer's [E, ...] slice; the slice counts as filled once
        every expert has arrived."""
        shape = self.expected_shape(name, transposed=transpose)[1:]
        if tuple(value.shape) != shape:
            raise shape_error(source_name or name, value.shape, shape)
        if not 0 <= expert < self.config.num_experts:
            raise ValueError(f"tensor {source_name or name!r} is for expert {expert}, but the "
                             f"model has {self.config.num_experts} experts")
        if name not in self.params:
            self.params[name] = np.empty(self.shapes[name], dtype=value.dtype)
            self._filled[name] = set()
        self.params[name][layer, expert] = value.T if transpose else value
        arrived = self._experts.setdefault((name, layer), set())
        arrived.add(expert)
        if len(arrived) == self.config.num_experts:
            self._filled[name].add(layer)

    def finish(self) -> dict[str, np.ndarray]:
        missing = [n for n in self.shapes if n not in self.params]
        missing += [f"{n}[layer {i}]" for n, done in self._filled.items()
                    for i in range(self.config.num_layers) if i not in done]
        if missing:
            raise ValueError(f"missing tensors: {', '.join(missing)}")
        return self.params


def _empty_stack(like: QuantizedTensor, num_layers: int) -> QuantizedTensor:
    empty = lambda a: None if a is None else np.empty((num_layers, *a.shape), a.dtype)
    return QuantizedTensor(empty(like.q), empty(like.scale), empty(like.zero), like.bits,
                           like.group, like.transposed)


def validate_params(config: ModelConfig, params: dict[str, np.ndarray]) -> None:
    """Exactly the names of `config.param_shapes()`, each with its shape."""
    shapes = config.param_shapes()
    missing, extra = set(shapes) - set(params), set(params) - set(shapes)
    if missing or extra:
        raise ValueError(f"parameter names differ from the config: missing {sorted(missing)}, "
                         f"unexpected {sorted(extra)}")
    for name, expected in shapes.items():
        if tuple(params[name].shape) != expected:
            raise shape_error(name, params[name].shape, expected)


def to_hf_state_dict(config: ModelConfig, params: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Our stacked [in, out] layout -> the family's HF tensor names, one [out, in] tensor per
    layer (fused tensors joined on their rows)."""
    validate_params(config, params)
    names = hf_layer_names(config)
    experts = {ours: hf for ours, hf in config.family.hf_expert_names.items()}
    stacked = {name for names in config.family.hf_expert_stacked.values() for name in names}
    state = {}
    for i in range(config.num_layers):
        for hf_suffix, ours in config.family.hf_expert_stacked.items():
            parts = [params[f"layers.{name}"][i] for name in ours]
            joined = np.stack(parts, axis=-1).reshape(*parts[0].shape[:-1], -1)  # interleaved
            state[f"model.layers.{i}.{hf_suffix}"] = np.ascontiguousarray(joined)
        for hf_suffix in config.family.hf_fused:
            parts = [params[f"layers.{name}"][i].T for name, _ in hf_fused_parts(config, hf_suffix)]
            state[f"model.layers.{i}.{hf_suffix}"] = np.ascontiguousarray(np.concatenate(parts))
    for name, value in params.items():
        if name.startswith("layers."):
            short = name[len("layers."):]
            if short in experts:
                for i in range(config.num_layers):
                    for e in range(config.num_experts):
                        w = value[i, e].T if short in TRANSPOSED else value[i, e]
                        state[f"model.layers.{i}.{experts[short].format(e=e)}"] = \
                            np.ascontiguousarray(w)
                continue
            if short not in names or short in stacked:
                continue  # part of a fused tensor
            for i in range(config.num_layers):
                w = np.swapaxes(value[i], -1, -2) if short in TRANSPOSED else value[i]
                state[f"model.layers.{i}.{names[short]}"] = np.ascontiguousarray(w)
        else:
            w = value.T if name in TRANSPOSED else value
            state[HF_GLOBAL_NAMES[name]] = np.ascontiguousarray(w)
    return state
