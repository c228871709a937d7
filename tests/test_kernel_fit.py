"""model/device/kernel_fit.py against the Hopper kernel itself: the formula's verdict for each call
(ragged; decode with N KV splits) must be what lowering the Mosaic GPU kernel for `cuda` on this
CPU does (succeeds vs raises), and where JAX's artificial shared-memory limit is available, the
formula's bytes must be the lowering's to the byte. Lowering is abstract (ShapeDtypeStructs, no
compile): the final PTX compile and a real H100 run are not checked here.

The lowering runs on a representative subset (each head_dim x KV dtype x stats mode, KV heads
and split counts varied across it); the formula's own invariants run on the whole grid
(head_dim 64/96/128/256, KV heads 1/2/4/8, bf16/fp8 KV, splits 1..16, sinks on/off).
"""

from __future__ import annotations

import contextlib
import itertools
import re

import jax
import jax.numpy as jnp
import pytest

from jaxserve.model.device import kernel_fit
from jaxserve.model.device.kernel_fit import KernelShape
from pallas_kernels import tuning
from pallas_kernels.paged_attention import paged_attention
from pallas_kernels.ragged_paged_attention import ragged_paged_attention

HEAD_DIMS, KV_HEADS, KV_DTYPES = (64, 96, 128, 256), (1, 2, 4, 8), ("bfloat16", "float8_e4m3fn")
GROUP, NUM_SEQS, PAGES_PER_SEQ = 2, 4, 8


def lower(shape: KernelShape, call: str, num_splits: int = 1, smem_limit: int | None = None):
    """Lower one kernel call for cuda; returns None, or the error's text."""
    sds = jax.ShapeDtypeStruct
    cache = sds((2, 64, shape.page_size, shape.num_kv_heads, shape.head_dim),
                jnp.dtype(shape.kv_dtype))
    num_heads = shape.group * shape.num_kv_heads
    num_tokens = 16 if call == "ragged" else NUM_SEQS
    args = [sds((num_tokens, num_heads, shape.head_dim), jnp.dtype(shape.q_dtype)), cache, cache,
            sds((), jnp.int32), sds((NUM_SEQS,), jnp.int32),
            sds((NUM_SEQS, PAGES_PER_SEQ), jnp.int32)]
    window = 32 if shape.sliding_window else None
    if call == "ragged":
        args += [sds((NUM_SEQS + 1,), jnp.int32), sds((), jnp.int32)]
        fn = lambda *a, sinks=None: ragged_paged_attention(*a, sm_scale=0.1, sinks=sinks,
                                                           sliding_window=window)
    else:
        fn = lambda *a, sinks=None: paged_attention(*a, sm_scale=0.1, sinks=sinks,
                                                    sliding_window=window,
                                                    num_kv_splits=num_splits)
    if shape.sinks:
        args.append(sds((num_heads,), jnp.float32))
        fn = (lambda f: lambda *a: f(*a[:-1], sinks=a[-1]))(fn)
    limit = _smem_limit(smem_limit)
    try:
        with limit:
            jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))
    except (ValueError, AssertionError) as e:  # the tiling transform's shape check asserts
        return str(e) or type(e).__name__
    return None


def _smem_limit(limit):
    if limit is None:
        return contextlib.nullcontext()
    from jax.experimental.mosaic.gpu import core as mgpu_core
    return mgpu_core.artificial_shared_memory_limit(limit)


def has_artificial_limit() -> bool:
    try:
        from jax.experimental.mosaic.gpu import core as mgpu_core
    except ImportError:
        return False
    return hasattr(mgpu_core, "artificial_shared_memory_limit")


@pytest.fixture(autouse=True)
def lower_for_gpu(monkeypatch):
    monkeypatch.setattr(tuning, "backend", lambda: "gpu")


def subset():
    """Each head_dim x KV dtype x (ragged, ragged + sinks, decode unsplit, decode split,
    decode + sinks), KV heads and split counts cycling through their ranges."""
    heads, splits = itertools.cycle(KV_HEADS), itertools.cycle((2, 5, 16, 3))
    for d, kv in itertools.product(HEAD_DIMS, KV_DTYPES):
        for call, num_splits, sinks in (("ragged", 1, False), ("ragged", 1, True),
                                        ("decode", 1, False), ("decode", next(splits), False),
                                        ("decode", 1, True)):
            yield KernelShape(d, GROUP, next(heads), "bfloat16", kv, 16, sinks=sinks), \
                call, num_splits


SUBSET = list(subset())


def fit_of(shape, call, num_splits):
    return (kernel_fit.ragged_fit(shape) if call == "ragged"
            else kernel_fit.decode_fit(shape, num_splits))


@pytest.mark.parametrize("shape,call,num_splits", SUBSET,
                         ids=[f"d{s.head_dim}-{s.kv_dtype}-hkv{s.num_kv_heads}-{c}{k}"
                              f"{'-sinks' if s.sinks else ''}" for s, c, k in SUBSET])
