"""Engine output streams -> OpenAI pieces: SSE events, usage, finish reasons, sampled logprobs.

Helpers of OpenAIServing (openai_serving.py): `rest` and `merged` walk one or several
AsyncEngine.generate streams and always close them (so a request whose client went away is
aborted), `usage`, `finish_reason` and the two logprobs shapes (completions: tokens /
token_logprobs / text_offset; chat: content entries with token, logprob, bytes) read finished
RequestOutputs. No engine calls beyond iterating the streams, no HTTP.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from typing import AsyncIterator

from jaxserve.outputs import RequestOutput
from jaxserve.server.openai_errors import OpenAIError

SSE_DONE = "data: [DONE]\n\n"
_dumps = json.JSONEncoder(ensure_ascii=False, separators=(",", ":")).encode


def sse(obj) -> str:
    return f"data: {_dumps(obj)}\n\n"


def usage(outs: list[RequestOutput]) -> dict:
    prompt = sum(len(o.prompt_token_ids) for o in outs)
    completion = sum(len(o.token_ids) for o in outs)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": sum(o.num_cached_tokens for o in outs)}}


def finish_reason(out: RequestOutput) -> str | None:
    """stop / length; an aborted or failed request is an error, not a reason."""
    if not out.finished or out.finish_reason in ("stop", "length"):
        return out.finish_reason
    if out.finish_reason == "abort":
        raise OpenAIError(503, f"request {out.request_id} was aborted by the server",
                          None, "service_unavailable")
    raise OpenAIError(500, out.error or "the request failed in the engine", None,
                      "internal_error")


async def rest(first: RequestOutput, stream) -> AsyncIterator[RequestOutput]:
    """The first (already received) output, then the rest; closing this closes the stream."""
    async with contextlib.aclosing(stream):
        yield first
        if not first.finished:
            async for out in stream:
                yield out


async def final(first: RequestOutput, stream) -> RequestOutput:
    out = first
    async with contextlib.aclosing(rest(first, stream)) as outs:
        async for out in outs:
            pass
    return out


async def merged(started) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(choice index, output) from several (first output, stream) pairs in arrival order."""
    if len(started) == 1:
        async with contextlib.aclosing(rest(*started[0])) as outs:
            async for out in outs:
                yield 0, out
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i, first, stream):
        try:
            async for out in rest(first, stream):
                queue.put_nowait((i, out))
        except Exception as exc:
            queue.put_nowait((i, exc))

    tasks = [asyncio.ensure_future(pump(i, f, s)) for i, (f, s) in enumerate(started)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item = await queue.get()
            if isinstance(item, BaseException):
                raise item
            yield i, item
            remaining -= item.finished
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for _, stream in started:  # a pump cancelled before it started never closed its own
            await stream.aclose()


class EventStream:
    """SSE event strings from `events`, an async generator over `started` (first output,
    engine stream) pairs. aclose() closes the generator and every engine stream, so the
    requests are aborted even if iteration never began."""

    def __init__(self, events, started):
        self.events, self.started = events, started

    def __aiter__(self):
        return self.events

    async def aclose(self) -> None:
        await self.events.aclose()
        for _, stream in self.started:
            await stream.aclose()


# ---- sampled-token logprobs (no top-k alternatives yet: see openai_errors.UNSUPPORTED) ----------
def _pieces(tokenizer, token_ids) -> list[str]:
    """Each token's own text (a byte-level token cut inside a character decodes to U+FFFD)."""
    return [tokenizer.decode([t], skip_special_tokens=False) for t in token_ids]


def completion_logprobs(tokenizer, token_ids, logprobs, text_offset: int) -> dict:
    """OpenAI's completions logprobs for these tokens; text_offset: where the first starts."""
    pieces, offsets = _pieces(tokenizer, token_ids), []
    for piece in pieces:
        offsets.append(text_offset)
        text_offset += len(piece)
    return {"tokens": pieces, "token_logprobs": [float(x) for x in logprobs],
            "top_logprobs": None, "text_offset": offsets}


def chat_logprobs(tokenizer, token_ids, logprobs) -> dict:
    """OpenAI's chat logprobs for these tokens (top_logprobs empty: only the sampled token)."""
    return {"content": [{"token": piece, "logprob": float(lp),
                         "bytes": list(piece.encode("utf-8")), "top_logprobs": []}
                        for piece, lp in zip(_pieces(tokenizer, token_ids), logprobs)]}
