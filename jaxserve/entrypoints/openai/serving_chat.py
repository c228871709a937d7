"""ChatServing: POST /v1/chat/completions, the chat half of OpenAIServing (serving.py).

A conversation (and its tools) goes through the chat template; the request's tool_choice
becomes a ToolPlan (openai/tools.py) whose enforced modes ("required", a named function)
constrain the output with the structured-output engine instead of an output-constraint field;
each choice's text is shaped into content and tool calls by a ChoiceOutput
(openai/tool_calls.py), whole or as SSE chunks; with a reasoning parser, the reasoning is split
out of each choice's text first (openai/reasoning.py) and the rest is what the ChoiceOutput
reads, and an output constraint (a tool plan's too) starts after the reasoning. The checks on the conversation and its tools,
and the template work, run on the engine's bounded text pool, never on the event loop. Like
the rest of OpenAIServing it talks to the engine only through AsyncEngine.generate and never
touches scheduling.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
import uuid

from jaxserve.core.intake import RequestError
from jaxserve.entrypoints.openai import protocol as api
from jaxserve.entrypoints.openai.chat_prompt import (check_template_kwargs, render_chat,
                                                     request_messages)
from jaxserve.entrypoints.openai.errors import bad_request, check_supported, error_for_exception
from jaxserve.entrypoints.openai.reasoning import StepSplitter
from jaxserve.entrypoints.openai.stream import (SSE_DONE, EventStream, chat_logprobs, final,
                                           finish_reason, merged, prompt_logprobs, sse, usage)
from jaxserve.entrypoints.openai.tool_calls import choice_output
from jaxserve.entrypoints.openai.tools import ToolPlan, check_messages, plan_tools


class ChatServing:
    """Mixed into OpenAIServing, whose checks, sampling parameters and engine calls it uses;
    `tool_parser` is the server's tool-call parser class (tool_choice "auto"), or None."""

    tool_parser = None

    # ---- the request's input -----------------------------------------------------------------
    def tool_plan(self, request: api.ChatCompletionRequest) -> ToolPlan:
        tools = [t.model_dump(exclude_none=True) for t in request.tools or ()]
        choice = request.tool_choice
        others = api.constraint_fields(request)
        return plan_tools(tools, choice.model_dump() if hasattr(choice, "model_dump") else choice,
                          request.parallel_tool_calls is not False,
                          auto_tool_choice=self.tool_parser is not None,
                          other_constraint=others[0] if others else None)

    def chat_prompt(self, request, plan: ToolPlan | None = None) -> list[int]:
        """The prompt's token ids (chat and /tokenize); plan: the chat request's ToolPlan (its
        tools reach the template), None for /tokenize (its tools go as given)."""
        try:
            messages = request_messages(request.messages)
            check_messages(messages)
            self.async_engine.limits.check_messages(
                [_text(m.get("content")) for m in messages] +
                [c["function"]["arguments"] for m in messages for c in m.get("tool_calls") or ()])
            kwargs = check_template_kwargs(request.chat_template_kwargs)
            tools = (plan.template_tools if plan is not None else
                     [t.model_dump(exclude_none=True) for t in request.tools or ()])
            _, ids = render_chat(self.chat_tokenizer, messages, request.add_generation_prompt,
                                 request.continue_final_message, tools, kwargs)
        except RequestError as exc:
            raise bad_request(str(exc), exc.field) from None
        except ValueError as exc:
            param = next((p for p in ("continue_final_message", "chat_template_kwargs")
                          if p in str(exc)), "messages")
            raise bad_request(str(exc), param) from None
        return ids

    def _chat_input(self, request) -> tuple[ToolPlan, list[int]]:
        try:
            plan = self.tool_plan(request)
        except RequestError as exc:
            raise bad_request(str(exc), exc.field) from None
        return plan, self.chat_prompt(request, plan)

    # ---- /v1/chat/completions ------------------------------------------------------------------
    async def chat(self, request: api.ChatCompletionRequest):
        """An api.ChatCompletion, or (streaming) an async iterator of SSE event strings."""
        lora = self.check_model(request.model)
        check_supported(request)
        constraint, constraint_field = self.constraint(request)
        plan, ids = await self._in_thread(self._chat_input, request)
        if plan.enforced:
            constraint, constraint_field = plan.structured_outputs, plan.constraint_field
        max_tokens = request.max_completion_tokens or request.max_tokens
        params = self._params(request, len(ids), "messages", max_tokens, None,
                              (request.top_logprobs or 0) if request.logprobs else None,
                              request.prompt_logprobs, constraint)
        if plan.mode == "auto" and self.tool_parser.needs_special_tokens:
            params = dataclasses.replace(params, skip_special_tokens=False)
        reasoning = None if self.reasoning is None else self.reasoning.for_request(
            ids, request.chat_template_kwargs, request.include_reasoning)
        if reasoning is not None:
            params = reasoning.constrain(params)
        request_id, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        started = await self._start(request_id, [ids], [params], "messages", constraint_field,
                                    request.timeout, lora)
        header = self._header(request_id, "chat.completion", created, lora)
        if request.stream:
            header["object"] = "chat.completion.chunk"
            return EventStream(self._chat_stream(request, plan, header, started, reasoning),
                               started)
        out = await final(*started[0])
        choices = []
        for sample in out.outputs:
            split = reasoning.message(sample.text) if reasoning else {"content": sample.text}
            shaped = choice_output(plan, self.tool_parser)
            shaped.feed(split.pop("content") or "")
            shaped.finish()
            content, calls = shaped.message()
            reason = finish_reason(sample, out)
            choices.append(api.ChatChoice(
                index=sample.index, message=api.AssistantMessage(content=content,
                                                                 tool_calls=calls, **split),
                finish_reason=shaped.finish_reason(reason) if reason else None,
                logprobs=self._chat_logprobs(request, sample.token_ids, sample.logprobs,
                                             sample.top_logprobs),
                token_ids=sample.token_ids if request.return_token_ids else None))
        return api.ChatCompletion(
            **header, choices=choices, usage=usage([out]),
            prompt_token_ids=ids if request.return_token_ids else None,
            prompt_logprobs=prompt_logprobs(self.tokenizer, ids, out.prompt_logprobs,
                                            request.prompt_logprobs))

    def _chat_logprobs(self, request, token_ids, logprobs, tops) -> dict | None:
        if not request.logprobs:
            return None
        return chat_logprobs(self.tokenizer, token_ids, logprobs or [],
                             tops if request.top_logprobs else None)

    async def _chat_stream(self, request, plan: ToolPlan, header, started, reasoning=None):
        include_usage = bool(request.stream_options and request.stream_options.include_usage)
        splitter = None if reasoning is None else StepSplitter(reasoning, request.n)
        # per choice: its shaper, and the tokens of steps whose text decided no delta yet
        shapers = {i: choice_output(plan, self.tool_parser) for i in range(request.n)}
        held: dict[int, tuple[list, list, list]] = {i: ([], [], []) for i in range(request.n)}

        def chunk(index: int, delta: dict, reason=None) -> str:
            ids, lps, tops = held[index]
            choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": reason}
            if ids:
                choice["logprobs"] = self._chat_logprobs(request, ids, lps, tops)
            if request.return_token_ids:
                choice["token_ids"] = list(ids)
            held[index] = ([], [], [])
            body = dict(header, choices=[choice])
            if include_usage:
                body["usage"] = None
            return sse(body)

        for index in range(request.n):
            yield chunk(index, {"role": "assistant", **shapers[index].start()})
        last, done = None, set()
        try:
            async with contextlib.aclosing(merged(started)) as outs:
                async for _, out in outs:
                    for sample in out.outputs:
                        if sample.index in done:
                            continue
                        reason = finish_reason(sample, out)
                        ids, lps, tops = held[sample.index]
                        ids += sample.new_token_ids
                        lps += sample.new_logprobs or []
                        tops += sample.new_top_logprobs or []
                        shaper, text = shapers[sample.index], sample.new_text
                        if splitter is not None:  # (a tag cut across steps waits for the next)
                            thought, text = splitter.split(sample.index, text, bool(reason))
                            if thought:
                                yield chunk(sample.index, {"reasoning_content": thought})
                        deltas = shaper.feed(text) if text else []
                        if reason:
                            deltas += shaper.finish()
                        for delta in deltas:
                            yield chunk(sample.index, delta)
                        if reason:
                            done.add(sample.index)
                            yield chunk(sample.index, {}, shaper.finish_reason(reason))
                    if out.finished:
                        last = out
        except Exception as exc:
            yield sse(error_for_exception(exc).body())
        else:
            if include_usage:
                yield sse(dict(header, choices=[], usage=usage([last])))
        yield SSE_DONE


def _text(content) -> str:
    if content is None:
        return ""
    return content if isinstance(content, str) else "".join(p["text"] for p in content)
