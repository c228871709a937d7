"""The parts scripts/gpu_check.py and scripts/tpu_check.py share: the default model's greedy
tokens on this device against the CPU float32 oracle (agreement rate), decode tokens/s with N
requests all decoding against the roofline bound, peak device memory, compile time, and the one
table both print.

The roofline bound of a decode step with N requests: it reads every weight once and each
request's KV context, so tokens/s <= N / ((weight bytes + N * context * KV bytes per token) /
bandwidth), the bandwidth the chip's nominal one from model/device_defaults.py's table (or
given). The oracle runs in a child process on the CPU backend in float32
(`python -m jaxserve.bench.device_check oracle`), so one process never mixes backends.
Measurement only: nothing here changes an engine's settings or is used when serving.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

PROMPTS = ("The capital of France is", "def fibonacci(n):", "Once upon a time,",
           "The three primary colors are", "To make a cup of tea, first",
           "import numpy as np\n", "The largest planet in the solar system", "Water boils at")


def greedy_tokens(loaded, prompts, max_tokens: int, **settings) -> list[list[int]]:
    """Greedy (temperature 0, no EOS stop) output ids of each prompt through LLM."""
    from jaxserve.core.request import SamplingParams
    from jaxserve.entrypoints.llm import LLM

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    settings.setdefault("num_pages", len(prompts) * 16 + 2)  # 256 tokens each, page_size 16
    settings.setdefault("page_size", 16)
    with LLM("check", loaded=loaded, progress=False, **settings) as llm:
        outputs = llm.generate(list(prompts), params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs]


def oracle_tokens(prompts, max_tokens: int, timeout: float = 600.0) -> list[list[int]]:
    """The CPU float32 greedy tokens of the default model, from a child process."""
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    cmd = [sys.executable, "-m", "jaxserve.bench.device_check", "oracle", str(max_tokens),
           json.dumps(list(prompts))]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout,
                          check=False)
    if done.returncode:
        raise RuntimeError(f"the CPU oracle failed: {done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def agreement(got: list[list[int]], want: list[list[int]]) -> float:
    """The share of oracle tokens matched before each prompt's first divergence (after it,
    the two continue from different text and are not comparable)."""
    matched = total = 0
    for a, b in zip(got, want):
        same = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        matched, total = matched + same, total + len(b)
    return matched / max(total, 1)


def peak_memory_bytes() -> int | None:
    """The largest peak_bytes_in_use over local devices (None where the backend has none)."""
    import jax

    peaks = [(d.memory_stats() or {}).get("peak_bytes_in_use") for d in jax.local_devices()]
    peaks = [p for p in peaks if p is not None]
    return max(peaks) if peaks else None


def decode_bound_tokens_per_s(n: int, weight_bytes: int, kv_bytes_per_token: int,
                              context: float, bandwidth_gbs: float) -> float:
    """Roofline: N tokens per step, a step no faster than its bytes over the bandwidth."""
    step_bytes = weight_bytes + n * context * kv_bytes_per_token
    return n / (step_bytes / (bandwidth_gbs * 1e9))


def decode_rates(loaded, counts: list[int], steps: int, prompt_len: int = 32,
                 bandwidth_gbs: float | None = None) -> list[dict]:
    """The model's decode speed with N requests all decoding, for each N in counts: one engine
    each (buckets for just that N and its prefill; its build time, compiles included, is
    compile_s), the N requests prefilled first, then `steps` steps timed. Returns
    [{n, ms_per_step, tokens_per_s, compile_s, bound_tokens_per_s}] (tokens: those the timed
    steps returned; the bound None without a bandwidth)."""
    import jax

    from jaxserve.core.request import SamplingParams
    from jaxserve.entrypoints.llm import LLM

    results = []
    for n in counts:
        prefill = min(max(64, n * prompt_len), 2048)
        start = time.perf_counter()
        max_len = prompt_len + steps + 16
        # a pool of just what the N requests fill (not the device's gpu_memory_utilization)
        llm = LLM("decode-rate", loaded=loaded, progress=False, max_num_seqs=n,
                  max_num_batched_tokens=prefill, token_buckets=tuple(sorted({n, prefill})),
                  seq_buckets=(n,), max_model_len=max_len, num_pages=n * -(-max_len // 16) + 2,
                  page_size=16, enable_prefix_caching=False)
        compile_s = time.perf_counter() - start
        engine = llm.engine
        # none ends before the timed steps do: the first prefilled decode while the rest prefill
        params = SamplingParams(max_tokens=steps + 4 + -(-n * prompt_len // prefill),
                                temperature=0.0, ignore_eos=True)
        span = min(1000, loaded.config.vocab_size - 3)
        waiting = {engine.add_request([3 + (7 * i + j) % span for j in range(prompt_len)],
                                      params) for i in range(n)}
        while waiting:  # prefill: until every request has its first token
            waiting -= {o.request_id for o in engine.step() if o.new_token_ids}
        num_tokens, start = 0, time.perf_counter()
        for _ in range(steps):
            num_tokens += sum(len(o.new_token_ids) for o in engine.step())
        wall = time.perf_counter() - start
        while engine.has_unfinished():
            engine.step()
        info = engine.info
        itemsize = jax.numpy.dtype(info.dtype).itemsize
        bound = None if bandwidth_gbs is None else decode_bound_tokens_per_s(
            n, info.weight_bytes, loaded.config.kv_bytes_per_token(itemsize),
            prompt_len + steps / 2, bandwidth_gbs)
        llm.close()
        del llm, engine  # the next engine's pool must not wait for this one's collection
        results.append({"n": n, "ms_per_step": 1000 * wall / steps,
                        "tokens_per_s": num_tokens / wall, "compile_s": compile_s,
                        "bound_tokens_per_s": bound})
    return results


def table(rows: list[tuple[str, str, str]]) -> str:
    """One table of (check, result, verdict) rows, as both scripts print it last."""
    widths = [max(len(r[i]) for r in rows + [("check", "result", "verdict")])
              for i in range(3)]
    line = "  ".join("{:<%d}" % w for w in widths)
    out = [line.format("check", "result", "verdict"), line.format(*("-" * w for w in widths))]
    return "\n".join(out + [line.format(*r) for r in rows])


def decode_rows(rates: list[dict]) -> list[tuple[str, str, str]]:
    rows = []
    for r in rates:
        bound = r["bound_tokens_per_s"]
        share = f"{100 * r['tokens_per_s'] / bound:.0f}% of roofline {bound:,.0f}" if bound \
            else "no bandwidth figure"
        rows.append((f"decode N={r['n']}", f"{r['tokens_per_s']:,.1f} tok/s "
                     f"({r['ms_per_step']:.2f} ms/step)", share))
        rows.append((f"compile N={r['n']}", f"{r['compile_s']:.1f} s engine build", ""))
    return rows


def _oracle_main(max_tokens: str, prompts: str) -> None:
    from jaxserve.model.loader import load_model

    tokens = greedy_tokens(load_model("default", progress=False), json.loads(prompts),
                           int(max_tokens), dtype="float32", max_num_seqs=8,
                           max_num_batched_tokens=64, max_model_len=256)
    print(json.dumps(tokens))


if __name__ == "__main__" and len(sys.argv) == 4 and sys.argv[1] == "oracle":
    _oracle_main(sys.argv[2], sys.argv[3])
