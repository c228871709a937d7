"""Helpers of test_front_load.py: waiting, holding the engine, a per-client bound set on the
served engine's config, and one completion (HTTP, streamed or not) or Generate call (gRPC, aio)
collected into its tokens or its refusal. No server of its own."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time

import grpc
import httpx

from jaxserve import SamplingParams
from jaxserve.entrypoints.grpc import convert

MODEL = "tiny-llama"
UNBOUNDED = httpx.Limits(max_connections=None, max_keepalive_connections=None)
KEY_A, KEY_B = (("authorization", "Bearer key-a"),), (("authorization", "Bearer key-b"),)


def wait_for(condition, timeout: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.01)
    return condition()


async def until(condition, timeout: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout
    while not condition() and time.monotonic() < deadline:
        await asyncio.sleep(0.01)
    return condition()


@contextlib.contextmanager
def engine_held(async_engine):
    """The engine loop waiting, not reading its inbox, until the block ends (or `release`)."""
    async_engine.paused.set()
    try:
        async_engine.abort("wake-up")  # an unknown id: wakes an idle loop, which then holds
        assert async_engine.holding.wait(10), "the engine loop never held"
        yield async_engine.paused.clear
    finally:
        async_engine.paused.clear()


@contextlib.contextmanager
def per_key_bound(fronts, bound: int):
    """max_queued_requests_per_key=bound on the served engine for the block (read per
    request, so it applies at once)."""
    engine = fronts.engine
    original = engine.config
    engine.config = original.replace(max_queued_requests_per_key=bound)
    try:
        yield
    finally:
        engine.config = original


def address_client(host: str) -> str:
    """The client an HTTP or gRPC caller from host is, without an API key."""
    from jaxserve.engine.client_limits import client_id
    return client_id(None, host, keyed=False)


def key_client(metadata) -> str:
    """The client a gRPC caller sending this authorization metadata is, keys configured."""
    from jaxserve.engine.client_limits import client_id
    return client_id(metadata[0][1], "unused", keyed=True)


def body(prompt, max_tokens: int, stream: bool = False, **extra) -> dict:
    return {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": True, "return_token_ids": True, "stream": stream, **extra}


async def http_completion(http: httpx.AsyncClient, request: dict):
    """(status, (prompt ids or None, output ids, finish reason)) or (status, error body)."""
    if not request["stream"]:
        r = await http.post("/v1/completions", json=request)
        if r.status_code != 200:
            return r.status_code, r
        choice = r.json()["choices"][0]
        return 200, (choice["prompt_token_ids"], choice["token_ids"], choice["finish_reason"])
    async with http.stream("POST", "/v1/completions", json=request) as r:
        if r.status_code != 200:
            await r.aread()
            return r.status_code, r
        ids, reason, done = [], None, False
        async for line in r.aiter_lines():
            done = done or line == "data: [DONE]"
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    return 500, chunk
                ids += chunk["choices"][0].get("token_ids") or []
                reason = chunk["choices"][0]["finish_reason"] or reason
        return 200, (None, ids, reason if done else "no [DONE]")


async def grpc_generate(stub, prompt, max_tokens: int, metadata=None, timeout: float = 300):
    """("OK", output ids, finish reason) or (status code, details, trailing metadata). prompt:
    text, token ids, or chat messages (a list of dicts)."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    is_chat = isinstance(prompt, list) and prompt and isinstance(prompt[0], dict)
    request = (convert.generate_request(messages=prompt, params=params) if is_chat
               else convert.generate_request(prompt, params))
    ids, reason = [], None
    try:
        async for response in stub.Generate(request, metadata=metadata, timeout=timeout):
            ids += response.token_ids
            reason = convert.FINISH_REASON_NAMES.get(response.finish_reason, reason)
    except grpc.aio.AioRpcError as exc:
        return exc.code(), exc.details(), dict(exc.trailing_metadata() or ())
    return "OK", ids, reason
