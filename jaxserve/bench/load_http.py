"""The serving benchmark's load generator over the OpenAI HTTP API (SSE streams), beside load.py's
gRPC one: the same schedule, the same per-token timing, the same LoadResult.

One asyncio task per request on one httpx.AsyncClient (a pool of keep-alive HTTP/1.1
connections, one per stream in flight), each started at its send offset and, with
max_concurrency, only once a slot is free. Requests ask for `return_token_ids` and
`stream_options.include_usage`, so every token gets the receive time of the SSE event that
carried it (not one guess per event) and the usage gives the prompt and cached-token counts.
It measures only: no statistics here (stats.py), no engine code.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time

from jaxserve.bench.datasets import ServeRequest
from jaxserve.bench.load import LoadResult, load_result, send_on_schedule
from jaxserve.bench.stats import RequestTimeline

PATHS = {"openai": "/v1/completions", "openai-chat": "/v1/chat/completions"}
# httpx logs every request at INFO: a line per benchmark request would bury the report.
logging.getLogger("httpx").setLevel(logging.WARNING)


def request_body(backend: str, request: ServeRequest, model: str, temperature: float = 0.0,
                 ignore_eos: bool = True, prompt_token_ids: list[int] | None = None) -> dict:
    """The JSON body of one streamed request. `openai` sends token ids (a chat request's are
    its rendered template, given as prompt_token_ids); `openai-chat` needs messages."""
    body = {"model": model, "max_tokens": request.max_tokens, "temperature": temperature,
            "ignore_eos": ignore_eos, "stream": True, "return_token_ids": True,
            "stream_options": {"include_usage": True}}
    if backend == "openai-chat":
        if request.messages is None:
            raise ValueError("--backend openai-chat sends chat messages: use --dataset chat "
                             "(or --backend openai for token-id prompts)")
        return dict(body, messages=list(request.messages))
    if backend != "openai":
        raise ValueError(f"backend {backend!r} is not an HTTP backend: one of {sorted(PATHS)}")
    ids = prompt_token_ids if request.messages is not None else request.prompt_token_ids
    return dict(body, prompt=list(ids))


async def _events(response):
    """The JSON objects of an SSE stream's `data: {...}` events, as their bytes arrive (split on
    the blank line ending each event: cheaper than text lines, and the load generator shares
    the machine with the server it measures)."""
    buffer = b""
    async for data in response.aiter_raw():
        buffer += data
        *events, buffer = buffer.split(b"\n\n")
        for event in events:
            if event.startswith(b"data: {"):
                yield json.loads(event[6:])


async def _one(http, path: str, body: dict, timeline: RequestTimeline) -> tuple[str | None, int]:
    timeline.arrival = time.perf_counter()
    cached = 0
    try:
        async with http.stream("POST", path, json=body) as response:
            if response.status_code != 200:
                text = (await response.aread()).decode(errors="replace")
                timeline.ok = False
                return f"HTTP {response.status_code}: {text[:200]}", cached
            async for event in _events(response):
                now = time.perf_counter()
                if "error" in event:
                    timeline.ok = False
                    return f"stream error: {event['error'].get('message')}", cached
                for choice in event["choices"]:
                    timeline.token_times.extend([now] * len(choice.get("token_ids") or ()))
                if event.get("usage"):
                    timeline.num_prompt_tokens = event["usage"]["prompt_tokens"]
                    details = event["usage"].get("prompt_tokens_details") or {}
                    cached = details.get("cached_tokens") or 0
    except Exception as exc:  # httpx transport errors, timeouts, a truncated stream
        timeline.ok = False
        return f"{type(exc).__name__}: {exc}", cached
    if not timeline.token_times:
        timeline.ok = False
        return "stream ended without a token", cached
    return None, cached


async def run_load_http(base_url: str, path: str, bodies: list[dict], send_offsets,
                        max_concurrency: int | None = None, timeout: float | None = None,
                        api_key: str | None = None) -> LoadResult:
    """POST bodies[i] to base_url + path at send_offsets[i] seconds (or later, waiting for a
    concurrency slot) and read every SSE stream to the end."""
    import httpx

    if len(bodies) != len(send_offsets):
        raise ValueError(f"{len(bodies)} bodies but {len(send_offsets)} send offsets")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=max_concurrency or len(bodies) or 1,
                          max_keepalive_connections=max_concurrency or len(bodies) or 1)
    slots = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    timelines = [RequestTimeline(0.0) for _ in bodies]
    async with httpx.AsyncClient(base_url=base_url, headers=headers, limits=limits,
                                 timeout=httpx.Timeout(timeout)) as http:

        async def send(i: int):
            if slots is None:
                return await _one(http, path, bodies[i], timelines[i])
            async with slots:
                return await _one(http, path, bodies[i], timelines[i])

        outcomes, start, end = await send_on_schedule(send, send_offsets)
    return load_result(timelines, outcomes, start, end, send_offsets)


def run_load_http_sync(*args, **kwargs) -> LoadResult:
    """run_load_http on a fresh event loop (for synchronous callers: the CLI, the suite)."""
    return asyncio.run(run_load_http(*args, **kwargs))
