"""config.json <-> ModelConfig fields, for transformers 4 and transformers 5 layouts alike.

transformers 4 writes `rope_theta` / `rope_scaling` at the top level; transformers 5 writes
`rope_parameters` (also nested by layer type: {"full_attention": {...}, "sliding_attention":
{...}}). Every key of config.json must be one this module reads, one known not to change the
forward pass (dropout, bookkeeping), or an error naming the key and its value: a setting that
changes the math must never be dropped silently. `JAXSERVE_IGNORE_CONFIG_KEYS=key1,key2`
overrides that for keys the user has checked. This module must not import jax or read files.
It sits below config.py (ModelConfig.from_hf_dict and to_hf_dict call it) and never imports it.
"""

from __future__ import annotations

import os

from jaxserve.model.families import family_for_hf
from jaxserve.model.families.base import FULL, SLIDING, Family
from jaxserve.model.decoder.rope import parse_rope

IGNORE_ENV = "JAXSERVE_IGNORE_CONFIG_KEYS"

# Keys that do not change the forward pass of an inference step.
INERT_KEYS = frozenset({
    "architectures", "model_type", "transformers_version", "_name_or_path", "torch_dtype",
    "dtype", "use_cache", "initializer_range", "attention_dropout", "pad_token_id",
    "output_hidden_states", "output_attentions", "return_dict", "chunk_size_feed_forward",
    "is_encoder_decoder", "id2label", "label2id", "problem_type", "tokenizer_class",
    "transformers.js_config", "auto_map", "_attn_implementation_autoset", "use_return_dict",
    "torchscript", "use_bfloat16", "pruned_heads", "tie_encoder_decoder", "is_decoder",
    "add_cross_attention", "cross_attention_hidden_size", "finetuning_task", "prefix",
    "task_specific_params", "tf_legacy_loss", "sep_token_id", "decoder_start_token_id",
    # generation defaults that transformers 4 wrote into config.json (sampling is per request)
    "max_length", "min_length", "do_sample", "early_stopping", "num_beams", "num_beam_groups",
    "diversity_penalty", "temperature", "top_k", "top_p", "typical_p", "repetition_penalty",
    "length_penalty", "no_repeat_ngram_size", "encoder_no_repeat_ngram_size", "bad_words_ids",
    "num_return_sequences", "output_scores", "return_dict_in_generate", "forced_bos_token_id",
    "forced_eos_token_id", "remove_invalid_values", "exponential_decay_length_penalty",
    "suppress_tokens", "begin_suppress_tokens",
})
# Keys read below, for every family.
READ_KEYS = frozenset({
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "rms_norm_eps", "rope_theta", "rope_scaling",
    "rope_parameters", "partial_rotary_factor", "original_max_position_embeddings",
    "tie_word_embeddings", "attention_bias", "max_position_embeddings", "bos_token_id",
    "eos_token_id", "add_bos_token", "sliding_window", "layer_types",
})


def _moe_keys(family: Family) -> set[str]:
    if not family.is_moe:
        return set()
    keys = {*family.num_experts_keys, family.expert_size_key, "num_experts_per_tok"}
    if family.norm_topk_key:
        keys.add(family.norm_topk_key)
    if family.expert_activation == "clamped_swiglu":
        keys |= {"swiglu_alpha", "swiglu_limit"}
    return keys


def check_keys(d: dict, family: Family) -> None:
    ignored = {k.strip() for k in os.environ.get(IGNORE_ENV, "").split(",") if k.strip()}
    understood = (INERT_KEYS | READ_KEYS | {family.activation_key} | set(family.extra_keys)
                  | _moe_keys(family))
    for key, value in d.items():
        if key in ignored:
            continue
        if key == "quantization_config" and family.hf_quantization:
            method = (value or {}).get("quant_method")
            if method not in family.hf_quantization:
                raise ValueError(f"config.json quantization_config.quant_method={method!r} is "
                                 f"not supported for {family.hf_architecture}; supported: "
                                 f"{', '.join(family.hf_quantization)} (dequantized on load)")
            continue
        if key not in understood:
            raise ValueError(
                f"config.json key {key}={value!r} is not supported for {family.hf_architecture}: "
                f"it may change the forward pass, so jaxserve refuses to guess (set "
                f"{IGNORE_ENV}={key} to load anyway if you know it does not)")
        allowed = family.extra_keys.get(key)
        if allowed is not None and value not in allowed:
            raise ValueError(f"config.json {key}={value!r} is not supported for "
                             f"{family.hf_architecture}; supported: {allowed}")


