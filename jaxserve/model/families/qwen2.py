"""Qwen2 / Qwen2.5: Llama with q, k, v biases; optional sliding window above max_window_layers."""

from jaxserve.model.families.base import Family

FAMILY = Family(
    name="qwen2", hf_architectures=("Qwen2ForCausalLM",), model_types=("qwen2",),
    attention_bias="qkv", window_rule="max_window_layers",
    extra_keys={"use_sliding_window": None, "max_window_layers": None})
