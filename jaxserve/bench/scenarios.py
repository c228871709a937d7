"""The benchmark suite's scenarios: engine settings, request sets and runners for each A/B.

Every engine shares one bucket table and page pool (BASE), so after the first start-up the
persistent compile cache serves the rest; each A/B changes exactly the setting it measures.
Runners: `Served.serve` (an in-process gRPC server and the bench-serve load generator),
`offline` (the Engine stepped directly, every request at t=0) and `decode_steps` (step times).
Sizes come from a Scale, so the suite fits its time budget; scripts/bench_suite.py
orchestrates and reports.
"""

from __future__ import annotations

import gc
import math
import time
from dataclasses import asdict, dataclass

import numpy as np

from jaxserve.bench.datasets import ServeRequest, chat_requests
from jaxserve.bench.serve import benchmark

BASE = dict(max_num_seqs=16, max_num_batched_tokens=256, max_model_len=512, page_size=16,
            num_pages=192, token_buckets=(16, 64, 256), seq_buckets=(16,),
            swap_space=256 << 20, enable_prefix_caching=True, enable_chunked_prefill=True,
            preemption_mode="recompute", batching="continuous")
# Batch-1 decode with no padding rows: one-token steps (prompts prefill in 16-token chunks).
ROOFLINE = dict(max_num_seqs=1, max_num_batched_tokens=16, max_model_len=512, page_size=16,
                num_pages=40, token_buckets=(1, 16), seq_buckets=(1,))
# Without chunked prefill a prompt is prefilled in one step, so the step budget must hold the
# longest prompt: max_model_len, as vLLM requires. One extra token bucket.
NO_CHUNKING = dict(enable_chunked_prefill=False, max_num_batched_tokens=512,
                   token_buckets=(16, 64, 256, 512))
INF = math.inf


@dataclass(frozen=True)
class Scale:
    batching_requests: int = 20
    batching_rates: tuple[float, ...] = (0.5, 1.0, 2.0, INF)
    batching_input_len: int = 16       # 16 x 16 prompts fill one 256-token step: a full batch
    batching_output_mean: int = 24     # exponential, clipped to [2, batching_output_max]
    batching_output_max: int = 80
    latency_rate: float = 1.0          # the fixed rate whose latencies the table shows
    prefix_requests: int = 10
    prefix_rate: float = 0.3
    prefix_len: int = 224
    prefix_suffix_len: int = 16
    prefix_output_len: int = 16
    chunk_decodes: int = 8             # chat requests decoding when the long prompts arrive
    chunk_decode_output: int = 64
    chunk_long_prompts: int = 6
    chunk_long_len: int = 448          # prefilled whole (off) needs a 512-token step
    chunk_first_arrival_s: float = 2.0
    chunk_gap_s: float = 4.0
    preempt_requests: int = 16
    preempt_input_len: int = 128       # 16 x (128 + 96) tokens need 224 pages; the pool has 191
    preempt_output_len: int = 96
    peer_requests: int = 16
    peer_output_len: int = 24
    roofline_prompt_len: int = 32
    roofline_decode_steps: int = 40
    spec_requests: int = 6
    spec_output_len: int = 48
    spec_max_concurrency: int = 2
    rounds: int = 2                    # target-bearing A/Bs run A B B A; each side's best round


QUICK = Scale(batching_requests=8, batching_rates=(1.0, INF), batching_output_mean=8,
              batching_output_max=16, prefix_requests=4, prefix_rate=1.0, prefix_output_len=4,
              chunk_decodes=4, chunk_decode_output=16, chunk_long_prompts=2, chunk_gap_s=2.0,
              preempt_requests=16, preempt_input_len=128, preempt_output_len=72,
              peer_requests=4, peer_output_len=8, roofline_decode_steps=8, spec_requests=2,
              spec_output_len=16, rounds=1)


def scale_dict(scale: Scale) -> dict:
    return {k: (str(v) if isinstance(v, float) and math.isinf(v) else v)
            for k, v in asdict(scale).items()}


# ---- request sets ---------------------------------------------------------------------------
def _random_ids(rng, n: int, vocab_size: int) -> tuple[int, ...]:
    return tuple(rng.integers(3, vocab_size, n).tolist())


def batching_requests(scale: Scale, vocab_size: int, seed: int = 1) -> list[ServeRequest]:
    """Short prompts, output lengths with chat's long tail (exponential)."""
    rng = np.random.default_rng(seed)
    lengths = np.clip(np.round(rng.exponential(scale.batching_output_mean,
                                               scale.batching_requests)),
                      2, scale.batching_output_max).astype(int)
    return [ServeRequest(int(n), _random_ids(rng, scale.batching_input_len, vocab_size))
            for n in lengths]


def prefix_requests(scale: Scale, vocab_size: int, seed: int = 2) -> list[ServeRequest]:
    """One long shared system prompt, a short question each."""
    rng = np.random.default_rng(seed)
    prefix = _random_ids(rng, scale.prefix_len, vocab_size)
    return [ServeRequest(scale.prefix_output_len,
                         prefix + _random_ids(rng, scale.prefix_suffix_len, vocab_size))
            for _ in range(scale.prefix_requests)]


