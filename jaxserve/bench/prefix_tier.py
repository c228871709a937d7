"""`jaxserve bench prefix-tier`: returning conversations with the prefix cache's host tier on
and off, side by side in one run.

    jaxserve bench prefix-tier [--conversations 32] [--turns 4] [--history 1000]
                               [--user-tokens 32] [--answer-tokens 16] [--device-conversations 4]
                               [--unique-requests 16] [--rounds=1] [--json OUT] [engine flags]

Each conversation has its own history of --history random tokens. Turn t of every conversation
is submitted at once (a round); its prompt is the history so far plus --user-tokens new ones,
and its greedy answer (--answer-tokens, EOS ignored) joins the history. The device pool holds
about --device-conversations conversations (num_pages is set so), so by the time a
conversation returns its prefix was evicted from the device: without the tier it is
recomputed, with it the pages come back from host memory. Reported per side: mean / p50 / p99
TTFT of the returning turns (t >= 1) and of the first turns, the host tier's hit tokens and
bytes moved; then output tokens/s of a workload that never returns (--unique-requests fresh
prompts of the same length, all at once), where the tier only costs its copies to the host.
Both sides run the same requests on the same loaded model, alternating for --rounds rounds;
the ratios are taken within each round (its two sides ran back to back) and their median is
reported. The tier's size is --host-prefix-cache-size, or by default room
for every conversation's pages. Timing is generation only (engines are built and warmed up
first). It prints and writes JSON; it changes no setting of a running server.
"""

from __future__ import annotations

import json
import time

import numpy as np

from jaxserve.bench.stats import RequestTimeline, report, summarize
from jaxserve.core.request import SamplingParams


def add_arguments(parser) -> None:
    parser.add_argument("--conversations", type=int, default=32,
                        help="conversations, each with its own history")
    parser.add_argument("--turns", type=int, default=4,
                        help="turns per conversation; turns after the first return")
    parser.add_argument("--history", type=int, default=1000, help="tokens of each history")
    parser.add_argument("--user-tokens", type=int, default=32, help="new tokens per turn")
    parser.add_argument("--answer-tokens", type=int, default=16, help="max_tokens per turn")
    parser.add_argument("--device-conversations", type=float, default=4.0,
                        help="conversations the device pool holds (sets num_pages)")
    parser.add_argument("--unique-requests", type=int, default=16,
                        help="requests of the never-returning workload")
    parser.add_argument("--rounds", type=int, default=1, help="runs per side, alternating")
    parser.add_argument("--json", dest="json_path", default=None, help="write results here")
    parser.add_argument("--quiet", action="store_true", help="no progress bars")


