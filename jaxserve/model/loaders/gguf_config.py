"""ModelConfig from a GGUF file's metadata, for every family llama.cpp's converter writes.

llama.cpp names its settings `{arch}.<suffix>` (`qwen3.attention.head_count`,
`gemma3.rope.freq_base`, `phi3.rope.dimension_count`, ...). This module reads them into the
same ModelConfig fields that hf_config.py reads from the checkpoint's config.json, filling in what
llama.cpp hard-codes instead of storing (Gemma 3's local RoPE base and 1-in-6 global layers, its
attention scale, the family a Llama file with experts really is): a model converted to GGUF must
load as the checkpoint it came from. Any
`{arch}.*` key it does not understand is an error naming it (a setting that changes the math
must never be dropped silently; JAXSERVE_IGNORE_CONFIG_KEYS=key lets a user waive one he has
checked). Plain data: it must not import jax, read files or touch tensors; whether the decoder
can run the result is ModelConfig.check_runnable's business, not this module's.
"""

from __future__ import annotations

import math
import os

from jaxserve.model.config import FULL, SLIDING, ModelConfig, RopeScaling
from jaxserve.model.families import FAMILIES
from jaxserve.model.families.base import Family
from jaxserve.model.text.gguf_tokenizer import wants_bos
from jaxserve.model.loaders.hf_config import IGNORE_ENV

# `{arch}.` keys read below (the families that take a key decide what it means).
READ_SUFFIXES = frozenset({
    "context_length", "embedding_length", "block_count", "feed_forward_length", "vocab_size",
    "attention.head_count", "attention.head_count_kv", "attention.key_length",
    "attention.value_length", "attention.layer_norm_rms_epsilon", "attention.sliding_window",
    "attention.sliding_window_pattern", "attention.scale", "rope.freq_base", "rope.freq_base_swa",
    "rope.dimension_count", "rope.scaling.type", "rope.scaling.factor",
    "rope.scaling.original_context_length", "rope.scaling.attn_factor",
    "final_logit_softcapping", "attn_logit_softcapping",
})
# `{arch}.` keys of a mixture-of-experts file (llama.cpp's LLM_KV_EXPERT_*), read by _experts.
MOE_SUFFIXES = frozenset({"expert_count", "expert_used_count", "expert_feed_forward_length",
                          "expert_weights_norm", "expert_weights_scale", "expert_gating_func"})
# `{arch}.` keys that do not change the forward pass.
INERT_SUFFIXES = frozenset({"rope.scaling.finetuned", "tensor_data_layout"})
# Families whose GGUF layout this module and gguf_loader know (llama.cpp architecture names).
GGUF_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "gemma3", "phi3", "qwen3moe")
# llama.cpp writes Mixtral as `llama` with experts (convert_hf_to_gguf.py's LlamaModel): the
# family a file of this architecture is when its expert_count is positive.
_WITH_EXPERTS = {"llama": "mixtral"}
# gguf.ExpertGatingFuncType.SOFTMAX: the only router llama.cpp runs for these families.
_GATING_SOFTMAX = 1
# llama.cpp's Gemma 3: every 6th layer global (llama-model.cpp set_swa_pattern(6)).
_GEMMA3_PATTERN = 6
ROPE_FACTORS_SHORT, ROPE_FACTORS_LONG = "rope_factors_short.weight", "rope_factors_long.weight"


def _family(metadata: dict, arch) -> Family:
    if arch not in GGUF_ARCHITECTURES:
        raise ValueError(f"unsupported architecture {arch!r} in GGUF; supported: "
                         f"{', '.join(GGUF_ARCHITECTURES)}")
    if arch in _WITH_EXPERTS and metadata.get(f"{arch}.expert_count", 0):
        return FAMILIES[_WITH_EXPERTS[arch]]
    return FAMILIES[arch]


