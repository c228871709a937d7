"""GGUF mixture-of-experts files in llama.cpp's layout: `qwen3moe`, and Mixtral as llama.cpp
writes it (general.architecture `llama` with experts).

A tiny transformers checkpoint is converted the way convert_hf_to_gguf.py converts it: its
per-expert tensors stacked into ffn_{gate,up,down}_exps ([E, out, in]), the router as
ffn_gate_inp, Llama's Q/K rows permuted, the metadata keys its TextModel / Qwen2MoeModel /
LlamaModel write (expert_count, expert_used_count, qwen3moe's expert_feed_forward_length; no
routing-norm key: llama.cpp renormalises the top-k weights of both families). The file must
load as its Hugging Face directory does (config fields, params) and give transformers' logits.
Q8_0 expert stacks, the older one-tensor-per-expert layout, `--quantization` with expert stacks
and the expert keys that change the math are checked too.
"""

from __future__ import annotations

import dataclasses
import json
import re

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from jaxserve.model.quant import formats as quant
from jaxserve.model.loaders.gguf_config import config_from_metadata
from jaxserve.model.loaders.gguf_loader import load_gguf, read_metadata
from jaxserve.model.loaders.loader import load_model
from jaxserve.model.loaders.safetensors_loader import load_hf_directory, save_hf_directory
from model_fixtures import llama_cpp_permute, tiny_vocab, write_tokenizer

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import arch_oracle  # noqa: E402
from test_gguf_archs import assert_same_config, assert_same_params  # noqa: E402

VOCAB = len(tiny_vocab()["tokenizer.ggml.tokens"])
# model_type -> (config overrides, llama.cpp architecture, HF per-expert tensor pattern with
# its projection names in llama.cpp's gate / up / down order)
FAMILIES = {
    "qwen3moe": ("qwen3_moe", dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                                   norm_topk_prob=True, rope_theta=50000.0),
                 gguf.MODEL_ARCH.QWEN3MOE,
                 r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(\w+)\.weight",
                 ("gate_proj", "up_proj", "down_proj")),
    # no sliding window: llama.cpp's Llama converter does not carry one
    "mixtral": ("mixtral", dict(num_local_experts=4, num_experts_per_tok=2),
                gguf.MODEL_ARCH.LLAMA,
                r"model\.layers\.(\d+)\.block_sparse_moe\.experts\.(\d+)\.(\w+)\.weight",
                ("w1", "w3", "w2")),
}


def _merged_name(family: str, layer: int, proj: str) -> str:
    """The name convert_hf_to_gguf.py maps a stacked expert tensor from."""
    if family == "qwen3moe":
        return f"model.layers.{layer}.mlp.experts.{proj}.weight"
    return f"layers.{layer}.feed_forward.experts.{proj}.weight"


def _metadata(family: str, hf: dict) -> dict:
    """The `{arch}.*` keys convert_hf_to_gguf.py writes for this config.json, with their values."""
    arch = gguf.MODEL_ARCH_NAMES[FAMILIES[family][2]]
    rope = hf.get("rope_parameters") or {"rope_theta": hf["rope_theta"]}
    keys = {"block_count": hf["num_hidden_layers"],
            "context_length": hf["max_position_embeddings"],
            "embedding_length": hf["hidden_size"], "feed_forward_length": hf["intermediate_size"],
            "attention.head_count": hf["num_attention_heads"],
            "attention.head_count_kv": hf["num_key_value_heads"],
            "rope.freq_base": float(rope["rope_theta"]),
            "attention.layer_norm_rms_epsilon": float(hf["rms_norm_eps"]),
            "expert_count": hf.get("num_local_experts") or hf["num_experts"],
            "expert_used_count": hf["num_experts_per_tok"],
            "attention.key_length": hf["head_dim"], "attention.value_length": hf["head_dim"]}
    if family == "qwen3moe":  # Qwen2MoeModel.set_gguf_parameters
        keys["expert_feed_forward_length"] = hf["moe_intermediate_size"]
    else:  # LlamaModel.set_gguf_parameters
        keys.update({"vocab_size": hf["vocab_size"], "rope.dimension_count": hf["head_dim"]})
    return {f"{arch}.{k}": v for k, v in keys.items()}


