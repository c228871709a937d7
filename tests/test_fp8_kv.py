"""The fp8 KV cache (kv_cache_dtype, model/quant/kv.py): names and refusals, quantization on
write with per-layer scales, every attention path reading fp8 pages (the Pallas kernels in
interpret mode, the CPU decode kernel: tests/test_decode_attention.py), checkpoint scales, the
pool's size for the same bytes, and the engine's greedy invariances (preemption in both modes)
with fp8 pages. The host tier with fp8 pages: tests/test_host_prefix_engine.py; swap round
trips: tests/test_swap.py; the default model's accuracy: test_fp8_kv_default.py.
"""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import pytest

from conftest import make_llm
from jaxserve import SamplingParams
from jaxserve.config import CacheConfig, EngineConfig
from jaxserve.model.quant import kv as kv_quant
from jaxserve.runner.compile_count import CompileCounter
from test_engine import assert_idle_and_no_leak, mixed_requests

E4M3, E5M2 = jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2)


@pytest.mark.parametrize("name,activation,want", [
    ("auto", jnp.float32, jnp.float32), ("auto", jnp.bfloat16, jnp.bfloat16),
    ("bfloat16", jnp.float32, jnp.bfloat16), ("float16", jnp.float32, jnp.float16),
    ("float32", jnp.bfloat16, jnp.float32), ("fp8", jnp.bfloat16, E4M3),
    ("fp8_e4m3", jnp.float32, E4M3), ("fp8_e5m2", jnp.float32, E5M2)])
def test_kv_cache_dtype_takes_vllms_names(name, activation, want):
    assert kv_quant.resolve(name, activation) == jnp.dtype(want), name


def test_an_unknown_kv_cache_dtype_is_refused_naming_the_field_and_the_allowed_values():
    for refuse in (lambda: kv_quant.resolve("int8", jnp.float32),
                   lambda: CacheConfig(kv_cache_dtype="fp4").validate(),
                   lambda: EngineConfig.from_kwargs(kv_cache_dtype="e4m3").validate()):
        with pytest.raises(ValueError, match="kv_cache_dtype") as err:
            refuse()
        assert "fp8_e5m2" in str(err.value) and "auto" in str(err.value), str(err.value)


def test_store_divides_by_the_scale_clips_to_the_fp8_range_and_casts():
    x = jnp.asarray([0.0, 1.0, -3.0, 100.0, 1e4, -1e6], jnp.float32)
    got = np.asarray(kv_quant.store(x, E4M3, jnp.float32(2.0)), np.float32)
    want = np.asarray(jnp.asarray([0.0, 0.5, -1.5, 50.0, 448.0, -448.0], E4M3), np.float32)
    np.testing.assert_array_equal(got, want)
    assert np.isfinite(np.asarray(kv_quant.store(x * 1e3, E5M2, 1.0), np.float32)).all()
    assert kv_quant.store(x, jnp.bfloat16, None).dtype == jnp.bfloat16  # a plain cast


@pytest.mark.parametrize("bad", [np.ones((2, 3)), np.array([[1.0, 0.0], [1.0, 1.0]]),
                                 np.array([[1.0, np.inf], [1.0, 1.0]])])
def test_bad_kv_scales_are_refused(bad):
    with pytest.raises(ValueError, match="kv_scales"):
        kv_quant.check_scales(bad, 2)


def _forward(config, params, kv_dtype, kv_scales=None):
    import quant_accuracy as qa
    return qa.Forward(config, params, kv_dtype=kv_dtype, kv_scales=kv_scales)


