"""Multi-LoRA's cost: 16 concurrent requests spread over 4 rank-16 adapters on every projection
against the same 16 requests on the base model, side by side in one run.

  python scripts/bench_lora.py [--num-requests 16] [--num-adapters 4] [--rank 16]
      [--prompt-len 128] [--max-tokens 128] [--rounds 3]
      [--json scripts/bench_results/lora_vs_base.json]

The base model is the default model (SmolLM2-135M, a Llama). The adapters are random PEFT
adapters on its architecture, written into a temporary directory: adapter_config.json by
peft's own LoraConfig.save_pretrained (r = --rank, lora_alpha = 2 r, targets q, k, v, o, gate,
up, down), adapter_model.safetensors with PEFT's tensor names and shapes (lora_A [r, in],
lora_B [out, r] per layer and projection, small random values so outputs stay sane). Two
engines in one process, both max_num_seqs = --num-requests: `lora` (enable_lora, max_loras =
--num-adapters, max_lora_rank = --rank; request i under adapter i mod --num-adapters) and
`base` (no LoRA at all); a third side, `base_on_lora_engine`, runs the base requests on the
LoRA engine (no adapter named), which shows what serving adapters costs requests that use
none. Every request has the same random prompt length and ignores EOS, so each side decodes
the same number of tokens. A warm-up round (untimed) compiles nothing new but reads the
adapters into their slots; then each round runs every side once, the order rotating from
round to round so machine load hits all sides alike. The prefix cache is off on both
engines (every run repeats the prompts: a cache would skip some sides' prefills). Reports each
run's output tokens/s, and lora over base (best run of each, and the mean ratio). Prints JSON; --json writes it too, with
the command. It measures and never asserts.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from jaxserve import LoRARequest, SamplingParams  # noqa: E402
from jaxserve.entrypoints.llm import LLM  # noqa: E402
from jaxserve.lora.device import lora_targets  # noqa: E402
from jaxserve.lora.peft import CONFIG_FILE, TARGETS, WEIGHTS_FILE  # noqa: E402

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MODULES = ATTENTION + ("gate_proj", "up_proj", "down_proj")


def write_adapter(directory: Path, model_config, rank: int, seed: int) -> Path:
    """A random PEFT LoRA adapter on every projection of model_config's architecture."""
    import peft
    from safetensors.numpy import save_file

    directory.mkdir(parents=True, exist_ok=True)
    peft.LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=list(MODULES),
                    task_type="CAUSAL_LM").save_pretrained(str(directory))
    shapes = lora_targets(model_config)  # our name -> (in, out)
    ours = {peft_name: name for peft_name, name in TARGETS.items()}
    rng = np.random.default_rng(seed)
    tensors = {}
    for layer in range(model_config.num_layers):
        for module in MODULES:
            d_in, d_out = shapes[ours[module]]
            part = "self_attn" if module in ATTENTION else "mlp"
            key = f"base_model.model.model.layers.{layer}.{part}.{module}"
            tensors[f"{key}.lora_A.weight"] = (rng.standard_normal((rank, d_in))
                                               / np.sqrt(d_in)).astype(np.float32)
            tensors[f"{key}.lora_B.weight"] = (0.01 * rng.standard_normal((d_out, rank))
                                               ).astype(np.float32)
    save_file(tensors, str(directory / WEIGHTS_FILE))
    assert (directory / CONFIG_FILE).is_file()
    return directory


def run(llm, prompts, params, loras) -> dict:
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False, lora_request=loras)
    wall = time.perf_counter() - start
    tokens = sum(len(o.token_ids) for o in outs)
    return {"output_tokens": tokens, "wall_s": round(wall, 4),
            "output_tok_s": round(tokens / wall, 3),
            "finish_reasons": sorted({o.finish_reason for o in outs})}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-requests", type=int, default=16)
    parser.add_argument("--num-adapters", type=int, default=4)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", dest="json_path", default=None)
    args = parser.parse_args()
    n, k = args.num_requests, args.num_adapters
    # No prefix cache: every run repeats the same prompts, and a cache would skip the prefill of
    # a side whose pages survived since its last run (the base engine's always do; the LoRA
    # engine's are split between two sides and evicted), which is not what this measures.
    engine = dict(max_num_seqs=n, max_model_len=args.prompt_len + args.max_tokens + 16,
                  enable_prefix_caching=False)
    llms = {"lora": LLM("default", progress=False, enable_lora=True, max_loras=k,
                        max_cpu_loras=k, max_lora_rank=args.rank, **engine)}
    config = llms["lora"].engine.model_config
    rng = np.random.default_rng(0)
    prompts = [rng.integers(10, config.vocab_size, args.prompt_len).tolist() for _ in range(n)]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    with tempfile.TemporaryDirectory(prefix="bench_lora_") as tmp:
        dirs = [write_adapter(Path(tmp) / f"adapter{i}", config, args.rank, seed=i + 1)
                for i in range(k)]
        adapters = [LoRARequest(f"adapter{i}", i + 1, str(d)) for i, d in enumerate(dirs)]
        llms["base"] = LLM("default", progress=False, **engine)
        sides = {"lora": (llms["lora"], [adapters[i % k] for i in range(n)]),
                 "base": (llms["base"], None),
                 "base_on_lora_engine": (llms["lora"], None)}
        for llm, loras in sides.values():  # warm-up: adapters into their slots
            run(llm, prompts, params, loras)
        runs = {side: [] for side in sides}
        names = list(sides)
        for r in range(args.rounds):
            order = names[r % len(names):] + names[:r % len(names)]
            for side in order:
                llm, loras = sides[side]
                runs[side].append(run(llm, prompts, params, loras))
    best = {side: max(x["output_tok_s"] for x in rs) for side, rs in runs.items()}
    mean = {side: sum(x["output_tok_s"] for x in rs) / len(rs) for side, rs in runs.items()}
    report = {
        "command": "python " + " ".join([sys.argv[0], *sys.argv[1:]]),
        "model": "default (SmolLM2-135M-Instruct)", "num_requests": n, "num_adapters": k,
        "rank": args.rank, "targets": list(MODULES), "prompt_len": args.prompt_len,
        "max_tokens": args.max_tokens, "rounds": args.rounds, "max_num_seqs": n,
        "enable_prefix_caching": False,
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                    "loadavg_at_end": list(os.getloadavg())},
        "lora_slot_loads": llms["lora"].engine.scheduler.lora_slots.num_loads,
        "runs": runs, "best_output_tok_s": best,
        "lora_over_base_tok_s": best["lora"] / best["base"],
        "lora_over_base_mean": mean["lora"] / mean["base"],
        "base_on_lora_engine_over_base_tok_s": best["base_on_lora_engine"] / best["base"],
    }
    print(json.dumps(report, indent=2))
    if args.json_path:
        Path(args.json_path).parent.mkdir(parents=True, exist_ok=True)
        with open(args.json_path, "w") as f:
            json.dump(report, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