def _add(writer: gguf.GGUFWriter, key: str, value) -> None:
    if isinstance(value, bool):
        writer.add_bool(key, value)
    elif isinstance(value, float):
        writer.add_float32(key, value)
    else:
        writer.add_uint32(key, value)


def write_moe_gguf(path, directory, family: str, *, expert_qtype=None, per_expert=False,
                   metadata: dict | None = None):
    """Convert the HF directory as convert_hf_to_gguf.py does; expert tensors in `expert_qtype`
    (others F32), stacked, or one per expert as llama.cpp's older Mixtral files (`per_expert`).
    `metadata` replaces the written keys (a value of None drops one)."""
    from safetensors.numpy import load_file

    _, _, model_arch, pattern, projs = FAMILIES[family]
    hf = json.loads((directory / "config.json").read_text())
    state = {}
    for file in sorted(directory.glob("*.safetensors")):
        state.update(load_file(file))
    writer = gguf.GGUFWriter(str(path), gguf.MODEL_ARCH_NAMES[model_arch])
    writer.add_name(f"tiny-{family}")
    for key, value in {**_metadata(family, hf), **(metadata or {})}.items():
        if value is not None:
            _add(writer, key, value)
    write_tokenizer(writer, tiny_vocab())
    tensor_map = gguf.get_tensor_name_map(model_arch, hf["num_hidden_layers"])
    llama_cpp = {"gate": projs[0], "up": projs[1], "down": projs[2]}

    def add(name, w, qtype=None):
        if qtype is None:
            writer.add_tensor(name, np.ascontiguousarray(w, np.float32))
        else:
            writer.add_tensor(name, gguf.quants.quantize(np.ascontiguousarray(w), qtype),
                              raw_dtype=qtype)

    experts: dict = {}
    for hf_name, w in state.items():
        w = np.asarray(w, np.float32)
        if (match := re.fullmatch(pattern, hf_name)) is not None:
            layer, expert, proj = int(match[1]), int(match[2]), match[3]
            experts.setdefault((layer, proj), {})[expert] = w
            continue
        if model_arch == gguf.MODEL_ARCH.LLAMA and hf_name.endswith("q_proj.weight"):
            w = llama_cpp_permute(w, hf["num_attention_heads"])
        elif model_arch == gguf.MODEL_ARCH.LLAMA and hf_name.endswith("k_proj.weight"):
            w = llama_cpp_permute(w, hf["num_key_value_heads"])
        name = tensor_map.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        assert name is not None, f"gguf has no name for {hf_name}"
        add(name, w)
    for (layer, proj), by_expert in sorted(experts.items()):
        stack = np.stack([by_expert[e] for e in range(len(by_expert))])  # [E, out, in]
        if per_expert:
            ours = {v: k for k, v in llama_cpp.items()}[proj]
            for e, w in enumerate(stack):
                add(f"blk.{layer}.ffn_{ours}.{e}.weight", w, expert_qtype)
        else:
            name = tensor_map.get_name(_merged_name(family, layer, proj), try_suffixes=(".weight",))
            assert name is not None and name.endswith("_exps.weight"), name
            add(name, stack, expert_qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@dataclasses.dataclass
class Converted:
    directory: object
    hf_loaded: object
    gguf_path: object
    gguf_loaded: object
    batch: list
    want_logits: np.ndarray


_CONVERTED: dict[str, Converted] = {}


def convert(family: str, tmp_path_factory) -> Converted:
    """The family's tiny checkpoint, its GGUF and both loads (built once per module)."""
    if family not in _CONVERTED:
        model_type, overrides = FAMILIES[family][:2]
        tmp = tmp_path_factory.mktemp(family)
        model = arch_oracle.hf_checkpoint(tmp / "hf", model_type, vocab_size=VOCAB, **overrides)
        batch = arch_oracle.prompts(0, vocab=VOCAB)
        path = write_moe_gguf(tmp / "m.gguf", tmp / "hf", family)
        _CONVERTED[family] = Converted(
            tmp / "hf", load_hf_directory(tmp / "hf", progress=False), path,
            load_gguf(path, progress=False), batch, arch_oracle.hf_last_logits(model, batch))
    return _CONVERTED[family]


@pytest.fixture(scope="module", params=list(FAMILIES))
def converted(request, tmp_path_factory) -> Converted:
    return convert(request.param, tmp_path_factory)


@pytest.fixture(scope="module")
def qwen3moe(tmp_path_factory) -> Converted:
    return convert("qwen3moe", tmp_path_factory)


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory) -> Converted:
    return convert("mixtral", tmp_path_factory)


