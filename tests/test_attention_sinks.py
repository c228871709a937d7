"""Attention sinks (gpt-oss) in every paged-attention backend, against a dense numpy oracle.

For query head h the softmax has one more logit, sinks[h], whose column is dropped:
out = sum_j e^(s_j - m) v_j / (sum_j e^(s_j - m) + e^(sinks[h] - m)), m = max(s, sinks[h]), with
s after sm_scale and soft cap. The oracle computes exactly that in float64 from the paged cache
read position by position; each backend must match it to float32 rounding: the jnp reference
(ragged and decode), the XLA backend (decode rows as a work list; with its CPU kernel asked
for, which has no sinks, so the backend must fall back; and a model too wide for the work
list), the Pallas kernels in interpret mode (ragged; decode whole and split over KV, where the
sink must count once, not once per split; the GPU formulation in its simulator) and the
engine's Pallas backend, and the backend sharded over two devices (tests/tp_sinks_check.py).
Batches mix decode rows and prefill chunks over shuffled page tables, with and without
sliding window and soft cap (the cache helpers of test_kernels.py and test_decode_attention.py
are reused). sinks=None must stay the attention without sinks.
"""

from __future__ import annotations

import functools
import json
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import test_decode_attention as xla_cases
from test_kernels import (MAX_SEQS, NUM_TOKENS, compile_once, decode_lens, gpu_interpret_params,
                          make_inputs, ragged_batch, realistic_specs)
from jaxserve.model.decoder import pytrees  # noqa: F401  (the step inputs as pytrees)
from jaxserve.model.decoder.attention import AttentionShape, PallasAttention, ReferenceAttention
from pallas_kernels import reference, tuning
from pallas_kernels.paged_attention import paged_attention
from pallas_kernels.ragged_paged_attention import ragged_paged_attention

ROOT = Path(__file__).resolve().parent.parent
ATOL = 1e-5
WINDOW_CAP = pytest.mark.parametrize("window,soft_cap", [(None, None), (13, None), (None, 4.0),
                                                         (13, 4.0)])


def draw_sinks(rng, num_heads):
    """Sinks from far below the scores to far above them: each head's output is scaled by
    anything from ~1 to ~0, so a sink added twice, on the wrong head or not at all shows."""
    sinks = rng.normal(scale=2.0, size=num_heads)
    sinks[0], sinks[-1] = 6.0, -30.0
    return jnp.asarray(rng.permutation(sinks), jnp.float32)


