"""Tiny random Llama models for tests, and their Hugging Face twins for oracle comparisons."""

from __future__ import annotations

import numpy as np

from jaxserve.model.config import ModelConfig
from jaxserve.model.decoder.decoder import random_params


def tiny_config(**overrides) -> ModelConfig:
    base = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4,
                num_kv_heads=2, head_dim=16, rms_norm_eps=1e-5, rope_theta=10000.0,
                tie_word_embeddings=False, max_position_embeddings=512, bos_token_id=1,
                eos_token_ids=(2,), name="tiny-llama")
    base.update(overrides)
    return ModelConfig(**base)


def tiny_model(seed: int = 0, **overrides) -> tuple[ModelConfig, dict[str, np.ndarray]]:
    config = tiny_config(**overrides)
    return config, random_params(config, seed=seed, scale=0.08)


def hf_state_dict(config: ModelConfig, params: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Our [in, out] stacked layout -> HF LlamaForCausalLM names, [out, in] per layer."""
    names = {"attn_norm": "input_layernorm.weight", "wq": "self_attn.q_proj.weight",
             "wk": "self_attn.k_proj.weight", "wv": "self_attn.v_proj.weight",
             "wo": "self_attn.o_proj.weight", "mlp_norm": "post_attention_layernorm.weight",
             "w_gate": "mlp.gate_proj.weight", "w_up": "mlp.up_proj.weight",
             "w_down": "mlp.down_proj.weight", "bq": "self_attn.q_proj.bias",
             "bk": "self_attn.k_proj.bias", "bv": "self_attn.v_proj.bias"}
    sd = {"model.embed_tokens.weight": params["embed"], "model.norm.weight": params["final_norm"]}
    if not config.tie_word_embeddings:
        sd["lm_head.weight"] = params["lm_head"].T
    for key, value in params.items():
        if not key.startswith("layers."):
            continue
        short = key[len("layers."):]
        for i in range(config.num_layers):
            w = value[i]
            sd[f"model.layers.{i}.{names[short]}"] = w.T if w.ndim == 2 else w
    return {k: np.ascontiguousarray(v) for k, v in sd.items()}


def hf_model(config: ModelConfig, params: dict[str, np.ndarray]):
    import torch
    import transformers

    kwargs = {k: v for k, v in config.to_hf_dict().items()
              if k not in ("architectures", "model_type")}
    if config.architecture == "qwen2":  # q/k/v biases only (Llama's flag would add o_proj's)
        kwargs.pop("attention_bias", None)
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**kwargs))
    else:
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**kwargs))
    model = model.eval().to(torch.float32)
    sd = {k: torch.from_numpy(v) for k, v in hf_state_dict(config, params).items()}
    model.load_state_dict(sd, strict=not config.tie_word_embeddings)
    return model


def hf_logits(model, token_ids: list[int]) -> np.ndarray:
    import torch

    with torch.no_grad():
        out = model(torch.tensor([token_ids]))
    return out.logits[0].numpy()


class CharTokenizer:
    """A byte-level toy tokenizer for tiny models: id = byte + 3; 0 pad, 1 BOS, 2 EOS."""

    def __init__(self, vocab_size: int = 128, eos_token_ids=(2,)):
        self.vocab_size = vocab_size
        self.eos_token_ids = tuple(eos_token_ids)
        self.bos_token_id = 1

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [min(b + 3, self.vocab_size - 1) for b in text.encode("utf-8")]

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        data = bytes(i - 3 for i in ids if i >= 3)
        return data.decode("utf-8", errors="replace")

    def apply_chat_template(self, messages, add_generation_prompt=True) -> str:
        return "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant: "


class TinyLoaded:
    """Stands where jaxserve.model.loaders.loader.LoadedModel does, for models made in a test."""

    def __init__(self, config, params, tokenizer=None):
        self.config, self.params = config, params
        self.tokenizer = tokenizer or CharTokenizer(config.vocab_size, config.eos_token_ids)
        self.source = "tiny"


def tiny_loaded(seed: int = 0, **overrides) -> TinyLoaded:
    return TinyLoaded(*tiny_model(seed, **overrides))