def run_round(engine, prompts: list[list[int]], max_tokens: int):
    """All prompts at once; returns (timelines, answers) in prompt order."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    ids = [engine.add_request(p, params) for p in prompts]
    timelines = {rid: RequestTimeline(start, num_prompt_tokens=len(p))
                 for rid, p in zip(ids, prompts)}
    answers: dict[str, list[int]] = {rid: [] for rid in ids}
    while engine.has_unfinished():
        outputs = engine.step()
        now = time.perf_counter()
        for out in outputs:
            timelines[out.request_id].token_times.extend([now] * len(out.new_token_ids))
            answers[out.request_id].extend(out.new_token_ids)
    return [timelines[r] for r in ids], [answers[r] for r in ids]


def conversation_side(engine, args, vocab_size: int, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    low = min(100, vocab_size // 2)  # clear of the special tokens at the bottom of the vocab
    histories = [rng.integers(low, vocab_size, args.history).tolist()
                 for _ in range(args.conversations)]
    first, returning, answers_all = [], [], []
    host0 = engine.pages.stats().host
    start = time.perf_counter()
    for turn in range(args.turns):
        prompts = [h + rng.integers(low, vocab_size, args.user_tokens).tolist()
                   for h in histories]
        timelines, answers = run_round(engine, prompts, args.answer_tokens)
        (returning if turn else first).extend(timelines)
        histories = [p + a for p, a in zip(prompts, answers)]
        answers_all.append(answers)
    duration = time.perf_counter() - start
    host = engine.pages.stats().host
    result = dict(duration_s=duration, returning_ttft_s=summarize(t.ttft for t in returning),
                  first_ttft_s=summarize(t.ttft for t in first),
                  preemptions=engine.scheduler.num_preemptions, answers=answers_all)
    if host is not None:
        result.update(host_hit_tokens=host.hit_tokens - host0.hit_tokens,
                      bytes_to_host=host.bytes_to_host - host0.bytes_to_host,
                      bytes_to_device=host.bytes_to_device - host0.bytes_to_device,
                      host_pages_used=host.num_used)
    return result


def unique_side(engine, args, vocab_size: int, seed: int) -> dict:
    rng = np.random.default_rng(seed + 1)
    low = min(100, vocab_size // 2)
    length = args.history + args.user_tokens
    prompts = [rng.integers(low, vocab_size, length).tolist() for _ in range(args.unique_requests)]
    start = time.perf_counter()
    timelines, _ = run_round(engine, prompts, args.answer_tokens)
    r = report(timelines, time.perf_counter() - start)
    return dict(output_throughput=r["output_throughput"], duration_s=r["duration_s"])


def side_configs(config, loaded, args) -> dict:
    """The two engine configs: the same small device pool, the tier off and on."""
    mc = loaded.config
    ps = config.cache.page_size
    per_conversation = -(-(args.history + args.turns * (args.user_tokens + args.answer_tokens))
                         // ps)
    num_pages = max(int(args.device_conversations * per_conversation) + 1, per_conversation + 2)
    import jax

    from jaxserve.runner.model_runner import resolve_dtype
    itemsize = jax.numpy.dtype(resolve_dtype(config.model.dtype, jax.default_backend())).itemsize
    page_bytes = ps * mc.kv_bytes_per_token(itemsize)
    size = (config.cache.host_prefix_cache_size
            or (args.conversations + 1) * per_conversation * page_bytes)
    small = config.replace(num_pages=num_pages, kv_cache_memory=None, gpu_memory_utilization=None)
    return {"off": small.replace(host_prefix_cache_size=0),
            "on": small.replace(host_prefix_cache_size=size)}


def main(args, config) -> int:
    from jaxserve.engine.engine import Engine
    from jaxserve.model.loaders.loader import load_model

    loaded = load_model(config.model.model, progress=not args.quiet)
    configs = side_configs(config, loaded, args)
    runs: dict[str, list[dict]] = {"off": [], "on": []}
    for round_index in range(args.rounds):
        for side in (("off", "on") if round_index % 2 == 0 else ("on", "off")):
            with Engine(configs[side], loaded=loaded, progress=not args.quiet) as engine:
                vocab_size, seed = loaded.config.vocab_size, config.model.seed
                conv = conversation_side(engine, args, vocab_size, seed)
                conv["unique"] = unique_side(engine, args, vocab_size, seed)
            runs[side].append(conv)
            _print_side(side, conv)
    same = all(off["answers"] == on["answers"] for off, on in zip(runs["off"], runs["on"]))
    for rs in runs.values():
        for r in rs:
            r.pop("answers")
    pairs = list(zip(runs["off"], runs["on"]))  # one round's two sides, run back to back
    ratio = lambda f: float(np.median([f(off) / f(on) for off, on in pairs]))  # noqa: E731
    summary = dict(
        mean_ttft_off_over_on=ratio(lambda r: r["returning_ttft_s"]["mean"]),
        p99_ttft_off_over_on=ratio(lambda r: r["returning_ttft_s"]["p99"]),
        unique_tokens_per_s_on_over_off=float(np.median([
            on["unique"]["output_throughput"] / off["unique"]["output_throughput"]
            for off, on in pairs])),
        answers_identical=same, num_pages=configs["on"].cache.num_pages,
        host_prefix_cache_size=configs["on"].cache.host_prefix_cache_size)
    print(f"returning turns, mean TTFT off/on: {summary['mean_ttft_off_over_on']:.2f}x, p99 "
          f"{summary['p99_ttft_off_over_on']:.2f}x; never-returning output tok/s on/off: "
          f"{summary['unique_tokens_per_s_on_over_off']:.3f}; greedy answers identical: {same}")
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump(dict(args={k: v for k, v in vars(args).items() if k != "func"},
                           model=config.model.model, summary=summary, runs=runs), f, indent=2,
                      default=str)
    return 0


def _print_side(side: str, r: dict) -> None:
    ms = lambda d: f"mean {d['mean'] * 1e3:8.1f}  p50 {d['median'] * 1e3:8.1f}  p99 {d['p99'] * 1e3:8.1f} ms"  # noqa: E731
    print(f"== host tier {side}: {r['duration_s']:.1f} s, {r['preemptions']} preemptions")
    print(f"  returning TTFT  {ms(r['returning_ttft_s'])}")
    print(f"  first-turn TTFT {ms(r['first_ttft_s'])}")
    if "host_hit_tokens" in r:
        print(f"  host tier       {r['host_hit_tokens']} hit tokens, "
              f"{r['bytes_to_host'] / 2**20:.1f} MiB to host, "
              f"{r['bytes_to_device'] / 2**20:.1f} MiB back")
    print(f"  never-returning {r['unique']['output_throughput']:.1f} output tok/s "
          f"({r['unique']['duration_s']:.1f} s)")
