"""How quantized matrices are multiplied on each backend (model/quant/select.py), with the
device mocked as JAX reports it; that the CPU's tuning (pinned chunks, the head's loop) appears
only in the chunked form; int8 per channel for every source where int8 activations run (a
GGUF's blocks requantized at load); and the cache of weights quantized at load
(model/quant/cache.py).
"""

from __future__ import annotations

import dataclasses
import logging
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from jaxserve.config import EngineConfig
from jaxserve.model.quant import qlinear
from jaxserve.model.quant import formats as quant
from jaxserve.model.quant import cache as quant_cache
from jaxserve.model.device.select import DeviceDescription
from jaxserve.model.loaders.gguf_loader import load_gguf
from jaxserve.model.loaders.loader import load_model
from jaxserve.model.quant.select import MatmulForm, select
from model_fixtures import random_model, write_gguf

DEVICES = {  # name -> (device, int8 activations, chunked) for "auto"
    "CPU": (DeviceDescription("cpu", "cpu"), True, True),
    "TPU v5e": (DeviceDescription("tpu", "TPU v5 lite"), True, False),
    "TPU v5p": (DeviceDescription("tpu", "TPU v5"), True, False),
    "TPU v6e": (DeviceDescription("tpu", "TPU v6 lite"), True, False),
    "TPU v4": (DeviceDescription("tpu", "TPU v4"), False, False),
    "H100": (DeviceDescription("gpu", "NVIDIA H100 80GB HBM3", "9.0"), False, False),
    "T4": (DeviceDescription("gpu", "Tesla T4", "7.5"), False, False),
}


@pytest.mark.parametrize("name", list(DEVICES))
def test_auto_picks_the_tables_form_with_its_reasons(name):
    device, int8, chunked = DEVICES[name]
    chosen = select(device=device)
    assert chosen.form == MatmulForm(int8, chunked), f"{name}: {chosen}"
    assert chosen.int8_reason and chosen.dequant_reason, "every choice carries its reason"


def test_explicit_choices_win_and_bad_ones_name_the_field():
    tpu = DEVICES["TPU v4"][0]
    assert select("on", "chunked", tpu).form == MatmulForm(True, True)
    assert select("off", "fused", DEVICES["CPU"][0]).form == MatmulForm(False, False)
    with pytest.raises(ValueError, match="int8_activations"):
        select("yes", "auto", tpu)
    with pytest.raises(ValueError, match="dequant_form"):
        select("auto", "tiled", tpu)
    for field in ("int8_activations", "dequant_form"):
        with pytest.raises(ValueError, match=field):
            EngineConfig.from_kwargs(**{field: "maybe"}).validate()


def _grouped_head(vocab: int = 512, dim: int = 64) -> qlinear.QArray:
    w = np.random.default_rng(0).standard_normal((vocab, dim)).astype(np.float32)
    t = quant.quantize(w, "int4", "embed")
    return qlinear.QArray(jnp.asarray(t.q), jnp.asarray(t.scale), jnp.asarray(t.zero), 4,
                          t.group)


@pytest.mark.parametrize("chunked", [True, False])
def test_only_the_chunked_form_pins_pieces_and_loops_over_the_head(chunked, monkeypatch):
    """The CPU's tuning (a zero from the activation's bit count pinning each piece, lax.map
    over vocabulary chunks) is in the chunked form's program and nowhere in the fused one,
    which is one dequantize-then-dot; both give the same logits."""
    monkeypatch.setattr(qlinear, "CHUNK_BYTES", 16 << 10)  # the head in 8 chunks
    w = dataclasses.replace(_grouped_head(), form=MatmulForm(False, chunked))
    h = jnp.asarray(np.random.default_rng(1).standard_normal((3, 64)), jnp.float32)
    fn = jax.jit(lambda a, b: (qlinear.head(a, b, False), qlinear.linear(a, b)))
    text = fn.lower(h, w).as_text()
    assert ("stablehlo.while" in text) == chunked, "the head's loop belongs to the CPU form"
    assert ("stablehlo.popcnt" in text) == chunked, "the _after pin belongs to the CPU form"
    fused = dataclasses.replace(w, form=MatmulForm(False, False))
    for got, want in zip(fn(h, w), fn(h, fused)):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def q4_file(tmp_path_factory):
    config, params = random_model(seed=5)
    return write_gguf(tmp_path_factory.mktemp("gguf") / "m.gguf", config, params,
                      qtype=Q.Q4_1)


def test_int8_per_channel_requantizes_a_gguf_within_half_a_step_of_its_values(q4_file):
    want = load_gguf(q4_file, progress=False).params  # the file's blocks in float32
    blocks = load_model(str(q4_file), progress=False, quantization="int8").params
    per_channel = load_model(str(q4_file), progress=False, quantization="int8",
                             int8_per_channel=True).params
    for name in quant.MATRIX_NAMES:
        if name not in want:
            continue
        assert blocks[name].group == 32, f"{name}: without the flag the blocks map as stored"
        t = per_channel[name]
        assert t.bits == 8 and t.zero is None and t.group == t.matrix_shape[-1], \
            f"{name}: {t.format}, expected int8 per channel"
        step = np.swapaxes(t.scale, -1, -2) if t.transposed else t.scale  # [.., 1, out]
        assert np.all(np.abs(t.dequantize() - want[name]) <= step / 2 + 1e-7), name


def test_grouped_int8_matrices_are_requantized_and_others_kept():
    _, params = random_model(seed=6)
    grouped = {k: (quant.QuantizedTensor(*_g32(v)) if k == "layers.w_up" else v)
               for k, v in quant.quantize_params(params, "int8").items()}
    out = quant.int8_per_channel(grouped)
    assert out["layers.w_up"].group == out["layers.w_up"].matrix_shape[-1]
    assert out["layers.wq"] is grouped["layers.wq"], "a per-channel matrix is kept as it is"
    per_channel = quant.quantize_params(params, "int8")
    assert quant.int8_per_channel(per_channel) is per_channel, "nothing grouped: same dict"


