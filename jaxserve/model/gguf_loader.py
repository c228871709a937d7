"""Read a GGUF file (llama.cpp's format): ModelConfig from its metadata, float32 params, tokenizer.

Every tensor is dequantized on load with `gguf.quants` and checked against the config's layout.
llama.cpp permutes the rows of Llama's Q and K projections for its interleaved RoPE; we undo that
exactly as transformers' GGUF loader does, so params are in HF's rotate-half convention. This module
must not import jax or keep quantized blocks around, and reads nothing but the file it is given.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
from pathlib import Path

import gguf
import numpy as np
from gguf import GGMLQuantizationType as Q
from tqdm.auto import tqdm

from jaxserve.model.config import RUNNABLE_ARCHITECTURES, ModelConfig, RopeScaling
from jaxserve.model.gguf_tokenizer import wants_bos
from jaxserve.model.tokenizer import Tokenizer
from jaxserve.model.weights import LoadedModel, ParamBuilder, shape_error

SUPPORTED_TYPES = frozenset({Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1,
                             Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K})
# Architectures whose converter permutes Q/K rows (llama.cpp's LlamaModel); Qwen2's does not.
_PERMUTED_ARCHITECTURES = {"llama", "mistral"}

# GGUF tensor name (after "blk.{i}.") -> (our name, stored [out, in] so transpose on load)
_LAYER_TENSORS = {
    "attn_norm.weight": ("attn_norm", False), "ffn_norm.weight": ("mlp_norm", False),
    "attn_q.weight": ("wq", True), "attn_k.weight": ("wk", True), "attn_v.weight": ("wv", True),
    "attn_output.weight": ("wo", True), "attn_q.bias": ("bq", False),
    "attn_k.bias": ("bk", False), "attn_v.bias": ("bv", False),
    "ffn_gate.weight": ("w_gate", True), "ffn_up.weight": ("w_up", True),
    "ffn_down.weight": ("w_down", True),
}
_GLOBAL_TENSORS = {"token_embd.weight": ("embed", False),
                   "output_norm.weight": ("final_norm", False), "output.weight": ("lm_head", True)}
_ROPE_FREQS = "rope_freqs.weight"


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


def config_from_metadata(metadata: dict, tensor_names, *, name: str) -> ModelConfig:
    arch = metadata.get("general.architecture")
    if arch not in RUNNABLE_ARCHITECTURES:
        raise ValueError(f"unsupported architecture {arch!r} in GGUF; supported: "
                         f"{', '.join(RUNNABLE_ARCHITECTURES)}")

    def key(suffix, default=KeyError):
        if f"{arch}.{suffix}" in metadata:
            return metadata[f"{arch}.{suffix}"]
        if default is KeyError:
            raise ValueError(f"GGUF metadata lacks {arch}.{suffix}")
        return default

    scaling = key("rope.scaling.type", "none")
    if scaling not in ("none", None):
        raise ValueError(f"unsupported GGUF rope scaling {scaling!r}")
    num_heads = key("attention.head_count")
    num_kv_heads = key("attention.head_count_kv", num_heads)
    if isinstance(num_kv_heads, list):
        if len(set(num_kv_heads)) != 1:
            raise ValueError(f"per-layer KV head counts are not supported: {num_kv_heads}")
        num_kv_heads = num_kv_heads[0]
    hidden = key("embedding_length")
    tokens = metadata.get("tokenizer.ggml.tokens") or ()
    eos = [metadata[k] for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id",
                                 "tokenizer.ggml.eom_token_id") if k in metadata]
    return ModelConfig(
        vocab_size=key("vocab_size", len(tokens)), hidden_size=hidden,
        intermediate_size=key("feed_forward_length"), num_layers=key("block_count"),
        num_heads=num_heads, num_kv_heads=num_kv_heads,
        head_dim=key("attention.key_length", hidden // num_heads),
        rms_norm_eps=key("attention.layer_norm_rms_epsilon", 1e-5),
        rope_theta=key("rope.freq_base", 10000.0),
        tie_word_embeddings="output.weight" not in tensor_names,
        attention_bias="blk.0.attn_q.bias" in tensor_names,
        max_position_embeddings=key("context_length", 2048),
        bos_token_id=metadata.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=tuple(dict.fromkeys(eos)), add_bos_token=wants_bos(metadata),
        architecture=arch, name=metadata.get("general.name") or name)


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


def _our_name(gguf_name: str) -> tuple[str, int | None, bool]:
    if gguf_name in _GLOBAL_TENSORS:
        name, transpose = _GLOBAL_TENSORS[gguf_name]
        return name, None, transpose
    parts = gguf_name.split(".", 2)
    if parts[0] == "blk" and len(parts) == 3 and parts[1].isdigit() and parts[2] in _LAYER_TENSORS:
        name, transpose = _LAYER_TENSORS[parts[2]]
        return f"layers.{name}", int(parts[1]), transpose
    raise ValueError(f"unexpected tensor {gguf_name!r} in GGUF")


def load_gguf(path: str | Path, *, progress: bool = True, name: str | None = None) -> LoadedModel:
    """Config, float32 params and tokenizer of a GGUF file."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {path}")
    reader = _READER(path)
    metadata = read_metadata(reader)
    tensors = {t.name: t for t in reader.tensors}
    config = config_from_metadata(metadata, tensors, name=path.stem)
    if name is not None:
        config = dataclasses.replace(config, name=name)
    if _ROPE_FREQS in tensors:
        factors = _dequantize(tensors[_ROPE_FREQS], (config.head_dim // 2,))
        config = dataclasses.replace(
            config, rope_scaling=_scaling_from_rope_freqs(factors, config, metadata))
    builder = ParamBuilder(config)
    permute = config.architecture in _PERMUTED_ARCHITECTURES
    for tensor in tqdm(reader.tensors, desc=f"loading {path.name}", unit="tensor",
                       disable=not progress):
        if tensor.name == _ROPE_FREQS:
            continue
        ours, layer, transpose = _our_name(tensor.name)
        expected = builder.expected_shape(ours, transposed=transpose)
        shape = tuple(int(n) for n in reversed(tensor.shape))  # GGUF lists dims innermost first
        if shape != expected:
            raise shape_error(tensor.name, shape, expected)
        values = _dequantize(tensor, shape)
        if permute and ours in ("layers.wq", "layers.bq"):
            values = reverse_permute(values, config.num_heads)
        elif permute and ours in ("layers.wk", "layers.bk"):
            values = reverse_permute(values, config.num_kv_heads)
        builder.set(ours, values, layer=layer, transpose=transpose, source_name=tensor.name)
    return LoadedModel(config=config, params=builder.finish(),
                       tokenizer=Tokenizer.from_gguf(metadata), source=str(path))
