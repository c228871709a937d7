"""Engine output streams -> OpenAI pieces: SSE events, usage, finish reasons, logprobs.

Helpers of OpenAIServing (openai_serving.py): `rest` and `merged` walk one or several
AsyncEngine.generate streams and always close them (so a request whose client went away is
aborted); `usage`, `finish_reason` and the two logprobs shapes (completions: tokens /
token_logprobs / top_logprobs {text: logprob} / text_offset, echoed prompt tokens included;
chat: content entries with token, logprob, bytes and top_logprobs entries of the same shape;
vLLM's prompt_logprobs) read RequestOutputs and their samples (CompletionOutputs). No engine
calls beyond iterating the streams, no HTTP.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from typing import AsyncIterator

from jaxserve.engine.outputs import CompletionOutput, RequestOutput
from jaxserve.entrypoints.openai.errors import OpenAIError

SSE_DONE = "data: [DONE]\n\n"
_dumps = json.JSONEncoder(ensure_ascii=False, separators=(",", ":")).encode


def sse(obj) -> str:
    return f"data: {_dumps(obj)}\n\n"


def usage(outs: list[RequestOutput]) -> dict:
    """Each prompt counted once, every sample's output tokens counted (as vLLM and OpenAI)."""
    prompt = sum(len(o.prompt_token_ids) for o in outs)
    completion = sum(len(c.token_ids) for o in outs for c in o.outputs)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": sum(o.num_cached_tokens for o in outs)}}


def finish_reason(sample: CompletionOutput, out: RequestOutput) -> str | None:
    """A sample's stop / length; an aborted or failed request is an error, not a reason: a 400
    naming the field when the request itself was at fault (out.error_field), else a 500."""
    if sample.finish_reason in (None, "stop", "length"):
        return sample.finish_reason
    if sample.finish_reason == "abort":
        raise OpenAIError(503, f"request {out.request_id} was aborted by the server",
                          None, "service_unavailable")
    if out.error_field is not None:
        raise OpenAIError(400, out.error or f"{out.error_field} is invalid", out.error_field)
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


# ---- logprobs ------------------------------------------------------------------------------------
def _pieces(tokenizer, token_ids) -> list[str]:
    """Each token's own text (a byte-level token cut inside a character decodes to U+FFFD)."""
    return [tokenizer.decode([t], skip_special_tokens=False) for t in token_ids]


def _ranked(top: dict[int, float]) -> list[tuple[int, float]]:
    return sorted(top.items(), key=lambda item: -item[1])


def _text_top(tokenizer, top: dict[int, float]) -> dict[str, float]:
    """{token id: logprob} -> {token text: logprob}; two ids of one text keep the likelier."""
    ranked = _ranked(top)
    out: dict[str, float] = {}
    for piece, (_, lp) in zip(_pieces(tokenizer, [t for t, _ in ranked]), ranked):
        out.setdefault(piece, float(lp))
    return out


def _offsets(pieces: list[str], start: int) -> list[int]:
    offsets = []
    for piece in pieces:
        offsets.append(start)
        start += len(piece)
    return offsets


def completion_logprobs(tokenizer, sample_delta: tuple, text_offset: int,
                        echo: tuple | None = None) -> dict:
    """OpenAI's completions logprobs. sample_delta: (token ids, their logprobs, their top
    {id: logprob} dicts or None); text_offset: where the first token's text starts. echo:
    (prompt ids, RequestOutput.prompt_logprobs) when the prompt is echoed before them (its
    offsets start at 0, its first token has no logprob)."""
    token_ids, logprobs, tops = sample_delta
    pieces = _pieces(tokenizer, token_ids)
    token_lps = [float(x) for x in logprobs]
    top_out = None if tops is None else [_text_top(tokenizer, t) for t in tops]
    offsets = _offsets(pieces, text_offset)
    if echo is not None:
        prompt_ids, prompt_lps = echo
        prompt_pieces = _pieces(tokenizer, prompt_ids)
        pieces, offsets = prompt_pieces + pieces, _offsets(prompt_pieces, 0) + offsets
        token_lps = [None if e is None else float(e[t])
                     for t, e in zip(prompt_ids, prompt_lps)] + token_lps
        if top_out is not None:
            top_out = [None if e is None else _text_top(tokenizer, e)
                       for e in prompt_lps] + top_out
    return {"tokens": pieces, "token_logprobs": token_lps, "top_logprobs": top_out,
            "text_offset": offsets}


def chat_logprobs(tokenizer, token_ids, logprobs, tops) -> dict:
    """OpenAI's chat logprobs for these tokens; tops: per token {id: logprob} of the
    top_logprobs alternatives, or None (top_logprobs empty: only the sampled token)."""
    def entry(piece, lp) -> dict:
        return {"token": piece, "logprob": float(lp), "bytes": list(piece.encode("utf-8"))}

    content = []
    for i, (piece, lp) in enumerate(zip(_pieces(tokenizer, token_ids), logprobs)):
        alternatives = []
        if tops is not None:
            ranked = _ranked(tops[i])
            alternatives = [entry(p, a) for p, (_, a) in
                            zip(_pieces(tokenizer, [t for t, _ in ranked]), ranked)]
        content.append({**entry(piece, lp), "top_logprobs": alternatives})
    return {"content": content}


def prompt_logprobs(tokenizer, prompt_ids: list[int], entries, num_alternatives: int
                    ) -> list[dict | None] | None:
    """vLLM's prompt_logprobs from RequestOutput.prompt_logprobs (per position None, then
    {token id: logprob}, the prompt token first, then the num_alternatives likeliest): per
    position None or {str(token id): {logprob, rank, decoded_token}}. The alternatives rank
    1, 2, ...; the prompt token has its rank when it is one of them, else None (it ranks
    below them, and the engine does not say by how far)."""
    if entries is None:
        return None
    out: list[dict | None] = []
    for token, entry in zip(prompt_ids, entries):
        if entry is None:
            out.append(None)
            continue
        alternatives = [t for t in entry if t != token or len(entry) == num_alternatives]
        ranks = {t: r for r, (t, _) in enumerate(
            sorted(((t, entry[t]) for t in alternatives), key=lambda item: -item[1]), 1)}
        out.append({str(t): {"logprob": max(float(lp), -9999.0), "rank": ranks.get(t),
                             "decoded_token": piece}
                    for (t, lp), piece in zip(entry.items(), _pieces(tokenizer, entry))})
    return out