def check_keys(metadata: dict, arch: str, family: Family) -> None:
    ignored = {k.strip() for k in os.environ.get(IGNORE_ENV, "").split(",") if k.strip()}
    for key, value in metadata.items():
        if not key.startswith(arch + ".") or key in ignored:
            continue
        suffix = key[len(arch) + 1:]
        if suffix in MOE_SUFFIXES and (family.is_moe or (
                suffix in ("expert_count", "expert_used_count") and value == 0)):
            continue  # a dense file may say it has no experts
        if suffix not in READ_SUFFIXES | INERT_SUFFIXES:
            raise ValueError(f"GGUF metadata key {key}={value!r} is not supported: it may change "
                             f"the forward pass, so jaxserve refuses to guess (set "
                             f"{IGNORE_ENV}={key} to load anyway if you know it does not)")


class _Keys:
    """`{arch}.<suffix>` lookups with defaults, and an error naming the key when one is needed."""

    def __init__(self, metadata: dict, arch: str):
        self.metadata, self.arch = metadata, arch

    def __contains__(self, suffix: str) -> bool:
        return f"{self.arch}.{suffix}" in self.metadata

    def __call__(self, suffix: str, default=KeyError):
        key = f"{self.arch}.{suffix}"
        if key in self.metadata:
            return self.metadata[key]
        if default is KeyError:
            raise ValueError(f"GGUF metadata lacks {key}")
        return default


def _layer_types(key: _Keys, family: Family, num_layers: int) -> tuple[tuple[str, ...], int | None]:
    """(layer_types, sliding_window) as hf_config derives them from config.json."""
    window = key("attention.sliding_window", 0) or 0  # phi3 writes 0 for "no window"
    if not window:
        return (), None
    if family.window_rule == "all":
        return (SLIDING,) * num_layers, int(window)
    if family.window_rule == "pattern":
        pattern = key("attention.sliding_window_pattern", _GEMMA3_PATTERN)
        if isinstance(pattern, list):  # one bool per layer: True is sliding
            if len(pattern) != num_layers:
                raise ValueError(f"GGUF {key.arch}.attention.sliding_window_pattern has "
                                 f"{len(pattern)} entries for {num_layers} layers")
            types = tuple(SLIDING if p else FULL for p in pattern)
        else:
            types = tuple(FULL if (i + 1) % int(pattern) == 0 else SLIDING
                          for i in range(num_layers))
        return (types, int(window)) if SLIDING in types else ((), None)
    # llama.cpp runs these families with full attention whatever the key says; which layers the
    # checkpoint meant to slide (max_window_layers) is not in the file
    raise ValueError(f"GGUF {key.arch}.attention.sliding_window={window!r} is not supported for "
                     f"{family.hf_architecture}; load the Hugging Face directory instead")


def _experts(key: _Keys, family: Family) -> dict:
    """The mixture-of-experts fields ({} for a dense family). llama.cpp's converter writes only
    the expert counts and (qwen3moe) the per-expert width; llama.cpp renormalises the top-k
    weights of both families whatever config.json said, so a file without expert_weights_norm
    renormalises here too."""
    if not family.is_moe:
        return {}
    count, used = key("expert_count"), key("expert_used_count", 0)
    if not 0 < used <= count:
        raise ValueError(f"GGUF {key.arch}.expert_used_count={used!r} must be in [1, "
                         f"{key.arch}.expert_count={count}]")
    if family.expert_size_key == "intermediate_size":  # every FFN is an expert (Mixtral)
        width = key("expert_feed_forward_length", key("feed_forward_length"))
    else:  # llama.cpp's fallback when the per-expert width is absent
        width = key("expert_feed_forward_length", None) or key("feed_forward_length") // used
    normalize = bool(key("expert_weights_norm", True))
    if not normalize and family.norm_topk_key is None:
        raise ValueError(f"GGUF {key.arch}.expert_weights_norm=False is not supported for "
                         f"{family.hf_architecture}, whose router always renormalises")
    scale = key("expert_weights_scale", 1.0)
    if scale not in (0.0, 1.0):  # llama.cpp: 0 means unscaled
        raise ValueError(f"GGUF {key.arch}.expert_weights_scale={scale!r} is not supported "
                         f"(jaxserve's {family.hf_architecture} router does not scale weights)")
    gating = key("expert_gating_func", _GATING_SOFTMAX)
    if gating != _GATING_SOFTMAX:
        raise ValueError(f"GGUF {key.arch}.expert_gating_func={gating!r} is not supported: "
                         f"{family.hf_architecture}'s router is a softmax ({_GATING_SOFTMAX})")
    return dict(num_experts=count, num_experts_per_tok=used, moe_intermediate_size=width,
                norm_topk_prob=normalize)