def test_formula_verdict_is_the_lowerings(shape, call, num_splits):
    fit = fit_of(shape, call, num_splits)
    error = lower(shape, call, num_splits)
    assert fit.fits == (error is None), \
        f"kernel_fit says fits={fit.fits} ({fit.reason}) but lowering gave: {error or 'success'}"


@pytest.mark.skipif(not has_artificial_limit(), reason="this JAX has no artificial smem limit")
@pytest.mark.parametrize("d,kv,with_stats", [
    (d, kv, stats) for d in (64, 128, 256) for kv in KV_DTYPES for stats in (False, True)
    if not (kv.startswith("float8") and d % 128)])
def test_formula_bytes_are_the_lowerings(d, kv, with_stats):
    """Under a 1-byte limit every lowering reports its exact shared memory."""
    shape = KernelShape(d, GROUP, 2, "bfloat16", kv, 16)
    error = lower(shape, "decode", 2 if with_stats else 1, smem_limit=1)
    got = re.search(r"smem_bytes=(\d+)", error or "")
    assert got, f"no shared-memory figure in the lowering's error: {error}"
    expected = kernel_fit.hopper_smem_bytes(shape, with_stats)
    assert int(got.group(1)) == expected, f"lowering needs {got.group(1)} bytes, formula {expected}"


@pytest.mark.parametrize("page_size,q_dtype,kv_dtype", [
    (24, "bfloat16", "bfloat16"),   # 2 pages = 48-position tiles
    (8, "bfloat16", "bfloat16"),
    (16, "float32", "float32"),
    (16, "bfloat16", "float32")])
def test_formula_verdict_on_page_sizes_and_dtypes_is_the_lowerings(page_size, q_dtype, kv_dtype):
    shape = KernelShape(128, GROUP, 2, q_dtype, kv_dtype, page_size)
    fit = kernel_fit.decode_fit(shape, 1)
    error = lower(shape, "decode")
    assert fit.fits == (error is None), \
        f"kernel_fit says fits={fit.fits} ({fit.reason}) but lowering gave: {error or 'success'}"


def test_gemma3_split_decode_exceeds_shared_memory_and_falls_back_to_one_split():
    shape = KernelShape(256, 2, 4, "bfloat16", "bfloat16", 16, sliding_window=True)
    assert not kernel_fit.decode_fit(shape, 4).fits
    assert "240680" in kernel_fit.decode_fit(shape, 4).reason, "the figure the lowering reports"
    choice = kernel_fit.hopper_fit(shape)
    assert (choice.impl, choice.max_kv_splits) == ("pallas", 1), choice.reason
    assert "shared memory" in choice.reason


def test_gemma3_with_fp8_pages_takes_the_xla_path():
    choice = kernel_fit.hopper_fit(KernelShape(256, 2, 4, "bfloat16", "float8_e4m3fn", 16))
    assert choice.impl == "xla", choice.reason


def test_phi3_head_dim_96_takes_the_xla_path_naming_the_limit():
    choice = kernel_fit.hopper_fit(KernelShape(96, 1, 32, "bfloat16", "bfloat16", 16))
    assert choice.impl == "xla" and "head_dim % 64" in choice.reason, choice.reason


def test_sinks_keep_the_stats_so_fewer_splits_do_not_help():
    shape = KernelShape(256, 2, 4, "bfloat16", "bfloat16", 16, sinks=True)
    assert kernel_fit.hopper_fit(shape).impl == "xla"


GRID = [KernelShape(d, GROUP, h, "bfloat16", kv, 16, sinks=s)
        for d, h, kv, s in itertools.product(HEAD_DIMS, KV_HEADS, KV_DTYPES, (False, True))]


@pytest.mark.parametrize("shape", GRID, ids=lambda s: f"d{s.head_dim}-hkv{s.num_kv_heads}-"
                                                      f"{s.kv_dtype}-{'sinks' if s.sinks else 'x'}")
def test_choice_takes_the_most_splits_that_fit_on_the_whole_grid(shape):
    choice = kernel_fit.hopper_fit(shape)
    fits = [k for k in range(1, 17) if kernel_fit.decode_fit(shape, k).fits]
    if choice.impl == "pallas":
        assert kernel_fit.ragged_fit(shape).fits, "pallas chosen with a ragged call that fails"
        assert choice.max_kv_splits == max(fits), f"{choice.max_kv_splits} splits, {fits} fit"
    else:
        assert not fits or not kernel_fit.ragged_fit(shape).fits, choice.reason
    assert choice.reason, "every choice carries its reason"
    assert (kernel_fit.decode_fit(shape, 16).smem_bytes or 0) >= \
        (kernel_fit.decode_fit(shape, 1).smem_bytes or 0), "splitting never needs less memory"
