"""Conversions between the wire messages (jaxserve.v1) and the engine's types.

Proto SamplingParams -> request.SamplingParams (unset fields keep its defaults; values are
validated there, never clamped), a GenerateRequest's prompt -> text or token ids (chat rendered
through the tokenizer's template: grpc/chat.py, tools and chat_template_kwargs included),
RequestOutput -> GenerateResponse (a chat's reasoning in reasoning_text when the server has a
reasoning parser: openai/reasoning.py; its tool calls on each sample's last message), engine
facts -> ModelInfoResponse, and the reverse direction for the client. Pure functions: no engine
state, no gRPC calls, no status codes.
"""

from __future__ import annotations

import json

from jaxserve.core.request import SamplingParams
from jaxserve.structured.params import StructuredOutputs
from jaxserve.entrypoints.grpc import chat as chat_input
from jaxserve.entrypoints.grpc.pb import jaxserve_pb2 as pb
from jaxserve.entrypoints.openai.reasoning import ReasoningFormat, StepSplitter

_OPTIONAL_SAMPLING_FIELDS = ("max_tokens", "temperature", "top_k", "top_p", "min_p", "seed",
                             "ignore_eos", "presence_penalty", "frequency_penalty",
                             "repetition_penalty", "min_tokens", "n",
                             "include_stop_str_in_output", "skip_special_tokens",
                             "prompt_logprobs")
FINISH_REASONS = {"stop": pb.FINISH_REASON_STOP, "length": pb.FINISH_REASON_LENGTH,
                  "tool_calls": pb.FINISH_REASON_TOOL_CALLS}
ENGINE_FINISH_REASONS = ("stop", "length")
FINISH_REASON_NAMES = {value: name for name, value in FINISH_REASONS.items()}


# ---- server side: wire -> engine -------------------------------------------------------------
def sampling_from_proto(msg: pb.SamplingParams) -> SamplingParams:
    """Raises ValueError naming the field, the value and the limit (SamplingParams.validate)."""
    kwargs = {name: getattr(msg, name) for name in _OPTIONAL_SAMPLING_FIELDS
              if msg.HasField(name)}
    if msg.HasField("top_logprobs") and msg.top_logprobs != 0:
        kwargs["logprobs"] = msg.top_logprobs  # validated there: in [0, 20]
    elif msg.HasField("logprobs"):
        kwargs["logprobs"] = 0 if msg.logprobs else None
    if msg.HasField("allowed_token_ids"):
        kwargs["allowed_token_ids"] = tuple(msg.allowed_token_ids.ids)
    if msg.HasField("structured_outputs"):
        kwargs["structured_outputs"] = _structured_from_proto(msg.structured_outputs)
    return SamplingParams(stop=tuple(msg.stop), stop_token_ids=tuple(msg.stop_token_ids),
                          logit_bias=dict(msg.logit_bias), bad_words=tuple(msg.bad_words),
                          structured_outputs_after=tuple(msg.structured_outputs_after),
                          **kwargs)


def _structured_from_proto(msg: pb.StructuredOutputs) -> StructuredOutputs:
    kind = msg.WhichOneof("kind")
    if kind is None:
        raise ValueError("structured_outputs is set but holds no constraint: set one of "
                         "json_schema, regex, choice, grammar, json_object")
    if kind == "json_schema":
        return StructuredOutputs(json=msg.json_schema)
    if kind == "choice":
        return StructuredOutputs(choice=list(msg.choice.options))
    return StructuredOutputs(**{kind: getattr(msg, kind)})


def _structured_to_proto(so: StructuredOutputs, msg: pb.StructuredOutputs) -> None:
    if so.json is not None:
        msg.json_schema = json.dumps(so.json)
    elif so.choice is not None:
        msg.choice.options.extend(so.choice)
    elif so.json_object:
        msg.json_object = True
    else:
        setattr(msg, so.kind, getattr(so, so.kind))


def chat_prompt(tokenizer, chat: pb.Chat) -> tuple[str, list[int]]:
    """The rendered chat template (the chat's tools included) and its token ids (no special
    tokens added: the template writes any BOS itself)."""
    return chat_input.render(tokenizer, chat)


def chat_reasoning(reasoning: ReasoningFormat | None, request: pb.GenerateRequest,
                   token_ids: list[int], params: SamplingParams
                   ) -> tuple[SamplingParams, StepSplitter | None]:
    """A chat's params (a constraint starting after its reasoning) and the splitter of its
    replies, on a server with a reasoning parser; (params, None) otherwise."""
    if reasoning is None or request.WhichOneof("prompt") != "chat":
        return params, None
    per_request = reasoning.for_request(token_ids, chat_input.template_kwargs(request.chat))
    return per_request.constrain(params), StepSplitter(per_request, params.n)


def prompt_from_proto(request: pb.GenerateRequest,
                      tokenizer) -> tuple[str | None, list[int] | None]:
    """(text, None) or (None, token ids); emptiness and vocabulary are checked at intake."""
    which = request.WhichOneof("prompt")
    if which is None:
        raise ValueError("prompt is unset: exactly one of text, token_ids or chat must be set")
    if which == "text":
        return request.text, None
    if which == "token_ids":
        return None, list(request.token_ids.ids)
    return None, chat_prompt(tokenizer, request.chat)[1]


