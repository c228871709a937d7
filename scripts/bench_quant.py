"""float32 vs int8 vs int4 weights on the default model, side by side in one run.

    python scripts/bench_quant.py [--rounds=2] [--out scripts/bench_results/quant.json]

Builds one engine per weight form (float32; int8: what `--quantization int8` serves, per
channel, the GGUF's blocks requantized at load, which the CPU multiplies with int8 activations,
qlinear.int8_dot; int8 g32 with `int8_activations="off"` and int4: the GGUF's blocks mapped
straight to each, model/quant/gguf.py, groups of 32, dequantized in the step), then alternates
between them, round by round: the batch-1 decode
step (median and min ms over 48 steps) and the 16-concurrent anyscale workload's output tok/s.
Each form's weight bytes on device come with its bandwidth bound, bytes / measured read
bandwidth (a jitted sum over a 1 GiB float32 array, the same run): the step time if it did
nothing but read its weights once. It measures and prints; it asserts nothing.
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

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine_probe import _anyscale, _decode_steps  # noqa: E402

from jaxserve.entrypoints.llm import LLM  # noqa: E402
from jaxserve.model.quant import qlinear
from jaxserve.model.quant import select as quant_select  # noqa: E402
from jaxserve.core.request import SamplingParams  # noqa: E402

MODES = ("none", "int8", "int8g32", "int4")
NAMES = {"none": "float32", "int8": "int8 pc", "int8g32": "int8 g32", "int4": "int4 g32"}


def read_bandwidth_gb_s(num_bytes: int = 1 << 30) -> float:
    """Best of 10 jitted sums over a float32 array of num_bytes (bytes read / s, GB/s)."""
    x = jnp.ones(num_bytes // 4, jnp.float32)
    total = jax.jit(jnp.sum)
    total(x).block_until_ready()
    best = float("inf")
    for _ in range(10):
        start = time.perf_counter()
        total(x).block_until_ready()
        best = min(best, time.perf_counter() - start)
    return num_bytes / best / 1e9


def decode1(llm) -> list[float]:
    params = SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True)
    return _decode_steps(llm.engine, [list(range(100, 164))], [params])


def anyscale16(llm) -> float:
    return _anyscale(llm.engine, 16)["anyscale16_output_tok_s"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    settings = dict(progress=False, max_model_len=1024, max_num_seqs=16)
    load_before = os.getloadavg()
    llms = {mode: LLM("default", quantization=mode, **settings) for mode in MODES
            if mode != "int8g32"}
    llms["int8g32"] = LLM("default", quantization="int8", int8_activations="off", **settings)
    llms = {mode: llms[mode] for mode in MODES}
    bandwidth = read_bandwidth_gb_s()
    steps = {mode: [] for mode in MODES}
    tok_s = {mode: [] for mode in MODES}
    for _ in range(args.rounds):
        for mode, llm in llms.items():
            steps[mode] += decode1(llm)
            tok_s[mode].append(anyscale16(llm))
    rows = {}
    for mode, llm in llms.items():
        info = llm.engine.info
        rows[mode] = dict(
            weight_bytes=info.weight_bytes, formats=[list(f) for f in info.weight_formats],
            decode1_ms_median=1000 * statistics.median(steps[mode]),
            decode1_ms_min=1000 * min(steps[mode]),
            bandwidth_bound_ms=info.weight_bytes / (bandwidth * 1e9) * 1000,
            anyscale16_tok_s=max(tok_s[mode]), anyscale16_tok_s_all=tok_s[mode])
    base = rows["none"]
    for row in rows.values():
        row["decode1_speedup_vs_float32"] = base["decode1_ms_median"] / row["decode1_ms_median"]
        row["anyscale16_vs_float32"] = row["anyscale16_tok_s"] / base["anyscale16_tok_s"]
        row["bytes_vs_float32"] = row["weight_bytes"] / base["weight_bytes"]
    result = dict(machine=f"{jax.default_backend()} x{jax.device_count()}",
                  read_bandwidth_gb_s=bandwidth, rounds=args.rounds,
                  quantized_matmul=quant_select.select().form.describe(),
                  dequant_chunk_bytes=qlinear.CHUNK_BYTES,
                  load_before=load_before, load_after=os.getloadavg(), modes=rows)
    print(f"read bandwidth {bandwidth:.1f} GB/s; load {load_before} -> {os.getloadavg()}")
    print(f"{'weights':8} {'MiB':>7} {'bytes':>6} {'decode1 ms':>11} {'min':>6} {'bound ms':>9} "
          f"{'x f32':>6} {'any16 tok/s':>12} {'x f32':>6}")
    for mode, r in rows.items():
        name = NAMES[mode]
        print(f"{name:8} {r['weight_bytes'] / 2**20:7.1f} {r['bytes_vs_float32']:6.1%} "
              f"{r['decode1_ms_median']:11.2f} {r['decode1_ms_min']:6.2f} "
              f"{r['bandwidth_bound_ms']:9.2f} {r['decode1_speedup_vs_float32']:6.2f} "
              f"{r['anyscale16_tok_s']:12.1f} {r['anyscale16_vs_float32']:6.2f}")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
