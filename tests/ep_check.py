"""Expert parallelism on 4 fake CPU devices; tests/test_expert_parallel.py runs it in a subprocess.

    python tests/ep_check.py SPEC.json OUT.json

XLA_FLAGS must ask for 4 host devices before jax starts, hence a process of its own, one for
every configuration: SPEC.json names the MoE checkpoints ({"models": {name: directory}}) and
the prompts. The first model is served greedily on one device, with plain tensor parallelism 2,
and with expert parallelism 2 (on 2 devices), 4 (on 4, scanned layers) and 2 x tensor 2 (on
4); the others on one device, with EP 4 and with EP 2 x TP 2 (OTHER_MODELS_RUNS). The first
model again as a jaxserve checkpoint restored straight into the 2 x 2 shardings, and with int8
weights on one device and 2 x 2; then a dense checkpoint with expert parallelism asked for
(ignored, with a warning). OUT.json gets each run's tokens, preemptions, the compilations
counted while serving (after warm-up), and the shardings found on the expert weights and the
router. It asserts nothing: the test reads the JSON and does.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import tempfile
from pathlib import Path

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=4")
os.environ["JAX_PLATFORMS"] = "cpu"
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import conftest  # noqa: E402,F401  (the test session's compile cache settings)
import jax  # noqa: E402  (after XLA_FLAGS)
import sharding_report  # noqa: E402
from arch_oracle import ENGINE, NUM_GREEDY  # noqa: E402

from jaxserve import SamplingParams  # noqa: E402
from jaxserve.entrypoints.llm import LLM  # noqa: E402
from jaxserve.model.loaders.checkpoint import save_checkpoint  # noqa: E402
from jaxserve.model.loaders.loader import load_model  # noqa: E402
from jaxserve.runner.compile_count import CompileCounter  # noqa: E402

# A 4-token bucket as well as ENGINE's 16: decode steps of up to 4 requests have at most
# 4 * top_k <= num_experts pairs, so they take moe.py's gathered path; larger steps the grouped.
SETTINGS = {**ENGINE, "token_buckets": (4, 16)}
RUNS = {
    "1": {},
    "tp2": dict(tensor_parallel_size=2),
    "ep2": dict(tensor_parallel_size=2, enable_expert_parallel=True),
    "ep4": dict(tensor_parallel_size=4, enable_expert_parallel=True, layer_loop="scan"),
    "ep2xtp2": dict(tensor_parallel_size=4, enable_expert_parallel=True, expert_parallel_size=2),
}
# The first model runs every configuration; the others the one-device reference, EP 4 and
# EP 2 x TP 2 (each expert split over experts and width, attention over all 4 devices).
OTHER_MODELS_RUNS = ("1", "ep4", "ep2xtp2")
WATCHED = ("router", "e_gate", "e_down", "wq")


def watched_shardings(state) -> dict:
    return sharding_report.watched_shardings(state, WATCHED)


def serve(loaded, batch, **settings) -> dict:
    """loaded: a LoadedModel, or a checkpoint directory (restored into the shardings)."""
    source = {"model": loaded} if isinstance(loaded, str) else {"loaded": loaded}
    llm = LLM(progress=False, **source, **{**SETTINGS, **settings})
    params = SamplingParams(max_tokens=NUM_GREEDY, temperature=0.0, ignore_eos=True)
    with CompileCounter() as compiles:
        outs = llm.generate(batch, params, use_tqdm=False)
    engine = llm.engine
    return {"tokens": [o.token_ids for o in outs], "compiles": compiles.count,
            "preemptions": engine.scheduler.num_preemptions,
            "expert_parallel_size": engine.info.expert_parallel_size,
            "weights": watched_shardings(engine.runner.state)}


class Warnings(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def dense_with_expert_parallel(batch) -> dict:
    """A dense checkpoint (restored straight into the shardings) served with expert
    parallelism asked for: the setting is ignored with a warning, the tokens are one device's."""
    from scale_out_fixtures import save_tiny_checkpoint

    warnings = Warnings()
    logging.getLogger("jaxserve").addHandler(warnings)
    with tempfile.TemporaryDirectory() as tmp:
        loaded = load_model(str(save_tiny_checkpoint(Path(tmp) / "dense")), progress=False)
        want = serve(loaded, batch)
        llm = LLM(str(Path(tmp) / "dense"), progress=False, tensor_parallel_size=4,
                  enable_expert_parallel=True, **SETTINGS)
        params = SamplingParams(max_tokens=NUM_GREEDY, temperature=0.0, ignore_eos=True)
        got = [o.token_ids for o in llm.generate(batch, params, use_tqdm=False)]
        result = {"want": want["tokens"], "tokens": got,
                  "expert_parallel_size": llm.engine.info.expert_parallel_size,
                  "weights": watched_shardings(llm.engine.runner.state)}
    logging.getLogger("jaxserve").removeHandler(warnings)
    result["warnings"] = [m for m in warnings.messages if "expert" in m]
    return result


def main() -> int:
    spec = json.loads(Path(sys.argv[1]).read_text())
    result: dict = {"device_count": jax.device_count(), "models": {}}
    first = next(iter(spec["models"]))
    for name, directory in spec["models"].items():
        loaded = load_model(directory, progress=False)
        runs = RUNS if name == first else {r: RUNS[r] for r in OTHER_MODELS_RUNS}
        result["models"][name] = {run: serve(loaded, spec["batch"], **settings)
                                  for run, settings in runs.items()}
    name, directory = next(iter(spec["models"].items()))
    with tempfile.TemporaryDirectory() as tmp:
        save_checkpoint(Path(tmp) / "ckpt", load_model(directory, progress=False))
        result["models"][name]["ep2xtp2_checkpoint"] = serve(
            str(Path(tmp) / "ckpt"), spec["batch"], **RUNS["ep2xtp2"])
    # int8 experts split over the devices (q, scales) serve int8's tokens on one device
    for run, settings in (("int8", {}), ("ep2xtp2_int8", RUNS["ep2xtp2"])):
        int8 = load_model(directory, progress=False, quantization="int8")
        result["models"][name][run] = serve(int8, spec["batch"], **settings)
    result["dense"] = dense_with_expert_parallel([p[:20] for p in spec["batch"]])
    Path(sys.argv[2]).write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
