"""Family: what one architecture family changes relative to the Llama decoder, as plain data.

Every field has Llama's behaviour as its default, so a family file states only its differences
(norm kind, MLP activation, q/k norm, extra norms, embedding scale, biases, fused tensors, how
`sliding_window` applies to layers, GGUF naming, and for a mixture-of-experts family how its
router scores experts and where its expert tensors live). The model, the config reader and the
loaders read these fields; none of them branches on a family's name. Data only: no jax, no file
access.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# The attention kinds a layer can have, by their transformers names (config.json layer_types).
FULL, SLIDING = "full_attention", "sliding_attention"
# How a mixture-of-experts router turns logits into top-k weights (Family.router).
ROUTE_SOFTMAX_TOPK, ROUTE_TOPK_SOFTMAX = "softmax_topk", "topk_softmax"


@dataclass(frozen=True)
class Family:
    name: str                                # ModelConfig.architecture, GGUF general.architecture
    hf_architectures: tuple[str, ...]        # config.json "architectures"
    model_types: tuple[str, ...]             # config.json "model_type"
    # RMSNorm scales by (1 + w) instead of w (Gemma stores the offset from one).
    norm_plus_one: bool = False
    # config.json key naming the MLP activation, and its default when absent.
    activation_key: str = "hidden_act"
    default_activation: str = "silu"
    qk_norm: bool = False                    # RMSNorm over head_dim on q and k before RoPE
    # Norms on the attention output and MLP output too (Gemma's four norms per layer).
    sandwich_norms: bool = False
    embed_scale: bool = False                # embeddings times sqrt(hidden_size)
    # "config": config.json attention_bias adds q, k, v and o biases; "qkv": q, k, v biases
    # always (Qwen2); "none": no biases, and attention_bias must be false if present.
    attention_bias: str = "config"
    # How sliding_window reaches layers: "none" (the key must be null), "all" (every layer,
    # when set), "max_window_layers" (layers >= max_window_layers, when use_sliding_window),
    # "pattern" (every sliding_window_pattern-th layer is global). layer_types, when present,
    # always wins.
    window_rule: str = "none"
    window_pattern: int = 6                  # "pattern": its default sliding_window_pattern
    default_rope_theta: float = 10000.0
    default_sliding_rope_theta: float | None = None  # rope_local_base_freq default (Gemma)
    # config.json keys this family reads beyond the common ones, each with the values it accepts
    # (None: any value).
    extra_keys: dict = field(default_factory=dict)
    # HF tensor names (under model.layers.{i}.) that differ from Llama's, by our name.
    hf_layer_names: dict = field(default_factory=dict)
    # HF fused tensors split on their rows into our tensors, in order (Phi-3's qkv_proj).
    hf_fused: dict = field(default_factory=dict)
    # GGUF: tensor names that differ from llama.cpp's Llama ones; whether the converter permuted
    # Q/K rows for interleaved RoPE; norm weights stored as (1 + w).
    # quantization_config.quant_method values whose weights the loader dequantizes (gpt-oss's
    # MXFP4 experts); any other quantization_config is refused.
    hf_quantization: tuple[str, ...] = ()
    gguf_layer_names: dict = field(default_factory=dict)
    gguf_fused: dict = field(default_factory=dict)
    gguf_permute_qk: bool = False
    gguf_norm_plus_one: bool = False
    # A BOS token is prepended when the tokenizer's config does not say (Llama's SentencePiece).
    bos_by_default: bool = False
    # ---- mixture of experts (empty num_experts_keys: a dense family) ----
    # config.json keys giving the expert count (the first present wins: transformers 4 and 5
    # name it differently), the per-expert FFN width, and whether top-k weights are renormalised
    # (None: always, as Mixtral and gpt-oss do).
    num_experts_keys: tuple[str, ...] = ()
    expert_size_key: str = "intermediate_size"
    norm_topk_key: str | None = None
    # ROUTE_SOFTMAX_TOPK: softmax over every expert, then the top k (renormalised per
    # norm_topk); ROUTE_TOPK_SOFTMAX: the top k logits, then a softmax over those (gpt-oss).
    router: str = ROUTE_SOFTMAX_TOPK
    router_bias: bool = False                # a bias on the router logits
    expert_bias: bool = False                # biases on every expert's projections
    # "gated": act(x @ gate) * (x @ up); "clamped_swiglu": gpt-oss's clamped form with
    # swiglu_alpha / swiglu_limit.
    expert_activation: str = "gated"
    attention_sinks: bool = False            # a learned logit per head in every softmax
    # HF tensors of expert e under model.layers.{i}., by our name ("{e}" is the expert index);
    # fused [E, ...] tensors are named in hf_expert_stacked instead.
    hf_expert_names: dict = field(default_factory=dict)
    # HF tensors holding every expert at once, stored [E, in, out] (gpt-oss): HF suffix ->
    # our names; two names split the last axis interleaved (gate = even, up = odd columns).
    hf_expert_stacked: dict = field(default_factory=dict)

    @property
    def is_moe(self) -> bool:
        return bool(self.num_experts_keys)

    @property
    def hf_architecture(self) -> str:
        return self.hf_architectures[0]
