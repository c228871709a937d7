"""Decode step time of a mixture-of-experts model against a dense model with the same active
parameters, side by side in one run, at several numbers of running requests.

    python scripts/bench_moe.py [--batches 1,16,64] [--experts 16] [--top-k 2]
        [--hidden 512] [--moe-intermediate 256] [--layers 4] [--vocab 8192] [--steps 24]
        [--rounds 2] [--quantization none|int8|int4] [--out scripts/bench_results/moe_vs_dense.json]
    python scripts/bench_moe.py --quick --out /tmp/moe_vs_dense.json   # a smoke run

Two random models with Qwen3's attention: a Qwen3-MoE ("qwen3moe": `--experts` experts of width
`--moe-intermediate`, top `--top-k`, renormalised) and a dense Qwen3 whose FFN width is
top-k * moe-intermediate, so one token reads the same number of parameters in both
(ModelConfig.num_active_params(), but for the MoE's router, hidden x experts a layer; the
totals differ by the experts a token skips). Each gets
its own engine (no prefix cache; enough pages for the largest batch; token buckets that hold
each batch's decode step exactly, so no padding differs between them). For each batch size B,
B requests of distinct 16-token prompts are prefilled, then `--steps` engine steps of all B
decoding are timed (the last step, which may run fewer, is dropped). Rounds alternate the order
(MoE first, then dense first) so load from elsewhere hits both alike. Reported per B: each
model's median and minimum step ms, and MoE / dense of the medians. On the CPU a decode of few
requests gathers the experts it uses (moe.py), while past num_experts pairs ragged_dot runs every
expert over the whole batch, so the ratio grows with B there; on TPU and GPU ragged_dot is a
grouped matmul. Writes JSON (the command, machine, settings, both configs, the figures). It
measures and prints; it asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # engine_probe

PROMPT_LEN = 16
QUICK = dict(batches="1,4,8", experts=8, hidden=64, moe_intermediate=32, layers=2, vocab=256,
             steps=4, rounds=1)


def configs(args):
    """(MoE config, dense config): the same attention, embedding and head; the dense FFN is
    top_k experts wide."""
    from jaxserve.model.config import ModelConfig

    heads = max(1, args.hidden // 64)
    common = dict(vocab_size=args.vocab, hidden_size=args.hidden, num_layers=args.layers,
                  num_heads=heads, num_kv_heads=max(1, heads // 2),
                  head_dim=args.hidden // heads, rms_norm_eps=1e-6, rope_theta=1e6,
                  max_position_embeddings=4096, eos_token_ids=(2,), bos_token_id=1)
    moe = ModelConfig(**common, architecture="qwen3moe", name="bench-moe",
                      intermediate_size=args.moe_intermediate, num_experts=args.experts,
                      num_experts_per_tok=args.top_k, moe_intermediate_size=args.moe_intermediate,
                      norm_topk_prob=True)
    dense = ModelConfig(**common, architecture="qwen3", name="bench-dense",
                        intermediate_size=args.top_k * args.moe_intermediate)
    router = math.prod(moe.param_shapes()["layers.router"])
    if moe.num_active_params() != dense.num_active_params() + router:
        raise RuntimeError(f"active parameters differ by more than the router: MoE "
                           f"{moe.num_active_params()}, dense {dense.num_active_params()}")
    return moe, dense


def build_llm(config, tokenizer, batches: list[int], steps: int, quantization: str):
    from jaxserve.entrypoints.llm import LLM
    from jaxserve.model.decoder.decoder import random_params
    from jaxserve.model.loaders.weights import LoadedModel

    top = max(batches)
    max_len = PROMPT_LEN + steps + 8
    pages_each = -(-max_len // 16)
    budget = max(top, 64)
    loaded = LoadedModel(config, random_params(config, seed=0, scale=0.08), tokenizer, "random")
    return LLM(loaded=loaded, progress=False, quantization=quantization, max_num_seqs=top,
               max_num_batched_tokens=budget, token_buckets=tuple(sorted({*batches, budget})),
               max_model_len=max_len, page_size=16, num_pages=top * pages_each + 2,
               enable_prefix_caching=False)


def decode_step_seconds(engine, batch: int, steps: int, vocab: int, seed: int) -> list[float]:
    """Seconds per engine step with `batch` requests of distinct prompts all decoding."""
    import numpy as np

    from engine_probe import _decode_steps
    from jaxserve.core.request import SamplingParams

    rng = np.random.default_rng(seed)
    params = SamplingParams(max_tokens=steps + 2, temperature=0.0, ignore_eos=True)
    prompts = [rng.integers(3, vocab, PROMPT_LEN).tolist() for _ in range(batch)]
    return _decode_steps(engine, prompts, [params] * batch)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", default="1,16,64")
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--moe-intermediate", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--quantization", default="none", choices=("none", "int8", "int4"))
    parser.add_argument("--quick", action="store_true", help="tiny settings: a smoke run")
    parser.add_argument("--out", default="scripts/bench_results/moe_vs_dense.json")
    args = parser.parse_args()
    if args.quick:
        for key, value in QUICK.items():
            setattr(args, key, value)
    import jax

    from jaxserve.model.loaders.loader import load_model

    batches = [int(b) for b in args.batches.split(",")]
    moe_config, dense_config = configs(args)
    tokenizer = load_model("default", progress=False).tokenizer
    load_before = os.getloadavg()
    llms = {}
    for name, config in (("moe", moe_config), ("dense", dense_config)):
        start = time.perf_counter()
        llms[name] = build_llm(config, tokenizer, batches, args.steps, args.quantization)
        print(f"{name}: engine up in {time.perf_counter() - start:.0f} s", flush=True)
    times = {name: {b: [] for b in batches} for name in llms}
    for r in range(args.rounds):
        order = list(llms) if r % 2 == 0 else list(reversed(llms))
        for b in batches:
            for name in order:
                times[name][b] += decode_step_seconds(llms[name].engine, b, args.steps,
                                                      args.vocab, seed=r * 1000 + b)
    rows = {}
    for b in batches:
        row = {name: {"median_ms": 1000 * statistics.median(times[name][b]),
                      "min_ms": 1000 * min(times[name][b]), "num_steps": len(times[name][b])}
               for name in llms}
        row["moe_over_dense"] = row["moe"]["median_ms"] / row["dense"]["median_ms"]
        rows[b] = row
        print(f"{b:3} running: MoE {row['moe']['median_ms']:8.2f} ms (min "
              f"{row['moe']['min_ms']:.2f})  dense {row['dense']['median_ms']:8.2f} ms (min "
              f"{row['dense']['min_ms']:.2f})  MoE/dense {row['moe_over_dense']:.2f}", flush=True)
    describe = lambda c: {"architecture": c.architecture, "num_params": c.num_params(),
                          "num_active_params": c.num_active_params(),
                          "hidden_size": c.hidden_size, "num_layers": c.num_layers,
                          "intermediate_size": c.intermediate_size,
                          "num_experts": c.num_experts,
                          "num_experts_per_tok": c.num_experts_per_tok,
                          "moe_intermediate_size": c.moe_intermediate_size,
                          "vocab_size": c.vocab_size}
    env = [f"{k}={os.environ[k]}" for k in ("JAXSERVE_MOE_GROUPED",) if k in os.environ]
    report = dict(command=" ".join([*env, Path(sys.executable).name, *sys.argv]),
                  machine={"backend": jax.default_backend(), "device": str(jax.devices()[0]),
                           "cores": os.cpu_count(), "platform": platform.platform(),
                           "jax": jax.__version__},
                  load_before=load_before, load_after=os.getloadavg(),
                  settings={k: v for k, v in vars(args).items()},
                  models={"moe": describe(moe_config), "dense": describe(dense_config)},
                  weight_bytes={n: llm.engine.info.weight_bytes for n, llm in llms.items()},
                  batches=rows)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
