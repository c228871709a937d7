"""The serving benchmark's load generator: send requests on a schedule, time every token.

One asyncio task per request over a grpc.aio channel (hundreds of concurrent streams are fine),
each started at its send offset and, with max_concurrency, only once a slot is free. A request's
arrival is the moment its call is sent; every streamed token gets the receive time of the
message that carried it (time.perf_counter). It measures only: no statistics here (stats.py),
and no engine code.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import grpc

from jaxserve.bench.datasets import ServeRequest
from jaxserve.bench.stats import RequestTimeline
from jaxserve.core.request import SamplingParams
from jaxserve.entrypoints.grpc import convert
from jaxserve.entrypoints.grpc.client import auth_metadata
from jaxserve.entrypoints.grpc.pb import jaxserve_pb2 as pb
from jaxserve.entrypoints.grpc.pb import jaxserve_pb2_grpc as pb_grpc

_CHANNELS = 8  # streams spread over a few HTTP/2 connections


@dataclass
class LoadResult:
    timelines: list[RequestTimeline]      # in request order
    errors: list[str | None]              # "CODE: details" for a failed request
    cached_prompt_tokens: list[int]       # from each finished stream's usage
    duration: float                       # schedule start to the last stream's end, seconds
    start: float = 0.0                    # perf_counter at the schedule's t=0
    send_offsets: list[float] = field(default_factory=list)


def request_message(request: ServeRequest, temperature: float = 0.0,
                    ignore_eos: bool = True, seed: int | None = None) -> pb.GenerateRequest:
    params = SamplingParams(max_tokens=request.max_tokens, temperature=temperature,
                            ignore_eos=ignore_eos, seed=seed)
    if request.messages is not None:
        return convert.generate_request(params=params, messages=list(request.messages))
    return convert.generate_request(list(request.prompt_token_ids), params)


async def _one(stub, message: pb.GenerateRequest, timeline: RequestTimeline,
               timeout: float | None, metadata=()) -> tuple[str | None, int]:
    timeline.arrival = time.perf_counter()
    cached = 0
    try:
        async for response in stub.Generate(message, timeout=timeout, metadata=metadata):
            now = time.perf_counter()
            timeline.token_times.extend([now] * len(response.token_ids))
            if response.finish_reason != pb.FINISH_REASON_UNSPECIFIED:
                timeline.num_prompt_tokens = response.usage.prompt_tokens
                cached = response.usage.cached_prompt_tokens
    except grpc.aio.AioRpcError as exc:
        timeline.ok = False
        return f"{exc.code().name}: {exc.details()}", cached
    if not timeline.token_times:
        timeline.ok = False
        return "stream ended without a token", cached
    return None, cached


async def run_load(address: str, messages: list[pb.GenerateRequest], send_offsets,
                   max_concurrency: int | None = None,
                   timeout: float | None = None, api_key: str | None = None) -> LoadResult:
    """Send messages[i] at send_offsets[i] seconds (or later, waiting for a concurrency slot)
    and stream every response to the end (with api_key, if given, on every call)."""
    if len(messages) != len(send_offsets):
        raise ValueError(f"{len(messages)} messages but {len(send_offsets)} send offsets")
    channels = [grpc.aio.insecure_channel(address) for _ in range(min(_CHANNELS, len(messages))
                                                                   or 1)]
    stubs = [pb_grpc.JaxServeStub(c) for c in channels]
    slots = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    timelines = [RequestTimeline(0.0) for _ in messages]

    metadata = auth_metadata(api_key)

    async def send(i: int):
        if slots is None:
            return await _one(stubs[i % len(stubs)], messages[i], timelines[i], timeout,
                              metadata)
        async with slots:
            return await _one(stubs[i % len(stubs)], messages[i], timelines[i], timeout,
                              metadata)

    try:
        await asyncio.gather(*(c.channel_ready() for c in channels))
        outcomes, start, end = await send_on_schedule(send, send_offsets)
    finally:
        await asyncio.gather(*(c.close() for c in channels))
    return load_result(timelines, outcomes, start, end, send_offsets)


async def send_on_schedule(send, send_offsets) -> tuple[list, float, float]:
    """Start send(i) at offset i from now (seconds); (its outcomes in order, start, end)."""
    start = time.perf_counter()
    tasks = []
    for i, offset in enumerate(send_offsets):
        delay = start + float(offset) - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(send(i)))
    outcomes = await asyncio.gather(*tasks)
    return outcomes, start, time.perf_counter()


def load_result(timelines, outcomes, start: float, end: float, send_offsets) -> "LoadResult":
    """A LoadResult from (error, chunks) outcomes, one per request."""
    return LoadResult(timelines, [e for e, _ in outcomes], [c for _, c in outcomes],
                      end - start, start, [float(x) for x in send_offsets])


def run_load_sync(address: str, messages, send_offsets, max_concurrency=None,
                  timeout=None, api_key=None) -> LoadResult:
    """run_load on a fresh event loop (for synchronous callers: the CLI, the suite)."""
    return asyncio.run(run_load(address, messages, send_offsets, max_concurrency, timeout,
                                api_key))
