"""OpenAIServing: OpenAI completion and chat requests -> AsyncEngine calls -> responses and SSE.

A thin translation layer, as vLLM's entrypoints/openai serving classes are. It reads only the
engine's frozen facts (`engine.info`), its tokenizer, and talks to the engine through
AsyncEngine.generate (whose iterator is always closed, so a request whose client went away is
aborted); it never touches the scheduler, the page manager or the runner, and knows nothing of
routing, auth or health (http_server.py). Prompt sizes are checked against AsyncEngine's
PromptLimits before any tokenizer work; a prompt of token ids is checked inline and never waits
for the text pool; long prompts, chat templating and detokenizing run on the text pool, never on
the event loop. A request's `timeout` becomes its deadline. Every
check on a request's content is core/intake.py's: its length against max_model_len and the KV
pool here (the default max_tokens depends on it), the rest as AsyncEngine.generate makes the
request. Every refusal is an OpenAIError with the HTTP status, a message naming the field and
its limit, and the field itself (openai/errors.py, with the parameters refused until the engine
learns them); walking engine streams, SSE, usage and logprobs are stream.py's; chat, tools
and tool calls are serving_chat.py's (ChatServing, mixed in here).
Output constraints (response_format, vLLM's structured_outputs and guided_*: at most one) become
SamplingParams.structured_outputs; AsyncEngine.generate compiles the grammar before queueing, so
an invalid one is a 400 naming its field before any work is done. With a reasoning parser, chat
replies are split into reasoning_content and content, and a constraint starts after the
reasoning (openai/reasoning.py); without one they are sent as the model writes them.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid

from jaxserve import __version__
from jaxserve.core import intake
from jaxserve.core.intake import RequestError
from jaxserve.engine.async_engine import AsyncEngine
from jaxserve.engine.prompt_intake import INLINE_MAX_CHARS, encode
from jaxserve.core.request import SamplingParams
from jaxserve.entrypoints.openai import protocol as api
from jaxserve.config.tool_calls import ToolCallSettings
from jaxserve.entrypoints.openai.chat_prompt import with_chat_template
from jaxserve.entrypoints.openai.errors import (OpenAIError, bad_request, check_supported,
                                           error_for_exception, logit_bias)
from jaxserve.entrypoints.openai.reasoning import ReasoningFormat
from jaxserve.entrypoints.openai.serving_chat import ChatServing
from jaxserve.entrypoints.openai.stream import (SSE_DONE, EventStream, completion_logprobs,
                                           final, finish_reason, merged, prompt_logprobs, sse,
                                           usage)
from jaxserve.entrypoints.openai.tool_calls import tool_parser_class
from jaxserve.structured.params import StructuredOutputs, StructuredOutputsError

DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


class OpenAIServing(ChatServing):
    """Completions, chat (ChatServing, serving_chat.py), tokenize and detokenize over one
    AsyncEngine. tool_calls: the server's tool-calling settings (tool_choice "auto" needs its
    parser; an unknown parser name is a ValueError here, at start-up)."""

    def __init__(self, async_engine: AsyncEngine, served_model_name: str | None = None,
                 chat_template: str | None = None, tool_calls: ToolCallSettings | None = None,
                 reasoning_parser: str | None = None):
        self.tool_parser = tool_parser_class((tool_calls or ToolCallSettings()).auto_parser)
        self.async_engine = async_engine
        self.info = async_engine.engine.info
        self.tokenizer = async_engine.engine.tokenizer
        self.model_name = served_model_name or self.info.model_name
        self.chat_tokenizer = with_chat_template(self.tokenizer, chat_template)
        self.fingerprint = f"jaxserve-{__version__}-{self.info.dtype}"
        self.reasoning = ReasoningFormat.load(reasoning_parser, self.tokenizer)  # None: off

    # ---- checks ------------------------------------------------------------------------------
    def check_model(self, name: str | None):
        """The LoRARequest of the adapter `name` names (None: the base model); 404 for a name
        this server does not serve."""
        if name is None or name == self.model_name:
            return None
        registry = self.async_engine.engine.lora_registry
        lora = None if registry is None else registry.lookup(name)
        if lora is None:
            raise OpenAIError(404, f"model {name!r} does not exist: this server serves "
                                   f"{self.model_name!r}" + self._adapter_names(),
                              "model", "model_not_found")
        return lora

    def _adapter_names(self) -> str:
        registry = self.async_engine.engine.lora_registry
        names = [r.lora_name for r in registry.requests] if registry is not None else []
        return f" and the LoRA adapters {', '.join(map(repr, names))}" if names else ""

    @staticmethod
    def constraint(request) -> tuple[StructuredOutputs | None, str | None]:
        """The request's output constraint and the field that set it (None, None: none)."""
        fields = api.constraint_fields(request)
        if not fields:
            return None, None
        if len(fields) > 1:
            raise bad_request(f"{' and '.join(fields)} are set together: constrain the output "
                              f"with at most one of response_format (json_object or "
                              f"json_schema), structured_outputs, guided_json, guided_regex, "
                              f"guided_choice, guided_grammar", fields[1])
        field = fields[0]
        try:
            return api.structured_outputs(request, field), field
        except StructuredOutputsError as exc:
            message = str(exc)
            if field.startswith("guided_"):  # "structured_outputs.json" is guided_json here
                message = message.replace(f"structured_outputs.{field[7:]}", field)
            raise bad_request(f"{field} is invalid: {message}", field) from None

    def _params(self, request, prompt_len: int, field: str, max_tokens: int | None,
                default_max_tokens: int | None, logprobs: int | None,
                prompt_logprobs: int | None = None,
                structured_outputs: StructuredOutputs | None = None) -> SamplingParams:
        max_field = ("max_completion_tokens" if getattr(request, "max_completion_tokens", None)
                     is not None else "max_tokens")
        try:  # intake's other checks run as AsyncEngine.generate makes the request
            room = intake.output_room(self.info, prompt_len, field)
            if max_tokens is None:
                max_tokens = min(room, default_max_tokens or room)
            intake.check_length(self.info, prompt_len, max_tokens, prompt_field=field,
                                max_tokens_field=max_field)
        except RequestError as exc:
            raise error_for_exception(exc) from None
        top_k = request.top_k if request.top_k not in (None, -1) else 0
        optional = dict(temperature=request.temperature, top_p=request.top_p,
                        min_p=request.min_p, seed=request.seed)
        try:
            return SamplingParams(
                max_tokens=max_tokens, top_k=top_k, stop=request.stop or (),
                stop_token_ids=tuple(request.stop_token_ids or ()), ignore_eos=request.ignore_eos,
                n=request.n, logprobs=logprobs, prompt_logprobs=prompt_logprobs,
                presence_penalty=request.presence_penalty,
                frequency_penalty=request.frequency_penalty,
                repetition_penalty=request.repetition_penalty,
                logit_bias=logit_bias(request.logit_bias), min_tokens=request.min_tokens,
                allowed_token_ids=request.allowed_token_ids, bad_words=request.bad_words or (),
                include_stop_str_in_output=request.include_stop_str_in_output,
                skip_special_tokens=request.skip_special_tokens,
                structured_outputs=structured_outputs,
                **{k: v for k, v in optional.items() if v is not None})
        except ValueError as exc:
            raise error_for_exception(exc) from None

    async def _in_thread(self, fn, *args):
        try:
            return await self.async_engine.text_pool.run(fn, *args)
        except Exception as exc:
            raise error_for_exception(exc) from None

    # ---- prompts -----------------------------------------------------------------------------
    async def _completion_prompts(self, prompt) -> tuple[list[list[int]], list[str | None]]:
        """Token ids per prompt, and each prompt's text when it was given as text. Token ids
        are checked here and never wait for the text pool; texts are size-checked first, then
        tokenized here when short (as AsyncEngine does), else on the text pool."""
        if isinstance(prompt, str):
            prompt = [prompt]
        if isinstance(prompt[0], int):
            prompt = [prompt]
        limits = self.async_engine.limits
        try:
            if isinstance(prompt[0], str):
                for text in prompt:
                    limits.check_text(text)
            else:
                for ids in prompt:
                    limits.check_num_tokens(len(ids), "prompt")
                    intake.check_prompt(self.info, ids, "prompt")
        except RequestError as exc:
            raise error_for_exception(exc) from None
        if not isinstance(prompt[0], str):
            return [list(ids) for ids in prompt], [None] * len(prompt)
        if sum(len(text) for text in prompt) <= INLINE_MAX_CHARS:
            return [encode(self.tokenizer, text) for text in prompt], list(prompt)
        ids = await self._in_thread(lambda: [encode(self.tokenizer, text) for text in prompt])
        return ids, list(prompt)

    # ---- engine ------------------------------------------------------------------------------
    async def _start(self, request_id: str, prompts: list[list[int]],
                     params: list[SamplingParams], prompt_field: str,
                     constraint_field: str | None = None, timeout: float | None = None,
                     lora_request=None):
        """Submit every prompt (under lora_request's adapter; None: the base model); (first
        output, stream) each, or one error for all (the submitted ones are aborted)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        streams = [self.async_engine.generate(None, p, request_id=f"{request_id}-{i}",
                                              prompt_token_ids=ids, deadline=deadline,
                                              **({} if lora_request is None
                                                 else {"lora_request": lora_request}))
                   for i, (ids, p) in enumerate(zip(prompts, params))]
        firsts = await asyncio.gather(*(anext(s) for s in streams), return_exceptions=True)
        failed = next((f for f in firsts if isinstance(f, BaseException)), None)
        if failed is not None:
            for stream in streams:
                await stream.aclose()
            raise error_for_exception(failed, prompt_field, constraint_field)
        return list(zip(firsts, streams))

    def _header(self, request_id: str, kind: str, created: int, lora=None) -> dict:
        model = self.model_name if lora is None else lora.lora_name
        return {"id": request_id, "object": kind, "created": created, "model": model,
                "system_fingerprint": self.fingerprint}

    # ---- /v1/completions -----------------------------------------------------------------------
    async def completions(self, request: api.CompletionRequest):
        """An api.Completion, or (streaming) an async iterator of SSE event strings. Prompt p's
        sample i is choice p * n + i, as in vLLM."""
        lora = self.check_model(request.model)
        check_supported(request)
        constraint, constraint_field = self.constraint(request)
        prompts, texts = await self._completion_prompts(request.prompt)
        num_prompt_lps = request.prompt_logprobs
        if num_prompt_lps is None and request.echo:
            num_prompt_lps = request.logprobs  # as vLLM: an echoed prompt gets logprobs' k
        params = [self._params(request, len(ids), "prompt", request.max_tokens,
                               DEFAULT_COMPLETION_MAX_TOKENS, request.logprobs, num_prompt_lps,
                               constraint)
                  for ids in prompts]
        request_id, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        started = await self._start(request_id, prompts, params, "prompt", constraint_field,
                                    request.timeout, lora)
        echoes = [None] * len(prompts)
        if request.echo:
            echoes = [t if t is not None else await self._in_thread(self.tokenizer.decode, ids)
                      for t, ids in zip(texts, prompts)]
        header = self._header(request_id, "text_completion", created, lora)
        if request.stream:
            return EventStream(self._completion_stream(request, header, started, echoes),
                               started)
        outs = await asyncio.gather(*(final(f, s) for f, s in started))
        choices = [api.CompletionChoice(**self._completion_choice(
            request, out, sample, p, echoes[p], 0, delta=False))
            for p, out in enumerate(outs) for sample in out.outputs]
        return api.Completion(**header, choices=choices, usage=usage(outs))

    def _completion_choice(self, request, out, sample, prompt_index: int, echo: str | None,
                           offset: int, delta: bool) -> dict:
        """One sample's choice (delta: only this step's part); echo: the prompt text to put
        before it, or None; offset: where its text starts in the choice's whole text."""
        if delta:
            ids, text = sample.new_token_ids, sample.new_text
            lps, tops = sample.new_logprobs, sample.new_top_logprobs
        else:
            ids, text, lps, tops = sample.token_ids, sample.text, sample.logprobs, \
                sample.top_logprobs
        choice = {"index": prompt_index * request.n + sample.index, "text": (echo or "") + text,
                  "logprobs": None, "finish_reason": finish_reason(sample, out)}
        if request.logprobs is not None:
            prompt = (out.prompt_token_ids, out.prompt_logprobs) \
                if echo is not None and out.prompt_logprobs is not None else None
            choice["logprobs"] = completion_logprobs(
                self.tokenizer, (ids, lps or [], tops if request.logprobs else None),
                offset + len(echo or ""), prompt)
        if request.return_token_ids:
            choice["token_ids"] = ids
            if not delta:
                choice["prompt_token_ids"] = out.prompt_token_ids
        if request.prompt_logprobs is not None:  # never streamed (check_supported)
            choice["prompt_logprobs"] = prompt_logprobs(
                self.tokenizer, out.prompt_token_ids, out.prompt_logprobs,
                request.prompt_logprobs)
        return choice

    async def _completion_stream(self, request, header, started, echoes):
        include_usage = bool(request.stream_options and request.stream_options.include_usage)
        # per choice index: where its next token's text starts (the tokens' own text, which
        # runs ahead of the text sent while a possible stop string is held back); finished
        finals, offsets, done = [], {}, set()
        try:
            async with contextlib.aclosing(merged(started)) as outs:
                async for p, out in outs:
                    for sample in out.outputs:
                        index = p * request.n + sample.index
                        if index in done:
                            continue
                        reason = finish_reason(sample, out)
                        if not (sample.new_text or sample.new_token_ids or reason):
                            continue
                        echo = echoes[p] if index not in offsets else None
                        choice = self._completion_choice(request, out, sample, p, echo,
                                                         offsets.get(index, 0), delta=True)
                        offsets[index] = _next_offset(choice, offsets.get(index, 0))
                        if reason:
                            done.add(index)
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

    # ---- /tokenize, /detokenize --------------------------------------------------------------
    async def tokenize(self, request) -> api.TokenizeResponse:
        self.check_model(request.model)
        if isinstance(request, api.TokenizeChatRequest):
            ids = await self._in_thread(self.chat_prompt, request)
        else:
            ids = await self._in_thread(encode, self.tokenizer, request.prompt,
                                        request.add_special_tokens)
        return api.TokenizeResponse(count=len(ids), max_model_len=self.info.max_model_len,
                                    tokens=list(ids))

    async def detokenize(self, request: api.DetokenizeRequest) -> api.DetokenizeResponse:
        self.check_model(request.model)
        try:
            intake.check_token_ids(self.info, request.tokens, "tokens")
        except RequestError as exc:
            raise error_for_exception(exc) from None
        return api.DetokenizeResponse(
            prompt=await self._in_thread(self.tokenizer.decode, request.tokens))


def _next_offset(choice: dict, offset: int) -> int:
    """Where the text of a streamed choice's next token starts: after this chunk's last token
    (logprobs' tokens and text_offset), else after the text this chunk sent."""
    lps = choice["logprobs"]
    if lps and lps["tokens"]:
        return lps["text_offset"][-1] + len(lps["tokens"][-1])
    return offset + len(choice["text"])