def _g32(t: quant.QuantizedTensor):
    """t's values as int8 in groups of 32 (each group its own copy of the row's scale)."""
    scale = np.repeat(t.scale, t.matrix_shape[-1] // 32, axis=-1)
    return t.q, scale, None, 8, 32, t.transposed


def _counting_build(spec, **kw):
    calls = []

    def build():
        calls.append(1)
        return load_model(spec, progress=False, **kw)
    return build, calls


def _same_params(a: dict, b: dict) -> None:
    assert set(a) == set(b)
    for name, v in a.items():
        if isinstance(v, quant.QuantizedTensor):
            for part in ("q", "scale", "zero"):
                x, y = getattr(v, part), getattr(b[name], part)
                assert (x is None) == (y is None) and (x is None or np.array_equal(x, y)), name
            assert (v.bits, v.group, v.transposed) == (b[name].bits, b[name].group,
                                                       b[name].transposed), name
        else:
            assert np.array_equal(v, b[name]), name


def test_the_cache_returns_the_quantized_model_without_quantizing_again(q4_file, tmp_path):
    root = tmp_path / "cache"
    kw = dict(quantization="int8", int8_per_channel=True)
    build, calls = _counting_build(str(q4_file), **kw)
    first = quant_cache.load_or_build(root, [q4_file], "int8 per channel", build)
    again = quant_cache.load_or_build(root, [q4_file], "int8 per channel", build)
    assert len(calls) == 1, "the second load quantized again"
    _same_params(first.params, again.params)
    assert again.config == first.config
    assert again.tokenizer.encode("hello world") == first.tokenizer.encode("hello world")
    assert str(q4_file) in again.source and "read from" in again.source
    assert (root.stat().st_mode & 0o777) == 0o700, "the cache directory is owner-only"
    # another form, or the same file touched, is another entry
    quant_cache.load_or_build(root, [q4_file], "int8", build)
    assert len(calls) == 2
    st = q4_file.stat()
    os.utime(q4_file, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    quant_cache.load_or_build(root, [q4_file], "int8 per channel", build)
    assert len(calls) == 3, "a modified source file must not be served from the cache"


def test_load_model_caches_only_what_it_quantizes(q4_file, tmp_path):
    root = tmp_path / "cache"
    load_model(str(q4_file), progress=False, cache_dir=root)  # float: nothing to cache
    assert not root.exists() or not any(root.iterdir())
    got = load_model(str(q4_file), progress=False, quantization="int4", cache_dir=root)
    entries = [p for p in root.iterdir()]
    assert len(entries) == 1 and (entries[0] / "jaxserve_checkpoint.json").is_file()
    _same_params(got.params, load_model(str(q4_file), progress=False,
                                        quantization="int4").params)


def test_a_damaged_entry_is_rebuilt_and_old_entries_are_evicted(q4_file, tmp_path, monkeypatch):
    root = tmp_path / "cache"
    build, calls = _counting_build(str(q4_file), quantization="int8")
    model = quant_cache.load_or_build(root, [q4_file], "int8", build)
    entry = root / quant_cache.key([q4_file], "int8")
    for f in (entry / "params").rglob("*"):
        if f.is_file():
            f.write_bytes(b"")
    again = quant_cache.load_or_build(root, [q4_file], "int8", build)
    assert len(calls) == 2, "a damaged entry must be rebuilt"
    _same_params(model.params, again.params)
    monkeypatch.setattr(quant_cache, "MAX_ENTRIES", 1)
    quant_cache.load_or_build(root, [q4_file], "another form", build)
    assert [p.name for p in root.iterdir()] == [quant_cache.key([q4_file], "another form")]


def test_a_cache_directory_others_can_write_is_not_used(q4_file, tmp_path, caplog):
    root = tmp_path / "shared"
    root.mkdir()
    root.chmod(0o777)
    build, calls = _counting_build(str(q4_file), quantization="int8")
    with caplog.at_level(logging.WARNING, logger="jaxserve.model.quant.cache"):
        quant_cache.load_or_build(root, [q4_file], "int8", build)
        quant_cache.load_or_build(root, [q4_file], "int8", build)
    assert len(calls) == 2 and not any(root.iterdir())
    assert "writable by its group or others" in caplog.text and str(root) in caplog.text


def test_the_engine_serves_int8_per_channel_from_a_gguf_and_caches_it(q4_file, tmp_path,
                                                                     monkeypatch):
    """On the CPU (int8 activations: auto = on) `quantization="int8"` of a GGUF is per channel,
    the weights kept in the compile cache directory's quantized cache."""
    from conftest import SMALL_ENGINE
    from jaxserve.entrypoints.llm import LLM
    from jaxserve.runner import model_runner

    root = tmp_path / "quantized"
    monkeypatch.setattr(model_runner, "quantized_cache_dir", lambda cache_dir: str(root))
    llm = LLM(str(q4_file), quantization="int8", progress=False, **SMALL_ENGINE)
    formats = {group: fmt for group, fmt, _ in llm.engine.info.weight_formats}
    assert formats["mlp"] == formats["attention"] == "int8 per-channel (float32 scales)"
    assert len(list(root.iterdir())) == 1, "the quantized weights were not cached"
    from jaxserve import SamplingParams
    out = llm.generate(["hello world"], SamplingParams(max_tokens=4, temperature=0.0),
                       use_tqdm=False)
    assert len(out[0].token_ids) == 4