def responses_from_output(out, with_logprobs: bool, reported: set[int],
                          splitter: StepSplitter | None = None,
                          replies: chat_input.Replies | None = None
                          ) -> list[pb.GenerateResponse]:
    """One RequestOutput snapshot -> one stream message per sample with news (new tokens, or
    its finish, which must be stop or length). reported: the samples whose finish was sent,
    updated here, so each is sent once. splitter: a chat's reasoning splitter (text then holds
    the content only); replies: a chat with tools: each sample's reply (its content, after any
    reasoning) is read as it comes, and its calls go on its last message. Usage comes with the
    request's last message."""
    messages = []
    for c in out.outputs:
        finishing = c.finished and c.index not in reported
        if not (c.new_token_ids or c.new_text or finishing):
            continue
        reasoning, text = "", c.new_text
        if splitter is not None:
            reasoning, text = splitter.split(c.index, c.new_text, finishing)
        if replies is not None:
            replies.feed(c.index, text)
        response = pb.GenerateResponse(request_id=out.request_id, text=text,
                                       reasoning_text=reasoning,
                                       token_ids=[int(t) for t in c.new_token_ids],
                                       index=c.index)
        if with_logprobs:
            response.logprobs.extend(float(x) for x in c.new_logprobs)
        for top in c.new_top_logprobs:
            response.top_logprobs.add(token_ids=list(top), logprobs=list(top.values()))
        if finishing:
            reason = c.finish_reason
            if replies is not None:
                reason = replies.complete(c.index, reason, response)
            response.finish_reason = FINISH_REASONS[reason]
            reported.add(c.index)
        if out.prompt_logprobs is not None and -1 not in reported:
            reported.add(-1)  # -1: the prompt's logprobs were sent
            for entry in out.prompt_logprobs[1:]:
                response.prompt_logprobs.add(token_ids=list(entry), logprobs=list(entry.values()))
        messages.append(response)
    if out.finished and messages:
        usage = messages[-1].usage
        usage.prompt_tokens = len(out.prompt_token_ids)
        usage.completion_tokens = sum(len(c.token_ids) for c in out.outputs)
        usage.cached_prompt_tokens = out.num_cached_tokens
        if out.time_to_first_token is not None:
            usage.time_to_first_token_s = out.time_to_first_token
    return messages


def model_info_response(info) -> pb.ModelInfoResponse:
    """The engine's facts (EngineInfo) as ModelInfo's answer."""
    return pb.ModelInfoResponse(
        model_name=info.model_name, max_model_len=info.max_model_len,
        vocab_size=info.vocab_size, page_size=info.page_size, dtype=info.dtype,
        num_pages=info.num_pages, max_num_seqs=info.max_num_seqs,
        eos_token_ids=list(info.eos_token_ids), quantization=info.quantization,
        weight_bytes=info.weight_bytes,
        weight_groups=[pb.WeightGroup(group=g, format=f, bytes=n)
                       for g, f, n in info.weight_formats])


# ---- client side: Python values -> wire --------------------------------------------------------
def sampling_to_proto(params: SamplingParams | None) -> pb.SamplingParams:
    """Every field set explicitly (the server's defaults never apply), seed only when given."""
    params = params or SamplingParams()
    msg = pb.SamplingParams(max_tokens=params.max_tokens, temperature=params.temperature,
                            top_k=params.top_k, top_p=params.top_p, min_p=params.min_p,
                            stop=list(params.stop), stop_token_ids=list(params.stop_token_ids),
                            ignore_eos=params.ignore_eos, logprobs=params.logprobs is not None,
                            top_logprobs=params.top_logprobs,
                            presence_penalty=params.presence_penalty,
                            frequency_penalty=params.frequency_penalty,
                            repetition_penalty=params.repetition_penalty,
                            logit_bias=dict(params.logit_bias), min_tokens=params.min_tokens,
                            bad_words=list(params.bad_words), n=params.n,
                            include_stop_str_in_output=params.include_stop_str_in_output,
                            skip_special_tokens=params.skip_special_tokens)
    if params.prompt_logprobs is not None:
        msg.prompt_logprobs = params.prompt_logprobs
    if params.structured_outputs is not None:
        _structured_to_proto(params.structured_outputs, msg.structured_outputs)
        msg.structured_outputs_after.extend(params.structured_outputs_after)
    if params.seed is not None:
        msg.seed = params.seed
    if params.allowed_token_ids is not None:
        msg.allowed_token_ids.ids.extend(params.allowed_token_ids)
    return msg


def chat_to_proto(messages: list[dict], chat_template_kwargs: dict | None = None) -> pb.Chat:
    return pb.Chat(messages=[pb.ChatMessage(role=m["role"], content=m["content"])
                             for m in messages],
                   chat_template_kwargs=json.dumps(chat_template_kwargs)
                   if chat_template_kwargs else "")


def generate_request(prompt: str | list[int] | None = None,
                     params: SamplingParams | None = None, *, messages: list[dict] | None = None,
                     request_id: str = "", priority: int = 0,
                     chat_template_kwargs: dict | None = None) -> pb.GenerateRequest:
    """Exactly one of prompt (text, or a list of token ids) and messages (chat, with its
    chat_template_kwargs)."""
    if (prompt is None) == (messages is None):
        raise ValueError("exactly one of prompt (text or token ids) and messages must be given")
    request = pb.GenerateRequest(request_id=request_id, priority=priority,
                                 sampling=sampling_to_proto(params))
    if isinstance(prompt, str):
        request.text = prompt
    elif prompt is not None:
        request.token_ids.ids.extend(int(t) for t in prompt)
    else:
        request.chat.CopyFrom(chat_to_proto(messages, chat_template_kwargs))
    return request
