"""Engine: the synchronous serving loop. step() = schedule -> execute -> update.

It validates and tokenizes requests and turns the scheduler's token events into RequestOutputs
with text (stop strings applied), keeping one record per request in flight. Its parts (model,
page pool, scheduler, runner) are wired by engine_builder.build_engine. It is single-threaded:
callers on other threads go through AsyncEngine. It never touches device arrays itself.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import random
import time
import uuid
from dataclasses import dataclass

from jaxserve.config import EngineConfig
from jaxserve.detokenizer import IncrementalDetokenizer
from jaxserve.engine_builder import EngineParts, build_engine
from jaxserve.metrics import EngineMetrics
from jaxserve.outputs import RequestOutput
from jaxserve.processor_slots import bad_words_ids
from jaxserve.request import FinishReason, Request, SamplingParams, TokenEvent

log = logging.getLogger(__name__)


class QueueFullError(RuntimeError):
    """The waiting queue holds max_queued_requests already."""


@dataclass
class _Tracked:
    """One request in flight, with everything output processing keeps for it."""
    request: Request
    output: RequestOutput       # the running record; callers get snapshots of it
    detok: IncrementalDetokenizer


class Engine:
    def __init__(self, config: EngineConfig, loaded=None, progress: bool = True, *,
                 parts: EngineParts | None = None):
        """parts: prebuilt by engine_builder.build_engine (None: built here from config)."""
        parts = parts or build_engine(config, loaded, progress)
        self.config = parts.config
        self.model_config = parts.model_config
        self.tokenizer = parts.tokenizer
        self.model_name = parts.model_config.name
        self.max_model_len = parts.max_model_len
        self.dtype_name = parts.dtype_name
        self.mesh = parts.mesh
        self.speculation = parts.speculation
        self.pages = parts.pages
        self.scheduler = parts.scheduler
        self.runner = parts.runner
        self.info = parts.info
        self._tracked: dict[str, _Tracked] = {}
        self._pending_events: list[TokenEvent] = []
        self._arrivals = itertools.count()
        self._seed_rng = random.Random(self.config.seed)
        self.num_steps = 0
        self._closed = False
        self._publish_stats()
        self.metrics = EngineMetrics(lambda: self.stats)

    def close(self) -> None:
        """Release the runner (multi-host: stop the followers). Idempotent."""
        if not self._closed:
            self._closed = True
            self.runner.close()

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _publish_stats(self) -> None:
        """A fresh immutable snapshot for other threads (metrics, front ends) to read."""
        self.stats = self.scheduler.stats(self.pages.stats(), self.num_steps)

    # ---- requests ---------------------------------------------------------------------
    def make_request(self, prompt: str | list[int] | None = None,
                     params: SamplingParams | None = None, *, request_id: str | None = None,
                     priority: int = 0, prompt_token_ids: list[int] | None = None) -> Request:
        """Validate and tokenize; raises ValueError naming the field, the value and the limit."""
        params = params or SamplingParams()
        if isinstance(prompt, (list, tuple)):
            prompt, prompt_token_ids = None, list(prompt)
        if (prompt is None) == (prompt_token_ids is None):
            raise ValueError("exactly one of prompt (text) and prompt_token_ids must be given")
        if prompt is not None:
            if not isinstance(prompt, str) or not prompt:
                raise ValueError("prompt must be a non-empty string")
            prompt_token_ids = self.tokenizer.encode(prompt)
        ids = [int(t) for t in prompt_token_ids]
        if not ids:
            raise ValueError("prompt_token_ids must not be empty")
        vocab = self.model_config.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt_token_ids contains {bad[0]}, outside the vocabulary "
                             f"[0, {vocab})")
        if len(ids) + params.max_tokens > self.max_model_len:
            raise ValueError(f"prompt length {len(ids)} + max_tokens {params.max_tokens} = "
                             f"{len(ids) + params.max_tokens} exceeds max_model_len "
                             f"{self.max_model_len}")
        for name, tokens in (("logit_bias", [t for t, _ in params.logit_bias]),
                             ("allowed_token_ids", params.allowed_token_ids or ())):
            bad = [t for t in tokens if t >= vocab]
            if bad:
                raise ValueError(f"{name} contains token id {bad[0]}, outside the vocabulary "
                                 f"[0, {vocab})")
        seed = params.seed if params.seed is not None else self._seed_rng.getrandbits(32)
        return Request(request_id or uuid.uuid4().hex, ids, params, seed,
                       eos_token_ids=tuple(self.tokenizer.eos_token_ids), priority=priority,
                       bad_words_ids=bad_words_ids(self.tokenizer, params.bad_words))

    def add(self, request: Request) -> None:
        limit = self.config.max_queued_requests
        if limit is not None and self.scheduler.num_waiting >= limit:
            raise QueueFullError(f"waiting queue is full (max_queued_requests={limit})")
        if request.request_id in self._tracked:
            raise ValueError(f"request_id {request.request_id!r} is already in use")
        request.arrival_seq = next(self._arrivals)
        request.arrival_time = time.monotonic()
        self._tracked[request.request_id] = _Tracked(
            request,
            RequestOutput(request.request_id, request.prompt_token_ids,
                          logprobs=[] if request.sampling.logprobs is not None else None,
                          top_logprobs=[] if request.sampling.top_logprobs else None),
            IncrementalDetokenizer(self.tokenizer, request.prompt_token_ids,
                                   request.sampling.stop))
        event = self.scheduler.add(request)
        if event is not None:
            self._pending_events.append(event)
        self._publish_stats()

    def add_request(self, prompt=None, params=None, **kwargs) -> str:
        request = self.make_request(prompt, params, **kwargs)
        self.add(request)
        return request.request_id

    def abort(self, request_id: str) -> RequestOutput | None:
        if not self.scheduler.finish(request_id, FinishReason.ABORT):
            return None
        out = self._emit(TokenEvent(request_id, (), (), FinishReason.ABORT))
        self.metrics.observe_outputs([out] if out is not None else [])
        self._publish_stats()
        return out

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._pending_events)

    # ---- the loop -----------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        start = time.perf_counter()
        plan = self.scheduler.schedule()
        result = self.runner.execute(plan)
        events = self.scheduler.update(plan, result.token_ids, result.logprobs, result.top_ids,
                                       result.top_logprobs)
        self.num_steps += 1
        outputs = self._process(events)
        self._publish_stats()
        self.metrics.observe_step(time.perf_counter() - start)
        self.metrics.observe_outputs(outputs)
        return outputs

    def _process(self, events: list[TokenEvent]) -> list[RequestOutput]:
        if self._pending_events:
            events = self._pending_events + events
            self._pending_events = []
        outputs = []
        for event in events:
            try:
                out = self._emit(event)
            except Exception as exc:  # fail this request only; the others go on
                log.exception("output processing failed for %s", event.request_id)
                out = self._fail(event.request_id, f"internal error: {exc!r}")
            if out is not None:
                outputs.append(out)
        return outputs

    def _fail(self, request_id: str, message: str) -> RequestOutput | None:
        self.scheduler.finish(request_id, FinishReason.ERROR)
        tracked = self._tracked.pop(request_id, None)
        if tracked is None:
            return None
        out = tracked.output
        out.finished, out.finish_reason, out.error = True, FinishReason.ERROR.value, message
        out.latency = time.monotonic() - tracked.request.arrival_time
        out.new_token_ids, out.new_text = [], ""
        return out

    def _emit(self, event: TokenEvent) -> RequestOutput | None:
        rid = event.request_id
        tracked = self._tracked.get(rid)
        if tracked is None:
            return None
        request, out, detok = tracked.request, tracked.output, tracked.detok
        # A stop string inside a multi-token (speculative) event ends the output at its token.
        num_used = detok.add_tokens(event.new_token_ids)
        if num_used < len(event.new_token_ids):
            event = dataclasses.replace(
                event, new_token_ids=event.new_token_ids[:num_used],
                new_logprobs=event.new_logprobs[:num_used],
                new_top_logprobs=event.new_top_logprobs[:num_used],
                finish_reason=None if event.finish_reason is None else FinishReason.STOP)
        reason, error = event.finish_reason, event.error
        if detok.stopped and reason is None:
            reason = FinishReason.STOP
            self.scheduler.finish(rid, FinishReason.STOP)
        if out.time_to_first_token is None and event.new_token_ids:
            out.time_to_first_token = time.monotonic() - request.arrival_time
        out.new_token_ids = list(event.new_token_ids)
        out.token_ids.extend(event.new_token_ids)
        out.new_logprobs = list(event.new_logprobs)
        if out.logprobs is not None:
            out.logprobs.extend(event.new_logprobs)
        out.new_top_logprobs = [dict(top) for top in event.new_top_logprobs]
        if out.top_logprobs is not None:
            out.top_logprobs.extend(out.new_top_logprobs)
        out.new_text = detok.take_delta(final=reason is not None)
        out.text += out.new_text
        out.num_cached_tokens = request.num_cached_tokens
        if reason is not None:
            out.finished, out.finish_reason, out.error = True, reason.value, error
            out.latency = time.monotonic() - request.arrival_time
            del self._tracked[rid]
        return dataclasses.replace(  # a snapshot: later steps must not change it
            out, token_ids=list(out.token_ids),
            logprobs=None if out.logprobs is None else list(out.logprobs),
            top_logprobs=None if out.top_logprobs is None else list(out.top_logprobs))