def _rope_scaling(key: _Keys, max_pos: int) -> RopeScaling | None:
    kind = key("rope.scaling.type", "none")
    if kind in ("none", None):
        return None
    if kind == "linear":
        # hf_config's reading of {"rope_type": "linear", "factor": f}
        return RopeScaling(float(key("rope.scaling.factor")), rope_type="linear",
                           original_max_position_embeddings=max_pos)
    raise ValueError(f"unsupported GGUF rope scaling {key.arch}.rope.scaling.type={kind!r} "
                     f"(jaxserve reads none, linear, and Llama-3 rope_freqs from GGUF); load the "
                     f"Hugging Face directory of this model instead")


def longrope_scaling(key: _Keys, short, long, max_pos: int) -> RopeScaling:
    """Phi-3's longrope, from the rope_factors_short/long tensors llama.cpp's converter writes."""
    original = int(key("rope.scaling.original_context_length"))
    factor = max_pos / original
    default = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    stored = key("rope.scaling.attn_factor", None)
    attention = None if stored is None or math.isclose(stored, default, rel_tol=1e-6) \
        else float(stored)
    return RopeScaling(float(factor), original_max_position_embeddings=original,
                       rope_type="longrope", attention_factor=attention,
                       short_factor=tuple(map(float, short)), long_factor=tuple(map(float, long)))


def _ropes(key: _Keys, family: Family, head_dim: int, max_pos: int) -> dict:
    scaling = _rope_scaling(key, max_pos)
    theta = float(key("rope.freq_base", family.default_rope_theta))
    rotary = key("rope.dimension_count", head_dim)
    if not 0 < rotary <= head_dim or rotary % 2:
        raise ValueError(f"GGUF {key.arch}.rope.dimension_count={rotary} does not fit "
                         f"head_dim={head_dim}")
    partial = rotary / head_dim
    while int(head_dim * partial) < rotary:  # ModelConfig.rotary_dim truncates head_dim * partial
        partial = math.nextafter(partial, 2.0)
    out = dict(rope_theta=theta, rope_scaling=scaling, partial_rotary_factor=partial)
    if family.default_sliding_rope_theta is not None:
        sliding = float(key("rope.freq_base_swa", family.default_sliding_rope_theta))
        if (sliding, None) != (theta, scaling):
            out.update(sliding_rope_theta=sliding, sliding_rope_scaling=None)
    elif "rope.freq_base_swa" in key:
        raise ValueError(f"GGUF {key.arch}.rope.freq_base_swa is not supported for "
                         f"{family.hf_architecture}")
    return out


