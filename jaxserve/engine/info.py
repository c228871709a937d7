"""EngineInfo and EngineStats: what front ends and metrics may know about a running engine.

EngineInfo is frozen at start-up (model, limits, pool size); EngineStats is an immutable
snapshot the engine thread publishes after every change (queue sizes, page usage, counters).
Other threads (gRPC and HTTP handlers, the Prometheus collector) read these two and never the
live scheduler or page manager. Plain data: no jax, no engine import.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EngineInfo:
    """Also a core.intake.RequestLimits: max_model_len, vocab_size, page_size, num_pages."""

    model_name: str
    architecture: str
    max_model_len: int
    vocab_size: int
    dtype: str
    page_size: int
    num_pages: int                  # the KV pool, reserved page 0 included
    max_num_seqs: int
    max_num_batched_tokens: int
    max_queued_requests: int | None
    eos_token_ids: tuple[int, ...]
    tensor_parallel_size: int = 1
    expert_parallel_size: int = 1   # device groups the experts are split over (1: off)
    speculative_method: str | None = None
    quantization: str = "none"
    weight_bytes: int = 0           # the weights on device, all shards together
    # (tensor group, format, bytes on device) per group: embed, lm_head, attention, mlp, other
    weight_formats: tuple[tuple[str, str, int], ...] = ()
    # (token bucket, int8 form) where the CPU runner measured them at warm-up
    # (model/quant/bucket_forms.py: int8-kernel, int8-xla or dequantize); () elsewhere
    quant_bucket_forms: tuple[tuple[int, str], ...] = ()


@dataclass(frozen=True)
class EngineStats:
    num_running: int = 0
    num_waiting: int = 0
    num_swapped: int = 0
    num_preemptions: int = 0
    num_swaps: int = 0
    num_steps: int = 0
    kv_usage: float = 0.0           # fraction of allocatable pages held by requests
    num_free_pages: int = 0         # allocatable now, evictable cached pages included
    prefix_query_tokens: int = 0
    prefix_hit_tokens: int = 0      # device and host tier hits together
    host_prefix_pages: int = 0      # pages held by the prefix cache's host tier
    host_prefix_capacity_pages: int = 0
    host_prefix_hit_tokens: int = 0
    host_prefix_bytes_to_host: int = 0
    host_prefix_bytes_to_device: int = 0
    lora_running: tuple[int, ...] = ()     # adapter ids of running requests, sorted
    lora_waiting: tuple[int, ...] = ()     # adapter ids of waiting or swapped ones, sorted
    lora_in_use: frozenset = frozenset()   # adapter ids of every unfinished request
    lora_slot_loads: int = 0               # adapters written into device slots
    lora_slot_evictions: int = 0           # idle adapters whose device slot was taken


def engine_stats(scheduler, pages, num_steps: int) -> EngineStats:
    """An immutable snapshot of a scheduler (its queues and counters) and its page manager's
    PageStats (pages), for other threads."""
    host = pages.host
    return EngineStats(
        num_running=len(scheduler.running), num_waiting=len(scheduler.waiting),
        num_swapped=len(scheduler.swapped), num_preemptions=scheduler.num_preemptions,
        num_swaps=scheduler.num_swaps, num_steps=num_steps, kv_usage=pages.usage,
        num_free_pages=pages.num_free, prefix_query_tokens=pages.prefix_query_tokens,
        prefix_hit_tokens=pages.prefix_hit_tokens,
        **_lora_stats(scheduler),
        **({} if host is None else dict(
            host_prefix_pages=host.num_used, host_prefix_capacity_pages=host.num_slots,
            host_prefix_hit_tokens=host.hit_tokens,
            host_prefix_bytes_to_host=host.bytes_to_host,
            host_prefix_bytes_to_device=host.bytes_to_device)))


def _lora_stats(scheduler) -> dict:
    if not scheduler.lora_slots.max_loras:
        return {}
    ids = lambda requests: tuple(sorted({r.lora_id for r in requests if r.lora_id}))
    slots = scheduler.lora_slots
    return dict(lora_running=ids(scheduler.running),
                lora_waiting=ids(scheduler.waiting + scheduler.swapped),
                lora_in_use=slots.in_use, lora_slot_loads=slots.num_loads,
                lora_slot_evictions=slots.num_evictions)