def oracle(q, k, v, layer, kv_lens, page_table, q_lens, *, sm_scale, soft_cap=None,
           sliding_window=None, sinks=None):
    """Dense softmax with sinks, float64: [T, Hq, D]; rows past sum(q_lens) and rows of
    requests without context come back zero.
    Request s's rows are rows cu[s]..cu[s+1]-1 at positions kv_lens[s] - q_lens[s] + i."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    table, layer = np.asarray(page_table), int(layer)
    num_heads, page_size, num_kv_heads = q.shape[1], k.shape[2], k.shape[3]
    group = num_heads // num_kv_heads
    out = np.zeros(q.shape)
    row = 0
    for s, (q_len, kv_len) in enumerate(zip(q_lens, kv_lens)):
        for i in range(q_len):
            pos = int(kv_len) - q_len + i
            if pos < 0:  # an unused request slot (kv_len 0): zero
                continue
            lo = 0 if sliding_window is None else max(0, pos - sliding_window + 1)
            seen = np.arange(lo, pos + 1)
            pages, offsets = table[s, seen // page_size], seen % page_size
            keys = np.repeat(k[layer, pages, offsets], group, axis=1)      # [n, Hq, D]
            values = np.repeat(v[layer, pages, offsets], group, axis=1)
            scores = np.einsum("hd,nhd->hn", q[row + i], keys) * sm_scale
            if soft_cap is not None:
                scores = soft_cap * np.tanh(scores / soft_cap)
            sink = (np.full(num_heads, -np.inf) if sinks is None
                    else np.asarray(sinks, np.float64))
            top = np.maximum(scores.max(axis=1), sink)
            weights = np.exp(scores - top[:, None])
            denominator = weights.sum(axis=1) + np.exp(sink - top)
            out[row + i] = np.einsum("hn,nhd->hd", weights, values) / denominator[:, None]
        row += q_len
    return out


def assert_matches(out, want, num_live, what):
    out = np.asarray(out, np.float64)
    assert not np.isnan(out[:num_live]).any(), f"{what}: NaN in a live row"
    assert not np.any(out[num_live:]), f"{what}: padding rows are not zero"
    err = np.abs(out[:num_live] - want[:num_live]).max()
    assert err <= ATOL, f"{what}: max error {err:.2e} against the oracle (atol {ATOL})"


def test_the_drawn_sinks_move_the_oracle_far_past_the_tolerance():
    """Premise of every comparison below: leaving out the sinks would fail them."""
    rng = np.random.default_rng(1)
    q_lens, kv_lens, *_ = ragged_batch(rng, 8)
    q, k, v, layer, _, table = make_inputs(rng, q_lens, kv_lens, 2, 8, 32, jnp.float32,
                                           NUM_TOKENS)
    kw = dict(sm_scale=32 ** -0.5)
    with_sinks = oracle(q, k, v, layer, kv_lens, table, q_lens, sinks=draw_sinks(rng, 4), **kw)
    without = oracle(q, k, v, layer, kv_lens, table, q_lens, **kw)
    live = sum(q_lens)
    assert np.abs(with_sinks - without)[:live].max() > 1000 * ATOL


# ----- the jnp reference (the oracle of the kernels and the CPU path) -------------------------

@WINDOW_CAP
def test_reference_ragged_and_decode_match_the_oracle(window, soft_cap):
    rng = np.random.default_rng([3, window or 0, int(soft_cap or 0)])
    page_size, head_dim, group = 8, 32, 3
    kw = dict(sm_scale=head_dim ** -0.5, sliding_window=window, soft_cap=soft_cap)
    sinks = draw_sinks(rng, group * 2)
    q_lens, kv_lens, cu_q_lens, num_seqs = ragged_batch(rng, page_size)
    q, k, v, layer, kv, table = make_inputs(rng, q_lens, kv_lens, group, page_size, head_dim,
                                            jnp.float32, NUM_TOKENS)
    out = reference.ragged_paged_attention(q, k, v, layer, kv, table, cu_q_lens, num_seqs,
                                           sinks=sinks, **kw)
    want = oracle(q, k, v, layer, kv_lens, table, q_lens, sinks=sinks, **kw)
    assert_matches(out, want, sum(q_lens), f"ragged reference q_lens={q_lens} kv={kv_lens}")

    kv_lens = decode_lens(rng, page_size)
    q, k, v, layer, kv, table = make_inputs(rng, [1] * MAX_SEQS, kv_lens, group, page_size,
                                            head_dim, jnp.float32, MAX_SEQS)
    out = np.asarray(reference.paged_attention(q, k, v, layer, kv, table, sinks=sinks, **kw))
    want = oracle(q, k, v, layer, kv_lens, table, [1] * MAX_SEQS, sinks=sinks, **kw)
    live = np.asarray(kv_lens) > 0
    assert not out[~live].any(), "decode reference: an unused slot is not zero"
    assert np.abs(out[live] - want[live]).max() <= ATOL, f"decode reference kv={kv_lens}"


# ----- the XLA backend: decode work list, CPU kernel fallback, the wide-model path ------------

@pytest.mark.parametrize("kernel", [False, True], ids=["work-list", "cpu-kernel-asked"])
@pytest.mark.parametrize("name", ["decode only, lengths from 1 to the table's width",
                                  "decode then prefill chunks and padding"])
@WINDOW_CAP
def test_xla_backend_matches_the_oracle(name, window, soft_cap, kernel):
    """With the CPU kernel asked for, the sinks must still be honoured: the backend has to
    take the work list (the kernel would silently leave them out)."""
    q_lens, kv_lens, num_tokens = xla_cases.CASES[name]
    rng = np.random.default_rng([len(name), window or 0])
    q, k, v, md = xla_cases.batch(rng, q_lens, kv_lens, 2, max(num_tokens, MAX_SEQS))
    sinks = draw_sinks(rng, 4)
    backend = ReferenceAttention(AttentionShape(2, 2, xla_cases.PAGE_SIZE, (None, window)),
                                 cpu_kernel=kernel)
    kw = dict(sm_scale=xla_cases.HEAD_DIM ** -0.5, sliding_window=window, soft_cap=soft_cap)
    out = jax.jit(lambda q, k, v, md, sinks: backend(
        q, k, v, jnp.int32(1), backend.prepare(md, q.shape[0]), sinks=sinks, **kw))(
        q, k, v, md, sinks)
    want = oracle(q, k, v, 1, kv_lens, md.page_table, q_lens, sinks=sinks, **kw)
    assert_matches(out, want, sum(q_lens), f"{name} (window {window}, cap {soft_cap})")


def test_xla_backend_with_more_kv_heads_than_the_work_list_takes_matches_the_oracle():
    rng = np.random.default_rng(5)
    q_lens, kv_lens = [1, 1, 4], [7, 30, 12]
    q, k, v, md = xla_cases.batch(rng, q_lens, kv_lens, 8, 8, group=1)
    sinks = draw_sinks(rng, 8)
    backend = ReferenceAttention(AttentionShape(1, 8, xla_cases.PAGE_SIZE), cpu_kernel=False)
    out = backend(q, k, v, jnp.int32(1), backend.prepare(md, 8), sm_scale=0.3, sinks=sinks)
    want = oracle(q, k, v, 1, kv_lens, md.page_table, q_lens, sm_scale=0.3, sinks=sinks)
    assert_matches(out, want, sum(q_lens), "8 KV heads, every row through the reference")


# ----- the Pallas kernels in interpret mode ---------------------------------------------------

def check_ragged_kernel(interpret, group, page_size, head_dim, dtype=jnp.float32, atol=ATOL,
                        **kw):
    rng = np.random.default_rng([group, page_size, head_dim, 9])
    kw["sm_scale"] = head_dim ** -0.5
    q_lens, kv_lens, cu_q_lens, num_seqs = ragged_batch(rng, page_size)
    q, k, v, layer, kv, table = make_inputs(rng, q_lens, kv_lens, group, page_size, head_dim,
                                            dtype, NUM_TOKENS)
    sinks = draw_sinks(rng, group * 2)
    args = (q, k, v, layer, kv, table, cu_q_lens, num_seqs, sinks)
    kernel = compile_once(lambda *a: ragged_paged_attention(
        *a[:-1], sinks=a[-1], interpret=interpret, **kw), *args)
    out = np.asarray(kernel(*args), np.float64)
    want = oracle(q, k, v, layer, kv_lens, table, q_lens, sinks=sinks, **kw)
    live = sum(q_lens)
    assert not np.isnan(out[:live]).any() and not out[live:].any(), "NaN or unzeroed padding"
    err = np.abs(out[:live] - want[:live]).max()
    assert err <= atol, f"ragged kernel q_lens={q_lens} kv={kv_lens}: max error {err:.2e}"


def check_decode_kernel(interpret, group, page_size, num_kv_splits, head_dim=32, **kw):
    rng = np.random.default_rng([group, page_size, num_kv_splits, 10])
    kw["sm_scale"] = head_dim ** -0.5
    kv_lens = decode_lens(rng, page_size)
    q, k, v, layer, kv, table = make_inputs(rng, [1] * MAX_SEQS, kv_lens, group, page_size,
                                            head_dim, jnp.float32, MAX_SEQS)
    q = jnp.where((kv == 0)[:, None, None], jnp.nan, q)   # an unused slot's q is junk
    sinks = draw_sinks(rng, group * 2)
    args = (q, k, v, layer, kv, table, sinks)
    kernel = compile_once(lambda *a: paged_attention(  # one-page tiles: up to 6 per request
        *a[:-1], sinks=a[-1], interpret=interpret, num_kv_splits=num_kv_splits, tile_pages=1,
        **kw), *args)
    out = np.asarray(kernel(*args), np.float64)
    want = oracle(q, k, v, layer, kv_lens, table, [1] * MAX_SEQS, sinks=sinks, **kw)
    live = np.asarray(kv_lens) > 0
    assert not np.isnan(out[live]).any() and not out[~live].any(), "NaN or unzeroed slot"
    err = np.abs(out[live] - want[live]).max()
    assert err <= ATOL, f"decode kernel, {num_kv_splits} splits, kv={kv_lens}: error {err:.2e}"


@pytest.mark.parametrize("window,soft_cap", [(None, None), (13, 4.0)])
def test_ragged_kernel_matches_the_oracle(window, soft_cap):
    check_ragged_kernel(True, 3, 8, 32, sliding_window=window, soft_cap=soft_cap)


@pytest.mark.parametrize("splits,window,soft_cap", [(1, None, None), (3, None, None),
                                                    (3, 13, 4.0)], ids=["whole", "split",
                                                                        "split-window-cap"])
def test_decode_kernel_matches_the_oracle_whole_and_split_over_kv(splits, window, soft_cap):
    """Split over KV, each split's partial softmax must leave the sink out: it is added once,
    after the splits merge (three splits of one sink would triple its weight)."""
    check_decode_kernel(True, 2, 8, splits, sliding_window=window, soft_cap=soft_cap)


def test_gpu_formulation_in_the_gpu_simulator_matches_the_oracle():
    params = gpu_interpret_params()
    try:
        check_ragged_kernel(params, 2, 16, 64, dtype=jnp.bfloat16, atol=3e-2,
                            sliding_window=40, soft_cap=4.0)
    except NotImplementedError as e:
        pytest.skip(f"JAX interpret-mode limitation: {e}")


@pytest.mark.parametrize("platform,backend", [("tpu", "tpu"), ("cuda", "gpu")])
def test_compiled_kernels_with_sinks_lower_for_device(platform, backend, monkeypatch):
    """The kernels with their log-sum-exp output (what sinks ask for) lower for both devices
    at serving sizes (the final Mosaic / PTX compile needs the device)."""
    monkeypatch.setattr(tuning, "backend", lambda: backend)
    sds = jax.ShapeDtypeStruct
    sinks = sds((32,), jnp.float32)
    ragged = jax.jit(lambda *a: ragged_paged_attention(*a[:-1], sinks=a[-1], sm_scale=0.1,
                                                       sliding_window=128))
    decode = jax.jit(lambda *a: paged_attention(*a[:-1], sinks=a[-1], sm_scale=0.1))
    ragged_args = realistic_specs(16, 256) + (sds((17,), jnp.int32), sds((), jnp.int32), sinks)
    for name, fn, args in (("ragged", ragged, ragged_args),
                           ("decode", decode, realistic_specs(16, 16) + (sinks,))):
        text = fn.trace(*args).lower(lowering_platforms=(platform,)).as_text()
        call = "tpu_custom_call" if platform == "tpu" else "mosaic_gpu"
        assert f"custom_call @{call}" in text, f"{name}: no {call} kernel in the {platform} HLO"


@pytest.mark.parametrize("window", [None, 7])
def test_engine_pallas_backend_matches_the_oracle(window):
    """Decode rows through the decode kernel (split over KV), the rest through the ragged
    kernel, joined by row: both halves must carry the sinks."""
    q_lens, kv_lens = [1, 1, 1, 5, 7], [9, 36, 2, 20, 7]
    rng = np.random.default_rng([7, window or 0])
    q, k, v, md = xla_cases.batch(rng, q_lens, kv_lens, 2, 16)
    sinks = draw_sinks(rng, 4)
    backend = PallasAttention(AttentionShape(2, 2, xla_cases.PAGE_SIZE, (None, window)),
                              interpret=True)
    kw = dict(sm_scale=xla_cases.HEAD_DIM ** -0.5, sliding_window=window, soft_cap=4.0)
    out = jax.jit(lambda q, k, v, md, sinks: backend(
        q, k, v, jnp.int32(1), backend.prepare(md, q.shape[0]), sinks=sinks, **kw))(
        q, k, v, md, sinks)
    want = oracle(q, k, v, 1, kv_lens, md.page_table, q_lens, sinks=sinks, **kw)
    assert_matches(out, want, sum(q_lens), f"Pallas backend (window {window})")


# ----- sinks=None, bad sinks, tensor parallelism ----------------------------------------------

def test_without_sinks_every_backend_is_the_attention_without_sinks():
    q_lens, kv_lens = [1, 1, 1, 5, 7], [9, 36, 2, 20, 7]
    q, k, v, md = xla_cases.batch(np.random.default_rng(8), q_lens, kv_lens, 2, 16)
    shape = AttentionShape(2, 2, xla_cases.PAGE_SIZE)
    kw = dict(sm_scale=0.4, soft_cap=4.0)
    want = oracle(q, k, v, 1, kv_lens, md.page_table, q_lens, **kw)
    for backend in (ReferenceAttention(shape, cpu_kernel=False),
                    ReferenceAttention(shape, cpu_kernel=True),
                    PallasAttention(shape, interpret=True)):
        out = jax.jit(functools.partial(backend, sinks=None, **kw))(
            q, k, v, jnp.int32(1), backend.prepare(md, 16))
        assert_matches(out, want, sum(q_lens), f"{type(backend).__name__} with sinks=None")


def test_sinks_of_the_wrong_shape_are_refused_naming_sinks():
    q_lens, kv_lens = [1, 3], [5, 9]
    q, k, v, md = xla_cases.batch(np.random.default_rng(9), q_lens, kv_lens, 2, 8)
    shape = AttentionShape(2, 2, xla_cases.PAGE_SIZE)
    for backend in (ReferenceAttention(shape, cpu_kernel=False),
                    PallasAttention(shape, interpret=True)):
        with pytest.raises(ValueError, match=r"sinks has shape \(8,\), expected \(4,\)"):
            backend(q, k, v, jnp.int32(1), backend.prepare(md, 8), sm_scale=0.3,
                    sinks=jnp.zeros(8, jnp.float32))


def test_sharded_backend_gives_each_device_the_sinks_of_its_own_heads(tmp_path):
    """Two fake CPU devices (a process of its own: XLA_FLAGS must be set before jax starts)."""
    out = tmp_path / "tp_sinks.json"
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "tp_sinks_check.py"), str(out)],
                          capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert proc.returncode == 0, f"tp_sinks_check.py failed:\n{proc.stderr[-4000:]}"
    report = json.loads(out.read_text())
    assert report["devices"] == 2, report
    assert report["error_vs_oracle"] <= ATOL, report
    assert report["error_vs_one_device"] <= ATOL, report
