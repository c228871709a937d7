"""OpenAIServing: OpenAI completion and chat requests -> AsyncEngine calls -> responses and SSE.

A thin translation layer, as vLLM's entrypoints/openai serving classes are. It reads only the
engine's frozen facts (`engine.info`), its tokenizer, and talks to the engine through
AsyncEngine.generate (whose iterator is always closed, so a request whose client went away is
aborted); it never touches the scheduler, the page manager or the runner, and knows nothing of
routing, auth or health (http_server.py). Tokenizing and chat templating run on a worker thread,
never on the event loop. Every refusal is an OpenAIError with the HTTP status, a message naming
the field and its limit, and the field itself (openai_errors.py, with the parameters refused until
the engine learns them); walking engine streams, SSE, usage and logprobs are openai_stream.py's.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid

from jaxserve import __version__
from jaxserve.async_engine import AsyncEngine
from jaxserve.request import SamplingParams
from jaxserve.server import openai_protocol as api
from jaxserve.server.chat_prompt import render_chat, with_chat_template
from jaxserve.server.openai_errors import (OpenAIError, bad_request, check_supported,
                                           error_for_exception)
from jaxserve.server.openai_stream import (SSE_DONE, EventStream, chat_logprobs,
                                           completion_logprobs, final, finish_reason, merged,
                                           sse, usage)

DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


class OpenAIServing:
    def __init__(self, async_engine: AsyncEngine, served_model_name: str | None = None,
                 chat_template: str | None = None):
        self.async_engine = async_engine
        self.info = async_engine.engine.info
        self.tokenizer = async_engine.engine.tokenizer
        self.model_name = served_model_name or self.info.model_name
        self.chat_tokenizer = with_chat_template(self.tokenizer, chat_template)
        self.fingerprint = f"jaxserve-{__version__}-{self.info.dtype}"
        # A request can hold at most this many tokens: the context, or the whole KV pool.
        self.max_tokens_total = min(self.info.max_model_len,
                                    (self.info.num_pages - 1) * self.info.page_size)

    # ---- checks ------------------------------------------------------------------------------
    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_name:
            raise OpenAIError(404, f"model {name!r} does not exist: this server serves "
                                   f"{self.model_name!r}", "model", "model_not_found")

    def _check_ids(self, ids: list[int], field: str) -> None:
        vocab = self.info.vocab_size
        bad = next((t for t in ids if t >= vocab), None)
        if bad is not None:
            raise bad_request(f"{field} contains token id {bad}, outside the vocabulary "
                              f"[0, {vocab})", field)

    def _params(self, request, prompt_len: int, field: str, max_tokens: int | None,
                default_max_tokens: int | None) -> SamplingParams:
        max_field = ("max_completion_tokens" if getattr(request, "max_completion_tokens", None)
                     is not None else "max_tokens")
        limit, context = self.max_tokens_total, self.info.max_model_len
        if prompt_len >= limit:
            raise bad_request(f"{field} has {prompt_len} tokens, but a request may hold at "
                              f"most {limit} (max_model_len {context}, KV pool "
                              f"{(self.info.num_pages - 1) * self.info.page_size} tokens), "
                              f"output included", field)
        if max_tokens is None:
            max_tokens = limit - prompt_len
            if default_max_tokens is not None:
                max_tokens = min(max_tokens, default_max_tokens)
        elif prompt_len + max_tokens > limit:
            raise bad_request(f"{max_field}={max_tokens} is too large: the prompt has "
                              f"{prompt_len} tokens and a request may hold at most {limit} "
                              f"(max_model_len {context}), so {max_field} must be at most "
                              f"{limit - prompt_len}", max_field)
        top_k = request.top_k if request.top_k not in (None, -1) else 0
        kwargs = dict(temperature=request.temperature, top_p=request.top_p, min_p=request.min_p,
                      seed=request.seed)
        try:
            return SamplingParams(
                max_tokens=max_tokens, top_k=top_k, stop=request.stop or (),
                stop_token_ids=tuple(request.stop_token_ids or ()), ignore_eos=request.ignore_eos,
                logprobs=request.logprobs is not None and request.logprobs is not False,
                **{k: v for k, v in kwargs.items() if v is not None})
        except ValueError as exc:
            raise error_for_exception(exc) from None

    async def _in_thread(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(None, fn, *args)

    # ---- prompts -----------------------------------------------------------------------------
    def _completion_prompts(self, prompt) -> tuple[list[list[int]], list[str | None]]:
        """Token ids per prompt, and each prompt's text when it was given as text."""
        if isinstance(prompt, str):
            prompt = [prompt]
        if isinstance(prompt[0], int):
            prompt = [prompt]
        if isinstance(prompt[0], str):
            return [self.tokenizer.encode(p) for p in prompt], list(prompt)
        for ids in prompt:
            self._check_ids(ids, "prompt")
        return [list(ids) for ids in prompt], [None] * len(prompt)

    def chat_prompt(self, request) -> list[int]:
        try:
            _, ids = render_chat(self.chat_tokenizer, request.messages,
                                 request.add_generation_prompt, request.continue_final_message)
        except ValueError as exc:
            param = "continue_final_message" if "continue_final_message" in str(exc) else \
                "messages"
            raise bad_request(str(exc), param) from None
        return ids

    # ---- engine ------------------------------------------------------------------------------
    async def _start(self, request_id: str, prompts: list[list[int]],
                     params: list[SamplingParams], prompt_field: str):
        """Submit every prompt; (first output, stream) each, or one error for all (the
        submitted ones are aborted)."""
        streams = [self.async_engine.generate(None, p, request_id=f"{request_id}-{i}",
                                              prompt_token_ids=ids)
                   for i, (ids, p) in enumerate(zip(prompts, params))]
        firsts = await asyncio.gather(*(anext(s) for s in streams), return_exceptions=True)
        failed = next((f for f in firsts if isinstance(f, BaseException)), None)
        if failed is not None:
            for stream in streams:
                await stream.aclose()
            raise error_for_exception(failed, prompt_field)
        return list(zip(firsts, streams))

    def _header(self, request_id: str, kind: str, created: int) -> dict:
        return {"id": request_id, "object": kind, "created": created, "model": self.model_name,
                "system_fingerprint": self.fingerprint}

    # ---- /v1/completions -----------------------------------------------------------------------
    async def completions(self, request: api.CompletionRequest):
        """An api.Completion, or (streaming) an async iterator of SSE event strings."""
        self.check_model(request.model)
        check_supported(request)
        prompts, texts = await self._in_thread(self._completion_prompts, request.prompt)
        params = [self._params(request, len(ids), "prompt", request.max_tokens,
                               DEFAULT_COMPLETION_MAX_TOKENS) for ids in prompts]
        request_id, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        started = await self._start(request_id, prompts, params, "prompt")
        echoes = [""] * len(prompts)
        if request.echo:
            echoes = [t if t is not None else await self._in_thread(self.tokenizer.decode, ids)
                      for t, ids in zip(texts, prompts)]
        if request.stream:
            return EventStream(self._completion_stream(request, request_id, created,
                                                       started, echoes), started)
        outs = await asyncio.gather(*(final(f, s) for f, s in started))
        choices = [api.CompletionChoice(
            index=i, text=echoes[i] + out.text, finish_reason=finish_reason(out),
            logprobs=None if request.logprobs is None else completion_logprobs(
                self.tokenizer, out.token_ids, out.logprobs, 0),
            token_ids=out.token_ids if request.return_token_ids else None,
            prompt_token_ids=out.prompt_token_ids if request.return_token_ids else None)
            for i, out in enumerate(outs)]
        return api.Completion(**self._header(request_id, "text_completion", created),
                              choices=choices, usage=usage(outs))

    async def _completion_stream(self, request, request_id, created, started, echoes):
        header = self._header(request_id, "text_completion", created)
        include_usage = bool(request.stream_options and request.stream_options.include_usage)
        finals, offsets = [], [len(e) for e in echoes]
        try:
            async with contextlib.aclosing(merged(started)) as outs:
                async for i, out in outs:
                    text, echoes[i] = echoes[i] + out.new_text, ""
                    if not (text or out.new_token_ids or out.finished):
                        continue
                    choice = {"index": i, "text": text, "logprobs": None,
                              "finish_reason": finish_reason(out)}
                    if request.logprobs is not None:
                        choice["logprobs"] = completion_logprobs(
                            self.tokenizer, out.new_token_ids, out.new_logprobs, offsets[i])
                        offsets[i] += len(out.new_text)
                    if request.return_token_ids:
                        choice["token_ids"] = out.new_token_ids
                    chunk = dict(header, choices=[choice])
                    if include_usage:
                        chunk["usage"] = None
                    yield sse(chunk)
                    if out.finished:
                        finals.append(out)
        except Exception as exc:
            yield sse(error_for_exception(exc).body())
        else:
            if include_usage:
                yield sse(dict(header, choices=[], usage=usage(finals)))
        yield SSE_DONE

    # ---- /v1/chat/completions ------------------------------------------------------------------
    async def chat(self, request: api.ChatCompletionRequest):
        """An api.ChatCompletion, or (streaming) an async iterator of SSE event strings."""
        self.check_model(request.model)
        check_supported(request)
        ids = await self._in_thread(self.chat_prompt, request)
        max_tokens = request.max_completion_tokens or request.max_tokens
        params = self._params(request, len(ids), "messages", max_tokens, None)
        request_id, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        started = await self._start(request_id, [ids], [params], "messages")
        if request.stream:
            return EventStream(self._chat_stream(request, request_id, created, started),
                               started)
        out = await final(*started[0])
        choice = api.ChatChoice(
            index=0, message=api.AssistantMessage(content=out.text),
            finish_reason=finish_reason(out), logprobs=chat_logprobs(
                self.tokenizer, out.token_ids, out.logprobs) if request.logprobs else None,
            token_ids=out.token_ids if request.return_token_ids else None)
        return api.ChatCompletion(
            **self._header(request_id, "chat.completion", created), choices=[choice],
            usage=usage([out]), prompt_token_ids=ids if request.return_token_ids else None)

    async def _chat_stream(self, request, request_id, created, started):
        header = self._header(request_id, "chat.completion.chunk", created)
        include_usage = bool(request.stream_options and request.stream_options.include_usage)

        def chunk(delta: dict, reason=None, out=None) -> str:
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}
            if request.logprobs and out is not None:
                choice["logprobs"] = chat_logprobs(self.tokenizer, out.new_token_ids,
                                                   out.new_logprobs)
            if request.return_token_ids:
                choice["token_ids"] = out.new_token_ids if out is not None else []
            body = dict(header, choices=[choice])
            if include_usage:
                body["usage"] = None
            return sse(body)

        yield chunk({"role": "assistant", "content": ""})
        last = None
        try:
            async with contextlib.aclosing(merged(started)) as outs:
                async for _, out in outs:
                    reason = finish_reason(out)
                    if out.new_text or out.new_token_ids:
                        yield chunk({"content": out.new_text}, out=out)
                    if out.finished:
                        last = out
                        yield chunk({}, reason)
        except Exception as exc:
            yield sse(error_for_exception(exc).body())
        else:
            if include_usage:
                yield sse(dict(header, choices=[], usage=usage([last])))
        yield SSE_DONE

    # ---- /tokenize, /detokenize --------------------------------------------------------------
    async def tokenize(self, request) -> api.TokenizeResponse:
        self.check_model(request.model)
        if isinstance(request, api.TokenizeChatRequest):
            ids = await self._in_thread(self.chat_prompt, request)
        else:
            ids = await self._in_thread(self.tokenizer.encode, request.prompt,
                                        request.add_special_tokens)
        return api.TokenizeResponse(count=len(ids), max_model_len=self.info.max_model_len,
                                    tokens=list(ids))

    async def detokenize(self, request: api.DetokenizeRequest) -> api.DetokenizeResponse:
        self.check_model(request.model)
        self._check_ids(request.tokens, "tokens")
        return api.DetokenizeResponse(
            prompt=await self._in_thread(self.tokenizer.decode, request.tokens))
