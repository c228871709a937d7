"""OutputProcessor: the scheduler's token events -> RequestOutputs with text, one record each.

A caller's request is a _Group (its RequestOutput, and its samples: one, or `n`), and each
sample a _Sample (the scheduler's Request, its CompletionOutput, its incremental detokenizer
with the stop strings). Events of one step are applied first; then every group they touched
yields one snapshot, so an n > 1 request streams one RequestOutput per step holding the deltas
of each of its samples (output_kind "final_only": only the group's last, holding them all). A
sample that a stop string (or a failure) ends here is reported by take_finished(): outputs flow
one way, and the engine tells the scheduler. The usual decode event (one token of a plain
n = 1 sample, not its first or last; a DecodeTokens holds a step's such tokens in lists) takes
a short path: the byte table's lookup and one append. Plain Python: no jax, no device state,
no scheduling.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

from jaxserve.engine.detokenizer import IncrementalDetokenizer
from jaxserve.engine.outputs import CompletionOutput, RequestOutput
from jaxserve.core.request import DecodeTokens, FinishReason, Request, TokenEvent


@dataclass(eq=False, slots=True)
class _Group:  # (hashed by identity)
    """One caller's request: the output it is handed, and its samples still running."""
    output: RequestOutput
    arrival_time: float
    running: set[str] = field(default_factory=set)
    final_only: bool = False  # sampling.output_kind "final_only": a snapshot only at the end


@dataclass(slots=True)
class _Sample:
    request: Request
    completion: CompletionOutput   # the running record; snapshots are copies of it
    detok: IncrementalDetokenizer
    group: _Group
    # The usual sample (n = 1, streamed, no logprobs, no stop strings, a byte-table tokenizer):
    # its detokenizer's one-token step, so that a decode token is applied without _apply's
    # checks (`step`, set once its first token is out; `plain` until then); None for every
    # other sample.
    plain: Callable[[int], str] | None = None
    step: Callable[[int], str] | None = None


