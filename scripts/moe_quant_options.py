"""Ways to run per-channel int8 experts through ragged_dot (the grouped MoE path), measured
against float32 on this machine's backend.

    python scripts/moe_quant_options.py [--pairs 64,256] [--experts 8] [--hidden 512]
        [--ffn 256] [--layers 2] [--repeats 20]
        [--json scripts/bench_results/moe_quant_options.json]

`ragged_dot` takes one dtype, so an int8 expert stack ([E, out, in], one float32 scale per
output channel) must become the activation dtype first. Each option runs `--layers` expert
FFNs (gate and up [E, hidden, ffn], down [E, ffn, hidden], SiLU; distinct weights per layer,
each layer fed by the previous one's output) over M pairs already sorted by expert, the pairs
spread evenly over the experts. Every round calls every option once, in turn, so load on a
shared machine hits all of them alike; medians over `repeats` rounds. Options:
  f32           float32 stacks [E, in, out], lax.ragged_dot            (the baseline)
  f32_oi        float32 stacks [E, out, in], ragged_dot_general contracting their last axis
  deq           q * scale (after the activations) to float32 [E, out, in], then ragged_dot_general
  scale_after   q converted alone (after the activations), ragged_dot_general, then each row's
                output times its expert's channel scales
  deq_io        deq, the float32 stack written transposed [E, in, out] for lax.ragged_dot
  scale_after_io  scale_after, the converted stack written transposed [E, in, out]:
                expert_matmul.grouped's int8 form
It measures and prints; the choice it informs is in jaxserve/model/decoder/expert_matmul.py and
docs/moe.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from jaxserve.model.quant.qlinear import QArray, _after, dequantize  # noqa: E402
from jaxserve.model.quant.formats import quantize_int8  # noqa: E402

OPTIONS = ("f32", "f32_oi", "deq", "scale_after", "deq_io", "scale_after_io")
NAMES = ("gate", "up", "down")


# rows [M, in] sorted by expert times a stack [E, out, in]: contract `in` of both.
OUT_IN = jax.lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(([1], [2]), ([], [])), lhs_ragged_dimensions=[0],
    rhs_group_dimensions=[0])


def _ragged_oi(rows, stack, sizes):
    return jax.lax.ragged_dot_general(rows, stack, sizes, OUT_IN,
                                      preferred_element_type=jnp.float32)


def project(option: str, rows, w, sizes, expert_of_row):
    """rows [M, in] through one expert stack in the option's form -> [M, out] float32."""
    if option == "f32":
        return jax.lax.ragged_dot(rows, w, sizes, preferred_element_type=jnp.float32)
    if option == "f32_oi":
        return _ragged_oi(rows, w, sizes)
    if option in ("deq", "deq_io"):
        stack = dequantize(w, rows.dtype, after=rows)
        if option == "deq":
            return _ragged_oi(rows, stack, sizes)
        return jax.lax.ragged_dot(rows, jnp.swapaxes(stack, -1, -2), sizes,
                                  preferred_element_type=jnp.float32)
    values = (w.q.astype(jnp.float32) + _after(rows)).astype(rows.dtype)
    if option == "scale_after":
        out = _ragged_oi(rows, values, sizes)
    else:
        out = jax.lax.ragged_dot(rows, jnp.swapaxes(values, -1, -2), sizes,
                                 preferred_element_type=jnp.float32)
    return out * w.scale[expert_of_row, :, 0]


def build(option: str):
    def run(x, layers, sizes, expert_of_row):
        for w in layers:
            gate = project(option, x, w["gate"], sizes, expert_of_row)
            up = project(option, x, w["up"], sizes, expert_of_row)
            x = project(option, jax.nn.silu(gate) * up, w["down"], sizes, expert_of_row)
        return x
    return jax.jit(run)


def weights(option: str, float_layers: list[dict]) -> list[dict]:
    """float_layers: {name: float32 [E, in, out]} per layer, in the option's form."""
    out = []
    for layer in float_layers:
        if option == "f32":
            out.append({k: jnp.asarray(v) for k, v in layer.items()})
        elif option == "f32_oi":
            out.append({k: jnp.asarray(np.swapaxes(v, -1, -2)) for k, v in layer.items()})
        else:
            qs = {k: quantize_int8(np.swapaxes(v, -1, -2)) for k, v in layer.items()}
            out.append({k: QArray(jnp.asarray(t.q), jnp.asarray(t.scale), None, 8, t.group)
                        for k, t in qs.items()})
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", default="64,256")
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--ffn", type=int, default=256)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    E, D, F = args.experts, args.hidden, args.ffn
    rng = np.random.default_rng(0)
    shapes = {"gate": (E, D, F), "up": (E, D, F), "down": (E, F, D)}
    float_layers = [{k: (0.05 * rng.standard_normal(s)).astype(np.float32)
                     for k, s in shapes.items()} for _ in range(args.layers)]
    forms = {o: weights(o, float_layers) for o in OPTIONS}
    fns = {o: build(o) for o in OPTIONS}
    load_before = os.getloadavg()
    results = {}
    for m in (int(p) for p in args.pairs.split(",")):
        sizes = np.full(E, m // E, np.int32)
        sizes[: m % E] += 1
        expert_of_row = jnp.asarray(np.repeat(np.arange(E, dtype=np.int32), sizes))
        sizes = jnp.asarray(sizes)
        x = jnp.asarray(rng.standard_normal((m, D)).astype(np.float32))
        outs = {o: np.asarray(fns[o](x, forms[o], sizes, expert_of_row)) for o in OPTIONS}
        times = {o: [] for o in OPTIONS}
        for _ in range(args.repeats):
            for o in OPTIONS:
                start = time.perf_counter()
                fns[o](x, forms[o], sizes, expert_of_row).block_until_ready()
                times[o].append(time.perf_counter() - start)
        base = statistics.median(times["f32"])
        ref = np.abs(outs["f32"]).max()
        results[m] = {o: {"median_ms": 1000 * statistics.median(times[o]),
                          "vs_f32": statistics.median(times[o]) / base,
                          "max_rel_err": float(np.abs(outs[o] - outs["f32"]).max() / ref)}
                      for o in OPTIONS}
        for o, r in results[m].items():
            print(f"M={m:4} {o:12} {r['median_ms']:9.3f} ms  x{r['vs_f32']:5.2f} of float32  "
                  f"max rel err {r['max_rel_err']:.1e}", flush=True)
    report = dict(command=" ".join(sys.argv), backend=jax.default_backend(),
                  device=str(jax.devices()[0]), experts=E, hidden=D, ffn=F, layers=args.layers,
                  repeats=args.repeats, load_before=load_before, load_after=os.getloadavg(),
                  results=results)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
