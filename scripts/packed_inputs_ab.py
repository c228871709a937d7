"""The plain step with its inputs in one buffer against the same step with 33 input arrays.

  python scripts/packed_inputs_ab.py [N ...]      (default: 1 16 64 256)

For each N: the tiny model of `jaxserve bench overhead` (jaxserve/bench/overhead_probe.py)
decodes N requests, one (N, N) decode step's packed inputs are captured, and a second
executable of the same step is compiled taking the fields as separate arrays (the layout
before step_layout.py; its unpack is skipped for them). Then 30 pairs of blocks, 10 queued
steps each, alternate the two on the same inputs, KV cache and weights; printed: the median
time per step of each and the median of the per-pair ratios. What it times is the call plus
the device's work, as the engine's launches see it.
"""

from __future__ import annotations

import functools
import statistics
import sys
import time

import jax
import numpy as np

import jaxserve.bench.overhead_probe as op
from jaxserve.model.loader import load_model
from jaxserve.core.request import SamplingParams
from jaxserve.runner import model_runner, packed_inputs
from jaxserve.runner.compiled_step import CompiledStep
from jaxserve.model.step_inputs import StepInputs


def measure(n: int, tokenizer, pairs: int = 30, block: int = 10) -> dict:
    steps = 20
    llm = op.build_llm(n, steps, tokenizer)
    runner = llm.engine.runner
    step = runner.step
    captured, run = [], step.run
    step.run = lambda inputs: (captured.append(inputs), run(inputs))[1]
    params = SamplingParams(max_tokens=steps + 2, temperature=0.0, ignore_eos=True)
    for i in range(n):
        llm.engine.add_request([3 + (7 * i + j) % 250 for j in range(8)], params)
    while llm.engine.has_unfinished():
        llm.engine.step()
    step.run = run
    packed = [c for c in captured if c.shape == (n, n)][-1]
    p = runner.buckets.max_pages_per_request
    empty = lambda shape: StepInputs.empty(*shape, p, runner.mask_words,  # noqa: E731
                                           device_tables=True)
    separate = CompiledStep("separate", functools.partial(
        model_runner.plain_step, runner.graphdef, runner.attention), step.state, step.caches,
        runner.buckets, empty)
    separate.warmup(progress=False)
    template = empty((n, n))
    template.sampling.grammar_bitmask = None  # (the packed views have none: no grammar)
    arrays = jax.tree.map(lambda v, e: np.asarray(v).astype(e.dtype), packed.views, template)
    arrays.sampling.grammar_bitmask = packed.grammar_bitmask  # the same device-resident one
    times = {"packed": [], "separate": []}
    for _ in range(pairs):
        for name, (compiled, inputs) in (("packed", (step, packed)),
                                         ("separate", (separate, arrays))):
            start = time.perf_counter()
            for _ in range(block):
                out = compiled.run(inputs)
            jax.block_until_ready(out)
            times[name].append((time.perf_counter() - start) / block * 1e3)
    llm.close()
    return {"n": n, "packed_ms": statistics.median(times["packed"]),
            "separate_ms": statistics.median(times["separate"]),
            "separate_over_packed": statistics.median(
                [s / p for s, p in zip(times["separate"], times["packed"])])}


def main() -> int:
    unpack = packed_inputs.unpack  # the separate arrays' executable skips it
    packed_inputs.unpack = lambda x: x if isinstance(x, StepInputs) else unpack(x)
    tokenizer = load_model("default", progress=False).tokenizer
    for n in [int(a) for a in sys.argv[1:]] or [1, 16, 64, 256]:
        r = measure(n, tokenizer)
        print(f"N={n}: ms per step packed {r['packed_ms']:.3f}, separate {r['separate_ms']:.3f},"
              f" separate/packed {r['separate_over_packed']:.3f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
