"""Tensor parallelism on 4 fake CPU devices; tests/test_tensor_parallel.py runs it in a subprocess.

    python tests/tp_check.py OUT.json

XLA_FLAGS must ask for 4 host devices before jax starts, hence a process of its own. It saves
the tiny GQA checkpoint (scale_out_fixtures), serves the 32 mixed greedy requests with
tensor_parallel_size 1, 2 (scan layout, swap preemption) and 4 (unrolled layout), each engine
restoring the checkpoint straight into its shardings, and writes to OUT.json the tokens, the
shardings it finds on the weights, KV pages, restored params and step inputs, and the errors of
impossible settings. It asserts nothing: the test reads the JSON and does.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=4")
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jax  # noqa: E402  (after XLA_FLAGS)
import sharding_report  # noqa: E402
from scale_out_fixtures import LEAN_ENGINE, mixed_requests, save_tiny_checkpoint  # noqa: E402

from jaxserve.entrypoints.llm import LLM  # noqa: E402
from jaxserve.model.decoder.sharding import make_mesh  # noqa: E402
from jaxserve.runner import tensor_parallel  # noqa: E402

RUNS = [  # (tensor_parallel_size, layer_loop, preemption_mode)
    (1, "unroll", "recompute"), (2, "scan", "swap"), (4, "unroll", "recompute")]
WATCHED = ("embed", "lm_head", "final_norm", "wq", "wk", "wo", "w_down", "inv_freq")


def state_shardings(state) -> dict:
    return sharding_report.watched_shardings(state, WATCHED)


SPEC_RUNS = {  # name -> speculative settings, served with tensor_parallel_size 2
    "ngram": dict(speculative_method="ngram", num_speculative_tokens=3),
    "draft": dict(speculative_method="draft", num_speculative_tokens=2,
                  speculative_draft="layers:1")}


def serve(checkpoint: Path, tp: int, layer_loop: str, preemption_mode: str, **spec) -> dict:
    llm = LLM(str(checkpoint), progress=False, tensor_parallel_size=tp, layer_loop=layer_loop,
              preemption_mode=preemption_mode, **LEAN_ENGINE, **spec)
    prompts, params = mixed_requests()
    outs = llm.generate(prompts, params, use_tqdm=False)
    runner, sched = llm.engine.runner, llm.engine.scheduler
    if spec:
        return {"tokens": [o.token_ids for o in outs]}
    shape, exe = next(iter(runner.step._executables.items()))
    step_inputs = jax.tree.leaves(exe.input_shardings[0][2:])
    return {"tokens": [o.token_ids for o in outs],
            "preemptions": sched.num_preemptions, "swaps": sched.num_swaps,
            "weights": state_shardings(runner.state),
            "kv": [sharding_report.describe(x) for x in runner.kv],
            "inputs_replicated": all(s.is_fully_replicated for s in step_inputs),
            "num_step_inputs": len(step_inputs),
            "num_input_leaves": len(jax.tree.leaves(runner.step.empty_inputs(shape)))}


def serve_twice_with_host_tier(checkpoint: Path) -> dict:
    """tensor_parallel_size 2 with the prefix cache's host tier: the mixed requests twice; the
    second pass finds the first's prefixes on the host (the 20-page pool evicted them)."""
    llm = LLM(str(checkpoint), progress=False, tensor_parallel_size=2,
              host_prefix_cache_size=16 << 20, **LEAN_ENGINE)
    prompts, params = mixed_requests()
    passes = [[o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
              for _ in range(2)]
    host = llm.engine.pages.stats().host
    return {"passes": passes, "host_hit_tokens": host.hit_tokens,
            "loaded_pages": host.loaded_pages}


def error_of(fn) -> str | None:
    try:
        fn()
    except ValueError as exc:
        return str(exc)
    return None


def main() -> int:
    out_path = Path(sys.argv[1])
    result: dict = {"device_count": jax.device_count(), "runs": {}}
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = save_tiny_checkpoint(Path(tmp) / "tiny")
        for tp, layer_loop, mode in RUNS:
            result["runs"][str(tp)] = serve(checkpoint, tp, layer_loop, mode)
        for name, spec in SPEC_RUNS.items():
            result["runs"][name] = serve(checkpoint, 2, "unroll", "recompute", **spec)
        result["runs"]["host_tier"] = serve_twice_with_host_tier(checkpoint)
        restored = tensor_parallel.load_model(str(checkpoint), make_mesh(2), progress=False)
        result["restored"] = {name: sharding_report.describe(restored.params[name])
                              for name in ("layers.wq", "layers.wk", "layers.w_up", "embed")}
        narrow = save_tiny_checkpoint(Path(tmp) / "narrow", num_heads=4, num_kv_heads=2)
        result["errors"] = {
            "kv_heads": error_of(lambda: LLM(str(narrow), progress=False,
                                             tensor_parallel_size=4, **LEAN_ENGINE)),
            "devices": error_of(lambda: LLM(str(checkpoint), progress=False,
                                            tensor_parallel_size=8, **LEAN_ENGINE))}
    out_path.write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
