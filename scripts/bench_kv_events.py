"""Throughput with KV-cache events on against off, paired in one run (docs/kv_events.md).

    python scripts/bench_kv_events.py [--num-requests 128] [--repeats 3] [--seed 0]
        [--json OUT] [engine flags: --model, --max-num-seqs, --num-pages, ...]

Loads the model once and builds two engines over it with the same settings, one with
`--kv-events-config` publishing on a ZeroMQ ipc socket that a subscriber thread drains (as a
router would), one without. Each round runs the same anyscale requests (input 16-512 tokens,
output exponential, mean 128; greedy, EOS ignored) through the events-off engine, then the
events-on one, all submitted at once; the output tokens/s ratio (on / off) is taken within each
round and the median over --repeats rounds is reported, with every round's figures. Both sides
must give the same tokens. Run it on a quiet machine: it measures, it does not test.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from jaxserve.bench.workloads import anyscale_workload  # noqa: E402
from jaxserve.core.request import SamplingParams  # noqa: E402
from jaxserve.entrypoints.cli_flags import add_engine_flags, engine_config_from_args  # noqa: E402


def run_side(engine, requests) -> tuple[float, list[list[int]]]:
    """(output tokens/s, the outputs' token ids in request order) of all requests at once."""
    ids = [engine.add_request(r.prompt_token_ids, SamplingParams(
        max_tokens=r.max_tokens, temperature=0.0, ignore_eos=True)) for r in requests]
    tokens: dict[str, list[int]] = {rid: [] for rid in ids}
    start = time.perf_counter()
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id].extend(out.new_token_ids)
    seconds = time.perf_counter() - start
    return sum(len(t) for t in tokens.values()) / seconds, [tokens[r] for r in ids]


def drain(endpoint: str, stop: threading.Event, counts: dict) -> None:
    import zmq

    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(endpoint)
    while not stop.is_set():
        if sub.poll(100):
            _, _, payload = sub.recv_multipart()
            counts["batches"] += 1
            counts["bytes"] += len(payload)
    sub.close(0)
    ctx.term()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-requests", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", dest="json_path", default=None)
    add_engine_flags(parser)
    args = parser.parse_args()
    from jaxserve.engine.engine import Engine
    from jaxserve.model.loaders.loader import load_model

    config = engine_config_from_args(args)
    loaded = load_model(config.model.model, progress=False)
    requests = anyscale_workload(args.num_requests, loaded.config.vocab_size,
                                 seed=config.model.seed)
    endpoint = f"ipc://{tempfile.mkdtemp()}/kv-events"
    events_config = json.dumps({"enable_kv_cache_events": True, "endpoint": endpoint})
    off = Engine(config.replace(kv_events_config=None), loaded=loaded)
    on = Engine(config.replace(kv_events_config=events_config), loaded=loaded)
    stop, counts = threading.Event(), {"batches": 0, "bytes": 0}
    subscriber = threading.Thread(target=drain, args=(endpoint, stop, counts), daemon=True)
    subscriber.start()
    run_side(off, requests[:4])  # warm both up (first-use costs off the clock)
    run_side(on, requests[:4])
    rounds = []
    for i in range(args.repeats):
        off_tps, off_tokens = run_side(off, requests)
        on_tps, on_tokens = run_side(on, requests)
        assert on_tokens == off_tokens, "events changed the generated tokens"
        rounds.append({"off_tokens_per_s": off_tps, "on_tokens_per_s": on_tps,
                       "ratio": on_tps / off_tps})
        print(f"round {i}: events off {off_tps:.1f} tok/s, on {on_tps:.1f} tok/s, "
              f"on/off {on_tps / off_tps:.3f}")
    time.sleep(0.5)
    stop.set()
    subscriber.join(5)
    summary = {"median_ratio": statistics.median(r["ratio"] for r in rounds),
               "num_requests": args.num_requests, "model": config.model.model,
               "batches_received": counts["batches"], "bytes_received": counts["bytes"],
               "batches_dropped": on.kv_events.num_dropped, "rounds": rounds}
    print(f"median on/off: {summary['median_ratio']:.3f} ({counts['batches']} batches, "
          f"{counts['bytes']} bytes received; {on.kv_events.num_dropped} dropped)")
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(summary, indent=2))
    off.close()
    on.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
