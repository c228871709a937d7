"""GGUF for qwen3, gemma3 and phi3: a tiny transformers checkpoint, written to GGUF the way
llama.cpp's convert_hf_to_gguf.py lays it out, loads as the same config and params as its
Hugging Face directory; unknown metadata keys and pre-tokenizers are refused by name.

The GGUF side uses the `gguf` package's own HF -> GGUF tensor-name map and the converter's
conventions (Gemma's norms stored as 1 + w, Phi-3's fused attn_qkv / ffn_up, no Q/K permutation
for these families, metadata keys as each converter's set_gguf_parameters writes them), so the
loader is checked against llama.cpp's layout rather than against its own tables. This file checks
loading only; tests/test_arch_*.py check the decoder's numbers against transformers.
"""

from __future__ import annotations

import dataclasses
import logging
import math

import gguf
import numpy as np
import pytest

from jaxserve.model.config import ModelConfig
from jaxserve.model.loaders.gguf_loader import load_gguf
from jaxserve.model.loaders.safetensors_loader import load_hf_directory
from jaxserve.model.text.tokenizer import Tokenizer
from model_fixtures import tiny_vocab, write_tokenizer

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

SIZES = dict(vocab_size=len(tiny_vocab()["tokenizer.ggml.tokens"]), hidden_size=64,
             intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
             bos_token_id=1, eos_token_id=2, max_position_embeddings=256)
GGUF_ARCH = {"qwen3": gguf.MODEL_ARCH.QWEN3, "gemma3": gguf.MODEL_ARCH.GEMMA3,
             "phi3": gguf.MODEL_ARCH.PHI3}
# f32-exact longrope factors (4 = rotary_dim / 2 for head_dim 16, partial 0.5)
SHORT, LONG = [1.0, 1.25, 1.5, 2.0], [1.0, 2.0, 4.0, 8.0]


def hf_config(arch: str, **overrides):
    if arch == "qwen3":
        kw = dict(num_hidden_layers=2, head_dim=16, rms_norm_eps=1e-6, rope_theta=50000.0)
        cls = transformers.Qwen3Config
    elif arch == "gemma3":
        # 6 layers: llama.cpp's fixed pattern makes layer 5 the one global layer
        kw = dict(num_hidden_layers=6, head_dim=16, query_pre_attn_scalar=16, sliding_window=8,
                  rms_norm_eps=1e-6, pad_token_id=0)
        cls = transformers.Gemma3TextConfig
    else:
        kw = dict(num_hidden_layers=2, partial_rotary_factor=0.5, rms_norm_eps=1e-5,
                  pad_token_id=0)
        cls = transformers.Phi3Config
    kw.update(overrides)
    config = cls(**{**SIZES, **kw})
    config.architectures = [{"qwen3": "Qwen3ForCausalLM", "gemma3": "Gemma3ForCausalLM",
                             "phi3": "Phi3ForCausalLM"}[arch]]
    return config


