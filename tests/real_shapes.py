"""The supported families at their published sizes, as transformers' own config classes.

Each entry is the keyword arguments of the model's Hugging Face config (`AutoConfig.for_model`),
from the checkpoint's published config.json: the lowering sweep builds jaxserve's ModelConfig
from them through the HF config reader, so the shapes it lowers are the ones a checkpoint would
give. No weights exist anywhere; tests lower abstract steps (bench/abstract_step.py).
"""

from __future__ import annotations

from jaxserve.model.config import ModelConfig
from jaxserve.model.loaders.hf_config import read_hf_config

GEMMA3_ROPE = {"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
               "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}}

# name: (model_type, architecture, config.json keyword arguments)
FAMILIES = {
    "Llama-3-8B": ("llama", "LlamaForCausalLM", dict(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, rope_theta=500000.0,
        max_position_embeddings=8192)),
    "Qwen3-8B": ("qwen3", "Qwen3ForCausalLM", dict(
        vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128, rope_theta=1e6,
        max_position_embeddings=40960, tie_word_embeddings=False)),
    "Gemma-3-4B": ("gemma3_text", "Gemma3ForCausalLM", dict(
        vocab_size=262208, hidden_size=2560, intermediate_size=10240, num_hidden_layers=34,
        num_attention_heads=8, num_key_value_heads=4, head_dim=256, sliding_window=1024,
        sliding_window_pattern=6, query_pre_attn_scalar=256, rope_parameters=GEMMA3_ROPE,
        max_position_embeddings=131072)),
    "Gemma-3-12B": ("gemma3_text", "Gemma3ForCausalLM", dict(
        vocab_size=262208, hidden_size=3840, intermediate_size=15360, num_hidden_layers=48,
        num_attention_heads=16, num_key_value_heads=8, head_dim=256, sliding_window=1024,
        sliding_window_pattern=6, query_pre_attn_scalar=256, rope_parameters=GEMMA3_ROPE,
        max_position_embeddings=131072)),
    "Phi-3-mini": ("phi3", "Phi3ForCausalLM", dict(
        vocab_size=32064, hidden_size=3072, intermediate_size=8192, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=32, max_position_embeddings=4096)),
    "Mistral-7B": ("mistral", "MistralForCausalLM", dict(
        vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, sliding_window=4096)),
    "Qwen3-30B-A3B": ("qwen3_moe", "Qwen3MoeForCausalLM", dict(
        vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
        num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
        num_experts=128, num_experts_per_tok=8, norm_topk_prob=True, rope_theta=1e6,
        max_position_embeddings=40960)),
    "Mixtral-8x7B": ("mixtral", "MixtralForCausalLM", dict(
        vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, num_local_experts=8,
        num_experts_per_tok=2, rope_theta=1e6, max_position_embeddings=32768)),
    "gpt-oss-20b": ("gpt_oss", "GptOssForCausalLM", dict(
        vocab_size=201088, hidden_size=2880, intermediate_size=2880, num_hidden_layers=24,
        num_attention_heads=64, num_key_value_heads=8, head_dim=64, sliding_window=128,
        num_local_experts=32, num_experts_per_tok=4)),
}
# A draft for speculative steps: Llama 3.2 1B beside the Llama 3 8B target (same vocabulary).
DRAFT = ("llama", "LlamaForCausalLM", dict(
    vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
    num_attention_heads=32, num_key_value_heads=8, head_dim=64, rope_theta=500000.0,
    max_position_embeddings=8192, tie_word_embeddings=True))


# Layers of one period of a family's layer kinds (Gemma 3: five local, one global)
PERIOD = {"Gemma-3-4B": 6, "Gemma-3-12B": 6}


def model_config(name: str, entry=None, num_layers: int | None = None) -> ModelConfig:
    """jaxserve's ModelConfig of a family above (or of `entry`), read from its HF config;
    num_layers: fewer layers than published (every per-layer shape unchanged)."""
    import transformers

    model_type, architecture, kwargs = entry or FAMILIES[name]
    if num_layers is not None:
        kwargs = {**kwargs, "num_hidden_layers": num_layers}
    hf = transformers.AutoConfig.for_model(model_type, **kwargs).to_dict()
    hf["architectures"] = [architecture]
    return ModelConfig(name=name, **read_hf_config(hf))