def test_fp8_pages_hold_the_kv_over_its_layer_scale_and_attention_undoes_it(monkeypatch):
    """The same prompts through float32 pages and fp8 pages with scales 0.25 / 4 (one per layer
    and per K/V): each first-layer fp8 element times its scale is the float32 page's element to
    e4m3's precision (later layers' K/V already differ through the first's attention), and the
    logits stay close to float32's."""
    import quant_accuracy as qa
    from tiny_models import tiny_model

    for name, value in dict(NUM_PAGES=32, S=4, SEQ_PAGES=6).items():
        monkeypatch.setattr(qa, name, value)
    config, params = tiny_model(seed=2)
    scales = np.array([[0.25, 4.0], [4.0, 0.25]], np.float32)  # [k/v, layer]
    seqs = [(list(range(3, 3 + n)), 0) for n in (5, 17, 9, 30)]
    runs = {}
    for dtype in (jnp.float32, E4M3):
        model = _forward(config, params, dtype, scales if dtype == E4M3 else None)
        runs[dtype] = (model.step(seqs, 64, 4), [np.asarray(x, np.float32) for x in model.kv])
    (ref_logits, ref_kv), (logits, kv) = runs[jnp.float32], runs[E4M3]
    for which, (ref, got) in enumerate(zip(ref_kv, kv)):
        s = scales[which, 0]
        err = np.abs(got[0] * s - ref[0])
        assert np.all(err <= np.abs(ref[0]) / 16 + s * 2.0 ** -10), (
            f"{'kv'[which]} (scale {s}): max error {err.max():.3g}")
        assert np.abs(ref[0]).max() > 0.1, "nothing was written"
    assert np.abs(logits - ref_logits).max() < 0.05 * np.abs(ref_logits).max()


@pytest.mark.parametrize("dtype", [E4M3, E5M2])
def test_pallas_kernels_read_fp8_pages_in_interpret_mode(dtype):
    """Ragged and split-KV decode kernels (TPU formulation, Pallas' generic interpreter) on fp8
    pages against the reference on the same pages."""
    from pallas_kernels import reference
    from pallas_kernels.paged_attention import paged_attention
    from pallas_kernels.ragged_paged_attention import ragged_paged_attention
    from test_kernels import (MAX_SEQS, NUM_TOKENS, decode_lens, make_inputs,
                              ragged_batch)

    rng = np.random.default_rng(5)
    kw = dict(sm_scale=16 ** -0.5)
    q_lens, kv_lens, cu_q_lens, num_seqs = ragged_batch(rng, 8)
    q, k, v, layer, kv, table = make_inputs(rng, q_lens, kv_lens, 2, 8, 16, jnp.float32,
                                            NUM_TOKENS)
    k, v = k.astype(dtype), v.astype(dtype)
    args = (q, k, v, layer, kv, table, cu_q_lens, num_seqs)
    out = ragged_paged_attention(*args, interpret=True, **kw)
    ref = reference.ragged_paged_attention(*args, **kw)
    live = np.arange(NUM_TOKENS) < sum(q_lens)
    np.testing.assert_allclose(np.asarray(out)[live], np.asarray(ref)[live], atol=2e-5,
                               rtol=1e-5, err_msg=f"ragged kernel on {dtype} pages")
    lens = jnp.asarray(decode_lens(rng, 8), jnp.int32)
    q, k2, v2, layer, _, table = make_inputs(rng, [1] * MAX_SEQS, list(np.asarray(lens)), 2, 8,
                                             16, jnp.float32, MAX_SEQS)
    k2, v2 = k2.astype(dtype), v2.astype(dtype)
    out = paged_attention(q, k2, v2, layer, lens, table, interpret=True, num_kv_splits=2, **kw)
    ref = reference.paged_attention(q, k2, v2, layer, lens, table, **kw)
    live = np.asarray(lens) > 0
    np.testing.assert_allclose(np.asarray(out)[live], np.asarray(ref)[live], atol=2e-5,
                               rtol=1e-5, err_msg=f"decode kernel on {dtype} pages")