def _layer_types(d: dict, family: Family, num_layers: int) -> tuple[str, ...]:
    window = d.get("sliding_window")
    if d.get("layer_types") is not None:
        types = tuple(d["layer_types"])
        if family.window_rule in ("none", "all") and len(set(types)) > 1:
            raise ValueError(f"config.json layer_types={list(types)!r} alternates attention "
                             f"kinds, which {family.hf_architecture} does not support")
        return types if SLIDING in types else ()
    if family.window_rule == "none":
        if window is not None:
            raise ValueError(f"config.json sliding_window={window!r} is not supported for "
                             f"{family.hf_architecture}")
        return ()
    if window is None:
        return ()
    if family.window_rule == "all":
        return (SLIDING,) * num_layers
    if family.window_rule == "max_window_layers":
        if not d.get("use_sliding_window", False):
            return ()
        first = d.get("max_window_layers", 28)
        return tuple(SLIDING if i >= first else FULL for i in range(num_layers))
    pattern = d.get("sliding_window_pattern", d.get("_sliding_window_pattern",
                                                    family.window_pattern))
    return tuple(FULL if (i + 1) % pattern == 0 else SLIDING for i in range(num_layers))


def _ropes(d: dict, family: Family, max_pos: int) -> dict:
    """rope_theta/rope_scaling (+ the sliding layers' own, + partial_rotary_factor) fields."""
    original = d.get("original_max_position_embeddings")
    kw = dict(max_position_embeddings=max_pos, original_max_position_embeddings=original)
    params = d.get("rope_parameters")
    if params is not None and d.get("rope_scaling") not in (None, params):
        raise ValueError(f"config.json has both rope_parameters={params!r} and "
                         f"rope_scaling={d['rope_scaling']!r}; which one applies is ambiguous")
    theta = d.get("rope_theta", family.default_rope_theta)
    if params is not None and set(params) <= {FULL, SLIDING}:  # transformers 5, per layer type
        full = parse_rope(params.get(FULL), theta=theta, where="rope_parameters.full_attention",
                          **kw)
        sliding = parse_rope(params.get(SLIDING) or params.get(FULL), theta=theta,
                             where="rope_parameters.sliding_attention", **kw)
    else:
        full = parse_rope(params if params is not None else d.get("rope_scaling"), theta=theta,
                          where="rope_parameters" if params is not None else "rope_scaling",
                          **kw)
        sliding = None
        if family.default_sliding_rope_theta is not None:  # transformers 4 Gemma 3
            sliding = parse_rope(None, theta=d.get("rope_local_base_freq",
                                                   family.default_sliding_rope_theta), **kw)
    partials = {p for p in (d.get("partial_rotary_factor"), full.partial_rotary_factor,
                            sliding and sliding.partial_rotary_factor) if p is not None}
    if len(partials) > 1:
        raise ValueError(f"config.json gives different partial_rotary_factor values "
                         f"{sorted(partials)}; jaxserve needs one for every layer")
    out = dict(rope_theta=full.theta, rope_scaling=full.scaling,
               partial_rotary_factor=partials.pop() if partials else 1.0)
    if sliding is not None and (sliding.theta, sliding.scaling) != (full.theta, full.scaling):
        out.update(sliding_rope_theta=sliding.theta, sliding_rope_scaling=sliding.scaling)
    return out


def _biases(d: dict, family: Family) -> dict:
    flag = bool(d.get("attention_bias", False))
    if family.attention_bias == "qkv":
        return dict(attention_bias=True, output_bias=False)
    if family.attention_bias == "none" and flag:
        raise ValueError(f"config.json attention_bias=True is not supported for "
                         f"{family.hf_architecture}")
    return dict(attention_bias=flag, output_bias=flag)


def _experts(d: dict, family: Family) -> dict:
    """The mixture-of-experts fields of a MoE family's config.json ({} for a dense one)."""
    if not family.is_moe:
        return {}
    key = next((k for k in family.num_experts_keys if d.get(k) is not None), None)
    if key is None:
        raise ValueError(f"config.json of {family.hf_architecture} gives no expert count "
                         f"({' or '.join(family.num_experts_keys)})")
    out = dict(num_experts=d[key], num_experts_per_tok=d["num_experts_per_tok"],
               moe_intermediate_size=d[family.expert_size_key],
               norm_topk_prob=bool(d.get(family.norm_topk_key, True))
               if family.norm_topk_key else True)
    if family.expert_activation == "clamped_swiglu":
        out.update(swiglu_alpha=d.get("swiglu_alpha", 1.702),
                   swiglu_limit=d.get("swiglu_limit", 7.0))
    return out