def save_checkpoint(directory, config, vocab: dict) -> dict[str, np.ndarray]:
    """save_pretrained a random model (norms random too, so (1 + w) offsets show); its
    float32 state dict."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(torch.randn_like(p) * 0.1)
    model.save_pretrained(directory)
    Tokenizer.from_gguf(vocab).save(directory)
    return {k: v.detach().numpy().astype(np.float32) for k, v in model.state_dict().items()}


def write_converted_gguf(path, arch: str, config, state: dict, vocab: dict, *,
                         extra_metadata: dict | None = None, qtype=None) -> None:
    """What convert_hf_to_gguf.py writes for `config` (Qwen3Model, Gemma3Model, Phi3MiniModel)."""
    c = config
    tensor_map = gguf.get_tensor_name_map(GGUF_ARCH[arch], c.num_hidden_layers)
    writer = gguf.GGUFWriter(str(path), gguf.MODEL_ARCH_NAMES[GGUF_ARCH[arch]])
    writer.add_name(f"tiny-{arch}")
    writer.add_block_count(c.num_hidden_layers)
    writer.add_context_length(c.max_position_embeddings)
    writer.add_embedding_length(c.hidden_size)
    writer.add_feed_forward_length(c.intermediate_size)
    writer.add_head_count(c.num_attention_heads)
    writer.add_head_count_kv(c.num_key_value_heads)
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    rope = c.rope_parameters.get("full_attention", c.rope_parameters)
    writer.add_rope_freq_base(rope["rope_theta"])
    if rope.get("rope_type") == "linear":  # TextModel.set_gguf_parameters' rope scaling
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(rope["factor"])
    if arch in ("qwen3", "gemma3"):
        writer.add_key_length(c.head_dim)
        writer.add_value_length(c.head_dim)
    if arch == "gemma3" and c.sliding_window is not None:
        writer.add_sliding_window(c.sliding_window)
    if arch == "phi3":
        head_dim = c.hidden_size // c.num_attention_heads
        partial = rope.get("partial_rotary_factor", 1.0)
        rotary = int(partial * c.hidden_size) // c.num_attention_heads
        writer.add_rope_dimension_count(rotary)
        writer.add_rope_scaling_orig_ctx_len(c.original_max_position_embeddings)
        writer.add_sliding_window(c.sliding_window or 0)
        if rope.get("rope_type") == "longrope":
            scale = c.max_position_embeddings / c.original_max_position_embeddings
            original = c.original_max_position_embeddings
            writer.add_rope_scaling_attn_factors(
                math.sqrt(1 + math.log(scale) / math.log(original)))
            for kind in ("long", "short"):
                writer.add_tensor(f"rope_factors_{kind}.weight",
                                  np.asarray(rope[f"{kind}_factor"], np.float32))
        assert head_dim == 16
    for key, value in (extra_metadata or {}).items():
        writer.add_uint32(key, value)
    write_tokenizer(writer, vocab)
    for hf_name, w in state.items():
        if hf_name == "lm_head.weight" and c.tie_word_embeddings:
            continue  # tied: llama.cpp reuses token_embd
        if arch == "gemma3" and hf_name.endswith("norm.weight"):
            w = w + 1.0  # Gemma3Model.norm_shift: llama.cpp's RMSNorm multiplies by w
        name = tensor_map.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        assert name is not None, f"gguf has no name for {hf_name}"
        if qtype is not None and w.ndim == 2:  # llama.cpp keeps 1-D tensors in F32
            writer.add_tensor(name, gguf.quants.quantize(w, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(name, np.ascontiguousarray(w))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def assert_same_config(got: ModelConfig, want: ModelConfig):
    for field in dataclasses.fields(ModelConfig):
        if field.name in ("name", "extra"):
            continue
        a, b = getattr(got, field.name), getattr(want, field.name)
        if isinstance(b, float) and isinstance(a, float):
            assert math.isclose(a, b, rel_tol=1e-6), f"{field.name}: GGUF {a!r}, HF {b!r}"
        else:
            assert a == b, f"{field.name}: GGUF {a!r}, HF {b!r}"


def assert_same_params(got: dict, want: dict):
    assert set(got) == set(want), f"param names differ: {sorted(set(got) ^ set(want))}"
    for name, w in want.items():
        assert got[name].shape == w.shape, f"{name}: {got[name].shape} != {w.shape}"
        np.testing.assert_allclose(got[name], np.asarray(w, np.float32), rtol=0, atol=1e-6,
                                   err_msg=name)


def convert_both(tmp_path, arch: str, vocab: dict | None = None, **overrides):
    vocab = vocab or tiny_vocab()
    config = hf_config(arch, **overrides)
    state = save_checkpoint(tmp_path / "hf", config, vocab)
    write_converted_gguf(tmp_path / "m.gguf", arch, config, state, vocab)
    return (load_gguf(tmp_path / "m.gguf", progress=False),
            load_hf_directory(tmp_path / "hf", progress=False))


CASES = {
    "qwen3": ("qwen3", {}),
    "qwen3-tied": ("qwen3", dict(tie_word_embeddings=True)),
    "gemma3": ("gemma3", {}),
    "gemma3-linear-global-rope": ("gemma3", dict(rope_parameters={
        "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1_000_000.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}})),
    "phi3": ("phi3", {}),
    "phi3-window": ("phi3", dict(sliding_window=8)),
    "phi3-longrope": ("phi3", dict(original_max_position_embeddings=64, rope_parameters={
        "rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
        "short_factor": SHORT, "long_factor": LONG})),
}


@pytest.mark.parametrize("case", CASES)
def test_gguf_loads_like_the_hf_checkpoint_it_was_converted_from(tmp_path, case):
    arch, overrides = CASES[case]
    gguf_model, hf_model = convert_both(tmp_path, arch, **overrides)
    assert gguf_model.config.architecture == arch
    assert_same_config(gguf_model.config, hf_model.config)
    assert_same_params(gguf_model.params, hf_model.params)


def test_gemma3_reads_llama_cpp_fixed_pattern_and_local_rope(tmp_path):
    gguf_model, _ = convert_both(tmp_path, "gemma3")
    c = gguf_model.config
    assert c.layer_windows == (8, 8, 8, 8, 8, None), c.layer_windows
    assert (c.rope_theta, c.sliding_rope_theta) == (1_000_000.0, 10_000.0)
    assert c.query_pre_attn_scalar == 16 and c.hidden_act == "gelu_pytorch_tanh"


def test_phi3_splits_fused_qkv_and_gate_up(tmp_path):
    gguf_model, hf_model = convert_both(tmp_path, "phi3")
    assert gguf_model.config.rotary_dim == 8
    for name in ("layers.wq", "layers.wk", "layers.wv", "layers.w_gate", "layers.w_up"):
        np.testing.assert_array_equal(gguf_model.params[name], hf_model.params[name],
                                      err_msg=name)


def test_quantized_fused_tensors_are_split_after_dequantizing(tmp_path):
    config = hf_config("phi3")
    state = save_checkpoint(tmp_path / "hf", config, tiny_vocab())
    q8 = gguf.GGMLQuantizationType.Q8_0
    write_converted_gguf(tmp_path / "m.gguf", "phi3", config, state, tiny_vocab(), qtype=q8)
    got = load_gguf(tmp_path / "m.gguf", progress=False).params
    want = load_hf_directory(tmp_path / "hf", progress=False).params
    for name in ("layers.wq", "layers.wk", "layers.wv", "layers.w_gate", "layers.w_up"):
        w = np.swapaxes(want[name], -1, -2)  # [L, out, in]: Q8_0 blocks run along `in`
        deq = gguf.quants.dequantize(gguf.quants.quantize(np.ascontiguousarray(w), q8), q8)
        np.testing.assert_allclose(got[name], np.swapaxes(deq.reshape(w.shape), -1, -2),
                                   rtol=0, atol=1e-6, err_msg=name)


def test_qwen3_takes_its_pre_tokenizer_from_the_file(tmp_path):
    vocab = dict(tiny_vocab(), **{"tokenizer.ggml.pre": "qwen2"})
    gguf_model, hf_model = convert_both(tmp_path, "qwen3", vocab=vocab)
    # qwen2's rule splits digits one by one (GPT-2's would keep "Ġ2024" whole)
    pieces = [p for p, _ in gguf_model.tokenizer.backend.pre_tokenizer.pre_tokenize_str(
        "the 2024  other")]
    assert pieces == ["the", "Ġ", "2", "0", "2", "4", "Ġ", "Ġother"], pieces
    text = "the 2024 other one"
    assert gguf_model.tokenizer.encode(text) == hf_model.tokenizer.encode(text)


def test_unknown_metadata_key_is_refused_by_name(tmp_path):
    config = hf_config("qwen3")
    state = save_checkpoint(tmp_path / "hf", config, tiny_vocab())
    write_converted_gguf(tmp_path / "m.gguf", "qwen3", config, state, tiny_vocab(),
                         extra_metadata={"qwen3.attention.temperature_length": 7})
    with pytest.raises(ValueError, match=r"qwen3\.attention\.temperature_length=7"):
        load_gguf(tmp_path / "m.gguf", progress=False)


def test_sliding_window_on_a_family_llama_cpp_runs_without_one_is_refused(tmp_path):
    config = hf_config("qwen3")
    state = save_checkpoint(tmp_path / "hf", config, tiny_vocab())
    write_converted_gguf(tmp_path / "m.gguf", "qwen3", config, state, tiny_vocab(),
                         extra_metadata={"qwen3.attention.sliding_window": 8})
    with pytest.raises(ValueError, match=r"qwen3\.attention\.sliding_window=8"):
        load_gguf(tmp_path / "m.gguf", progress=False)


def test_unknown_pre_tokenizer_is_an_error_naming_it(tmp_path):
    vocab = dict(tiny_vocab(), **{"tokenizer.ggml.pre": "made-up-bpe"})
    with pytest.raises(ValueError, match=r"tokenizer\.ggml\.pre='made-up-bpe'"):
        convert_both(tmp_path, "qwen3", vocab=vocab)


def test_default_pre_tokenizer_warns_that_it_guesses(tmp_path, caplog):
    vocab = dict(tiny_vocab(), **{"tokenizer.ggml.pre": "default"})
    with caplog.at_level(logging.WARNING, logger="jaxserve.model.text.gguf_tokenizer"):
        Tokenizer.from_gguf(vocab)
    assert any("tokenizer.ggml.pre" in r.getMessage() for r in caplog.records), caplog.text


def test_gguf_refuses_an_architecture_it_has_no_layout_for(tmp_path):
    config = hf_config("qwen3")
    state = save_checkpoint(tmp_path / "hf", config, tiny_vocab())
    write_converted_gguf(tmp_path / "m.gguf", "qwen3", config, state, tiny_vocab())
    raw = (tmp_path / "m.gguf").read_bytes().replace(b"qwen3", b"qwen9")
    (tmp_path / "bad.gguf").write_bytes(raw)
    with pytest.raises(ValueError, match="unsupported architecture 'qwen9'"):
        load_gguf(tmp_path / "bad.gguf", progress=False)


def test_a_split_gguf_shard_is_refused_with_the_merge_command(tmp_path):
    config = hf_config("qwen3")
    state = save_checkpoint(tmp_path / "hf", config, tiny_vocab())
    write_converted_gguf(tmp_path / "m.gguf", "qwen3", config, state, tiny_vocab(),
                         extra_metadata={"split.count": 2})
    with pytest.raises(ValueError, match="shard 1 of 2.*llama-gguf-split --merge"):
        load_gguf(tmp_path / "m.gguf", progress=False)
