"""Quantized weights under tensor parallelism on 2 fake CPU devices; tests/test_quant_engine.py
runs it in a subprocess.

    python tests/tp_quant_check.py OUT.json

XLA_FLAGS must ask for host devices before jax starts, hence a process of its own. For int8 and
int4 it converts the tiny GQA model to a quantized checkpoint, serves the mixed greedy requests
with tensor_parallel_size 1 (unrolled layers) and 2 (scanned layers, swap preemption), each
engine restoring the quantized arrays straight into their shardings, and writes the tokens and
the shardings of the quantized parts to OUT.json. It asserts nothing: the test does.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=2")
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jax  # noqa: E402  (after XLA_FLAGS)
from scale_out_fixtures import LEAN_ENGINE, mixed_requests, save_tiny_checkpoint  # noqa: E402

from jaxserve.entrypoints.llm import LLM  # noqa: E402
from jaxserve.model.loaders.loader import convert  # noqa: E402

RUNS = [(1, "unroll", "recompute"), (2, "scan", "swap")]


def part_specs(state) -> dict:
    """'layers.wq.q' -> its PartitionSpec, for the stacked (scan) layout."""
    specs = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]:
        keys = [str(k.key) for k in path if isinstance(k, jax.tree_util.DictKey)]
        specs[".".join(keys)] = str(getattr(leaf.sharding, "spec", None))
    return specs


def main() -> int:
    result: dict = {"tokens": {}, "shardings": {}}
    prompts, params = mixed_requests(n=16)
    with tempfile.TemporaryDirectory() as tmp:
        # 128 FFN columns: each of 2 devices holds 64 inputs of w_down, whole groups of 32
        source = save_tiny_checkpoint(Path(tmp) / "float", intermediate_size=128)
        for mode in ("int8", "int4"):
            checkpoint = convert(str(source), Path(tmp) / mode, progress=False,
                                 quantization=mode)
            result["tokens"][mode] = {}
            for tp, layer_loop, preemption in RUNS:
                llm = LLM(str(checkpoint), progress=False, tensor_parallel_size=tp,
                          layer_loop=layer_loop, preemption_mode=preemption, **LEAN_ENGINE)
                outs = llm.generate(prompts, params, use_tqdm=False)
                result["tokens"][mode][str(tp)] = [o.token_ids for o in outs]
                if tp == 2:
                    result["shardings"][mode] = part_specs(llm.engine.runner.state)
                llm.close()
    Path(sys.argv[1]).write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
