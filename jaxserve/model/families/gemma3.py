"""Gemma 3 text (Gemma3ForCausalLM): (1 + w) RMSNorm, four norms per layer, q/k norm, GeGLU,
embeddings scaled by sqrt(hidden_size), local sliding-window layers (their own RoPE base) between
global ones, attention scaled by query_pre_attn_scalar."""

from jaxserve.model.families.base import Family

FAMILY = Family(
    name="gemma3", hf_architectures=("Gemma3ForCausalLM",), model_types=("gemma3_text",),
    norm_plus_one=True, activation_key="hidden_activation",
    default_activation="gelu_pytorch_tanh", qk_norm=True, sandwich_norms=True, embed_scale=True,
    window_rule="pattern", default_rope_theta=1_000_000.0, default_sliding_rope_theta=10_000.0,
    extra_keys={"query_pre_attn_scalar": None, "final_logit_softcapping": None,
                # transformers' Gemma3Attention never applies it: only null is unambiguous
                "attn_logit_softcapping": (None,), "use_bidirectional_attention": (False, None),
                "sliding_window_pattern": None, "_sliding_window_pattern": None,
                "rope_local_base_freq": None, "cache_implementation": None},
    hf_layer_names={"mlp_norm": "pre_feedforward_layernorm.weight",
                    "post_attn_norm": "post_attention_layernorm.weight",
                    "post_mlp_norm": "post_feedforward_layernorm.weight"},
    gguf_layer_names={"q_norm": "attn_q_norm.weight", "k_norm": "attn_k_norm.weight",
                      "post_attn_norm": "post_attention_norm.weight",
                      "post_mlp_norm": "post_ffw_norm.weight"},
    gguf_norm_plus_one=True, bos_by_default=True)