def test_checkpoint_kv_scales_are_read_and_survive_conversion(tmp_path):
    """vLLM's names (self_attn.k_scale / v_scale, the older kv_scale) in a Hugging Face
    directory become LoadedModel.kv_scales (1.0 for a layer without them), an Orbax
    conversion keeps them, and the model's variable holds them."""
    from safetensors.numpy import load_file, save_file

    from jaxserve.model.loaders.checkpoint import load_checkpoint, save_checkpoint
    from jaxserve.model.loaders.gguf_loader import load_gguf
    from jaxserve.model.decoder.decoder import Llama
    from jaxserve.model.loaders.safetensors_loader import load_hf_directory, save_hf_directory
    from model_fixtures import random_model, write_gguf

    config, params = random_model(seed=1, num_layers=3)
    gguf = load_gguf(write_gguf(tmp_path / "m.gguf", config, params), progress=False)
    assert gguf.kv_scales is None  # a GGUF has none: 1.0
    source = tmp_path / "hf"
    save_hf_directory(source, gguf.config, gguf.params, gguf.tokenizer)
    tensors = load_file(str(source / "model.safetensors"))
    tensors["model.layers.0.self_attn.k_scale"] = np.array(0.5, np.float32)
    tensors["model.layers.0.self_attn.v_scale"] = np.array(2.0, np.float32)
    tensors["model.layers.2.self_attn.kv_scale"] = np.array([3.0], np.float32)
    tensors["model.layers.2.self_attn.q_scale"] = np.array(7.0, np.float32)  # not KV: ignored
    save_file(tensors, str(source / "model.safetensors"), metadata={"format": "pt"})
    want = np.array([[0.5, 1.0, 3.0], [2.0, 1.0, 3.0]], np.float32)
    loaded = load_hf_directory(source, progress=False)
    np.testing.assert_array_equal(loaded.kv_scales, want)
    save_checkpoint(tmp_path / "ckpt", loaded)
    assert json.loads((tmp_path / "ckpt" / "jaxserve_checkpoint.json").read_text())[
        "kv_scales"] == want.tolist()
    restored = load_checkpoint(tmp_path / "ckpt")
    np.testing.assert_array_equal(restored.kv_scales, want)
    model = Llama(restored.config, restored.params, jnp.float32, "scan",
                  kv_scales=restored.kv_scales)
    np.testing.assert_array_equal(np.asarray(model.kv_scales[...]), want)


# An fp8 pool of the small engine's 48 pages: 2 layers x 2 KV heads x 16 dims x (K, V) = 128
# bytes a token at one byte an element.
FP8_POOL_BYTES = 48 * 16 * 128


@pytest.fixture(scope="module")
def fp8_llms():
    """{preemption mode: an engine with fp8 pages sized from FP8_POOL_BYTES}."""
    return {mode: make_llm(kv_cache_dtype="fp8", num_pages=None,
                           kv_cache_memory=FP8_POOL_BYTES, preemption_mode=mode)
            for mode in ("recompute", "swap")}


def test_fp8_pages_are_twice_bfloat16s_and_four_times_float32s_for_the_same_bytes(fp8_llms):
    llm = fp8_llms["recompute"]
    assert llm.engine.runner.kv[0].dtype == E4M3
    assert llm.engine.info.num_pages == 48
    bf16 = make_llm(kv_cache_dtype="bfloat16", num_pages=None, kv_cache_memory=FP8_POOL_BYTES)
    assert bf16.engine.runner.kv[0].dtype == jnp.bfloat16
    assert llm.engine.info.num_pages == 2 * bf16.engine.info.num_pages, (
        llm.engine.info.num_pages, bf16.engine.info.num_pages)
    out = bf16.generate([[5, 6, 7]], SamplingParams(max_tokens=4, temperature=0.0),
                        use_tqdm=False)  # bfloat16 pages under a float32 model also serve
    assert len(out[0].outputs[0].token_ids) == 4
    config = EngineConfig.from_kwargs(kv_cache_dtype="auto").validate()
    assert config.cache.kv_cache_dtype == "auto"  # float32 on the CPU: a quarter of fp8's
    assert kv_quant.resolve("auto", jnp.float32).itemsize == 4 * E4M3.itemsize


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_fp8_busy_batch_with_preemption_matches_requests_run_alone(mode, fp8_llms):
    llm = fp8_llms[mode]
    prompts, params = mixed_requests(n=16, seed=5, max_prompt=200, max_out=120)
    alone = [llm.generate([p], sp, use_tqdm=False)[0].token_ids
             for p, sp in zip(prompts, params)]
    with CompileCounter() as compiles:
        outs = llm.generate(prompts, params, use_tqdm=False)
    sched = llm.engine.scheduler
    assert sched.num_preemptions > 0, "the page pool was meant to force preemption"
    if mode == "swap":
        assert sched.num_swaps > 0, "swap mode never swapped"
    mismatched = [i for i, (o, ref) in enumerate(zip(outs, alone)) if o.token_ids != ref]
    assert not mismatched, f"{len(mismatched)} requests differ from their solo run: {mismatched}"
    assert compiles.count == 0, "serving compiled something after warm-up"
    assert_idle_and_no_leak(llm)