def test_moe_gguf_loads_like_its_hf_checkpoint(converted):
    got, want = converted.gguf_loaded, converted.hf_loaded
    assert got.config.architecture == want.config.architecture
    assert got.config.num_experts > 0
    assert_same_config(got.config, want.config)
    assert_same_params(got.params, want.params)


def test_moe_gguf_logits_match_transformers(converted):
    got = arch_oracle.last_logits(converted.gguf_loaded, converted.batch)
    arch_oracle.assert_logits_close(got, converted.want_logits)


def _dequantized(w: np.ndarray, qtype) -> np.ndarray:
    """ggml's round trip of a float [..., out, in] array."""
    return gguf.quants.dequantize(gguf.quants.quantize(np.ascontiguousarray(w), qtype),
                                  qtype).reshape(w.shape)


def _q8_reference(params: dict) -> dict:
    """params with every expert stack through Q8_0 (blocks along each expert's inputs)."""
    out = dict(params)
    for name in ("layers.e_gate", "layers.e_up", "layers.e_down"):
        w = np.swapaxes(np.asarray(params[name], np.float32), -1, -2)  # [L, E, out, in]
        out[name] = np.swapaxes(_dequantized(w, Q.Q8_0), -1, -2)
    return out


@pytest.fixture(scope="module")
def q8_qwen3moe(qwen3moe, tmp_path_factory):
    """The qwen3moe file with Q8_0 expert stacks, and the params it must load as."""
    path = write_moe_gguf(tmp_path_factory.mktemp("q8") / "q8.gguf", qwen3moe.directory,
                          "qwen3moe", expert_qtype=Q.Q8_0)
    return path, _q8_reference(qwen3moe.hf_loaded.params)


def test_q8_0_expert_stacks_dequantize_like_ggml_and_run_like_transformers(
        q8_qwen3moe, qwen3moe, tmp_path):
    path, reference = q8_qwen3moe
    loaded = load_gguf(path, progress=False)
    assert_same_params(loaded.params, reference)
    assert not np.array_equal(loaded.params["layers.e_up"],
                              qwen3moe.hf_loaded.params["layers.e_up"]), "Q8_0 changed nothing"
    # transformers on exactly these weights: our HF writer round-trips (ArchSuite checks it)
    save_hf_directory(tmp_path, loaded.config, loaded.params, loaded.tokenizer)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, dtype=torch.float32, attn_implementation="eager").eval()
    arch_oracle.assert_logits_close(arch_oracle.last_logits(loaded, qwen3moe.batch),
                                    arch_oracle.hf_last_logits(model, qwen3moe.batch))


def _dequantize_int8(t: quant.QuantizedTensor) -> np.ndarray:
    """[..., out, in] float of an int8 QuantizedTensor."""
    w = t.q.astype(np.float32) * np.repeat(t.scale.astype(np.float32), t.group, axis=-1)
    return w if t.zero is None else w + np.repeat(t.zero.astype(np.float32), t.group, axis=-1)


def test_quantization_mode_requantizes_expert_stacks_and_keeps_the_router_float(q8_qwen3moe):
    """Expert stacks are never block-mapped (the block mapping reads 2-D matrices): they are
    dequantized, then quantized per expert like any float matrix; the router stays float."""
    path, reference = q8_qwen3moe
    for loaded in (load_gguf(path, progress=False, quantization="int8"),
                   load_model(str(path), progress=False, quantization="int8")):  # the CLI's
        assert quant.stored_mode(loaded.params) == "int8"
        assert isinstance(loaded.params["layers.wq"], quant.QuantizedTensor)
        np.testing.assert_allclose(loaded.params["layers.router"], reference["layers.router"],
                                   rtol=0, atol=1e-6)
        shapes = loaded.config.param_shapes()
        for name in ("layers.e_gate", "layers.e_up", "layers.e_down"):
            got = loaded.params[name]
            assert isinstance(got, quant.QuantizedTensor) and got.shape == shapes[name], name
            want = np.swapaxes(reference[name], -1, -2)
            np.testing.assert_allclose(_dequantize_int8(got), want, rtol=0,
                                       atol=np.abs(want).max() / 127, err_msg=name)


