"""Pallas paged-attention kernels against the jnp reference, in interpret mode on the CPU.

Every case draws fresh random inputs (never zeros): ragged lengths including 1 and exact page
multiples, prefill chunks after earlier context, speculative-style short chunks, dead request
slots and padding rows, shuffled non-contiguous page tables whose unused entries name other
requests' pages, and a cache whose slots no request may see are scaled ×30 so a masking leak
is loud. Padding query rows are NaN: they must never reach a real row.

Poisoning: an output row the kernel forgets to write must not pass by luck. All three
interpreters fill every output and scratch buffer with NaN before the kernel runs (Pallas'
generic interpreter always does; the TPU and GPU simulators are given
uninitialized_memory="nan"), and test_interpreters_poison_unwritten_outputs proves that premise
on this JAX, so an unwritten block shows up as NaN, which every check rejects.

Formulations: interpret=True runs the TPU formulation in the generic interpreter (what the
engine's `pallas-interpret` uses), pltpu.InterpretParams in the TPU simulator, and Mosaic GPU's
InterpretGPUParams (a private JAX class) in the GPU simulator. Compiled lowerings are checked
by lowering for "tpu" and "cuda" on this CPU (Pallas -> Mosaic MLIR; the final Mosaic/PTX
compile needs the device). Shapes stay tiny and lengths are data, so each case compiles once.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels import reference, tuning
from pallas_kernels.paged_attention import paged_attention
from pallas_kernels.ragged_paged_attention import ragged_paged_attention

NUM_LAYERS, NUM_KV_HEADS, MAX_SEQS, PAGES_PER_SEQ, NUM_TOKENS = 2, 2, 6, 6, 32
TOLERANCE = {jnp.float32: 1e-5, jnp.bfloat16: 2e-2}


def gpu_interpret_params(skip_if_missing: bool = True):
    try:
        from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams
    except ImportError as e:
        if skip_if_missing:
            pytest.skip(f"Mosaic GPU interpret mode unavailable: {e}")
        return None
    return InterpretGPUParams(uninitialized_memory="nan")


def make_inputs(rng, q_lens, kv_lens, group, page_size, head_dim, dtype, num_rows,
                num_kv_heads=NUM_KV_HEADS, kv_dtype=None):
    """Random q and cache plus a shuffled page table; slots nobody may see are scaled ×30.
    The cache takes kv_dtype (default: dtype)."""
    num_pages = MAX_SEQS * PAGES_PER_SEQ + 1
    shape = (NUM_LAYERS, num_pages, page_size, num_kv_heads, head_dim)
    k, v = (rng.normal(size=shape).astype(np.float32) for _ in range(2))
    page_table = rng.permutation(np.arange(1, num_pages)).reshape(MAX_SEQS, PAGES_PER_SEQ)
    visible = np.zeros((num_pages, page_size), bool)
    for s, kv_len in enumerate(kv_lens):
        visible.reshape(-1)[(page_table[s][:, None] * page_size + np.arange(page_size))
                            .reshape(-1)[:kv_len]] = True
    k[:, ~visible] *= 30
    v[:, ~visible] *= 30
    q = rng.normal(size=(num_rows, group * num_kv_heads, head_dim)).astype(np.float32)
    q[sum(q_lens):] = np.nan
    kv_dtype = kv_dtype or dtype
    return (jnp.asarray(q, dtype), jnp.asarray(k, kv_dtype), jnp.asarray(v, kv_dtype),
            jnp.int32(rng.integers(NUM_LAYERS)), jnp.asarray(kv_lens, jnp.int32),
            jnp.asarray(page_table, jnp.int32))


def ragged_batch(rng, page_size):
    """Five live requests (in random order) and one dead slot: two decode rows, one with a
    single token of context, a 3-row verification chunk, a prefill chunk after earlier
    context, and a fresh prefill of an exact page multiple; then padding rows."""
    max_len = PAGES_PER_SEQ * page_size
    chunk = int(rng.integers(4, 12))
    q_lens = [1, 1, 3, chunk, page_size]
    kv_lens = [1, int(rng.integers(2, max_len + 1)), int(rng.integers(3, max_len + 1)),
               int(rng.integers(chunk, max_len + 1)), page_size]
    order = rng.permutation(5)
    q_lens = [q_lens[i] for i in order] + [2]
    kv_lens = [kv_lens[i] for i in order] + [int(rng.integers(2, max_len + 1))]
    cu_q_lens = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    return q_lens[:5], kv_lens, jnp.asarray(cu_q_lens), jnp.int32(5)


def decode_lens(rng, page_size):
    """Unused slot (0), 1, an exact page multiple, a full table, and two random contexts."""
    max_len = PAGES_PER_SEQ * page_size
    lens = [0, 1, 2 * page_size, max_len] + list(rng.integers(2, max_len, size=2))
    return [int(x) for x in rng.permutation(lens)]


def assert_close(out, ref, dtype, live_rows, what):
    out, ref = np.asarray(out, np.float32), np.asarray(ref, np.float32)
    assert not np.isnan(out).any(), f"{what}: NaN in output (unwritten or leaked row)"
    assert not np.any(out[~live_rows]), f"{what}: padding rows are not zero"
    err = np.abs(out - ref).max() / np.abs(ref).max()
    assert err <= TOLERANCE[dtype], f"{what}: relative error {err:.2e} > {TOLERANCE[dtype]}"


def compile_once(fn, *args):
    """One executable for these shapes, compiled with few LLVM passes (compile time dominates
    these tests). Every draw reuses it: new lengths, page tables and layer are data."""
    return jax.jit(fn).trace(*args).lower().compile({"xla_backend_optimization_level": 0})


def check_ragged(interpret, group, page_size, dtype, head_dim=32, num_draws=2,
                 num_kv_heads=NUM_KV_HEADS, kv_dtype=None, **kw):
    rng = np.random.default_rng([group, page_size, head_dim])
    kw["sm_scale"] = head_dim ** -0.5
    for draw in range(num_draws):
        q_lens, kv_lens, cu_q_lens, num_seqs = ragged_batch(rng, page_size)
        q, k, v, layer, kv, table = make_inputs(rng, q_lens, kv_lens, group, page_size,
                                                head_dim, dtype, NUM_TOKENS, num_kv_heads,
                                                kv_dtype)
        args = (q, k, v, layer, kv, table, cu_q_lens, num_seqs)
        if draw == 0:
            ref_fn = compile_once(functools.partial(reference.ragged_paged_attention, **kw),
                                  *args)
            kernel = compile_once(functools.partial(ragged_paged_attention,
                                                    interpret=interpret, **kw), *args)
        live = np.arange(NUM_TOKENS) < sum(q_lens)
        assert_close(kernel(*args), ref_fn(*args), dtype, live,
                     f"ragged draw {draw} q_lens={q_lens} kv_lens={kv_lens}")


def check_decode(interpret, group, page_size, dtype, num_kv_splits, head_dim=32,
                 num_kv_heads=NUM_KV_HEADS, kv_dtype=None, **kw):
    rng = np.random.default_rng([group, page_size, num_kv_splits, 7])
    kw["sm_scale"] = head_dim ** -0.5
    for draw in range(2):
        kv_lens = decode_lens(rng, page_size)
        q, k, v, layer, kv, table = make_inputs(rng, [1] * MAX_SEQS, kv_lens, group,
                                                page_size, head_dim, dtype, MAX_SEQS,
                                                num_kv_heads, kv_dtype)
        q = jnp.where((kv == 0)[:, None, None], jnp.nan, q)   # an unused slot's q is junk
        args = (q, k, v, layer, kv, table)
        if draw == 0:
            ref_fn = compile_once(functools.partial(reference.paged_attention, **kw), *args)
            kernel = compile_once(functools.partial(paged_attention, interpret=interpret,
                                                    num_kv_splits=num_kv_splits, **kw), *args)
        assert_close(kernel(*args), ref_fn(*args), dtype, np.asarray(kv_lens) > 0,
                     f"decode draw {draw} kv_lens={kv_lens}")


@pytest.mark.parametrize("group,page_size,dtype", [
    (1, 8, jnp.float32), (3, 16, jnp.float32), (8, 16, jnp.bfloat16)])
def test_ragged_matches_reference(group, page_size, dtype):
    check_ragged(True, group, page_size, dtype)


def test_ragged_soft_cap_and_sliding_window_match_reference():
    check_ragged(True, 4, 16, jnp.float32, soft_cap=3.0, sliding_window=13)


@pytest.mark.parametrize("num_rows,q_lens", [(1, [1]), (4, [1, 1, 1])])
def test_ragged_in_the_smallest_token_buckets_matches_reference(num_rows, q_lens):
    """The default buckets start at T=1 and T=4: decode rows alone, then a padding row."""
    rng = np.random.default_rng([num_rows, 11])
    page_size, kw = 8, {"sm_scale": 32 ** -0.5}
    kv_lens = [int(x) for x in rng.integers(1, PAGES_PER_SEQ * page_size + 1, MAX_SEQS)]
    q, k, v, layer, kv, table = make_inputs(rng, q_lens, kv_lens, 3, page_size, 32,
                                            jnp.float32, num_rows)
    cu_q_lens = np.full(MAX_SEQS + 1, len(q_lens), np.int32)
    cu_q_lens[:len(q_lens) + 1] = np.arange(len(q_lens) + 1)
    args = (q, k, v, layer, kv, table, jnp.asarray(cu_q_lens), jnp.int32(len(q_lens)))
    ref = compile_once(functools.partial(reference.ragged_paged_attention, **kw), *args)
    kernel = compile_once(functools.partial(ragged_paged_attention, interpret=True, **kw), *args)
    assert_close(kernel(*args), ref(*args), jnp.float32, np.arange(num_rows) < len(q_lens),
                 f"T={num_rows} kv_lens={kv_lens[:len(q_lens)]}")


@pytest.mark.parametrize("group,page_size,dtype,splits", [
    (1, 16, jnp.float32, 1), (3, 8, jnp.float32, 3), (8, 16, jnp.bfloat16, 2)])
def test_decode_matches_reference(group, page_size, dtype, splits):
    check_decode(True, group, page_size, dtype, splits)


def test_decode_split_kv_with_soft_cap_and_sliding_window_matches_reference():
    check_decode(True, 4, 8, jnp.float32, 2, soft_cap=3.0, sliding_window=13)


@pytest.mark.parametrize("num_kv_heads,kv_dtype,dtype", [
    (1, jnp.float32, jnp.float32), (1, jnp.bfloat16, jnp.bfloat16),
    (1, jnp.float8_e4m3fn, jnp.float32), (4, jnp.float8_e5m2, jnp.float32),
    (4, jnp.bfloat16, jnp.bfloat16)])
def test_every_tpu_head_read_matches_reference(num_kv_heads, kv_dtype, dtype):
    """One KV head (f32: the buffer is the head; bf16 and 8-bit: widened first) and four (read
    as halves / bytes of 32-bit words), ragged and split-KV decode; the reference reads the
    same pages."""
    check_ragged(True, 2, 8, dtype, num_draws=1, num_kv_heads=num_kv_heads,
                 kv_dtype=kv_dtype)
    check_decode(True, 2, 8, dtype, 2, num_kv_heads=num_kv_heads, kv_dtype=kv_dtype)


def run_or_skip_on_jax_limitation(check):
    """Run a simulator check; a JAX NotImplementedError skips with its exact text."""
    try:
        check()
    except NotImplementedError as e:
        pytest.skip(f"JAX interpret-mode limitation: {e}")


def test_tpu_kernels_in_tpu_interpret_mode():
    params = pltpu.InterpretParams(uninitialized_memory="nan")
    run_or_skip_on_jax_limitation(lambda: (
        check_ragged(params, 4, 16, jnp.float32, num_draws=1, soft_cap=3.0,
                     sliding_window=13),
        check_decode(params, 3, 8, jnp.bfloat16, 2)))


def test_gpu_kernels_in_gpu_interpret_mode():
    params = gpu_interpret_params()
    run_or_skip_on_jax_limitation(lambda: (
        check_ragged(params, 4, 16, jnp.bfloat16, head_dim=64, num_draws=1, soft_cap=3.0,
                     sliding_window=40),
        check_decode(params, 8, 8, jnp.float32, 2, head_dim=64)))


def test_interpreters_poison_unwritten_outputs():
    def writes_nothing(x_ref, o_ref):
        del x_ref, o_ref

    x = jnp.ones((8, 128), jnp.float32)
    modes = [True, pltpu.InterpretParams(uninitialized_memory="nan"),
             gpu_interpret_params(skip_if_missing=False)]
    for interpret in filter(None, modes):
        out = pl.pallas_call(writes_nothing, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
                             interpret=interpret)(x)
        assert np.isnan(np.asarray(out)).all(), f"{interpret}: unwritten output is not NaN"


def realistic_specs(num_seqs, num_tokens):
    """Abstract bf16 inputs at serving sizes: 32 query heads, 8 KV heads, head_dim 128."""
    sds = jax.ShapeDtypeStruct
    cache = sds((2, 512, 16, 8, 128), jnp.bfloat16)
    return (sds((num_tokens, 32, 128), jnp.bfloat16), cache, cache, sds((), jnp.int32),
            sds((num_seqs,), jnp.int32), sds((num_seqs, 64), jnp.int32))


@pytest.mark.parametrize("platform,backend", [("tpu", "tpu"), ("cuda", "gpu")])
def test_compiled_kernels_lower_for_device(platform, backend, monkeypatch):
    monkeypatch.setattr(tuning, "backend", lambda: backend)
    ragged = jax.jit(lambda *a: ragged_paged_attention(
        *a, sm_scale=0.1, soft_cap=30.0, sliding_window=256))
    decode = jax.jit(lambda *a: paged_attention(*a, sm_scale=0.1))
    split_decode = jax.jit(lambda *a: paged_attention(*a, sm_scale=0.1, num_kv_splits=4))
    sds = jax.ShapeDtypeStruct
    ragged_args = realistic_specs(16, 256) + (sds((17,), jnp.int32), sds((), jnp.int32))
    for name, fn, args in (("ragged", ragged, ragged_args),
                           ("decode", decode, realistic_specs(16, 16)),
                           ("split decode", split_decode, realistic_specs(16, 16))):
        text = fn.trace(*args).lower(lowering_platforms=(platform,)).as_text()
        call = "tpu_custom_call" if platform == "tpu" else "mosaic_gpu"
        assert f"custom_call @{call}" in text, f"{name}: no {call} kernel in the {platform} HLO"


def test_compiled_gpu_kernel_refuses_float32(monkeypatch):
    monkeypatch.setattr(tuning, "backend", lambda: "gpu")
    specs = [jax.ShapeDtypeStruct(s.shape, jnp.float32 if s.dtype == jnp.bfloat16 else s.dtype)
             for s in realistic_specs(4, 4)]
    fn = jax.jit(lambda *a: paged_attention(*a, sm_scale=0.1))
    with pytest.raises(ValueError, match="bfloat16"):
        fn.trace(*specs).lower(lowering_platforms=("cuda",))


def test_kernels_refuse_cpu_without_interpret(monkeypatch):
    monkeypatch.setattr(tuning, "backend", lambda: "cpu")
    q, k, v, layer, kv, table = make_inputs(np.random.default_rng(0), [1] * MAX_SEQS,
                                            [1] * MAX_SEQS, 1, 8, 32, jnp.float32, MAX_SEQS)
    with pytest.raises(ValueError, match="interpret=True"):
        paged_attention(q, k, v, layer, kv, table, sm_scale=0.1)


@pytest.mark.parametrize("sliding_window", [None, 13])
def test_engine_backend_splits_decode_rows_to_the_decode_kernel_and_matches_reference(
        sliding_window):
    """The engine's Pallas backend (model/decoder/attention.py): metadata prepared once for the
    step,
    the leading one-row requests (num_decode_seqs) through the decode kernel, the rest through
    the ragged kernel, joined by row; a mixed batch must equal the reference."""
    from jaxserve.model.decoder.attention import AttentionShape, PallasAttention
    from jaxserve.model.decoder.step_inputs import AttentionMetadata

    group, page_size, head_dim = 4, 16, 32
    rng = np.random.default_rng(11)
    max_len = PAGES_PER_SEQ * page_size
    chunk = int(rng.integers(4, 12))
    q_lens = [1, 1, 3, chunk, page_size]  # two decode requests first, as the scheduler orders
    kv_lens = [int(rng.integers(2, max_len + 1)), 1, int(rng.integers(3, max_len + 1)),
               int(rng.integers(chunk, max_len + 1)), page_size, int(rng.integers(2, max_len))]
    cu_q_lens = jnp.asarray(np.concatenate([[0], np.cumsum(q_lens + [2])]).astype(np.int32))
    q, k, v, layer, kv, table = make_inputs(rng, q_lens, kv_lens, group, page_size, head_dim,
                                            jnp.float32, NUM_TOKENS)
    backend = PallasAttention(AttentionShape(group, NUM_KV_HEADS, page_size,
                                             (None, sliding_window)), interpret=True)
    metadata = AttentionMetadata(cu_q_lens, kv, table, jnp.int32(5), jnp.int32(2))
    kw = dict(sm_scale=head_dim ** -0.5, sliding_window=sliding_window)
    out = backend(q, k, v, layer, backend.prepare(metadata, NUM_TOKENS), **kw)
    ref = reference.ragged_paged_attention(q, k, v, layer, kv, table, cu_q_lens, jnp.int32(5),
                                           **kw)
    live = np.arange(NUM_TOKENS) < sum(q_lens)
    assert_close(out, ref, jnp.float32, live, f"split backend q_lens={q_lens} kv={kv_lens}")
