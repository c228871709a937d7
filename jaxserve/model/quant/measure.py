"""Times a model's quantized matmuls in each candidate form (model/quant/bucket_forms.py) at a
token bucket's row count, on this machine, for the runner's per-bucket choice at warm-up.

The matmul set of one step: every decoder layer's quantized matrices with T rows (the
bucket's tokens), in the model's order, each input tied to the previous result (so they run
one after another, as in the step, and none is dropped as unused), then the head with S rows
(the bucket's requests). The weights are the model's own arrays, passed as arguments (never
constants: XLA would fold a dequantization), so each candidate reads the same bytes from the
same places as the step will. Each candidate's program is compiled, run once, then timed
over interleaved rounds; a candidate's time is its fastest round (load from elsewhere only
ever adds time). Expert stacks are not in the set: their matmuls (model/decoder/expert_matmul.py)
take no per-bucket form. This module measures: choosing and remembering is
quant_bucket_forms.py's, and what runs in a step is qlinear.py's.
"""

from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor

import jax
import jax.numpy as jnp
import jaxlib
import numpy as np
from flax import nnx

from jaxserve.model.cpu import ffi as cpu_ffi
from jaxserve.model.cpu import int8 as cpu_int8
from jaxserve.model.quant import qlinear
from jaxserve.model.quant import bucket_forms as qbf
from jaxserve.model.quant.qlinear import QArray, QuantizedWeight
from jaxserve.model.quant.select import MatmulForm

HEAD_NAMES = ("embed", "lm_head")
MIN_ROUNDS, MAX_ROUNDS = 3, 9
MIN_SECONDS = 0.3  # per candidate: rounds continue past MIN_ROUNDS until each has this much


def _layers(w: QArray) -> list[QArray]:
    """A layer stack [L, out, in] as L matrices; a matrix as itself."""
    if w.q.ndim == 2:
        return [w]
    return [QArray(w.q[i], w.scale[i], None if w.zero is None else w.zero[i], w.bits,
                   w.group, w.form) for i in range(w.q.shape[0])]


def matmul_set(model) -> tuple[list[QArray], QArray | None, bool]:
    """(the layers' quantized matrices, the quantized head or None, whether the head is an
    lm_head [D, V] in param layout: transposed) of a Llama-like nnx model."""
    mats, head, transposed = [], None, True
    tied = model.config.tie_word_embeddings
    for path, node in nnx.iter_graph(model):
        if not isinstance(node, QuantizedWeight):
            continue
        top, last = str(path[0]), str(path[-1])
        if top in HEAD_NAMES:
            if top == "lm_head" or tied:
                head, transposed = node.value(), top == "lm_head"
        elif not last.startswith("e_"):
            mats.extend(_layers(node.value()))
    return mats, head, transposed


def _inputs(w: QArray) -> int:
    return w.q.shape[-1] * (8 // w.bits)


def _program(form: MatmulForm, transposed: bool):
    """fn(xs {in: [T, in]}, h [S, D], mats, head) -> every result, all in `form`."""
    def fn(xs, h, mats, head):
        outs, prev = [], None
        with qlinear.matmul_form(form):
            for w in mats:
                x = xs[str(_inputs(w))]
                if prev is not None:  # after the previous matmul, as in the step
                    x = x + qlinear._after(prev).astype(x.dtype)
                prev = qlinear.linear(x, w)
                outs.append(prev)
            if head is not None:
                if prev is not None:
                    h = h + qlinear._after(prev).astype(h.dtype)
                outs.append(qlinear.head(h, head, transposed))
        return outs
    return jax.jit(fn)


def _arguments(mats, head, rows: tuple[int, int], dtype):
    tokens, requests = rows
    rng = np.random.default_rng(0)
    sizes = sorted({_inputs(w) for w in mats})
    xs = {str(n): jnp.asarray(rng.standard_normal((tokens, n)), dtype) for n in sizes}
    dim = _inputs(head) if head is not None else 1
    h = jnp.asarray(rng.standard_normal((requests, dim)), dtype)
    return xs, h, mats, head


def time_forms(model, forms: dict[str, MatmulForm], rows: tuple[int, int],
               dtype=jnp.float32) -> dict[str, float]:
    """{name: seconds} of the model's matmul set (rows = (T, S)) in each form: the fastest of
    interleaved rounds, after a compile and a first run."""
    mats, head, transposed = matmul_set(model)
    args = _arguments(mats, head, rows, dtype)
    with ThreadPoolExecutor(max(1, min(len(forms), os.cpu_count() or 1))) as pool:
        futures = {name: pool.submit(_program(form, transposed).lower(*args).compile)
                   for name, form in forms.items()}
        compiled = {name: f.result() for name, f in futures.items()}
    for exe in compiled.values():
        jax.block_until_ready(exe(*args))
    best = {name: float("inf") for name in compiled}
    spent = {name: 0.0 for name in compiled}
    for rounds in range(1, MAX_ROUNDS + 1):
        for name, exe in compiled.items():
            start = time.perf_counter()
            jax.block_until_ready(exe(*args))
            took = time.perf_counter() - start
            best[name], spent[name] = min(best[name], took), spent[name] + took
        if rounds >= MIN_ROUNDS and min(spent.values()) >= MIN_SECONDS:
            break
    return best


def fingerprint(model, dtype) -> dict:
    """What the timings depend on besides the buckets and candidates (quant_bucket_forms.key):
    the CPU (model and flags), jax and jaxlib, the threads this process may use, whether the
    kernel runs, the compute dtype and every measured matrix's shape and format."""
    mats, head, transposed = matmul_set(model)
    described = [[list(w.q.shape), str(w.q.dtype), w.bits, w.group] for w in mats]
    if head is not None:
        described.append(["head", list(head.q.shape), str(head.q.dtype), head.bits, transposed])
    threads = (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
               else os.cpu_count())
    return {"cpu": cpu_ffi.cpu_identity().decode(errors="replace"), "jax": jax.__version__,
            "jaxlib": jaxlib.__version__, "threads": threads,
            "kernel": cpu_int8.available(), "dtype": str(jnp.dtype(dtype)),
            "matrices": described}


def has_per_channel_int8(model) -> bool:
    """Whether any measured matrix is per-channel int8 (the only kind the forms differ on)."""
    mats, head, _ = matmul_set(model)
    return any(qlinear.per_channel_int8(w) for w in (*mats, *([head] if head else [])))


def bucket_forms(model, shapes, base: MatmulForm, cache_dir, dtype
                 ) -> tuple[dict[int, MatmulForm], dict[int, str], str]:
    """({token bucket: form}, {token bucket: candidate name}, a log line) for the buckets
    `shapes` [(T, S), ...]: read from `cache_dir` (quant_bucket_forms.SUBDIR inside it) when
    this machine measured the same set before, else measured here (each T at its largest S)
    and stored."""
    forms = qbf.candidates(base, cpu_int8.available())
    rows = {}
    for t, s in shapes:
        rows[t] = (t, max(s, rows.get(t, (t, 0))[1]))
    names, record = qbf.select(rows, tuple(forms), fingerprint(model, dtype), cache_dir,
                               lambda r: time_forms(model, forms, tuple(r), dtype))
    line = (f"int8 matmul form per token bucket, {record['source']} on this CPU: "
            + qbf.describe(names, record))
    return {t: forms[n] for t, n in names.items()}, names, line