def test_older_one_tensor_per_expert_mixtral_layout_loads_the_same_stacks(mixtral, tmp_path):
    path = write_moe_gguf(tmp_path / "old.gguf", mixtral.directory, "mixtral", per_expert=True)
    assert "blk.0.ffn_gate.3.weight" in {t.name for t in gguf.GGUFReader(path).tensors}
    assert_same_params(load_gguf(path, progress=False).params, mixtral.gguf_loaded.params)


def _config(converted, **changes):
    """The file's config with its metadata changed (None drops a key)."""
    metadata = read_metadata(gguf.GGUFReader(converted.gguf_path))
    for key, value in changes.items():
        key = key.replace("ARCH", metadata["general.architecture"])
        if value is None:
            metadata.pop(key, None)
        else:
            metadata[key] = value
    return config_from_metadata(metadata, set(converted.gguf_loaded.params) | {"output.weight"},
                                name="m")


def test_llama_file_with_no_experts_stays_llama(mixtral):
    config = _config(mixtral, **{"ARCH.expert_count": 0, "ARCH.expert_used_count": 0})
    assert (config.architecture, config.num_experts) == ("llama", 0)
    assert "layers.w_gate" in config.param_shapes()


def test_expert_weights_norm_key_sets_qwen3moe_renormalisation(qwen3moe):
    assert qwen3moe.gguf_loaded.config.norm_topk_prob is True  # no key: llama.cpp renormalises
    assert _config(qwen3moe, **{"ARCH.expert_weights_norm": False}).norm_topk_prob is False
    assert _config(qwen3moe, **{"ARCH.expert_weights_norm": True}).norm_topk_prob is True


def test_mixtral_cannot_turn_renormalisation_off(mixtral):
    with pytest.raises(ValueError, match=r"llama\.expert_weights_norm=False"):
        _config(mixtral, **{"ARCH.expert_weights_norm": False})


def test_missing_per_expert_width_follows_llama_cpp(converted):
    config = _config(converted, **{"ARCH.expert_feed_forward_length": None})
    want = (converted.hf_loaded.config.intermediate_size if config.architecture == "mixtral"
            else converted.hf_loaded.config.intermediate_size // config.num_experts_per_tok)
    assert config.moe_intermediate_size == want


@pytest.mark.parametrize("key,value,message", [
    ("ARCH.expert_used_count", None, r"expert_used_count=0 must be in \[1, \S+expert_count="),
    ("ARCH.expert_used_count", 9, r"expert_used_count=9"),
    ("ARCH.expert_gating_func", 2, r"expert_gating_func=2"),
    ("ARCH.expert_weights_scale", 2.5, r"expert_weights_scale=2\.5"),
    ("ARCH.expert_shared_count", 1, r"expert_shared_count=1"),
    ("ARCH.leading_dense_block_count", 1, r"leading_dense_block_count=1"),
])
def test_expert_keys_that_change_the_math_are_refused_by_name(converted, key, value, message):
    with pytest.raises(ValueError, match=message):
        _config(converted, **{key: value})


def test_a_dense_family_with_experts_is_refused_by_name(converted):
    metadata = read_metadata(gguf.GGUFReader(converted.gguf_path))
    arch = metadata["general.architecture"]
    dense = {(k.replace(f"{arch}.", "qwen3.") if k.startswith(f"{arch}.") else k): v
             for k, v in metadata.items()}
    dense["general.architecture"] = "qwen3"
    with pytest.raises(ValueError, match=r"qwen3\.expert_count="):
        config_from_metadata(dense, {"output.weight"}, name="m")
