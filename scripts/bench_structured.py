"""Structured output's cost: 16 concurrent JSON-schema requests vs the same workload without
constraints, side by side in one run (one engine, rounds alternating which goes first).

  python scripts/bench_structured.py [--num-requests 48] [--max-tokens 128] [--rounds=2]

The workload is the ten schemas of jaxserve/bench/structured_schemas.py with their chat prompts,
greedy, max_num_seqs 16. Each unconstrained request ignores EOS and runs exactly as many tokens
as the same prompt's constrained output (measured by a first constrained run), so both sides
prefill and decode the same amounts; each side reports output tokens/s, and the
constrained side the host time per step spent on masks: GrammarMatcher.fill_bitmask (at
schedule time) plus GrammarMatcher.accept (at update), timed by wrapping those two methods for
the run. Prints JSON; --json writes it too. It measures and never asserts.
"""

from __future__ import annotations

import argparse
import json
import time

from jaxserve.bench.structured_schemas import JSON_SCHEMAS, PROMPTS
from jaxserve.entrypoints.llm import LLM
from jaxserve.core.request import SamplingParams
from jaxserve.structured.matcher import GrammarMatcher


class MaskTimer:
    """Wraps GrammarMatcher's per-step host work with a clock while it is open."""

    def __init__(self):
        self.seconds = 0.0
        self._originals = {}

    def __enter__(self):
        for name in ("fill_bitmask", "accept"):
            original = getattr(GrammarMatcher, name)
            self._originals[name] = original

            def timed(matcher, *args, _original=original):
                start = time.perf_counter()
                try:
                    return _original(matcher, *args)
                finally:
                    self.seconds += time.perf_counter() - start

            setattr(GrammarMatcher, name, timed)
        return self

    def __exit__(self, *exc):
        for name, original in self._originals.items():
            setattr(GrammarMatcher, name, original)


def run(llm, prompts, params) -> dict:
    engine = llm.engine
    steps0 = engine.num_steps
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - start
    tokens = sum(len(o.token_ids) for o in outs)
    return {"output_tokens": tokens, "wall_s": wall, "output_tok_s": tokens / wall,
            "steps": engine.num_steps - steps0,
            "finish_reasons": sorted({o.finish_reason for o in outs})}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-requests", type=int, default=48)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--json", dest="json_path", default=None)
    args = parser.parse_args()
    llm = LLM("default", progress=False, max_model_len=1024, max_num_seqs=16)
    tok, names = llm.tokenizer, list(JSON_SCHEMAS)
    prompts, constrained = [], []
    for i in range(args.num_requests):
        name = names[i % len(names)]
        text = tok.apply_chat_template([{"role": "user", "content": PROMPTS[name]}])
        prompts.append(tok.encode(text, add_special_tokens=False))
        constrained.append(SamplingParams(max_tokens=args.max_tokens, temperature=0.0,
                                          structured_outputs={"json": JSON_SCHEMAS[name]}))
    # Grammars compiled, and each constrained output's length, which its twin runs.
    lengths = [len(o.token_ids) for o in llm.generate(prompts, constrained, use_tqdm=False)]
    plain = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in lengths]
    runs = {"constrained": [], "unconstrained": []}
    for r in range(args.rounds):
        order = ("constrained", "unconstrained") if r % 2 == 0 else ("unconstrained",
                                                                      "constrained")
        for side in order:
            if side == "constrained":
                with MaskTimer() as timer:
                    result = run(llm, prompts, constrained)
                result["host_mask_ms_per_step"] = 1000 * timer.seconds / result["steps"]
            else:
                result = run(llm, prompts, plain)
            runs[side].append(result)
    best = {side: max(r["output_tok_s"] for r in rs) for side, rs in runs.items()}
    report = {"num_requests": args.num_requests, "max_tokens": args.max_tokens,
              "max_num_seqs": 16, "runs": runs,
              "constrained_over_unconstrained_tok_s": best["constrained"] / best["unconstrained"],
              "mean_ratio": (sum(r["output_tok_s"] for r in runs["constrained"])
                             / sum(r["output_tok_s"] for r in runs["unconstrained"]))}
    print(json.dumps(report, indent=2))
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump(report, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
