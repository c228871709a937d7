"""pallas_kernels/xla_blocked.py (the XLA path for GPUs without a usable Pallas kernel) against
pallas_kernels/reference.py on the CPU, through its two calls and through the engine backend
(model/decoder/attention.py's XlaAttention); lowered for `cuda` at Gemma 3 and Phi-3 shapes; and the
ragged blocks of both blocked backends skipped by a lax.cond in steps of one-row requests.

Inputs come from tests/test_kernels.py (random, ragged, shuffled page tables, invisible slots
x30, NaN padding rows). Lowering checks are abstract: no GPU ran any of this.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import test_kernels as tk
from jaxserve.model.decoder.attention import AttentionShape, PallasAttention, XlaAttention
from jaxserve.model.decoder.step_inputs import AttentionMetadata
from pallas_kernels import reference, tuning, xla_blocked

HEAD_DIM = 32


def inputs(monkeypatch, num_kv_heads, q_lens, kv_lens, group, page_size, num_rows, seed,
           kv_dtype=jnp.float32):
    """test_kernels.make_inputs with num_kv_heads KV heads and pages stored as kv_dtype."""
    monkeypatch.setattr(tk, "NUM_KV_HEADS", num_kv_heads)
    rng = np.random.default_rng(seed)
    q, k, v, layer, kv, table = tk.make_inputs(rng, q_lens, kv_lens, group, page_size, HEAD_DIM,
                                               jnp.float32, num_rows)
    sinks = jnp.asarray(rng.normal(size=q.shape[1]) * 2, jnp.float32)
    return q, k.astype(kv_dtype), v.astype(kv_dtype), layer, kv, table, sinks


CASES = {  # name -> (KV heads, group, page size, pages' dtype, keywords)
    "mqa": (1, 8, 8, jnp.float32, {}),
    "gqa": (2, 4, 16, jnp.float32, {}),
    "window_soft_cap": (2, 3, 8, jnp.float32, {"sliding_window": 13, "soft_cap": 3.0}),
    "fp8": (2, 4, 16, jnp.float8_e4m3fn, {"sliding_window": 21}),
}


@pytest.mark.parametrize("with_sinks", [False, True], ids=["plain", "sinks"])
@pytest.mark.parametrize("case", list(CASES))
def test_ragged_mixed_batch_matches_reference(case, with_sinks, monkeypatch):
    num_kv_heads, group, page_size, kv_dtype, kw = CASES[case]
    q_lens, kv_lens, cu_q_lens, num_seqs = tk.ragged_batch(
        np.random.default_rng(len(case)), page_size)
    q, k, v, layer, kv, table, sinks = inputs(monkeypatch, num_kv_heads, q_lens, kv_lens, group,
                                              page_size, tk.NUM_TOKENS, 1, kv_dtype)
    kw = dict(kw, sm_scale=HEAD_DIM ** -0.5, sinks=sinks if with_sinks else None)
    args = (q, k, v, layer, kv, table, cu_q_lens, num_seqs)
    out = xla_blocked.ragged_paged_attention(*args, **kw)
    ref = reference.ragged_paged_attention(*args, **kw)
    tk.assert_close(out, ref, jnp.float32, np.arange(tk.NUM_TOKENS) < sum(q_lens),
                    f"{case} ragged q_lens={q_lens} kv_lens={kv_lens}")


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("case", list(CASES))
def test_split_decode_matches_reference(case, num_splits, monkeypatch):
    num_kv_heads, group, page_size, kv_dtype, kw = CASES[case]
    kv_lens = tk.decode_lens(np.random.default_rng(num_splits), page_size)
    q, k, v, layer, kv, table, sinks = inputs(monkeypatch, num_kv_heads, [1] * tk.MAX_SEQS,
                                              kv_lens, group, page_size, tk.MAX_SEQS, 2,
                                              kv_dtype)
    q = jnp.where((kv == 0)[:, None, None], jnp.nan, q)   # an unused slot's q is junk
    kw = dict(kw, sm_scale=HEAD_DIM ** -0.5, sinks=sinks if num_splits == 3 else None)
    out = xla_blocked.paged_attention(q, k, v, layer, kv, table, num_kv_splits=num_splits,
                                      tile_pages=1, **kw)
    ref = reference.paged_attention(q, k, v, layer, kv, table, **kw)
    tk.assert_close(out, ref, jnp.float32, np.asarray(kv_lens) > 0,
                    f"{case} decode splits={num_splits} kv_lens={kv_lens}")


def engine_batch(monkeypatch, decode_only: bool, window=None):
    """Metadata and inputs of one engine step: two decode requests first, then (unless
    decode_only) a 3-row verification chunk, a prefill chunk and a fresh page-sized prefill."""
    group, page_size = 4, 16
    rng = np.random.default_rng(5)
    max_len = tk.PAGES_PER_SEQ * page_size
    q_lens = [1, 1] if decode_only else [1, 1, 3, 9, page_size]
    kv_lens = [int(rng.integers(2, max_len + 1)), 1, int(rng.integers(3, max_len + 1)),
               int(rng.integers(9, max_len + 1)), page_size, int(rng.integers(2, max_len))]
    num_seqs = len(q_lens)
    cu = np.concatenate([[0], np.cumsum(q_lens + [2] * (tk.MAX_SEQS - num_seqs))])
    q, k, v, layer, kv, table, sinks = inputs(monkeypatch, tk.NUM_KV_HEADS, q_lens, kv_lens,
                                              group, page_size, tk.NUM_TOKENS, 6)
    metadata = AttentionMetadata(jnp.asarray(cu, jnp.int32), kv, table, jnp.int32(num_seqs),
                                 jnp.int32(2))
    shape = AttentionShape(group, tk.NUM_KV_HEADS, page_size, (None, window))
    return shape, metadata, (q, k, v, layer), sinks, q_lens


@pytest.mark.parametrize("decode_only", [False, True], ids=["mixed", "decode_only"])
def test_engine_xla_backend_matches_reference(decode_only, monkeypatch):
    shape, md, (q, k, v, layer), sinks, q_lens = engine_batch(monkeypatch, decode_only, 13)
    backend = XlaAttention(shape)
    kw = dict(sm_scale=HEAD_DIM ** -0.5, sliding_window=13, sinks=sinks)
    out = backend(q, k, v, layer, backend.prepare(md, tk.NUM_TOKENS), **kw)
    ref = reference.ragged_paged_attention(q, k, v, layer, md.kv_lens, md.page_table,
                                           md.cu_q_lens, md.num_seqs, **kw)
    tk.assert_close(out, ref, jnp.float32, np.arange(tk.NUM_TOKENS) < sum(q_lens),
                    f"XlaAttention q_lens={q_lens}")


def test_engine_pallas_backend_on_a_decode_only_batch_matches_reference(monkeypatch):
    shape, md, (q, k, v, layer), _, q_lens = engine_batch(monkeypatch, True)
    backend = PallasAttention(shape, interpret=True)
    kw = dict(sm_scale=HEAD_DIM ** -0.5)
    step = tk.compile_once(lambda *a: backend(*a, backend.prepare(md, tk.NUM_TOKENS), **kw),
                           q, k, v, layer)
    ref = reference.ragged_paged_attention(q, k, v, layer, md.kv_lens, md.page_table,
                                           md.cu_q_lens, md.num_seqs, **kw)
    tk.assert_close(step(q, k, v, layer), ref, jnp.float32,
                    np.arange(tk.NUM_TOKENS) < sum(q_lens), "PallasAttention decode-only")


def lowered_step(backend, num_tokens, num_seqs, pages_per_seq, cache_shape, num_heads, kv_dtype,
                 window=None):
    sds = jax.ShapeDtypeStruct

    def step(q, k, v, layer, cu, kv, table, n, nd):
        prepared = backend.prepare(AttentionMetadata(cu, kv, table, n, nd), num_tokens)
        return backend(q, k, v, layer, prepared, sm_scale=0.1, sliding_window=window)

    cache = sds(cache_shape, kv_dtype)
    args = (sds((num_tokens, num_heads, cache_shape[-1]), jnp.bfloat16), cache, cache,
            sds((), jnp.int32), sds((num_seqs + 1,), jnp.int32), sds((num_seqs,), jnp.int32),
            sds((num_seqs, pages_per_seq), jnp.int32), sds((), jnp.int32), sds((), jnp.int32))
    return jax.jit(step).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize("model,num_heads,num_kv_heads,head_dim,window,kv_dtype", [
    ("gemma3", 8, 4, 256, 512, jnp.bfloat16),
    ("gemma3-fp8", 8, 4, 256, 512, jnp.float8_e4m3fn),
    ("phi3", 32, 32, 96, None, jnp.bfloat16)])
def test_xla_backend_lowers_for_cuda_at_model_shapes(model, num_heads, num_kv_heads, head_dim,
                                                     window, kv_dtype):
    shape = AttentionShape(num_heads // num_kv_heads, num_kv_heads, 16, (None, window))
    text = lowered_step(XlaAttention(shape), 64, 8, 32, (2, 128, 16, num_kv_heads, head_dim),
                        num_heads, kv_dtype, window)
    assert "stablehlo.while" in text, f"{model}: no tile loop in the cuda lowering"
    assert "mosaic_gpu" not in text, f"{model}: the XLA path lowered a Pallas kernel"


@pytest.mark.parametrize("backend_cls", [PallasAttention, XlaAttention])
def test_ragged_call_sits_under_a_cond_on_multi_row_requests(backend_cls, monkeypatch):
    monkeypatch.setattr(tuning, "backend", lambda: "gpu")
    backend = backend_cls(AttentionShape(2, 2, 16))
    text = lowered_step(backend, 8, 4, 8, (2, 64, 16, 2, 128), 4, jnp.bfloat16)
    calls = re.findall(r"func\.call @ragged_attend\b", text)
    assert len(calls) == 1, f"{backend_cls.__name__}: {len(calls)} ragged calls, expected one"
    assert re.search(r'"stablehlo\.case".*?func\.call @ragged_attend\b', text, re.S), \
        f"{backend_cls.__name__}: the ragged call is not inside a lax.cond branch"


def test_xla_backend_splits_decode_by_tunings_xla_row():
    shape = AttentionShape(4, 2, 16)
    _, decode, splits = XlaAttention(shape)._configs((1, 64), None)
    sizes = tuning.block_sizes("xla")
    assert decode.tile == sizes.kv_tile_tokens, "XLA tiles follow the xla row"
    assert splits == tuning.num_kv_splits(2, 1, 64 * 16 // decode.tile, sizes) > 1, \
        f"one long request should split its context, got {splits} split(s)"


def test_pallas_backend_caps_decode_splits_at_the_fits_maximum(monkeypatch):
    monkeypatch.setattr(tuning, "backend", lambda: "gpu")
    capped = PallasAttention(AttentionShape(2, 4, 16), max_kv_splits=1)._configs((1, 64), None)
    free = PallasAttention(AttentionShape(2, 4, 16))._configs((1, 64), None)
    assert (capped[2], capped[1].with_stats) == (1, False), "one split has no float32 stats"
    assert free[2] > 1, "uncapped, one long request splits"


def test_an_engine_on_the_xla_impl_gives_the_reference_greedy_tokens(small_llm):
    from conftest import make_llm
    from jaxserve import SamplingParams
    rng = np.random.default_rng(3)
    prompts = [[int(t) for t in rng.integers(1, 128, n)] for n in (3, 17, 40, 9)]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    want = [o.token_ids for o in small_llm.generate(prompts, params, use_tqdm=False)]
    xla = make_llm(attention_impl="xla", token_buckets=(32,), seq_buckets=(16,))
    got = [o.token_ids for o in xla.generate(prompts, params, use_tqdm=False)]
    assert got == want, "the xla impl's greedy tokens differ from the reference's"
