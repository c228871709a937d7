"""jaxserve's CPU kernels against the XLA ops they replace, side by side in one process.

    python scripts/bench_cpu_kernels.py [--rounds=7] [--out FILE.json]

* int8 matmul: SmolLM2's 30 layers of seven int8 matrices chained in one jit, at 2, 8, 32 and
  1024 activation rows: the kernel (model/cpu/int8.py), XLA's int8 dot_general (YNNPACK), and
  float32 dots of the same shapes at half the rows (int8 activations come in two levels). The
  kernel's result is checked equal to XLA's first.
* decode attention: 30 layers of the default model's decode attention (9 query heads, 3 KV
  heads of 64, pages of 16) at 1, 16 and 64 requests of 211 positions, through
  ReferenceAttention with the kernel (model/cpu/attention.py) and with XLA's work list.

Rounds alternate between the forms; medians and minimums in ms. It measures and prints; it
asserts nothing but the kernel's equality.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.model.cpu import int8 as cpu_int8
from jaxserve.model.decoder.attention import AttentionShape, ReferenceAttention
from jaxserve.model.decoder.step_inputs import AttentionMetadata

LAYER = [(576, 576), (192, 576), (192, 576), (576, 576), (1536, 576), (1536, 576), (576, 1536)]


def _time(fns: dict, args: dict, rounds: int) -> dict:
    for name, fn in fns.items():
        jax.block_until_ready(fn(*args[name]))
    times = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            start = time.perf_counter()
            jax.block_until_ready(fn(*args[name]))
            times[name].append(1000 * (time.perf_counter() - start))
    return {name: {"median_ms": statistics.median(t), "min_ms": min(t)}
            for name, t in times.items()}


def _fit(a, width):
    """a's columns cut or tiled to width."""
    reps = -(-width // a.shape[1])
    return jnp.tile(a, (1, reps))[:, :width]


def int8_matmul(rounds: int) -> dict:
    rng = np.random.default_rng(0)
    shapes = LAYER * 30
    ws = [jnp.asarray(rng.integers(-128, 128, s, dtype=np.int8)) for s in shapes]
    wf = [jnp.asarray(rng.standard_normal((s[1], s[0]), np.float32)) for s in shapes]

    def chain(mm):
        @jax.jit
        def f(a, ws):
            s = jnp.int32(0)
            for w in ws:  # each product depends on the last: no two run at once
                s = mm(_fit(a, w.shape[1]) + (s > 0).astype(jnp.int8), w)[0, 0]
            return s
        return f

    @jax.jit
    def floats(x, wf):
        s = jnp.float32(0)
        for w in wf:
            s = ((_fit(x, w.shape[0]) + s * 0) @ w)[0, 0]
        return s

    results = {}
    for rows in (2, 8, 32, 1024):
        a = jnp.asarray(rng.integers(-127, 128, (rows, 576), dtype=np.int8))
        x = jnp.asarray(rng.standard_normal((max(1, rows // 2), 576), np.float32))
        for w in ws[:7]:
            got = jax.jit(cpu_int8.matmul)(_fit(a, w.shape[1]), w)
            want = jax.jit(cpu_int8._xla_dot)(_fit(a, w.shape[1]), w)
            assert np.array_equal(np.asarray(got), np.asarray(want)), "kernel != XLA's dot"
        fns = {"kernel": chain(cpu_int8.matmul), "xla_int8": chain(cpu_int8._xla_dot),
               "float32": floats}
        results[rows] = _time(fns, {"kernel": (a, ws), "xla_int8": (a, ws),
                                    "float32": (x, wf)}, rounds)
        print(f"int8 matmul, {rows:4d} rows: " + "  ".join(
            f"{k} {v['median_ms']:.2f} (min {v['min_ms']:.2f})"
            for k, v in results[rows].items()), flush=True)
    return results


def decode_attention(rounds: int, context: int = 211) -> dict:
    layers, pages, page_size, kv_heads, head_dim, heads = 30, 1100, 16, 3, 64, 9
    rng = np.random.default_rng(0)
    shape = (layers, pages, page_size, kv_heads, head_dim)
    k = jnp.asarray(rng.standard_normal(shape, np.float32))
    v = jnp.asarray(rng.standard_normal(shape, np.float32))
    results = {}
    for seqs in (1, 16, 64):
        need, width = -(-context // page_size), 64
        table = np.zeros((seqs, width), np.int32)
        for s in range(seqs):
            table[s, :need] = 1 + s * need + np.arange(need)
        md = (jnp.arange(seqs + 1, dtype=jnp.int32), jnp.full((seqs,), context, jnp.int32),
              jnp.asarray(table), jnp.int32(seqs), jnp.int32(seqs))
        q = jnp.asarray(rng.standard_normal((seqs, heads, head_dim), np.float32))

        def layers_of(backend):
            @jax.jit
            def f(q, k, v, md):
                prepared = backend.prepare(AttentionMetadata(*md), seqs)
                out = q
                for layer in range(layers):
                    out = backend(out, k, v, jnp.int32(layer), prepared, sm_scale=0.125)
                return out
            return f

        fns = {"kernel": layers_of(ReferenceAttention(AttentionShape(3, kv_heads, page_size),
                                                      cpu_kernel=True)),
               "xla_ops": layers_of(ReferenceAttention(AttentionShape(3, kv_heads, page_size),
                                                       cpu_kernel=False))}
        results[seqs] = _time(fns, {name: (q, k, v, md) for name in fns}, rounds)
        print(f"decode attention, {seqs:2d} requests x {context} positions, 30 layers: " +
              "  ".join(f"{k} {v['median_ms']:.2f} (min {v['min_ms']:.2f})"
                        for k, v in results[seqs].items()), flush=True)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    assert cpu_int8.available(), "the CPU kernels did not build here (see the log)"
    report = {"int8_matmul": int8_matmul(args.rounds),
              "decode_attention": decode_attention(args.rounds)}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
