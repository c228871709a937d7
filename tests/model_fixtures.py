"""Test helpers for the weight loaders: tiny random Llamas, a tiny byte-level BPE vocabulary, a
GGUF writer that lays tensors out as llama.cpp's convert script does, and the real default model
(loaded once per test session)."""

from __future__ import annotations

import functools
from pathlib import Path

import gguf
import numpy as np
from gguf import GGMLQuantizationType as Q

from jaxserve.model.config import ModelConfig
from jaxserve.model.text.gguf_tokenizer import bytes_to_unicode
from jaxserve.model.text.tokenizer import Tokenizer
from jaxserve.model.loaders.weights import to_hf_state_dict

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + "
          "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
_MERGES = ["Ġ t", "h e", "Ġt he", "i n", "Ġ a", "e r", "o n", "Ġ s", "l l", "Ġ w", "o r"]


def tiny_vocab() -> dict:
    """GGUF tokenizer metadata for a 270-token byte-level BPE with ChatML special tokens."""
    tokens = SPECIALS + sorted(bytes_to_unicode().values())
    tokens += ["".join(m.split(" ")) for m in _MERGES]
    return {
        "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "smollm",
        "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.merges": list(_MERGES),
        "tokenizer.ggml.token_type": [3] * len(SPECIALS) + [1] * (len(tokens) - len(SPECIALS)),
        "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.add_bos_token": False, "tokenizer.chat_template": CHATML,
    }


def write_tokenizer(writer: "gguf.GGUFWriter", vocab: dict) -> None:
    """tiny_vocab()'s BPE tokenizer metadata (its chat template aside) into a GGUF writer."""
    writer.add_tokenizer_model(vocab["tokenizer.ggml.model"])
    writer.add_tokenizer_pre(vocab["tokenizer.ggml.pre"])
    writer.add_token_list(vocab["tokenizer.ggml.tokens"])
    writer.add_token_merges(vocab["tokenizer.ggml.merges"])
    writer.add_token_types(vocab["tokenizer.ggml.token_type"])
    writer.add_bos_token_id(vocab["tokenizer.ggml.bos_token_id"])
    writer.add_eos_token_id(vocab["tokenizer.ggml.eos_token_id"])
    writer.add_add_bos_token(vocab["tokenizer.ggml.add_bos_token"])


def tiny_tokenizer() -> Tokenizer:
    return Tokenizer.from_gguf(tiny_vocab())


def random_model(seed: int = 0, dtype=np.float32, **overrides) -> tuple[ModelConfig, dict]:
    """A tiny config (GQA 4/2 heads, sizes multiples of 32 so every GGUF block type fits) and
    random params in our layout."""
    base = dict(vocab_size=len(tiny_vocab()["tokenizer.ggml.tokens"]), hidden_size=64,
                intermediate_size=96, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=256,
                bos_token_id=1, eos_token_ids=(2,), add_bos_token=False, name="tiny")
    base.update(overrides)
    config = ModelConfig(**base)
    rng = np.random.default_rng(seed)
    params = {name: (rng.standard_normal(shape) * 0.1).astype(dtype)
              for name, shape in config.param_shapes().items()}
    return config, params


def llama_cpp_permute(w: np.ndarray, num_heads: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute: rotate-half rows -> interleaved pairs."""
    return (w.reshape(num_heads, 2, w.shape[0] // num_heads // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


_GGUF_NAMES = {"input_layernorm.weight": "attn_norm.weight",
               "post_attention_layernorm.weight": "ffn_norm.weight",
               "self_attn.q_proj.weight": "attn_q.weight",
               "self_attn.k_proj.weight": "attn_k.weight",
               "self_attn.v_proj.weight": "attn_v.weight",
               "self_attn.o_proj.weight": "attn_output.weight",
               "self_attn.q_proj.bias": "attn_q.bias", "self_attn.k_proj.bias": "attn_k.bias",
               "self_attn.v_proj.bias": "attn_v.bias", "mlp.gate_proj.weight": "ffn_gate.weight",
               "mlp.up_proj.weight": "ffn_up.weight", "mlp.down_proj.weight": "ffn_down.weight"}


def gguf_tensors(config: ModelConfig, params: dict) -> dict[str, np.ndarray]:
    """GGUF names -> float32 [out, in] tensors, Q/K permuted for llama (not for qwen2)."""
    out = {}
    for hf_name, w in to_hf_state_dict(config, params).items():
        w = np.asarray(w, dtype=np.float32)
        if hf_name == "model.embed_tokens.weight":
            out["token_embd.weight"] = w
        elif hf_name == "model.norm.weight":
            out["output_norm.weight"] = w
        elif hf_name == "lm_head.weight":
            out["output.weight"] = w
        else:
            _, _, layer, rest = hf_name.split(".", 3)
            if config.architecture != "qwen2" and rest.startswith("self_attn.q_proj"):
                w = llama_cpp_permute(w, config.num_heads)
            elif config.architecture != "qwen2" and rest.startswith("self_attn.k_proj"):
                w = llama_cpp_permute(w, config.num_kv_heads)
            out[f"blk.{layer}.{_GGUF_NAMES[rest]}"] = w
    return out


def encode_tensor(w: np.ndarray, qtype: Q) -> tuple[np.ndarray, Q | None]:
    """(array to hand GGUFWriter, raw_dtype); 1-D tensors stay F32 as llama.cpp keeps them."""
    if w.ndim == 1 or qtype == Q.F32:
        return w.astype(np.float32), None
    if qtype == Q.F16:
        return w.astype(np.float16), None
    return gguf.quants.quantize(w, qtype), qtype


def write_gguf(path: Path, config: ModelConfig, params: dict, *, qtype: Q = Q.F32,
               vocab: dict | None = None, tensors: dict | None = None, extra_tensors=(),
               arch: str | None = None) -> Path:
    """A GGUF as llama.cpp writes one: metadata, tokenizer, tensors in `qtype`."""
    arch = arch or config.architecture
    vocab = vocab or tiny_vocab()
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name(config.name)
    writer.add_block_count(config.num_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_heads)
    writer.add_head_count_kv(config.num_kv_heads)
    writer.add_rope_freq_base(config.rope_theta)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    writer.add_rope_dimension_count(config.head_dim)
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    write_tokenizer(writer, vocab)
    writer.add_chat_template(vocab["tokenizer.chat_template"])
    tensors = gguf_tensors(config, params) if tensors is None else tensors
    for name, w in tensors.items():
        data, raw = encode_tensor(w, qtype)
        writer.add_tensor(name, data, raw_dtype=raw)
    for name, data, raw in extra_tensors:
        writer.add_tensor(name, data, raw_dtype=raw)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@functools.lru_cache(maxsize=1)
def default_gguf_path() -> Path:
    from jaxserve.model.loaders.default_model import default_model_path
    return default_model_path()


@functools.lru_cache(maxsize=1)
def real_default_model():
    """The real SmolLM2-135M-Instruct, loaded once per session (tests must not mutate it)."""
    from jaxserve.model.loaders.loader import load_model
    return load_model("default", progress=False)


@functools.lru_cache(maxsize=1)
def hf_default_model():
    """transformers' own load of the default GGUF in float32 (the oracle), once per session:
    it takes ~12 s (tests must not mutate it)."""
    import torch
    import transformers

    path = default_gguf_path()
    return transformers.AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32).eval()