def read_hf_config(d: dict) -> dict:
    """ModelConfig keyword arguments (all but name) from a config.json dict."""
    family = family_for_hf(d.get("architectures"), d.get("model_type"))
    check_keys(d, family)
    num_heads, num_layers = d["num_attention_heads"], d["num_hidden_layers"]
    max_pos = d.get("max_position_embeddings", 2048)
    eos = d.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
    layer_types = _layer_types(d, family, num_layers)
    window = d.get("sliding_window") if layer_types else None
    if layer_types and window is None:
        layer_types = ()  # sliding layers without a window attend to everything (transformers)
    return dict(
        vocab_size=d["vocab_size"], hidden_size=d["hidden_size"],
        intermediate_size=d["intermediate_size"], num_layers=num_layers,
        num_heads=num_heads, num_kv_heads=d.get("num_key_value_heads") or num_heads,
        head_dim=d.get("head_dim") or d["hidden_size"] // num_heads,
        rms_norm_eps=d.get("rms_norm_eps", 1e-5), **_ropes(d, family, max_pos),
        tie_word_embeddings=d.get("tie_word_embeddings", False), **_biases(d, family),
        max_position_embeddings=max_pos, bos_token_id=d.get("bos_token_id"),
        eos_token_ids=eos_ids,
        add_bos_token=d.get("add_bos_token", family.bos_by_default
                            and d.get("bos_token_id") is not None),
        architecture=family.name,
        hidden_act=d.get(family.activation_key) or family.default_activation,
        sliding_window=window, layer_types=layer_types,
        query_pre_attn_scalar=d.get("query_pre_attn_scalar"),
        attn_logit_softcap=d.get("attn_logit_softcapping"),
        final_logit_softcap=d.get("final_logit_softcapping"), **_experts(d, family))


def write_hf_config(c) -> dict:
    """A transformers 5 config.json that both jaxserve and transformers read back, from `c`, a
    ModelConfig read through its fields (config.py imports this module, not the reverse)."""
    family = c.family
    rope = {"rope_type": "default", "rope_theta": c.rope_theta}
    if c.rope_scaling is not None:
        rope = {**c.rope_scaling.to_hf_dict(), "rope_theta": c.rope_theta}
    if c.partial_rotary_factor != 1.0:
        rope["partial_rotary_factor"] = c.partial_rotary_factor
    if family.default_sliding_rope_theta is not None:
        sliding = {"rope_type": "default", "rope_theta": c.sliding_rope_theta or c.rope_theta}
        if c.sliding_rope_scaling is not None:
            sliding = {**c.sliding_rope_scaling.to_hf_dict(), "rope_theta": sliding["rope_theta"]}
        rope = {FULL: rope, SLIDING: sliding}
    d = {
        "architectures": [family.hf_architecture], "model_type": family.model_types[0],
        "vocab_size": c.vocab_size, "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size, "num_hidden_layers": c.num_layers,
        "num_attention_heads": c.num_heads, "num_key_value_heads": c.num_kv_heads,
        "head_dim": c.head_dim, "rms_norm_eps": c.rms_norm_eps, "rope_parameters": rope,
        "tie_word_embeddings": c.tie_word_embeddings,
        "max_position_embeddings": c.max_position_embeddings, "bos_token_id": c.bos_token_id,
        "eos_token_id": list(c.eos_token_ids) if len(c.eos_token_ids) != 1
        else c.eos_token_ids[0],
        "add_bos_token": c.add_bos_token, family.activation_key: c.hidden_act,
        "pad_token_id": None,  # else transformers fills in its class default (Phi-3: 32000)
    }
    if "original_max_position_embeddings" in rope:
        # transformers gives a top-level value priority over the rope dict's, and Phi-3's
        # config class always has one (default 4096): write the real one there too.
        d["original_max_position_embeddings"] = rope["original_max_position_embeddings"]
    if family.attention_bias == "config":
        if c.attention_bias != c.output_bias:
            raise ValueError(f"{family.hf_architecture} has q/k/v and o biases together or "
                             f"not at all (attention_bias); this config has q/k/v biases "
                             f"{c.attention_bias} and o bias {c.output_bias}")
        d["attention_bias"] = c.output_bias
    if family.window_rule != "none":
        d["sliding_window"] = c.sliding_window
        if c.layer_types:
            d["layer_types"] = list(c.layer_types)
        if family.window_rule == "max_window_layers":
            d["use_sliding_window"] = c.sliding_window is not None
    if family.is_moe:
        d.update({family.num_experts_keys[-1]: c.num_experts,
                  "num_experts_per_tok": c.num_experts_per_tok,
                  family.expert_size_key: c.moe_intermediate_size})
        if family.expert_size_key != "intermediate_size":
            d["intermediate_size"] = c.intermediate_size
        if family.norm_topk_key:
            d[family.norm_topk_key] = c.norm_topk_prob
        if family.expert_activation == "clamped_swiglu":
            d.update(swiglu_alpha=c.swiglu_alpha, swiglu_limit=c.swiglu_limit)
    for key, value in (("query_pre_attn_scalar", c.query_pre_attn_scalar),
                       ("attn_logit_softcapping", c.attn_logit_softcap),
                       ("final_logit_softcapping", c.final_logit_softcap)):
        if key in family.extra_keys:
            d[key] = value
    return d