class OutputProcessor:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._finished: list[tuple[str, FinishReason]] = []  # ended here, for the scheduler
        self._samples: dict[str, _Sample] = {}
        self._groups: dict[str, _Group] = {}
        self.weight_version = 0  # of the weights sampling now: each snapshot carries it

    def __contains__(self, request_id: str) -> bool:
        """Whether a caller's request (by the id its outputs carry) is still running."""
        return request_id in self._groups

    def request_ids(self) -> list[str]:
        """The caller's ids of every request still running."""
        return list(self._groups)

    def take_finished(self) -> list[tuple[str, FinishReason]]:
        """(sample id, reason) of each sample that processing ended (a stop string, a
        failure) since the last call, for the scheduler to finish."""
        finished, self._finished = self._finished, []
        return finished

    def samples_of(self, request_id: str) -> list[str]:
        """The engine's ids of the samples of a caller's request still running (empty when
        unknown or done)."""
        group = self._groups.get(request_id)
        return sorted(group.running) if group else []

    def add(self, samples: list[Request]) -> None:
        """One caller's request: its samples, sample 0 first (whose external_id its outputs
        carry); samples are keyed by the engine's ids (Request.request_id)."""
        first = samples[0]
        sp = first.sampling
        group = _Group(RequestOutput(first.external_id or first.request_id,
                                     first.prompt_token_ids, outputs=[]),
                       first.arrival_time, final_only=sp.output_kind == "final_only")
        plain = (len(samples) == 1 and not group.final_only and sp.logprobs is None
                 and sp.prompt_logprobs is None)
        for request in samples:
            completion = CompletionOutput(
                request.sample_index, logprobs=[] if sp.logprobs is not None else None,
                top_logprobs=[] if sp.top_logprobs else None)
            group.output.outputs.append(completion)
            group.running.add(request.request_id)
            detok = IncrementalDetokenizer(self.tokenizer, request.prompt_token_ids, sp.stop,
                                           include_stop_str=sp.include_stop_str_in_output,
                                           skip_special_tokens=sp.skip_special_tokens)
            self._samples[request.request_id] = _Sample(
                request, completion, detok, group, detok.one_token_step if plain else None)
        self._groups[group.output.request_id] = group

    def process(self, events: list[TokenEvent], on_error) -> list[RequestOutput]:
        """Apply one step's events; one snapshot per request they touched, in event order.
        on_error(sample_id, exc) is called when an event can't be processed: that request
        fails, the others go on."""
        touched: dict[_Group, None] = {}
        samples = self._samples
        for event in events:  # (per request and step: few calls)
            if type(event) is DecodeTokens:
                self._decode_tokens(event, touched, on_error)
                continue
            sample = samples.get(event.request_id)
            if sample is None:
                continue
            step, tokens, group = sample.step, event.new_token_ids, sample.group
            if (step is not None and len(tokens) == 1 and event.finish_reason is None
                    and group not in touched):
                token = tokens[0]  # the usual decode: one token, nothing else to report
                sample.completion.append_one(token, step(token), event.new_logprobs[0])
                touched[group] = None
                continue
            self._apply_event(sample, event, touched, on_error)
        return [self._snapshot(group) for group in touched
                if not group.final_only or not group.running]

    def _decode_tokens(self, batch: DecodeTokens, touched: dict, on_error) -> None:
        """A DecodeTokens event: one token each, finishing nothing; the short path where the
        sample has it, else its TokenEvent's."""
        samples = self._samples
        for request_id, token, logprob in zip(batch.request_ids, batch.token_ids,
                                              batch.logprobs):
            sample = samples.get(request_id)
            if sample is None:
                continue
            step, group = sample.step, sample.group
            if step is not None and group not in touched:
                sample.completion.append_one(token, step(token), logprob)
                touched[group] = None
            else:
                self._apply_event(sample, TokenEvent(request_id, (token,), (logprob,)),
                                  touched, on_error)

    def _apply_event(self, sample: _Sample, event: TokenEvent, touched: dict, on_error) -> None:
        """An event off the short path; a failure fails the request (on_error is told)."""
        group = sample.group
        try:
            self._apply(sample, event)
        except Exception as exc:
            on_error(event.request_id, exc)
            self.fail(group.output.request_id, f"internal error: {exc!r}")
        if sample.plain is not None and group.output.time_to_first_token is not None:
            sample.step = sample.plain  # its first token is out: the short path from now
        touched[group] = None

    def fail(self, request_id: str, message: str) -> RequestOutput | None:
        """End every sample of a request with an error; its final output (None if unknown)."""
        group = self._groups.get(request_id)
        if group is None:
            return None
        for sample_id in list(group.running):
            self._finished.append((sample_id, FinishReason.ERROR))
            sample = self._samples.pop(sample_id)
            c = sample.completion
            c.finish_reason = FinishReason.ERROR.value
            c.clear_deltas()
        group.running.clear()
        group.output.error = message
        return self._snapshot(group)

    def _apply(self, sample: _Sample, event: TokenEvent) -> None:
        request, c, detok, group = sample.request, sample.completion, sample.detok, sample.group
        new_tokens, reason = event.new_token_ids, event.finish_reason
        num_used, delta = detok.feed(new_tokens, reason is not None)
        if detok.stopped:
            # A stop string, found here, ends the output at the token that completed it: any
            # tokens after it in a multi-token (speculative) event are dropped, and it is a
            # stop even where the scheduler's limit (max_tokens) ended the request too.
            if reason is None:
                self._finished.append((request.request_id, FinishReason.STOP))
            if reason in (None, FinishReason.LENGTH) or num_used < len(new_tokens):
                reason = FinishReason.STOP
        out = group.output
        if out.time_to_first_token is None and new_tokens:
            out.time_to_first_token = time.monotonic() - group.arrival_time
        tops, logprobs = event.new_top_logprobs, event.new_logprobs
        if num_used < len(new_tokens):
            new_tokens, logprobs, tops = (new_tokens[:num_used], logprobs[:num_used],
                                          tops[:num_used])
        c.append(list(new_tokens), delta, list(logprobs),
                 [dict(top) for top in tops] if tops else [])
        if request.sample_index == 0:
            out.num_cached_tokens = request.num_cached_tokens
            if (out.prompt_logprobs is None and request.sampling.prompt_logprobs is not None
                    and (new_tokens or reason is not None)):
                out.prompt_logprobs = [None] + list(request.prompt_logprobs)
        if reason is not None:
            c.finish_reason = reason.value
            if event.error:
                out.error, out.error_field = event.error, event.error_field
            group.running.discard(request.request_id)
            del self._samples[request.request_id]

    def _snapshot(self, group: _Group) -> RequestOutput:
        out = group.output
        if not group.running and not out.finished:
            out.finished = True
            out.latency = time.monotonic() - group.arrival_time
            del self._groups[out.request_id]
        outputs = out.outputs
        # (deltas belong to the step that produced them: handing them out clears them)
        return RequestOutput(out.request_id, out.prompt_token_ids,
                             [outputs[0].hand_out()] if len(outputs) == 1
                             else [c.hand_out() for c in outputs], out.finished, out.error,
                             out.num_cached_tokens, out.time_to_first_token, out.latency,
                             out.prompt_logprobs, self.weight_version, out.error_field)
