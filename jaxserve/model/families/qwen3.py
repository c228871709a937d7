"""Qwen3: Llama with RMSNorm on q and k per head (before RoPE), no biases by default."""

from jaxserve.model.families.base import Family

FAMILY = Family(
    name="qwen3", hf_architectures=("Qwen3ForCausalLM",), model_types=("qwen3",),
    qk_norm=True, window_rule="max_window_layers",
    extra_keys={"use_sliding_window": None, "max_window_layers": None},
    gguf_layer_names={"q_norm": "attn_q_norm.weight", "k_norm": "attn_k_norm.weight"})