def _attention_extras(key: _Keys, family: Family, hidden: int, num_heads: int, head_dim: int,
                      num_layers: int) -> dict:
    """query_pre_attn_scalar and soft caps, for the families whose config.json has them."""
    out = {}
    if "query_pre_attn_scalar" in family.extra_keys:
        scale = key("attention.scale", None)
        if scale is not None:
            out["query_pre_attn_scalar"] = 1.0 / float(scale) ** 2
        else:  # llama.cpp's Gemma 3 rule: 27B (62 layers) scales by hidden/heads, others head_dim
            out["query_pre_attn_scalar"] = hidden // num_heads if num_layers == 62 else head_dim
    elif "attention.scale" in key:
        raise ValueError(f"GGUF {key.arch}.attention.scale is not supported for "
                         f"{family.hf_architecture}")
    for suffix, field in (("final_logit_softcapping", "final_logit_softcap"),
                          ("attn_logit_softcapping", "attn_logit_softcap")):
        value = key(suffix, None)
        if value is None:
            continue
        if suffix not in family.extra_keys:
            raise ValueError(f"GGUF {key.arch}.{suffix}={value!r} is not supported for "
                             f"{family.hf_architecture}")
        out[field] = float(value) or None
    return out


def config_from_metadata(metadata: dict, tensor_names, *, name: str,
                         rope_factors: tuple | None = None) -> ModelConfig:
    """The ModelConfig a GGUF describes. `tensor_names` tells biases and a tied head apart;
    `rope_factors` is (short, long) when the file holds Phi-3's rope_factors tensors."""
    if metadata.get("split.count", 1) > 1:
        raise ValueError(f"this GGUF is shard {metadata.get('split.no', 0) + 1} of "
                         f"{metadata['split.count']}; jaxserve reads one file: merge the shards "
                         f"with llama.cpp's `llama-gguf-split --merge <first shard> <out.gguf>`")
    arch = metadata.get("general.architecture")
    family = _family(metadata, arch)
    check_keys(metadata, arch, family)
    key = _Keys(metadata, arch)
    experts = _experts(key, family)
    # a MoE file without a dense width (no layer has a dense FFN) gets the experts' width
    ffn = key("feed_forward_length", experts["moe_intermediate_size"]) if experts \
        else key("feed_forward_length")
    num_heads = key("attention.head_count")
    num_kv_heads = key("attention.head_count_kv", num_heads)
    if isinstance(num_kv_heads, list):
        if len(set(num_kv_heads)) != 1:
            raise ValueError(f"per-layer KV head counts are not supported: {num_kv_heads}")
        num_kv_heads = num_kv_heads[0]
    hidden, num_layers = key("embedding_length"), key("block_count")
    head_dim = key("attention.key_length", hidden // num_heads)
    if key("attention.value_length", head_dim) != head_dim:
        raise ValueError(f"GGUF {arch}.attention.value_length={key('attention.value_length')} "
                         f"differs from key_length={head_dim}; jaxserve needs one head_dim")
    max_pos = key("context_length", 2048)
    ropes = _ropes(key, family, head_dim, max_pos)
    if rope_factors is not None:
        if ropes["rope_scaling"] is not None:
            raise ValueError("GGUF has both rope_factors tensors and rope.scaling.type")
        ropes["rope_scaling"] = longrope_scaling(key, *rope_factors, max_pos)
    layer_types, window = _layer_types(key, family, num_layers)
    tokens = metadata.get("tokenizer.ggml.tokens") or ()
    eos = [metadata[k] for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id",
                                 "tokenizer.ggml.eom_token_id") if k in metadata]
    return ModelConfig(
        vocab_size=key("vocab_size", len(tokens)), hidden_size=hidden,
        intermediate_size=ffn, num_layers=num_layers,
        num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
        rms_norm_eps=key("attention.layer_norm_rms_epsilon", 1e-5), **ropes,
        tie_word_embeddings="output.weight" not in tensor_names,
        attention_bias="blk.0.attn_q.bias" in tensor_names,
        output_bias="blk.0.attn_output.bias" in tensor_names,
        max_position_embeddings=max_pos,
        bos_token_id=metadata.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=tuple(dict.fromkeys(eos)), add_bos_token=wants_bos(metadata),
        architecture=family.name, hidden_act=family.default_activation,
        sliding_window=window, layer_types=layer_types,
        **_attention_extras(key, family, hidden, num_heads, head_dim, num_layers), **experts,
        name=metadata.get("general.name") or name)
