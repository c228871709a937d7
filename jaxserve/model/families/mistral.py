"""Mistral: Llama with an optional sliding window on every layer, and no attention biases."""

from jaxserve.model.families.base import Family

FAMILY = Family(
    name="mistral", hf_architectures=("MistralForCausalLM",), model_types=("mistral",),
    attention_bias="none", window_rule="all", gguf_permute_qk=True)
