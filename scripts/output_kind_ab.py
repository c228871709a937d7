"""Decode steps of N requests with output_kind "cumulative" against "final_only", paired.

  python scripts/output_kind_ab.py [N ...]      (default: 16 64 256)

The tiny model of `jaxserve bench overhead` (jaxserve/bench/overhead_probe.py); per N, 8 pairs:
N requests of each kind in turn are prefilled, then 26 decode steps are timed (wall per step,
inside the serving loops' frozen heap). Printed: the medians and the median per-pair ratio
cumulative / final_only (what LLM.generate saves by asking for final outputs only).
"""

from __future__ import annotations

import statistics
import sys
import time

import jaxserve.bench.overhead_probe as op
from jaxserve.engine.engine import frozen_heap
from jaxserve.model.loader import load_model
from jaxserve.core.request import SamplingParams


def measure(n: int, tokenizer, pairs: int = 8, steps: int = 30) -> dict:
    llm = op.build_llm(n, steps + 10, tokenizer)
    engine = llm.engine
    times = {"cumulative": [], "final_only": []}
    for r in range(pairs):
        for kind in times:
            params = SamplingParams(max_tokens=steps + 2, temperature=0.0, ignore_eos=True,
                                    output_kind=kind)
            for i in range(n):
                engine.add_request([3 + (7 * i + j + r) % 250 for j in range(8)], params)
            for _ in range(2):  # prefill, first decode
                engine.step()
            with frozen_heap():
                start = time.perf_counter()
                for _ in range(steps - 4):
                    engine.step()
                times[kind].append((time.perf_counter() - start) / (steps - 4) * 1e3)
            while engine.has_unfinished():
                engine.step()
    llm.close()
    return {k: statistics.median(v) for k, v in times.items()} | {"ratio": statistics.median(
        [c / f for c, f in zip(times["cumulative"], times["final_only"])])}


def main() -> int:
    tokenizer = load_model("default", progress=False).tokenizer
    for n in [int(a) for a in sys.argv[1:]] or [16, 64, 256]:
        r = measure(n, tokenizer)
        print(f"N={n}: ms per step cumulative {r['cumulative']:.3f}, final_only "
              f"{r['final_only']:.3f}, cumulative/final_only {r['ratio']:.3f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
