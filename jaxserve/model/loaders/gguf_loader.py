"""Read a GGUF file (llama.cpp's format): ModelConfig from its metadata, float32 params, tokenizer.

Every tensor is dequantized on load with `gguf.quants` and checked against the config's layout.
What llama.cpp's converter changed per family is undone as the family declares it
(families/*.py: gguf_layer_names, gguf_fused, gguf_permute_qk, gguf_norm_plus_one): Llama's Q/K
rows are un-permuted exactly as transformers' GGUF loader does, so params are in HF's
rotate-half convention; Gemma's (1 + w) norms lose their 1; Phi-3's fused attn_qkv and ffn_up
are split. A mixture-of-experts file's router (ffn_gate_inp, [E, D]) and expert stacks
(ffn_{gate,up,down}_exps, [E, out, in], or llama.cpp's older one tensor per expert,
ffn_gate.{e}) fill the [L, E, in, out] stacks. With a quantization mode the matrices come back as
QuantizedTensors instead, mapped from the file's blocks one tensor at a time (model/quant/gguf.py
says which GGML type gets which form), or with int8_per_channel each dequantized and requantized
per output channel, one tensor at a time. Expert tensors are never block-mapped (gguf_quant maps 2-D
matrices): they are dequantized to float, and requantized like a float matrix only where
quant.MATRIX_NAMES lists them (one expert of the older layout stays float: load_model's
quantize_params covers the finished stack). The metadata is read by gguf_config. This module
must not import jax, and reads nothing but the file it is given.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import re
from pathlib import Path

import gguf
import numpy as np
from gguf import GGMLQuantizationType as Q
from tqdm.auto import tqdm

from jaxserve.model.quant import gguf as gguf_quant
from jaxserve.model.quant import formats as quant
from jaxserve.model.config import ModelConfig, RopeScaling
from jaxserve.model.loaders.gguf_config import (ROPE_FACTORS_LONG, ROPE_FACTORS_SHORT,
                                                config_from_metadata)
from jaxserve.model.text.tokenizer import Tokenizer
from jaxserve.model.loaders.weights import TRANSPOSED, LoadedModel, ParamBuilder, shape_error

SUPPORTED_TYPES = frozenset({Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1,
                             Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K})
# Our per-layer name -> llama.cpp's Llama tensor name (after "blk.{i}."); a family's
# gguf_layer_names adds or overrides entries.
_LAYER_NAMES = {
    "attn_norm": "attn_norm.weight", "mlp_norm": "ffn_norm.weight",
    "wq": "attn_q.weight", "wk": "attn_k.weight", "wv": "attn_v.weight",
    "wo": "attn_output.weight", "bq": "attn_q.bias", "bk": "attn_k.bias", "bv": "attn_v.bias",
    "bo": "attn_output.bias", "w_gate": "ffn_gate.weight", "w_up": "ffn_up.weight",
    "w_down": "ffn_down.weight",
    # mixture of experts: the router and every expert of a layer in one [E, out, in] tensor
    "router": "ffn_gate_inp.weight", "e_gate": "ffn_gate_exps.weight",
    "e_up": "ffn_up_exps.weight", "e_down": "ffn_down_exps.weight",
}
# llama.cpp's older Mixtral layout: one [out, in] tensor per expert, "blk.{i}.ffn_gate.{e}.weight".
_PER_EXPERT = re.compile(r"blk\.(\d+)\.ffn_(gate|up|down)\.(\d+)\.weight")
_GLOBAL_TENSORS = {"token_embd.weight": "embed", "output_norm.weight": "final_norm",
                   "output.weight": "lm_head"}
_EXPERT_PARAMS = ("layers.e_gate", "layers.e_up", "layers.e_down")
_ROPE_FREQS = "rope_freqs.weight"
_CONFIG_TENSORS = (_ROPE_FREQS, ROPE_FACTORS_SHORT, ROPE_FACTORS_LONG)


class _PlainViewReader(gguf.GGUFReader):
    """GGUFReader, ~3x faster to open: it parses the header one value at a time through slices of
    an np.memmap, whose subclass hooks dominate; slicing a plain ndarray view of the same mapping
    gives the same bytes without them (tensor data stays memory-mapped)."""

    def _get(self, offset, dtype, count=1, override_order=None):
        plain = self.__dict__.get("_plain")
        if plain is None:
            plain = self.__dict__["_plain"] = self.data.view(np.ndarray)
        count = int(count)
        values = plain[offset:offset + np.dtype(dtype).itemsize * count].view(dtype=dtype)[:count]
        order = self.byte_order if override_order is None else override_order
        return values.view(values.dtype.newbyteorder(order))


# Only override the private hook while its signature is the one this override was written for.
_READER = (_PlainViewReader if list(inspect.signature(gguf.GGUFReader._get).parameters)
           == ["self", "offset", "dtype", "count", "override_order"] else gguf.GGUFReader)


def read_metadata(reader: gguf.GGUFReader) -> dict:
    """Every key/value of the file as python values."""
    return {key: field.contents() for key, field in reader.fields.items()}


def reverse_permute(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's `permute` of Q/K rows ([out, ...]; interleaved pairs -> rotate-half)."""
    half = w.shape[0] // num_heads // 2
    return w.reshape(num_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def llama3_rope_factors(scaling: RopeScaling, head_dim: int, theta: float) -> np.ndarray:
    """The per-frequency divisors llama.cpp stores as rope_freqs for Llama-3.1-style scaling."""
    freqs = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * math.pi / freqs
    low_wavelen = scaling.original_max_position_embeddings / scaling.low_freq_factor
    high_wavelen = scaling.original_max_position_embeddings / scaling.high_freq_factor
    smooth = ((scaling.original_max_position_embeddings / wavelen - scaling.low_freq_factor)
              / (scaling.high_freq_factor - scaling.low_freq_factor))
    mid = 1 / ((1 - smooth) / scaling.factor + smooth)
    return np.where(wavelen < high_wavelen, 1.0,
                    np.where(wavelen > low_wavelen, scaling.factor, mid))


def _scaling_from_rope_freqs(factors: np.ndarray, config: ModelConfig,
                             metadata: dict) -> RopeScaling:
    """Recover the llama3 RopeScaling that produced `rope_freqs`; refuse anything else rather than
    run a model with RoPE frequencies we cannot reproduce."""
    arch = config.architecture
    original = metadata.get(f"{arch}.rope.scaling.original_context_length", 8192)
    candidate = RopeScaling(float(factors.max()), 1.0, 4.0, int(original))
    expected = llama3_rope_factors(candidate, config.head_dim, config.rope_theta)
    if factors.shape != expected.shape or not np.allclose(factors, expected, rtol=1e-4):
        raise ValueError("GGUF rope_freqs does not match Llama-3 RoPE scaling (factor "
                         f"{candidate.factor}, low 1, high 4, original {original}); load the "
                         "Hugging Face directory of this model instead")
    return candidate


def _dequantize(tensor, shape: tuple[int, ...]) -> np.ndarray:
    if tensor.tensor_type not in SUPPORTED_TYPES:
        raise ValueError(f"tensor {tensor.name!r} has GGML type {tensor.tensor_type.name}, which "
                         f"jaxserve cannot dequantize; supported: "
                         f"{', '.join(sorted(t.name for t in SUPPORTED_TYPES))}")
    values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    # copy: F32 comes back as a view of the memory-mapped file
    return np.array(values, dtype=np.float32).reshape(shape)


def layer_tensor_names(config: ModelConfig) -> dict[str, tuple[str, ...]]:
    """GGUF name after "blk.{i}." -> our per-layer names it holds (several: a fused tensor, split
    on its rows in this order)."""
    family = config.family
    names = {**_LAYER_NAMES, **family.gguf_layer_names}
    table = {gguf_name: (ours,) for ours, gguf_name in names.items()}
    table.update({gguf_name: tuple(parts) for gguf_name, parts in family.gguf_fused.items()})
    return table


def _per_expert(gguf_name: str) -> tuple[str, int, int] | None:
    """(our full name, layer, expert) of a tensor in the one-per-expert layout, else None."""
    match = _PER_EXPERT.fullmatch(gguf_name)
    if match is None:
        return None
    return f"layers.e_{match[2]}", int(match[1]), int(match[3])


def _targets(gguf_name: str, table: dict) -> tuple[tuple[str, ...], int | None]:
    """(our full names, layer or None) of a GGUF tensor; an unknown tensor is an error."""
    if (expert := _per_expert(gguf_name)) is not None:
        return (expert[0],), expert[1]
    if gguf_name in _GLOBAL_TENSORS:
        return (_GLOBAL_TENSORS[gguf_name],), None
    parts = gguf_name.split(".", 2)
    if parts[0] == "blk" and len(parts) == 3 and parts[1].isdigit() and parts[2] in table:
        return tuple(f"layers.{n}" for n in table[parts[2]]), int(parts[1])
    raise ValueError(f"unexpected tensor {gguf_name!r} in GGUF")


def _is_norm(ours: str) -> bool:
    return ours.endswith("norm")


def read_config(reader: gguf.GGUFReader, metadata: dict, *, name: str) -> ModelConfig:
    """The file's ModelConfig, rope settings recovered from its rope tensors (not yet checked
    against what the decoder runs: load_gguf does that)."""
    tensors = {t.name: t for t in reader.tensors}
    factors = None
    if ROPE_FACTORS_SHORT in tensors or ROPE_FACTORS_LONG in tensors:
        factors = tuple(np.array(gguf.quants.dequantize(tensors[n].data, tensors[n].tensor_type),
                                 dtype=np.float32).reshape(-1)
                        for n in (ROPE_FACTORS_SHORT, ROPE_FACTORS_LONG))
    config = config_from_metadata(metadata, tensors, name=name, rope_factors=factors)
    if _ROPE_FREQS in tensors:
        factors = _dequantize(tensors[_ROPE_FREQS], (config.rotary_dim // 2,))
        config = dataclasses.replace(
            config, rope_scaling=_scaling_from_rope_freqs(factors, config, metadata))
    return config


def _exact_names(reader, table, mode: str) -> set[str]:
    """Our param names whose every GGUF tensor maps to `mode` without float (one GGML type in
    all layers, listed in gguf_quant.EXACT)."""
    types: dict[str, set] = {}
    for tensor in reader.tensors:
        if tensor.name in _CONFIG_TENSORS:
            continue
        for ours in _targets(tensor.name, table)[0]:
            # expert tensors are never block-mapped (the module docstring)
            kind = None if _is_expert(tensor.name, ours) else tensor.tensor_type
            types.setdefault(ours, set()).add(kind)
    return {name for name, kinds in types.items() if name in quant.MATRIX_NAMES
            and len(kinds) == 1 and None not in kinds
            and gguf_quant.maps_exactly(next(iter(kinds)), mode)}


def _is_expert(gguf_name: str, ours: str) -> bool:
    """Whether the tensor holds experts ([E, out, in], or one expert of the older layout)."""
    return ours in _EXPERT_PARAMS or _per_expert(gguf_name) is not None


def _rows(value, lo: int, hi: int):
    """Rows [lo, hi) of a float [out, in] array or a QuantizedTensor [out, in]."""
    if isinstance(value, quant.QuantizedTensor):
        return dataclasses.replace(value, q=value.q[lo:hi], scale=value.scale[lo:hi],
                                   zero=None if value.zero is None else value.zero[lo:hi])
    return value[lo:hi]


def _permute_rows(value, num_heads: int):
    if isinstance(value, quant.QuantizedTensor):
        part = lambda a: None if a is None else np.ascontiguousarray(reverse_permute(a, num_heads))
        return dataclasses.replace(value, q=part(value.q), scale=part(value.scale),
                                   zero=part(value.zero))
    return reverse_permute(value, num_heads)


def read_params(reader: gguf.GGUFReader, config: ModelConfig, *, progress: bool = False,
                desc: str = "loading", quantization: str = "none",
                int8_per_channel: bool = False) -> dict:
    """Every weight of the file in our layout (HF conventions), checked against config: float32,
    or with quantization 'int8' / 'int4' the matrices as QuantizedTensors (gguf_quant's table;
    int8_per_channel: int8 per output channel, every block requantized)."""
    if quantization not in quant.MODES:
        raise ValueError(f"quantization={quantization!r} is not one of {quant.MODES}")
    family = config.family
    table = layer_tensor_names(config)
    builder = ParamBuilder(config)
    requantize = quantization == "none" or (quantization == "int8" and int8_per_channel)
    exact = set() if requantize else _exact_names(reader, table, quantization)
    for tensor in tqdm(reader.tensors, desc=desc, unit="tensor", disable=not progress):
        if tensor.name in _CONFIG_TENSORS:
            continue
        if (expert := _per_expert(tensor.name)) is not None:
            _set_one_expert(builder, tensor, *expert)
            continue
        targets, layer = _targets(tensor.name, table)
        transpose = targets[0].split(".")[-1] in TRANSPOSED
        # one [out, in] slice per target, stacked on rows in the file
        expected = [builder.expected_shape(t, transposed=transpose) for t in targets]
        shape = tuple(int(n) for n in reversed(tensor.shape))  # GGUF lists dims innermost first
        want = (sum(e[0] for e in expected), *expected[0][1:])
        if shape != want:
            raise shape_error(tensor.name, shape, want)
        if targets[0] in exact:
            values = gguf_quant.map_tensor(tensor.tensor_type, tensor.data, shape[0],
                                           shape[1], quantization)
        else:
            values = _dequantize(tensor, shape)
        offsets = np.cumsum([0] + [e[0] for e in expected])
        for ours, lo, hi in zip(targets, offsets[:-1], offsets[1:]):
            part = _rows(values, lo, hi)
            if family.gguf_permute_qk and ours in ("layers.wq", "layers.bq"):
                part = _permute_rows(part, config.num_heads)
            elif family.gguf_permute_qk and ours in ("layers.wk", "layers.bk"):
                part = _permute_rows(part, config.num_kv_heads)
            if family.gguf_norm_plus_one and _is_norm(ours):
                part = part - np.float32(1.0)
            if quantization != "none" and ours in quant.MATRIX_NAMES:
                if not isinstance(part, quant.QuantizedTensor):  # requantized, this tensor only
                    part = quant.quantize(np.swapaxes(part, -1, -2) if transpose else part,
                                          quantization, ours)
                part = dataclasses.replace(part, transposed=transpose)
            builder.set(ours, part, layer=layer, transpose=transpose, source_name=tensor.name)
    return builder.finish()


def _set_one_expert(builder: ParamBuilder, tensor, name: str, layer: int, expert: int) -> None:
    """One expert's [out, in] matrix of the older layout, in float (load_model's quantize_params
    quantizes the finished stack when the mode covers it)."""
    want = builder.expected_shape(name, transposed=True)[1:]
    shape = tuple(int(n) for n in reversed(tensor.shape))
    if shape != want:
        raise shape_error(tensor.name, shape, want)
    builder.set(name, _dequantize(tensor, shape), layer=layer, expert=expert, transpose=True,
                source_name=tensor.name)


def load_gguf(path: str | Path, *, progress: bool = True, name: str | None = None,
              quantization: str = "none", int8_per_channel: bool = False) -> LoadedModel:
    """Config, params (float32, or quantized: read_params) and tokenizer of a GGUF file."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {path}")
    reader = _READER(path)
    metadata = read_metadata(reader)
    config = read_config(reader, metadata, name=path.stem)
    if name is not None:
        config = dataclasses.replace(config, name=name)
    config.check_runnable()
    params = read_params(reader, config, progress=progress, desc=f"loading {path.name}",
                         quantization=quantization, int8_per_channel=int8_per_channel)
    return LoadedModel(config=config, params=params, tokenizer=Tokenizer.from_gguf(metadata),
                       source=str(path))