def test_fp8_prefix_cache_hit_gives_the_tokens_of_a_fresh_prefill(fp8_llms):
    """A prompt whose prefix pages are cached (fp8 pages shared by reference) continues as the
    same prompt run on an engine without a prefix cache would."""
    llm = fp8_llms["recompute"]
    rng = np.random.default_rng(8)
    prefix = rng.integers(3, 128, 64).tolist()
    prompts = [prefix + rng.integers(3, 128, 6).tolist() for _ in range(3)]
    greedy = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    llm.generate([prefix + [9]], greedy, use_tqdm=False)
    hits_before = llm.engine.pages.stats().prefix_hit_tokens
    cached = [o.token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
    assert llm.engine.pages.stats().prefix_hit_tokens > hits_before, "no prefix cache hit"
    fresh = make_llm(kv_cache_dtype="fp8", enable_prefix_caching=False)
    assert fresh.engine.runner.kv[0].dtype == E4M3
    again = [o.token_ids for o in fresh.generate(prompts, greedy, use_tqdm=False)]
    assert cached == again


@pytest.mark.parametrize("platform,backend", [("tpu", "tpu"), ("cuda", "gpu")])
def test_compiled_kernels_on_fp8_pages_lower_for_device(platform, backend, monkeypatch):
    """The ragged and decode kernels on fp8 pages go through Mosaic's lowering for each
    device (the GPU kernel widens each fp8 tile to bfloat16 in shared memory for WGMMA)."""
    import jax

    from pallas_kernels import tuning
    from pallas_kernels.paged_attention import paged_attention
    from pallas_kernels.ragged_paged_attention import ragged_paged_attention
    from test_kernels import realistic_specs

    monkeypatch.setattr(tuning, "backend", lambda: backend)
    sds = jax.ShapeDtypeStruct
    for dtype in (E4M3, E5M2):
        def fp8(specs):
            return [sds(s.shape, dtype) if i in (1, 2) else s for i, s in enumerate(specs)]
        ragged = jax.jit(lambda *a: ragged_paged_attention(*a, sm_scale=0.1, soft_cap=30.0))
        decode = jax.jit(lambda *a: paged_attention(*a, sm_scale=0.1, num_kv_splits=4))
        ragged_args = fp8(realistic_specs(16, 256)) + [sds((17,), jnp.int32),
                                                      sds((), jnp.int32)]
        for name, fn, args in (("ragged", ragged, ragged_args),
                               ("decode", decode, fp8(realistic_specs(16, 16)))):
            text = fn.trace(*args).lower(lowering_platforms=(platform,)).as_text()
            call = "tpu_custom_call" if platform == "tpu" else "mosaic_gpu"
            assert f"custom_call @{call}" in text, f"{name} on {dtype.name}: no {call} kernel"


def test_gpu_kernel_reads_fp8_pages_in_the_gpu_simulator():
    from pallas_kernels import reference
    from pallas_kernels.ragged_paged_attention import ragged_paged_attention
    from test_kernels import (NUM_TOKENS, gpu_interpret_params, make_inputs, ragged_batch,
                              run_or_skip_on_jax_limitation)

    params = gpu_interpret_params()
    rng = np.random.default_rng(3)
    q_lens, kv_lens, cu_q_lens, num_seqs = ragged_batch(rng, 16)
    q, k, v, layer, kv, table = make_inputs(rng, q_lens, kv_lens, 4, 16, 128, jnp.bfloat16,
                                            NUM_TOKENS)
    args = (jnp.nan_to_num(q), k.astype(E4M3), v.astype(E4M3), layer, kv, table, cu_q_lens,
            num_seqs)

    def check():
        out = ragged_paged_attention(*args, sm_scale=128 ** -0.5, interpret=params)
        ref = reference.ragged_paged_attention(*args, sm_scale=128 ** -0.5)
        live = np.arange(NUM_TOKENS) < sum(q_lens)
        out, ref = (np.asarray(x, np.float32)[live] for x in (out, ref))
        err = np.abs(out - ref).max() / np.abs(ref).max()
        assert err < 2e-2, f"GPU kernel on fp8 pages: relative error {err:.2e} (bf16 WGMMA)"

    run_or_skip_on_jax_limitation(check)
