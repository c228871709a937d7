"""The rollout API under tensor parallelism on 2 fake CPU devices; tests/test_rollout_tp.py runs
it in a subprocess.

    python tests/tp_rollout_check.py OUT.json

XLA_FLAGS must ask for host devices before jax starts, hence a process of its own. For float32
and int8 weights it serves greedy requests on a tensor_parallel_size 2 engine of the tiny model
(seed 0), swaps in seed 1's weights (counting compilations and device bytes), sleeps and wakes
it at both levels, and serves the same requests on a fresh engine loaded with seed 1's weights;
it writes the tokens, counts and bytes to OUT.json and asserts nothing: the test does.
"""

from __future__ import annotations

import gc
import json
import os
import sys
from pathlib import Path

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=2")
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jax  # noqa: E402  (after XLA_FLAGS)
from conftest import SMALL_ENGINE  # noqa: E402
from tiny_models import tiny_loaded  # noqa: E402

from jaxserve import SamplingParams  # noqa: E402
from jaxserve.entrypoints.llm import LLM  # noqa: E402
from jaxserve.runner.compile_count import CompileCounter  # noqa: E402
from jaxserve.runner.rollout_memory import device_bytes  # noqa: E402

PROMPTS = [[5, 9, 13, 17, 21], [40, 41, 42], list(range(30, 70))]
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)


def greedy(llm) -> list[list[int]]:
    return [o.token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


def bytes_now() -> int:
    gc.collect()
    return device_bytes()


def run(quantization: str) -> dict:
    engine = lambda seed: LLM(loaded=tiny_loaded(seed), progress=False, tensor_parallel_size=2,
                              quantization=quantization, **SMALL_ENGINE)
    fresh = engine(1)
    want = greedy(fresh)
    fresh.close()
    del fresh
    llm = engine(0)
    before_tokens = greedy(llm)
    before = bytes_now()
    with CompileCounter() as compiles:
        llm.update_weights(tiny_loaded(1).params)
        updated = greedy(llm)
        after = bytes_now()
        llm.sleep(level=1)
        asleep1 = bytes_now()
        llm.wake_up()
        woke1 = greedy(llm)
        llm.sleep(level=2)
        asleep2 = bytes_now()
        llm.update_weights(tiny_loaded(1).params)
        llm.wake_up()
        woke2 = greedy(llm)
    kv = sum(a.nbytes for a in llm.engine.runner.kv)
    weights = sum(a.nbytes for a in llm.engine.runner.step.leaves)
    llm.close()
    return {"want": want, "before": before_tokens, "updated": updated, "woke1": woke1,
            "woke2": woke2, "compiles": compiles.count, "bytes_before": before,
            "bytes_after": after, "bytes_asleep1": asleep1, "bytes_asleep2": asleep2,
            "kv_bytes": kv, "weight_bytes": weights, "devices": jax.device_count()}


def main() -> int:
    result = {mode: run(mode) for mode in ("none", "int8")}
    Path(sys.argv[1]).write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
