"""Engine: the serving loop. step() = schedule -> dispatch -> update (a step's results) -> emit.

One text for both paths. With async scheduling (the default, where the lag can hold:
Scheduler.may_plan_ahead and a runner that can_overlap) step N+1 is planned and dispatched
before step N's results are collected, so the host's update and output processing of step N
overlap the device's step N+1; otherwise the step dispatched is collected at once (a step in
flight is taken in first). Finishing a request is the scheduler's: the output processor only
reports the samples a stop string or a failure ended (take_finished), and the engine hands them
to the scheduler.

It validates and tokenizes requests, fans an n > 1 request out into its samples, starts the
compile of a structured request's grammar (off-thread) and gives each sample its matcher once
ready (ending, before its next step, one whose own token bans leave that grammar no token:
structured/dead_end.py), and turns the scheduler's token events into RequestOutputs with text
(output_processor: one record per request and per sample). Its parts (model, page pool,
scheduler, runner) are wired by engine_builder.build_engine. It is single-threaded: callers
on other threads go through AsyncEngine. It never touches device arrays itself.
"""

from __future__ import annotations

import dataclasses
import gc
import itertools
import logging
import random
import time
import uuid
from contextlib import contextmanager

from jaxserve.config import EngineConfig
from jaxserve.core import intake
from jaxserve.engine.builder import EngineParts, build_engine
from jaxserve.config.kv_events import parse_kv_events_config
from jaxserve.engine.info import engine_stats
from jaxserve.engine.kv_events import make_publisher
from jaxserve.engine.metrics import EngineMetrics
from jaxserve.engine.output_processor import OutputProcessor
from jaxserve.engine.rollout import Rollout
from jaxserve.engine.outputs import RequestOutput
from jaxserve.core.processor_slots import bad_words_ids
from jaxserve.core.request import FinishReason, Request, SamplingParams, TokenEvent, sample_seed
from jaxserve.runner.step_timings import StepTimings

log = logging.getLogger(__name__)


# While a serving loop runs, a young-generation collection starts only past this many new
# container objects (Python's default: 700). A step makes ~12 per request that live until the
# step's outputs are handed on, so at 256 requests the default ran two young collections and
# a middle one every few steps: 0.29-0.36 ms a step of 4.8-7 ms (2-core CPU), none at 10 000.
# Objects freed by reference counting never wait for it; only cyclic garbage waits longer.
SERVING_GEN0_THRESHOLD = 50_000


@contextmanager
def frozen_heap():
    """While a serving loop runs, the objects alive when it started (the engine, its model's
    host arrays, compiled executables: hundreds of thousands) leave the garbage collector's
    scans: a full collection over them cost ~4 ms per step at 256 requests on the 2-core CPU;
    and young collections wait for SERVING_GEN0_THRESHOLD new objects. Afterwards both are as
    they were (no leak when an engine is dropped)."""
    thresholds = gc.get_threshold()
    gc.freeze()
    gc.set_threshold(max(thresholds[0], SERVING_GEN0_THRESHOLD), *thresholds[1:])
    try:
        yield
    finally:
        gc.set_threshold(*thresholds)
        gc.unfreeze()


