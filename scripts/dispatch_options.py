"""What one call of the compiled step costs the calling thread, per way of calling it.

    python scripts/dispatch_options.py [--json scripts/bench_results/dispatch_options.json]

The default model (SmolLM2-135M) at batch 1, every option on the same bucket, medians of 30
calls each with the device idle before the call (the engine's case when the host is the
bottleneck) and with a step already queued (the async loop's steady state when the device
is):
  unroll:   per-layer weights (273 argument leaves): the CPU default, fastest compute
  scan:     stacked weights (12 leaves): the TPU/GPU default
  numpy / placed: the step inputs as host numpy arrays, or already on the device
  launcher: the call handed to ModelRunner's launcher thread (the engine thread's cost)
  flatten:  what flattening the weights costs per call, as the NNX state (what each call paid
            before CompiledStep passed them as one flat tuple) and as that tuple
It measures; the choice it informs is written in model_runner.py and docs/host_loop.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

import jax

from jaxserve.entrypoints.llm import LLM
from jaxserve.model.loaders.loader import load_model


def _median_ms(fn, before=None, repeats: int = 30) -> float:
    times = []
    for _ in range(repeats):
        if before is not None:
            before()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


def measure(layer_loop: str, loaded) -> dict:
    llm = LLM("default", loaded=loaded, progress=False, max_model_len=256, max_num_seqs=1,
              max_num_batched_tokens=1, token_buckets=(1,), seq_buckets=(1,),
              layer_loop=layer_loop)
    step = llm.engine.runner.step
    exe = step._executables[(1, 1)]
    numpy_inputs = step.empty_inputs((1, 1))
    placed = jax.device_put(numpy_inputs)

    def call(inputs):
        out, kv = exe(step.leaves, step.kv, inputs)
        step._set_kv(kv)
        return out

    idle = lambda: jax.block_until_ready(step.kv)  # noqa: E731
    result = {"leaves": len(jax.tree.leaves(step.state)) + len(jax.tree.leaves(step.kv))}
    result["numpy_idle_ms"] = _median_ms(lambda: call(numpy_inputs), idle)
    result["placed_idle_ms"] = _median_ms(lambda: call(placed), idle)
    result["placed_queued_ms"] = _median_ms(lambda: call(placed),
                                            lambda: (idle(), call(placed)))
    result["compute_ms"] = _median_ms(lambda: jax.block_until_ready(call(placed)), idle)
    result["state_flatten_ms"] = _median_ms(lambda: jax.tree.flatten(step.state))
    result["tuple_flatten_ms"] = _median_ms(lambda: jax.tree.flatten(step.leaves))
    pool = ThreadPoolExecutor(1)
    result["launcher_submit_ms"] = _median_ms(lambda: pool.submit(call, placed),
                                              lambda: (pool.submit(idle).result()))
    pool.shutdown()
    llm.close()
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", dest="json_path", default=None)
    args = parser.parse_args()
    loaded = load_model("default", progress=False)
    results = {loop: measure(loop, loaded) for loop in ("unroll", "scan")}
    print(f"{'':8} {'leaves':>6} {'numpy idle':>10} {'placed idle':>11} {'placed queued':>13} "
          f"{'launcher':>8} {'compute':>8} {'flatten state / tuple':>22}   (ms on the calling thread)")
    for loop, r in results.items():
        print(f"{loop:8} {r['leaves']:6d} {r['numpy_idle_ms']:10.2f} {r['placed_idle_ms']:11.2f} "
              f"{r['placed_queued_ms']:13.2f} {r['launcher_submit_ms']:8.3f} "
              f"{r['compute_ms']:8.2f} {r['state_flatten_ms']:10.3f} / {r['tuple_flatten_ms']:.3f}")
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