def chunked_requests(scale: Scale, vocab_size: int, seed: int = 3):
    """(requests, send offsets): chat requests decoding from t=0, then long prompts (one
    output token each, so every measured ITL belongs to a running decode) arriving among them."""
    rng = np.random.default_rng(seed)
    decodes = chat_requests(scale.chunk_decodes, seed, output_len=scale.chunk_decode_output)
    longs = [ServeRequest(1, _random_ids(rng, scale.chunk_long_len, vocab_size))
             for _ in range(scale.chunk_long_prompts)]
    offsets = [0.0] * len(decodes) + [scale.chunk_first_arrival_s + i * scale.chunk_gap_s
                                      for i in range(len(longs))]
    return decodes + longs, offsets


def preemption_requests(scale: Scale, vocab_size: int, seed: int = 4) -> list[ServeRequest]:
    rng = np.random.default_rng(seed)
    return [ServeRequest(scale.preempt_output_len,
                         _random_ids(rng, scale.preempt_input_len, vocab_size))
            for _ in range(scale.preempt_requests)]


def peer_prompts(scale: Scale, tokenizer, seed: int = 5) -> list[list[int]]:
    """Bundled chat prompts rendered through the chat template, as token ids."""
    prompts = []
    for r in chat_requests(scale.peer_requests, seed):
        text = tokenizer.apply_chat_template(list(r.messages), add_generation_prompt=True)
        prompts.append(list(tokenizer.encode(text, add_special_tokens=False)))
    return prompts


# ---- engines and runners --------------------------------------------------------------------
def build_engine(loaded, settings: dict, **overrides):
    from jaxserve.config import EngineConfig
    from jaxserve.engine.engine import Engine

    start = time.perf_counter()
    engine = Engine(EngineConfig.from_kwargs(**{**settings, **overrides}), loaded=loaded,
                    progress=False)
    engine.startup_s = time.perf_counter() - start
    return engine


def release(engine) -> None:
    del engine
    gc.collect()


def _counters(engine) -> dict:
    stats = engine.stats  # the snapshot: a served engine's scheduler runs on another thread
    return {"preemptions": stats.num_preemptions, "swaps": stats.num_swaps,
            "steps": stats.num_steps, "prefix_hit_tokens": stats.prefix_hit_tokens,
            "prefix_query_tokens": stats.prefix_query_tokens}


class Served:
    """An engine behind an in-process gRPC server (AsyncEngine + ServerThread)."""

    def __init__(self, engine):
        from jaxserve.engine.async_engine import AsyncEngine
        from jaxserve.entrypoints.grpc.background import ServerThread

        self.engine = engine
        self.async_engine = AsyncEngine(engine)
        self.async_engine.start()
        self.server = ServerThread(self.async_engine, "127.0.0.1", 0)
        self.address = self.server.address

    def serve(self, requests, **kwargs) -> dict:
        """One bench-serve load; adds the engine's preemptions, swaps, steps, prefix hits."""
        before = _counters(self.engine)
        result = benchmark(self.address, requests, timeout=900.0, **kwargs)
        after = _counters(self.engine)
        result.update({k: after[k] - before[k] for k in after})
        queried = result["prefix_query_tokens"]
        result["prefix_hit_rate"] = result["prefix_hit_tokens"] / queried if queried else 0.0
        return result

    def close(self) -> None:
        self.server.stop(timeout=5.0)
        self.async_engine.stop(timeout=30.0)
        release(self.engine)
        self.engine = self.async_engine = None


def offline(engine, prompts: list[list[int]], max_tokens: int) -> dict:
    """Every prompt added at t=0 and the engine stepped to the end (no server)."""
    from jaxserve.core.request import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    for p in prompts:
        engine.add_request(list(p), params)
    num_out, steps = 0, 0
    while engine.has_unfinished():
        num_out += sum(len(o.new_token_ids) for o in engine.step())
        steps += 1
    duration = time.perf_counter() - start
    return {"duration_s": duration, "total_output_tokens": num_out, "steps": steps,
            "output_throughput": num_out / duration}


def decode_steps(engine, prompt: list[int], num_steps: int, batch: int = 1) -> list[float]:
    """Seconds per step once every request is decoding (prefill steps excluded)."""
    from jaxserve.core.request import SamplingParams

    params = SamplingParams(max_tokens=num_steps + 1, temperature=0.0, ignore_eos=True)
    for _ in range(batch):
        engine.add_request(list(prompt), params)
    times, decoding = [], False
    while engine.has_unfinished():
        start = time.perf_counter()
        outputs = engine.step()
        if decoding:
            times.append(time.perf_counter() - start)
        decoding = decoding or (len(outputs) == batch and all(o.token_ids for o in outputs))
    return times
