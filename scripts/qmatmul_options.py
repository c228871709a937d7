"""Ways to write a weight-only quantized matmul that XLA runs, measured against float32 on the CPU.

    python scripts/qmatmul_options.py [--batches 1,4,16] [--forms int8c,int8g,int4g]
        [--options ...] [--repeats 30] [--json scripts/bench_results/qmatmul_options.json]

SmolLM2-135M's shapes (hidden 576, intermediate 1536, 9 / 3 heads of 64, 30 layers, vocab 49152
tied): `layers` runs every layer's seven projections (q, k, v, o, gate, up, down; distinct
weights per layer, each projection fed by the previous one's output so nothing runs out of
order), `head` the tied head over the 49152-row embedding. Each option is one jitted function of
(x [B, 576], weights); float32 runs in the same process, and every round calls every option
once, in turn, so load on the shared machine hits all of them alike; medians over `repeats`
rounds. Forms: int8c (int8, one scale per output channel), int8g (int8 in groups of 32 with a
scale and zero: the default GGUF's Q4_1 blocks mapped to int8), int4g (int4 groups of 32, two
values per byte, low nibble = even input). Options:
  f32           x @ w, float32 [in, out]                      (the baseline)
  f32pad        the same with one row padded to two (YNNPACK takes dots of 2+ rows only)
  deq_dot       qlinear.linear's dequantizing path (CHUNK_BYTES of rows at a time), then a dot
  deq_whole     the whole matrix dequantized after x, one dot (int8c: scale after the dot)
  deq_whole_bf16  the same dequantized to bfloat16, a bfloat16 dot accumulating in float32
  deq_split     int4: low / high nibbles dequantized apart, two dots with x's even / odd inputs
  red_nk, red_kn      sum over inputs of x * dequant(w), weights [out, in] / [in, out]
  red_nk32, red_kn32  the same with the inputs as [groups, 32], the scale applied per group
  red_kn32_deq  int8g: the dequantized value inside one product, one reduction
  w8a8          qlinear.int8_dot: x quantized per row in two int8 levels, one int8 x int8 ->
                int32 dot of 2B rows (YNNPACK), then scales
  w8a8_1        one int8 level only (int8g: a dot batched over groups of 32)
  bf16          the int8 weights as bfloat16, a bfloat16 dot accumulating in float32
  mixed         lax.dot_general of float32 x int8 (JAX inserts the convert)
The reductions use an add YNNPACK's reduce fusion does not match (`_add`), so XLA's own loops
run them; with the plain add YNNPACK took them and ran 10-20x slower than float32.
It measures and prints; the choice it informs is in jaxserve/model/quant/qlinear.py and
docs/quantization.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from jaxserve.model.quant import qlinear  # noqa: E402
from jaxserve.model.quant.qlinear import QArray, _after, dequantize, int8_dot, linear  # noqa: E402
from jaxserve.model.quant.select import MatmulForm  # noqa: E402

D, F, Q, KV, L, V, G = 576, 1536, 576, 192, 30, 49152, 32
# (name, in, out) of each layer's projections, in the order they run
PROJ = (("wq", D, Q), ("wk", D, KV), ("wv", D, KV), ("wo", Q, D), ("w_gate", D, F),
        ("w_up", D, F), ("w_down", F, D))
OPTIONS = ("f32", "f32pad", "deq_dot", "deq_whole", "deq_whole_bf16", "red_nk", "red_kn", "red_nk32", "red_kn32", "red_kn32_deq", "w8a8", "w8a8_1",
           "bf16", "mixed")


def make_weight(rng, inp: int, out: int, form: str) -> dict:
    """One matrix in every layout an option reads (built on the host, placed on device):
    f32 [in, out]; q [out, in] (int4: [out, in // 2]) and q_kn [in, out] (int4: [in // 2, out],
    inputs 2j / 2j + 1 in byte j's low / high nibble); s, z [out, groups] and s_kn, z_kn."""
    w = rng.standard_normal((out, inp), np.float32) * 0.05  # [out, in]
    d = {"f32": w.T.copy()}
    if form == "int8c":
        s = np.abs(w).max(-1, keepdims=True) / 127
        q = np.clip(np.rint(w / s), -127, 127).astype(np.int8)
        d.update(q=q, s=s[:, 0].astype(np.float32), q_kn=q.T.copy())
        return {k: jax.device_put(v) for k, v in d.items()}
    g = w.reshape(out, inp // G, G)
    lo, hi = g.min(-1), g.max(-1)
    levels = 255 if form == "int8g" else 15
    s = ((hi - lo) / levels).astype(np.float16)
    z = lo.astype(np.float16)
    q = np.clip(np.rint((g - z[..., None]) / s[..., None].astype(np.float32)), 0, levels)
    q = q.reshape(out, inp)
    if form == "int8g":  # stored signed: q - 128, and the zero moved by 128 scales
        q8 = (q - 128).astype(np.int8)
        z = (z.astype(np.float32) + 128 * s.astype(np.float32)).astype(np.float16)
        d.update(q=q8, q_kn=q8.T.copy())
    else:
        u = q.astype(np.uint8)
        d.update(q=(u[:, 0::2] | (u[:, 1::2] << 4)).astype(np.uint8),
                 q_kn=(u[:, 0::2] | (u[:, 1::2] << 4)).T.copy())
    d.update(s=s, z=z, s_kn=s.T.copy(), z_kn=z.T.copy())
    return {k: jax.device_put(v) for k, v in d.items()}


def _qarray(w: dict, form: str) -> QArray:
    if form == "int8c":
        return QArray(w["q"], w["s"][:, None], None, 8, w["q"].shape[1])
    return QArray(w["q"], w["s"], w["z"], 8 if form == "int8g" else 4, G)


def _add(a, b):
    """a + b that YNNPACK's reduce fusion does not match (it takes a root add, max or min), so
    XLA's own loop emitter runs the reduction with its producers fused in."""
    return a - (-b)


def _sum(p, axes):
    return jax.lax.reduce(p, jnp.float32(0), _add, axes)


def _pad2(x):
    """[1, in] -> [2, in] (a zero row): XLA sends dots of one row to its own loop, YNNPACK
    takes two or more."""
    return jnp.concatenate([x, jnp.zeros_like(x)]) if x.shape[0] == 1 else x


def _quantize_rows(x):
    """x [B, in] float32 -> (int8 [B, in], float32 [B, 1]): symmetric, one scale a row."""
    sx = jnp.maximum(jnp.max(jnp.abs(x), -1, keepdims=True), 1e-30) / 127
    return jnp.clip(jnp.round(x / sx), -127, 127).astype(jnp.int8), sx


def _w8a8(x, w, form: str):
    """int8 activations (one level, per row) x int8 weights -> int32 in one YNNPACK dot, then
    scales (mean KL 0.05 to float32 on the default model: the two-level int8_dot is adopted); int8g
    contracts each group of 32 separately (a dot batched over groups) to apply its scale."""
    b = x.shape[0]
    qx, sx = _quantize_rows(_pad2(x))
    if form == "int8c":
        acc = jax.lax.dot_general(qx, w["q_kn"], (((1,), (0,)), ((), ())),
                                  preferred_element_type=jnp.int32)   # [B', out]
        return (acc.astype(jnp.float32) * sx * w["s"])[:b]
    inp, out = w["q_kn"].shape
    ng = inp // G
    qxg = qx.reshape(-1, ng, G).transpose(1, 0, 2)                     # [groups, B', G]
    qkg = w["q_kn"].reshape(ng, G, out)                                # [groups, G, out]
    acc = jax.lax.dot_general(qxg, qkg, (((2,), (1,)), ((0,), (0,))),
                              preferred_element_type=jnp.int32)       # [groups, B', out]
    sk, zk = w["s_kn"].astype(jnp.float32), w["z_kn"].astype(jnp.float32)  # [groups, out]
    y = jnp.sum(acc.astype(jnp.float32) * sk[:, None, :], 0) * sx
    xsum = _pad2(x).reshape(-1, ng, G).sum(-1)                         # [B', groups]
    return (y + xsum @ zk)[:b]


def _int4_split(x, w):
    """int4 without interleaving nibbles: low nibbles (even inputs) and high nibbles (odd inputs)
    dequantized apart, each contracted with its half of x, the two dots summed."""
    zero = _after(x)
    out, half = w["q"].shape
    s = w["s"].astype(jnp.float32)[..., None] + zero                 # [out, groups, 1]
    z = w["z"].astype(jnp.float32)[..., None]
    ng = s.shape[1]

    def deq(nibbles):
        return (nibbles.astype(jnp.float32).reshape(out, ng, G // 2) * s + z).reshape(out, half)

    lo, hi = deq(w["q"] & 15), deq(w["q"] >> 4)
    return (jnp.einsum("bi,oi->bo", x[:, 0::2], lo) + jnp.einsum("bi,oi->bo", x[:, 1::2], hi))


def _deq_whole(x, w, form: str, dtype):
    """The whole matrix dequantized (after x: see qlinear._after) to dtype [out, in], one dot
    contracting `in`; int8c applies its per-channel scale to the dot's output instead."""
    zero = _after(x)
    if form == "int8c":
        vals = (w["q"].astype(jnp.float32) + zero).astype(dtype)
        y = jnp.einsum("bi,oi->bo", x.astype(dtype), vals, preferred_element_type=jnp.float32)
        return y * w["s"]
    qa = _qarray(w, form)
    qa = QArray(qa.q, qa.scale.astype(jnp.float32) + zero, qa.zero, qa.bits, qa.group)
    return jnp.einsum("bi,oi->bo", x.astype(dtype), dequantize(qa, dtype),
                      preferred_element_type=jnp.float32)


def lin(option: str, form: str, x, w):
    """x [B, in] float32 times one weight under `option` -> [B, out] float32."""
    f32 = jnp.float32
    if option == "f32":
        return x @ w["f32"]
    if option == "f32pad":  # batch 1 padded to 2 rows: YNNPACK takes dots of 2+ rows only
        return (_pad2(x) @ w["f32"])[:x.shape[0]]
    if option == "w8a8" and form == "int8c":  # as adopted: qlinear.int8_dot
        return int8_dot(x, _qarray(w, form), jnp.float32)
    if option == "w8a8_1" and form != "int4g":
        return _w8a8(x, w, form)
    if option == "deq_dot":  # the CPU's dequantizing path, even where int8_dot would be taken
        cpu_form = MatmulForm(int8_activations=False, chunked=True)
        return linear(x, dataclasses.replace(_qarray(w, form), form=cpu_form))
    if option == "deq_split":
        return qlinear.linear(x, _qarray(w, form)) if form != "int4g" else _int4_split(x, w)
    if option.startswith("deq_whole"):
        return _deq_whole(x, w, form, jnp.bfloat16 if option.endswith("bf16") else f32)
    b, inp = x.shape
    if form == "int8c":
        q, qk, s = w["q"], w["q_kn"], w["s"]
        out = s.shape[0]
        if option == "red_nk":
            return _sum(x[:, None, :] * q.astype(f32)[None], (2,)) * s
        if option == "red_kn":
            return _sum(x[:, :, None] * qk.astype(f32)[None], (1,)) * s
        if option == "red_nk32":
            p = x.reshape(b, 1, inp // G, G) * q.reshape(out, inp // G, G).astype(f32)
            return _sum(p, (2, 3)) * s
        if option == "red_kn32":
            p = x.reshape(b, inp // G, G, 1) * qk.reshape(inp // G, G, out).astype(f32)
            return _sum(p, (1, 2)) * s
        if option == "bf16":
            return jnp.dot(x.astype(jnp.bfloat16), qk.astype(jnp.bfloat16),
                           preferred_element_type=f32) * s
        if option == "mixed":
            return jax.lax.dot_general(x, qk, (((1,), (0,)), ((), ())),
                                       preferred_element_type=f32) * s
        raise NotImplementedError
    ng = inp // G
    xsum = x.reshape(b, ng, G).sum(-1)  # [B, groups]: what each group's zero multiplies
    if form == "int8g":
        vals_nk = w["q"].reshape(-1, ng, G).astype(f32)          # [out, groups, G]
        vals_kn = w["q_kn"].reshape(ng, G, -1).astype(f32)       # [groups, G, out]
        xn = x.reshape(b, 1, ng, G)
        xk = x.reshape(b, ng, G, 1)
    else:
        lo_nk, hi_nk = (w["q"] & 15).astype(f32), (w["q"] >> 4).astype(f32)
        lo_kn, hi_kn = (w["q_kn"] & 15).astype(f32), (w["q_kn"] >> 4).astype(f32)
        xe, xo = x[:, 0::2], x[:, 1::2]  # [B, in // 2]
    s, z = w["s"].astype(f32), w["z"].astype(f32)               # [out, groups]
    sk, zk = w["s_kn"].astype(f32), w["z_kn"].astype(f32)       # [groups, out]
    if option == "red_nk32":
        if form == "int8g":
            part = _sum(xn * vals_nk, (3,))                      # [B, out, groups]
        else:
            h = G // 2
            part = _sum(xe.reshape(b, 1, ng, h) * lo_nk.reshape(-1, ng, h)
                        + xo.reshape(b, 1, ng, h) * hi_nk.reshape(-1, ng, h), (3,))
        return _sum(part * s + xsum[:, None, :] * z, (2,))
    if option == "red_kn32":
        if form == "int8g":
            part = _sum(xk * vals_kn, (2,))                      # [B, groups, out]
        else:
            h = G // 2
            part = _sum(xe.reshape(b, ng, h, 1) * lo_kn.reshape(ng, h, -1)
                        + xo.reshape(b, ng, h, 1) * hi_kn.reshape(ng, h, -1), (2,))
        return _sum(part * sk + xsum[:, :, None] * zk, (1,))
    if option == "red_kn32_deq":  # the dequantized value inside the product, one reduce
        if form != "int8g":
            raise NotImplementedError
        deq = vals_kn * sk[:, None, :] + zk[:, None, :]
        return _sum(xk * deq, (1, 2))
    if option == "bf16" and form == "int8g":
        deq = vals_nk * s[..., None] + z[..., None]
        return jnp.einsum("bi,oi->bo", x.astype(jnp.bfloat16),
                          deq.reshape(-1, inp).astype(jnp.bfloat16), preferred_element_type=f32)
    raise NotImplementedError


def layers_fn(option: str, form: str):
    def run(x, weights):
        h = x
        for layer in weights:
            q = lin(option, form, h, layer["wq"])
            k = lin(option, form, h, layer["wk"])
            v = lin(option, form, h, layer["wv"])
            a = q + jnp.tile(k * v, 3)  # [B, 576]: stands in for attention
            h = h + 0.1 * lin(option, form, a, layer["wo"])
            h = h * jax.lax.rsqrt(jnp.mean(h * h, -1, keepdims=True) + 1e-6)
            m = jax.nn.silu(lin(option, form, h, layer["w_gate"])) * lin(option, form, h,
                                                                           layer["w_up"])
            h = h + 0.1 * lin(option, form, m, layer["w_down"])
            h = h * jax.lax.rsqrt(jnp.mean(h * h, -1, keepdims=True) + 1e-6)
        return h
    return jax.jit(run)


def head_fn(option: str, form: str):
    return jax.jit(lambda x, w: lin(option, form, x, w))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batches", default="1,4,16")
    p.add_argument("--forms", default="int8c,int8g,int4g")
    p.add_argument("--options", default=",".join(OPTIONS))
    p.add_argument("--parts", default="layers,head")
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    rng = np.random.default_rng(0)
    load_before = os.getloadavg()
    results = []
    for form in args.forms.split(","):
        weights = {"layers": [{n: make_weight(rng, i, o, form) for n, i, o in PROJ}
                              for _ in range(L)],
                   "head": make_weight(rng, D, V, form)}
        for part in args.parts.split(","):
            make = layers_fn if part == "layers" else head_fn
            for b in batches:
                x = jax.device_put(rng.standard_normal((b, D), np.float32))
                fns, ref = {}, None
                for opt in args.options.split(","):
                    try:
                        fn = make(opt, form)
                        y = np.asarray(fn(x, weights[part]))
                    except NotImplementedError as e:
                        print(f"  {form} {part} b{b} {opt}: skipped ({type(e).__name__})")
                        continue
                    if opt == "f32":
                        ref = y
                    err = None if ref is None else float(np.abs(y - ref).max()
                                                         / (np.abs(ref).max() + 1e-9))
                    fns[opt] = (fn, err)
                times = {opt: [] for opt in fns}
                for _ in range(args.repeats):
                    for opt, (fn, _) in fns.items():
                        start = time.perf_counter()
                        fn(x, weights[part]).block_until_ready()
                        times[opt].append(time.perf_counter() - start)
                base = statistics.median(times["f32"]) if "f32" in times else None
                for opt, ts in times.items():
                    med = statistics.median(ts)
                    row = dict(form=form, part=part, batch=b, option=opt,
                               median_ms=1000 * med, min_ms=1000 * min(ts),
                               vs_f32=None if base is None else base / med,
                               max_rel_err_vs_f32=fns[opt][1])
                    results.append(row)
                    print(f"{form:6} {part:6} b{b:<3} {opt:12} {row['median_ms']:8.2f} ms "
                          f"(min {row['min_ms']:7.2f})  x f32 {row['vs_f32'] or 0:5.2f}  "
                          f"err {row['max_rel_err_vs_f32'] or 0:.1e}", flush=True)
        del weights
    out = dict(jax=jax.__version__, backend=jax.default_backend(),
               xla_flags=os.environ.get("XLA_FLAGS", ""), repeats=args.repeats,
               load_before=load_before, load_after=os.getloadavg(),
               uptime=subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip(),
               results=results)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