class Engine:
    def __init__(self, config: EngineConfig, loaded=None, progress: bool = True, *,
                 parts: EngineParts | None = None, data_parallel_rank: int = 0):
        """parts: prebuilt by engine_builder.build_engine (None: built here from config);
        data_parallel_rank: this engine's rank behind a data-parallel front end (its KV-event
        ports are the configured ones plus the rank, its vllm:* metrics say engine=<rank>)."""
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
        self.lora_registry = parts.lora_registry  # None: enable_lora off
        self._outputs = OutputProcessor(self.tokenizer)
        self._pending_events: list[TokenEvent] = []
        self.grammars = None        # a GrammarCompiler, made by the first structured request
        self._awaiting_grammar: list[Request] = []  # samples whose grammar is compiling
        self._banning: list[Request] = []  # constrained samples whose processors ban tokens
        self._arrivals = itertools.count()
        self._serials = itertools.count(1)  # (thread-safe: make_request runs on callers' threads)
        self._seed_rng = random.Random(self.config.model.seed)
        self.num_steps = 0
        self._closed = False
        self.timings = StepTimings()
        self.runner.timings = self.timings
        self._async = self.config.scheduler.async_scheduling and self.runner.can_overlap
        self._in_flight = None  # (plan, the runner's pending step) dispatched, not yet read
        self.num_overlapped_steps = 0  # steps dispatched before their predecessor was read
        self._publish_stats()
        if self.lora_registry is not None:  # an adapter a request uses is never evicted
            self.lora_registry.in_use = lambda lora_id: lora_id in self.stats.lora_in_use
        self.metrics = EngineMetrics(lambda: self.stats, self.info, self.lora_registry,
                                     self.scheduler.lora_slots.max_loras,
                                     engine_index=data_parallel_rank)
        # The prefix cache's changes, sent off this thread (engine/kv_events.py); the page
        # manager logs them only when the config turns events on.
        self.kv_events = make_publisher(parse_kv_events_config(
            self.config.cache.kv_events_config), data_parallel_rank)
        self.rollout = Rollout(self)  # weight updates, sleep / wake_up, pause / resume

    def close(self) -> None:
        """Release the runner (multi-host: stop the followers). Idempotent."""
        if not self._closed:
            self._closed = True
            self.kv_events.close()
            self.runner.close()
            if self.grammars is not None:
                self.grammars.close()

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _publish_stats(self) -> None:
        """A fresh immutable snapshot for other threads (metrics, front ends) to read."""
        self.stats = engine_stats(self.scheduler, self.pages.stats(), self.num_steps)

    # ---- requests ---------------------------------------------------------------------
    def make_request(self, prompt: str | list[int] | None = None,
                     params: SamplingParams | None = None, *, request_id: str | None = None,
                     priority: int = 0, prompt_token_ids: list[int] | None = None,
                     lora_request=None) -> Request:
        """Tokenize, then check the request at intake (core/intake.py: every check on a
        request); raises intake.RequestError naming the field, the value and the limit.
        lora_request: a LoRARequest (jaxserve/lora/request.py) to run under, its adapter read
        on first use (a bad one: RequestError on field lora_request)."""
        params = params or SamplingParams()
        if isinstance(prompt, (list, tuple)):
            prompt, prompt_token_ids = None, list(prompt)
        if (prompt is None) == (prompt_token_ids is None):
            raise intake.RequestError("prompt", "exactly one of prompt (text) and "
                                      "prompt_token_ids must be given")
        field = "prompt_token_ids"
        if prompt is not None:
            if not isinstance(prompt, str) or not prompt:
                raise intake.RequestError("prompt", "prompt must be a non-empty string")
            prompt_token_ids, field = self.tokenizer.encode(prompt), "prompt"
        ids = [int(t) for t in prompt_token_ids]
        intake.check_request(self.info, ids, params, prompt_field=field)
        if params.structured_outputs is not None:
            self._grammar_compiler().submit(params.structured_outputs)  # compiles off-thread
        lora_id = 0 if lora_request is None else self._lora_id(lora_request)  # (last: pending)
        seed = params.seed if params.seed is not None else self._seed_rng.getrandbits(32)
        external_id = request_id or uuid.uuid4().hex
        return Request(f"{external_id}-{next(self._serials)}", ids, params, seed,
                       eos_token_ids=tuple(self.tokenizer.eos_token_ids), priority=priority,
                       bad_words_ids=bad_words_ids(self.tokenizer, params.bad_words),
                       external_id=external_id, lora_id=lora_id)

    def _lora_id(self, lora_request) -> int:
        """The adapter id of a request's LoRARequest (read the first time it is named)."""
        intake.check_adapter_served(lora_request, self.lora_registry is not None)
        try:
            return self.lora_registry.resolve(lora_request)
        except ValueError as exc:
            raise intake.RequestError("lora_request", str(exc)) from None

    def add(self, request: Request) -> None:
        """Queue a made request; with sampling.n > 1 its other samples too (ids
        "<request_id>#<i>", seeds sample_seed(seed, i)), which share its prompt's KV pages."""
        try:
            self._add(request)
        finally:  # queued (or refused): the adapter's use is the scheduler's to count now
            self.release_lora(request)

    def release_lora(self, request: Request) -> None:
        """The request made by make_request is queued, or will never be: its adapter's
        pending count ends (call once per made request; add does)."""
        if request.lora_id and self.lora_registry is not None:
            self.lora_registry.queued(request.lora_id)

    def _add(self, request: Request) -> None:
        n = request.sampling.n
        intake.check_admission(request.external_id, self._outputs, self.scheduler.num_waiting,
                               n, self.config.scheduler.max_queued_requests)
        samples = [request] + [dataclasses.replace(
            request, request_id=f"{request.request_id}#{i}", seed=sample_seed(request.seed, i),
            sample_index=i, shares_prompt_of=request.request_id, output_token_ids=[],
            prompt_logprobs=[], external_id=f"{request.external_id}#{i}") for i in range(1, n)]
        seq, now = next(self._arrivals), time.monotonic()
        for sample in samples:
            sample.arrival_seq, sample.arrival_time = seq, now
        self._outputs.add(samples)
        if request.sampling.structured_outputs is not None:
            self._awaiting_grammar.extend(samples)
        for sample in samples:
            event = self.scheduler.add(sample)
            if event is not None:
                self._pending_events.append(event)
        self._publish_stats()

    def add_request(self, prompt=None, params=None, **kwargs) -> str:
        request = self.make_request(prompt, params, **kwargs)
        self.add(request)
        return request.external_id

    def abort(self, request_id: str) -> RequestOutput | None:
        """Abort every sample of the caller's request `request_id` (the id its outputs carry);
        its final output, or None if unknown or done."""
        samples = [s for s in self._outputs.samples_of(request_id)
                   if self.scheduler.finish(s, FinishReason.ABORT)]
        if not samples:
            return None
        outs = self._emit([TokenEvent(s, (), (), FinishReason.ABORT) for s in samples])
        self.metrics.observe_outputs(outs)
        self._publish_stats()
        return outs[0] if outs else None

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix (vLLM's reset_prefix_cache: subscribers to the KV events
        get AllBlocksCleared); running requests keep their pages. Engine thread only."""
        self.pages.reset_prefix_cache()
        if self.pages.events:
            self.kv_events.publish(self.pages.events.take())
        self._publish_stats()
        return True

    def has_unfinished(self) -> bool:
        # A step in flight when no request is unfinished holds only finished ones' rows: the
        # next step reads and drops it.
        # Paused or asleep (engine/rollout.py): requests wait, only made events go out.
        return ((self.scheduler.has_unfinished() and not self.rollout.holds_steps)
                or bool(self._pending_events))

    def unfinished_request_ids(self) -> list[str]:
        """The caller's ids of every request not finished yet."""
        return self._outputs.request_ids()

    def settle(self) -> list[RequestOutput]:
        """Read the step in flight (its outputs are returned) and wait for the device: until
        the next step() nothing runs, so the rollout verbs may swap device arrays."""
        events = []
        if self._in_flight is not None:
            events = self._update(*self._in_flight)
            self._in_flight = None
        outputs = self._process(events)
        self._publish_stats()
        self.metrics.observe_outputs(outputs)
        self.runner.wait()
        return outputs

    def set_weight_version(self, version: int) -> None:
        """Outputs from now on carry `version` (sampled by the weights just swapped in)."""
        self._outputs.weight_version = version

    # ---- the loop -----------------------------------------------------------------------
    def _grammar_compiler(self):
        if self.grammars is None:
            from jaxserve.structured.compiler import GrammarCompiler
            if not hasattr(self.tokenizer, "backend"):
                raise ValueError("structured_outputs needs a Hugging Face `tokenizers` "
                                 "tokenizer; this model's tokenizer is not one")
            self.grammars = GrammarCompiler(self.tokenizer, self.model_config.vocab_size)
        return self.grammars

    def _attach_grammars(self) -> None:
        """Each sample whose grammar has compiled gets its own matcher, and may be scheduled;
        one whose grammar failed (or timed out) finishes with the error."""
        from jaxserve.structured.dead_end import may_dead_end
        from jaxserve.structured.deferred import request_matcher
        waiting = []
        for sample in self._awaiting_grammar:
            if sample.is_finished:
                continue
            try:
                compiled = self.grammars.check(sample.sampling.structured_outputs)
            except (ValueError, TimeoutError) as exc:
                if self.scheduler.finish(sample.request_id, FinishReason.ERROR):
                    self._pending_events.append(TokenEvent(
                        sample.request_id, (), (), FinishReason.ERROR, str(exc)))
                continue
            if compiled is None:
                waiting.append(sample)
            else:
                sample.grammar = request_matcher(compiled,
                                                 sample.sampling.structured_outputs_after)
                if may_dead_end(sample.sampling):
                    self._banning.append(sample)
        self._awaiting_grammar = waiting

    def step(self) -> list[RequestOutput]:
        if self.rollout.holds_steps:  # paused or asleep: no step, made events still go out
            return self._process([])
        start = time.perf_counter()
        if self._awaiting_grammar:
            self._attach_grammars()
        ahead = self._async and self.scheduler.may_plan_ahead()
        events: list[TokenEvent] = []
        if self._in_flight is not None and not ahead:  # the lag can't hold: read it first
            events = self._update(*self._in_flight)
            self._in_flight = None
        if self._banning:  # (after the update: the state the step's bitmasks are built from)
            events += self._end_dead_ends()
        with self.timings.phase("schedule"):
            plan = self.scheduler.schedule()
        pending = self.runner.dispatch(plan)
        if self._in_flight is not None:  # the device runs `plan` meanwhile
            events += self._update(*self._in_flight)
            self.num_overlapped_steps += bool(plan.num_seqs)
        self._in_flight = None
        if ahead and plan.num_seqs:
            self._in_flight = (plan, pending)
        else:
            events += self._update(plan, pending)
        self.num_steps += 1
        with self.timings.phase("emit"):
            outputs = self._process(events)
            if self.pages.events:  # (None: events off; empty: nothing changed)
                self.kv_events.publish(self.pages.events.take())
            self._publish_stats()
            self.metrics.observe_outputs(outputs)
        self.metrics.observe_step(time.perf_counter() - start)
        return outputs

    def _end_dead_ends(self) -> list[TokenEvent]:
        """Finish each constrained sample whose own bans leave its grammar no next token with
        the RequestError that says so (bad input: the front ends answer 400), before a step
        would sample it from logits that are all -inf."""
        from jaxserve.structured.dead_end import dead_end
        events, live = [], []
        for sample in self._banning:
            if sample.is_finished:
                continue
            error = dead_end(sample)
            if error is None:
                live.append(sample)
            elif self.scheduler.finish(sample.request_id, FinishReason.ERROR):
                events.append(TokenEvent(sample.request_id, (), (), FinishReason.ERROR,
                                         error.message, error_field=error.field))
        self._banning = live
        return events

    def _update(self, plan, pending) -> list[TokenEvent]:
        """A dispatched step's results into the scheduler: the step's token events."""
        result = self.runner.collect(pending)
        with self.timings.phase("update"):
            return self.scheduler.update(plan, result)

    def _process(self, events: list[TokenEvent]) -> list[RequestOutput]:
        if self._pending_events:
            events = self._pending_events + events
            self._pending_events = []
        return self._emit(events)

    def _emit(self, events: list[TokenEvent]) -> list[RequestOutput]:
        """Events -> outputs; the samples the output processor ended (a stop string, a
        failure) are finished in the scheduler."""
        outputs = self._outputs.process(events, self._log_failure)
        for sample_id, reason in self._outputs.take_finished():
            self.scheduler.finish(sample_id, reason)
        return outputs

    @staticmethod
    def _log_failure(sample_id: str, exc: Exception) -> None:
        log.error("output processing failed for %s", sample_id, exc_info=exc)
