"""The device check that scripts/gpu_check.py and scripts/tpu_check.py run: its stages, their
budgets, its command line, and the measurements they share.

Stages (stage_runner.py runs each in a child process with its budget; the table always prints
and is written as markdown + JSON to --out or $OUT):
  probe     the backend, the device and its class (nominal bandwidth), the device selection;
  sweep     compile-only sweep of the attention kernels (kernel_stages.sweep);
  kernels   the kernels against pallas_kernels/reference.py at realistic sizes, timed;
  decode    a random-weight Llama-3-8B-shaped model's decode tokens/s at N requests against
            the roofline (model_stages.decode);
  agreement greedy tokens of tiny transformers models (float32 torch on the CPU) against
            jaxserve on the device (oracle_stage.agreement).
Nothing is downloaded. `--plan` prints the stages and budgets and needs no device; without the
device the check exits 2 unless --allow-cpu, which runs every stage's code on tiny shapes (the
kernels interpreted, the sweep lowered for the device's platform without compiling): a smoke
test, not a measurement.

The roofline bound of a decode step with N requests: it reads every weight a token uses once
(roofline.decode_bound; an untied embedding table only by the rows looked up, so not counted)
and each request's KV context, so tokens/s <= N / step bytes * bandwidth, the bandwidth the
chip's nominal one from model/device/defaults.py's table (or given).
Measurement only: nothing here changes an engine's settings or is used when serving.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from jaxserve.bench import stage_runner
from jaxserve.bench.stage_runner import Stage, table  # noqa: F401 (table: the scripts' API)

BUDGETS = {"probe": 30, "sweep": 150, "kernels": 90, "decode": 170, "agreement": 90}
DEVICE_BUDGET_S = 540  # the lent machine's 10 minutes a command, less start-up and transfers


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


def weight_bytes_read(config, itemsize: int) -> int:
    """Bytes of weights one decode step reads: the active parameters, less an untied
    embedding table (only the looked-up rows are read)."""
    from jaxserve.bench.roofline import decode_bound

    params = config.num_active_params()
    if not config.tie_word_embeddings:
        params -= config.vocab_size * config.hidden_size
    return decode_bound(params, itemsize, 0, 0, 1.0)["weight_bytes"]


def decode_rates(loaded, counts: list[int], steps: int, prompt_len: int = 32,
                 bandwidth_gbs: float | None = None, on_row=None) -> list[dict]:
    """The model's decode speed with N requests all decoding, for each N in counts, on one
    engine (a token bucket for each N and one for prefill; its build time, compiles included,
    is compile_s): the N requests prefilled first, then `steps` steps timed, then drained.
    Returns [{n, ms_per_step, tokens_per_s, compile_s, bound_tokens_per_s}] (tokens: those the
    timed steps returned; the bound None without a bandwidth); on_row(result) as each ends."""
    import jax

    from jaxserve.core.request import SamplingParams
    from jaxserve.entrypoints.llm import LLM

    top = max(counts)
    prefill = min(max(16, top * prompt_len), 2048)
    max_len = prompt_len + steps + 16
    start = time.perf_counter()
    # a pool of just what the requests fill (not the device's gpu_memory_utilization)
    llm = LLM("decode-rate", loaded=loaded, progress=False, max_num_seqs=top,
              max_num_batched_tokens=prefill, token_buckets=tuple(sorted({*counts, prefill})),
              max_model_len=max_len, num_pages=top * -(-max_len // 16) + 2, page_size=16,
              enable_prefix_caching=False)
    compile_s = time.perf_counter() - start
    engine, results = llm.engine, []
    itemsize = jax.numpy.dtype(engine.info.dtype).itemsize
    span = min(1000, loaded.config.vocab_size - 3)
    for n in counts:
        # none ends before the timed steps do: the first prefilled decode while the rest prefill
        params = SamplingParams(max_tokens=steps + 4 + -(-n * prompt_len // prefill),
                                temperature=0.0, ignore_eos=True)
        waiting = {engine.add_request([3 + (7 * i + j) % span for j in range(prompt_len)],
                                      params) for i in range(n)}
        while waiting:  # prefill: until every request has its first token
            waiting -= {o.request_id for o in engine.step() if o.new_token_ids}
        num_tokens, timed = 0, time.perf_counter()
        for _ in range(steps):
            num_tokens += sum(len(o.new_token_ids) for o in engine.step())
        wall = time.perf_counter() - timed
        while engine.has_unfinished():
            engine.step()
        bound = None if bandwidth_gbs is None else decode_bound_tokens_per_s(
            n, weight_bytes_read(loaded.config, itemsize),
            loaded.config.kv_bytes_per_token(itemsize), prompt_len + steps / 2, bandwidth_gbs)
        results.append({"n": n, "ms_per_step": 1000 * wall / steps,
                        "tokens_per_s": num_tokens / wall, "compile_s": compile_s,
                        "bound_tokens_per_s": bound})
        if on_row is not None:
            on_row(results[-1])
    llm.close()
    return results


def decode_row(r: dict) -> tuple[str, str, str]:
    bound = r["bound_tokens_per_s"]
    share = f"{100 * r['tokens_per_s'] / bound:.0f}% of roofline {bound:,.0f}" if bound \
        else "no bandwidth figure"
    return (f"decode N={r['n']}", f"{r['tokens_per_s']:,.1f} tok/s ({r['ms_per_step']:.2f} "
            f"ms/step; engine build {r['compile_s']:.1f} s)", share)


def decode_rows(rates: list[dict]) -> list[tuple[str, str, str]]:
    return [decode_row(r) for r in rates]


# ---- the staged check and its command line ------------------------------------------------

def stages(platform: str, args) -> list[Stage]:
    base = {"platform": platform, "bandwidth_gbs": args.bandwidth_gbs}
    grid = {key: value for key, value in (
        ("head_dims", args.head_dims), ("kv_heads", args.kv_heads),
        ("kv_dtypes", args.kv_dtypes), ("kv_splits", args.kv_splits)) if value}
    counts = [int(n) for n in args.decode_counts.split(",")] if args.decode_counts else None
    decode = {k: v for k, v in (("counts", counts), ("steps", args.decode_steps),
                                ("layers", args.model_layers)) if v}
    every = [
        Stage("probe", "backend, device class and nominal bandwidth, device selection",
              BUDGETS["probe"], "jaxserve.bench.model_stages:probe", base),
        Stage("sweep", "compile-only sweep: head_dim x KV heads x KV dtype x decode KV splits",
              BUDGETS["sweep"], "jaxserve.bench.kernel_stages:sweep",
              {**base, "grid": grid, "threads": args.compile_threads}),
        Stage("kernels", "paged / ragged attention against the reference, timed",
              BUDGETS["kernels"], "jaxserve.bench.kernel_stages:kernels",
              {**base, "iters": args.iters}),
        Stage("decode", "random Llama-3-8B-shaped model: decode tok/s vs the HBM roofline",
              BUDGETS["decode"], "jaxserve.bench.model_stages:decode", {**base, **decode}),
        Stage("agreement", "greedy tokens of tiny transformers models vs jaxserve",
              BUDGETS["agreement"], "jaxserve.bench.oracle_stage:agreement", base),
    ]
    only = set(args.only.split(",")) if args.only else None
    if only and not only <= {s.name for s in every}:
        raise SystemExit(f"--only: unknown stages {sorted(only - {s.name for s in every})}")
    # the probe always runs: it tells whether the device is there
    return [s for s in every if only is None or s.name in only or s.name == "probe"]


def parse_args(argv, platform: str, doc: str):
    ints = lambda text: tuple(int(x) for x in text.split(","))
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--plan", action="store_true",
                        help="print the stages and their budgets, run nothing")
    parser.add_argument("--out", default=os.environ.get("OUT"),
                        help="folder for the report (markdown, JSON, log); default $OUT")
    parser.add_argument("--allow-cpu", action="store_true",
                        help=f"without a {platform.upper()}, run every stage on tiny shapes")
    parser.add_argument("--only", help="comma-separated stages to run (the probe always runs)")
    parser.add_argument("--bandwidth-gbs", "--hbm-gbps", type=float, default=None,
                        help="memory bandwidth for the roofline, GB/s; default: the chip's "
                             "nominal one from jaxserve/model/device/defaults.py")
    parser.add_argument("--iters", type=int, default=20, help="timed runs per kernel path")
    parser.add_argument("--head-dims", type=ints, help="sweep head_dims (default 64,96,128,256)")
    parser.add_argument("--kv-heads", type=ints, help="sweep KV heads (default 1,2,4,8)")
    parser.add_argument("--kv-dtypes", type=lambda t: tuple(t.split(",")),
                        help="sweep KV dtypes, of bf16,fp8 (default both)")
    parser.add_argument("--kv-splits", type=ints, help="sweep decode KV splits (default 1,4,16)")
    parser.add_argument("--compile-threads", type=int, default=4,
                        help="sweep compiles at a time")
    parser.add_argument("--decode-counts", help="decode request counts (default 1,16,64,256)")
    parser.add_argument("--decode-steps", type=int, help="decode steps timed (default 32)")
    parser.add_argument("--model-layers", type=int,
                        help="layers of the random Llama-3-8B-shaped model (default 4)")
    return parser.parse_args(argv)


def main(argv, platform: str, doc: str) -> int:
    """The check for `platform` ("gpu" | "tpu"): 0 all OK, 1 a check failed, errored or was
    cut, 2 no such device (without --allow-cpu)."""
    args = parse_args(argv, platform, doc)
    chosen = stages(platform, args)
    name = f"{platform}_check"
    if args.plan:
        print(stage_runner.plan_text(chosen))
        return 0
    out = Path(args.out) if args.out else None
    if out:
        out.mkdir(parents=True, exist_ok=True)
    found = {}

    def after(run):
        backends = [r.data["backend"] for r in run.rows if "backend" in r.data]
        found["backend"] = backends[0] if backends else None
        return found["backend"] in (platform, None) or args.allow_cpu

    runs = stage_runner.run_stages(chosen[:1], out / f"{name}.log" if out else None,
                                   after=after)
    if not after(runs[0]):
        print(f"{name}: no {platform.upper()} (JAX backend is {found['backend']!r}); run it on "
              f"a {platform.upper()} machine, or pass --allow-cpu for a smoke test on tiny "
              "shapes", file=sys.stderr)
        return 2
    runs += stage_runner.run_stages(chosen[1:], out / f"{name}.log" if out else None)
    header = (f"# {name}: backend {found['backend']}"
              + (" (--allow-cpu: tiny shapes, not a measurement)"
                 if found["backend"] != platform else ""))
    # the console's table keeps one line a row; the report files have the whole text
    rows = [(r.check, r.result if len(r.result) <= 100 else r.result[:97] + "...", r.verdict)
            for run in runs for r in run.rows]
    print(f"\n{header}\n" + "\n".join(f"{run.stage.name}: {run.status} "
                                       f"{run.seconds:.1f} s of {run.stage.budget_s:.0f} s"
                                       for run in runs))
    print(table(rows))
    if out:
        written = stage_runner.write_report(runs, out, name, header)
        print("written: " + ", ".join(str(p) for p in written))
    return 1 if stage_runner.failed(runs) else 0
