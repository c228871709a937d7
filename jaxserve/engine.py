"""Engine: the synchronous serving loop. step() = schedule -> execute -> update.

It validates and tokenizes requests, sizes the KV page pool, and turns the scheduler's token
events into RequestOutputs with text (stop strings applied). It is single-threaded: callers on
other threads go through AsyncEngine. It never touches device arrays itself (the runner does).
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import random
import time
import uuid

from jaxserve.config import EngineConfig
from jaxserve.detokenizer import IncrementalDetokenizer
from jaxserve.engine_info import EngineInfo
from jaxserve.metrics import EngineMetrics
from jaxserve.outputs import RequestOutput
from jaxserve.page_manager import PageManager
from jaxserve.request import FinishReason, Request, SamplingParams, TokenEvent
from jaxserve.scheduler import Scheduler
from jaxserve.swap_space import HostSwapSpace

log = logging.getLogger(__name__)
DEFAULT_KV_CACHE_MEMORY = 1 << 30


class QueueFullError(RuntimeError):
    """The waiting queue holds max_queued_requests already."""


def size_page_pool(config: EngineConfig, kv_bytes_per_token: int, max_model_len: int) -> int:
    """Pages for the KV pool: given directly, or from a byte budget (page 0 included)."""
    if config.num_pages is not None:
        return config.num_pages
    budget = config.kv_cache_memory
    if budget is None:  # enough for every sequence at full length, within a default budget
        budget = min(DEFAULT_KV_CACHE_MEMORY,
                     config.max_num_seqs * (max_model_len + config.page_size) * kv_bytes_per_token)
    num_pages = budget // (config.page_size * kv_bytes_per_token)
    if num_pages < 2:
        raise ValueError(f"kv_cache_memory={budget} bytes holds {num_pages} pages of "
                         f"{config.page_size} tokens; at least 2 are needed")
    return int(num_pages)


class Engine:
    def __init__(self, config: EngineConfig, loaded=None, progress: bool = True):
        import jax

        from jaxserve.runner.model_runner import ModelRunner, resolve_dtype

        self.config = config.validate()
        from jaxserve.model.sharding import make_mesh
        from jaxserve.runner import multihost, tensor_parallel
        self.mesh = make_mesh(config.tensor_parallel_size)  # None: one device, unsharded
        if loaded is None:  # a checkpoint is restored straight into the mesh's shardings
            loaded = tensor_parallel.load_model(config.model, self.mesh, progress=progress)
        self.model_config = mc = loaded.config
        self.tokenizer = loaded.tokenizer
        self.model_name = mc.name
        self.max_model_len = config.max_model_len or min(mc.max_position_embeddings, 2048)
        dtype = resolve_dtype(config.dtype, jax.default_backend())
        self.dtype_name = jax.numpy.dtype(dtype).name
        from jaxserve.spec.setup import Speculation
        self.speculation = Speculation.build(config, loaded, progress=progress)
        itemsize = jax.numpy.dtype(dtype).itemsize
        kv_per_token = (mc.kv_bytes_per_token(itemsize)
                        + self.speculation.draft_kv_bytes_per_token(itemsize))
        num_pages = size_page_pool(config, kv_per_token, self.max_model_len)
        log.info("KV cache: %d pages x %d tokens = %d tokens, %.1f MiB", num_pages - 1,
                 config.page_size, (num_pages - 1) * config.page_size,
                 num_pages * config.page_size * kv_per_token / 2**20)
        self.pages = PageManager(num_pages, config.page_size, config.enable_prefix_caching)
        from jaxserve.runner.buckets import powers_of_two
        max_pages = -(-self.max_model_len // config.page_size)
        swap = HostSwapSpace(config.swap_space, config.page_size * kv_per_token,
                             page_buckets=powers_of_two(1, max_pages))
        self.scheduler = Scheduler(
            self.pages, max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=self.max_model_len, preemption_mode=config.preemption_mode,
            enable_chunked_prefill=config.enable_chunked_prefill, batching=config.batching,
            swap_space=swap, speculation=self.speculation.policy)
        self.runner = self.speculation.wrap(ModelRunner(
            mc, loaded.params, num_pages=num_pages, page_size=config.page_size,
            max_model_len=self.max_model_len, max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens, dtype=config.dtype,
            attention_impl=config.attention_impl, layer_loop=config.layer_loop,
            token_buckets=config.token_buckets, seq_buckets=config.seq_buckets,
            compile_cache_dir=config.compile_cache_dir, mesh=self.mesh))
        self.runner.warmup(progress=progress)
        # Several JAX processes: process 0 broadcasts each plan, the others follow it.
        self.runner = multihost.for_this_process(self.runner)
        self._outputs: dict[str, RequestOutput] = {}
        self._detok: dict[str, IncrementalDetokenizer] = {}
        self._live: dict[str, Request] = {}
        self._pending_events: list[TokenEvent] = []
        self._arrivals = itertools.count()
        self._seed_rng = random.Random(config.seed)
        self.num_steps = 0
        self.info = EngineInfo(
            model_name=mc.name, architecture=mc.architecture, max_model_len=self.max_model_len,
            vocab_size=mc.vocab_size, dtype=self.dtype_name, page_size=config.page_size,
            num_pages=num_pages, max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_queued_requests=config.max_queued_requests,
            eos_token_ids=tuple(int(t) for t in self.tokenizer.eos_token_ids),
            tensor_parallel_size=config.tensor_parallel_size,
            speculative_method=config.speculative_method)
        self._publish_stats()
        self.metrics = EngineMetrics(lambda: self.stats)

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
        seed = params.seed if params.seed is not None else self._seed_rng.getrandbits(32)
        return Request(request_id or uuid.uuid4().hex, ids, params, seed,
                       eos_token_ids=tuple(self.tokenizer.eos_token_ids), priority=priority)

    def add(self, request: Request) -> None:
        limit = self.config.max_queued_requests
        if limit is not None and self.scheduler.num_waiting >= limit:
            raise QueueFullError(f"waiting queue is full (max_queued_requests={limit})")
        if request.request_id in self._outputs:
            raise ValueError(f"request_id {request.request_id!r} is already in use")
        request.arrival_seq = next(self._arrivals)
        request.arrival_time = time.monotonic()
        self._outputs[request.request_id] = RequestOutput(
            request.request_id, request.prompt_token_ids,
            logprobs=[] if request.sampling.logprobs else None)
        self._detok[request.request_id] = IncrementalDetokenizer(
            self.tokenizer, request.prompt_token_ids, request.sampling.stop)
        self._live[request.request_id] = request
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
        events = self.scheduler.update(plan, result.token_ids, result.logprobs)
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
        out = self._outputs.pop(request_id, None)
        self._detok.pop(request_id, None)
        request = self._live.pop(request_id, None)
        if out is None:
            return None
        out.finished, out.finish_reason, out.error = True, FinishReason.ERROR.value, message
        if request is not None:
            out.latency = time.monotonic() - request.arrival_time
        out.new_token_ids, out.new_text = [], ""
        return out

    def _emit(self, event: TokenEvent) -> RequestOutput | None:
        rid = event.request_id
        out = self._outputs.get(rid)
        if out is None:
            return None
        request = self._live[rid]
        detok = self._detok[rid]
        # A stop string inside a multi-token (speculative) event ends the output at its token.
        num_used = detok.add_tokens(event.new_token_ids)
        if num_used < len(event.new_token_ids):
            event = dataclasses.replace(
                event, new_token_ids=event.new_token_ids[:num_used],
                new_logprobs=event.new_logprobs[:num_used],
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
        out.new_text = detok.take_delta(final=reason is not None)
        out.text += out.new_text
        out.num_cached_tokens = request.num_cached_tokens
        if reason is not None:
            out.finished, out.finish_reason, out.error = True, reason.value, error
            out.latency = time.monotonic() - request.arrival_time
            del self._outputs[rid], self._detok[rid], self._live[rid]
        return dataclasses.replace(  # a snapshot: later steps must not change it
            out, token_ids=list(out.token_ids),
            logprobs=None if out.logprobs is None else list(out.logprobs))
