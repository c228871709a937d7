"""The XLA attention backend (model/decoder/attention.py ReferenceAttention: decode rows as one work
list, model/decoder/decode_attention.py; other rows through the reference) against the reference
(pallas_kernels/reference.py) on mixed batches: decode rows of different lengths, prefill
chunks, padding rows, sliding windows, soft caps, steps with fewer rows than requests, and a
model with more KV heads than the work list takes; with the decode rows through XLA's ops and
through jaxserve's CPU kernel (model/cpu/attention.py); and on fp8 pages (kv_cache_dtype fp8:
the kernel reads their bytes through a table), against the reference on the same pages."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from jaxserve.model.decoder import pytrees  # noqa: E402,F401  (the step inputs as pytrees)
from jaxserve.model.decoder.attention import AttentionShape, ReferenceAttention  # noqa: E402
from jaxserve.model.decoder.step_inputs import AttentionMetadata  # noqa: E402
from pallas_kernels import reference  # noqa: E402

PAGE_SIZE, PAGES, MAX_SEQS, LAYERS, HEAD_DIM = 4, 9, 6, 2, 8


def batch(rng, q_lens, kv_lens, num_kv_heads, num_tokens, group=2):
    num_pages = MAX_SEQS * PAGES + 1
    shape = (LAYERS, num_pages, PAGE_SIZE, num_kv_heads, HEAD_DIM)
    k, v = (jnp.asarray(rng.normal(size=shape), jnp.float32) for _ in range(2))
    table = rng.permutation(np.arange(1, num_pages)).reshape(MAX_SEQS, PAGES).astype(np.int32)
    q = jnp.asarray(rng.normal(size=(num_tokens, num_kv_heads * group, HEAD_DIM)), jnp.float32)
    lens = np.zeros(MAX_SEQS, np.int32)
    lens[:len(kv_lens)] = kv_lens
    cu = np.full(MAX_SEQS + 1, sum(q_lens), np.int32)
    cu[:len(q_lens) + 1] = np.concatenate([[0], np.cumsum(q_lens)])
    num_decode = next((i for i, n in enumerate(q_lens) if n != 1), len(q_lens))
    md = AttentionMetadata(jnp.asarray(cu), jnp.asarray(lens), jnp.asarray(table),
                           jnp.int32(len(q_lens)), jnp.int32(num_decode))
    return q, k, v, md


def run_both(q, k, v, md, shape, kernel=False, **kw):
    backend = ReferenceAttention(shape, cpu_kernel=kernel)
    num_tokens = q.shape[0]
    out = jax.jit(lambda q, k, v, md: backend(q, k, v, jnp.int32(1),
                                              backend.prepare(md, num_tokens), **kw))(q, k, v, md)
    ref = reference.ragged_paged_attention(q, k, v, jnp.int32(1), md.kv_lens, md.page_table,
                                           md.cu_q_lens, md.num_seqs, **kw)
    return np.asarray(out), np.asarray(ref)


CASES = {  # q_lens, kv_lens, rows in the bucket
    "decode only, lengths from 1 to the table's width": ([1] * 6, [1, 5, 36, 17, 4, 30], 8),
    "decode then prefill chunks and padding": ([1, 1, 1, 5, 7], [9, 36, 2, 20, 7], 16),
    "prefill only": ([6, 3], [6, 30], 16),
    "fewer rows than requests": ([1, 1, 1], [3, 33, 12], 4),
}


KERNEL = pytest.mark.parametrize("kernel", [False, True], ids=["xla-ops", "cpu-kernel"])


@KERNEL
@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("window,soft_cap", [(None, None), (7, None), (None, 5.0)])
def test_xla_backend_matches_the_reference(name, window, soft_cap, kernel):
    q_lens, kv_lens, num_tokens = CASES[name]
    rng = np.random.default_rng(len(name))
    q, k, v, md = batch(rng, q_lens, kv_lens, 2, max(num_tokens, MAX_SEQS)
                        if name != "fewer rows than requests" else num_tokens)
    shape = AttentionShape(2, 2, PAGE_SIZE, (None, window))
    out, ref = run_both(q, k, v, md, shape, kernel, sm_scale=HEAD_DIM ** -0.5,
                        sliding_window=window, soft_cap=soft_cap)
    live = np.arange(q.shape[0]) < sum(q_lens)
    assert not out[~live].any(), f"{name}: padding rows are not zero"
    err = np.abs(out - ref).max()
    assert err < 1e-5, f"{name} (window {window}, cap {soft_cap}): max error {err:.2e}"


@KERNEL
def test_many_kv_heads_take_the_reference_path_and_match_it(kernel):
    rng = np.random.default_rng(3)
    q, k, v, md = batch(rng, [1, 1, 4], [7, 30, 12], 8, 8, group=1)
    out, ref = run_both(q, k, v, md, AttentionShape(1, 8, PAGE_SIZE), kernel, sm_scale=0.3)
    assert np.abs(out - ref).max() < 1e-5


def test_backend_without_a_shape_makes_its_work_list_in_the_layer():
    rng = np.random.default_rng(4)
    q, k, v, md = batch(rng, [1, 1, 3], [5, 21, 9], 2, 8)
    out, ref = run_both(q, k, v, md, None, sm_scale=0.3)
    assert np.abs(out - ref).max() < 1e-5


@KERNEL
@pytest.mark.parametrize("dtype", [jnp.float8_e4m3fn, jnp.float8_e5m2])
@pytest.mark.parametrize("window", [None, 7])
def test_fp8_pages_match_the_reference_on_the_same_pages(dtype, window, kernel):
    """Every fp8 byte value appears in the pages (NaN codes aside), so the kernel's 256-entry
    table is checked against XLA's conversion for each."""
    from jaxserve.model.cpu import attention as cpu_attention

    if kernel and not cpu_attention.available():
        pytest.skip(f"the CPU kernel can't run here: "
                    f"{cpu_attention.cpu_ffi.reason(cpu_attention.NAME)}")
    q_lens, kv_lens, num_tokens = CASES["decode then prefill chunks and padding"]
    rng = np.random.default_rng(9)
    q, k, v, md = batch(rng, q_lens, kv_lens, 2, num_tokens)
    codes = np.arange(k.size, dtype=np.int64) % 256
    k = jnp.asarray(codes.astype(np.uint8).reshape(k.shape)).view(dtype)
    v = jnp.asarray(rng.permutation(codes).astype(np.uint8).reshape(v.shape)).view(dtype)
    finite = lambda x: jnp.where(jnp.isfinite(x.astype(jnp.float32)), x, jnp.zeros((), dtype))
    k, v = finite(k), finite(v)
    shape = AttentionShape(2, 2, PAGE_SIZE, (None, window))
    out, ref = run_both(q * 0.01, k, v, md, shape, kernel, sm_scale=HEAD_DIM ** -0.5,
                        sliding_window=window)
    live = np.arange(q.shape[0]) < sum(q_lens)
    assert not out[~live].any(), "padding rows are not zero"
    err = np.abs(out - ref).max() / np.abs(ref).max()
    assert err < 1e-5, f"{jnp.dtype(dtype).name} pages (window {window}): rel error {err:.2e}"
