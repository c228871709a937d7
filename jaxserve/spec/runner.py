"""SpeculativeRunner: runs plans that carry draft rows; every other plan goes to the ModelRunner.

It wraps the engine's ModelRunner (same weights, KV pages, buckets and swaps) and adds, per
(T, S) bucket, one compiled verification step (with the draft model's passes in front for the
draft method) and, for a draft with a KV cache of its own, the draft's sync pass, so that cache
follows every step and every swap. A `layers:N` draft needs neither: it is the target's first N
layers, so it works in the target's own cache. All are compiled and timed at warm-up: the
timings give the policy the cost of speculating at each batch size. Serving never compiles.
It never decides what runs or how many tokens to propose: the scheduler and policy do.
"""

from __future__ import annotations

import functools
import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor

import jax
import numpy as np
from flax import nnx

from jaxserve.model.attention import get_attention_fn
from jaxserve.model.llama import Llama, init_kv_cache
from jaxserve.plan import StepPlan
from jaxserve.runner.batch import build_host_batch, empty_host_batch
from jaxserve.runner.buckets import powers_of_two
from jaxserve.runner.compile_count import num_compilations
from jaxserve.runner.model_runner import ModelRunner, StepResult
from jaxserve.runner.swap import KVSwapper
from jaxserve.spec import step
from jaxserve.spec.batch import build_spec_batch, empty_spec_batch
from jaxserve.spec.draft import share_weights
from jaxserve.spec.policy import SpeculationPolicy

log = logging.getLogger(__name__)
_TIMING_RUNS = 5


class SpeculativeRunner:
    def __init__(self, base: ModelRunner, policy: SpeculationPolicy, *, attention_impl: str,
                 draft=None):
        """draft: (config, params, shares the target's weights) for the draft method."""
        self.base = base
        self.policy = policy
        self.k = policy.num_speculative_tokens
        attention_fn = get_attention_fn(attention_impl)
        self.draft_config = None
        self.own_draft_cache = False  # a draft model with a paged KV cache of its own
        if draft is None:
            verify = functools.partial(step.ngram_step, base.graphdef, attention_fn, self.k)
            self._verify = jax.jit(verify, donate_argnums=(1,))
        else:
            config, params, shares_target = draft
            self.draft_config = config
            self.draft_graphdef, self.draft_state = nnx.split(
                Llama(config, params, base.dtype, base.layer_loop))
            self.draft_kv = None
            if shares_target:
                self.draft_state = share_weights(self.draft_state, base.state)
            else:
                self.own_draft_cache = True
                self.draft_kv = init_kv_cache(config, base.num_pages, base.page_size, base.dtype)
                self.draft_swapper = KVSwapper(
                    powers_of_two(1, base.buckets.max_pages_per_request))
                self._draft_host_pages = {}
                sync = functools.partial(step.draft_sync_step, self.draft_graphdef, attention_fn)
                self._sync = jax.jit(sync, donate_argnums=(1,))
            verify = functools.partial(step.draft_model_step, base.graphdef, self.draft_graphdef,
                                       attention_fn, self.k)
            self._verify = jax.jit(verify, donate_argnums=(1, 3) if self.own_draft_cache else (1,))
        self._verify_exes, self._sync_exes = {}, {}
        self.compilations_after_warmup: int | None = None

    @property
    def buckets(self):
        return self.base.buckets

    @property
    def state(self):
        return self.base.state

    @property
    def kv(self):
        return self.base.kv

    @property
    def num_host_swapped(self) -> int:
        draft_pages = self._draft_host_pages if self.own_draft_cache else {}
        return self.base.num_host_swapped + len(draft_pages)

    # ---- compilation and timing ------------------------------------------------------------
    def warmup(self, progress: bool = True) -> None:
        self.base.warmup(progress=progress)
        shapes = self.base.buckets.shapes()
        lowered = {("verify", shape): self._verify.lower(*self._verify_args(self._empty(shape)))
                   for shape in shapes}
        if self.own_draft_cache:
            for shape in shapes:
                lowered[("sync", shape)] = self._sync.lower(*self._sync_args(self._empty(shape)))
        workers = max(1, min(len(lowered), os.cpu_count() or 1, 4))
        with ThreadPoolExecutor(workers) as pool:
            compiled = dict(zip(lowered, pool.map(lambda low: low.compile(), lowered.values())))
        for (kind, shape), exe in compiled.items():
            (self._verify_exes if kind == "verify" else self._sync_exes)[shape] = exe
        for shape in shapes:  # a first run can allocate: do it now
            self._run_verify(self._empty(shape))
            if self.own_draft_cache:
                self._run_sync(self._empty(shape).sync)
        if self.own_draft_cache:
            self.draft_swapper.warmup(self.draft_kv)
        self.policy.set_step_costs(self._measure_costs())
        self.compilations_after_warmup = num_compilations()

    def _empty(self, shape):
        return empty_spec_batch(*shape, self.base.buckets.max_pages_per_request, self.k)

    def _verify_args(self, batch) -> tuple:
        b = self.base
        if self.draft_config is None:
            return (b.state, b.kv, *batch.verify_inputs(), *batch.sampling_inputs())
        return (b.state, b.kv, self.draft_state, self.draft_kv, *batch.verify_inputs(),
                *batch.draft_inputs(), *batch.sampling_inputs())

    def _sync_args(self, batch) -> tuple:
        return (self.draft_state, self.draft_kv, *batch.sync.model_inputs()[:7])

    def _measure_costs(self) -> dict[int, float]:
        """Batch size B -> time of a step verifying k drafts for B requests over the time of a
        plain step for B requests (plus the draft's sync pass), from all-padding batches. Each
        time is the minimum of a few interleaved runs: the least disturbed by other work."""
        buckets, p = self.base.buckets, self.base.buckets.max_pages_per_request
        max_tokens, max_seqs = buckets.token_buckets[-1], buckets.seq_buckets[-1]

        def plain_step(shape):
            batch, sync = empty_host_batch(*shape, p), self._empty(shape).sync
            if not self.own_draft_cache:
                return lambda: np.asarray(self.base._run(batch))
            return lambda: (self._run_sync(sync).block_until_ready(),
                            np.asarray(self.base._run(batch)))

        def spec_step(shape):
            batch = self._empty(shape)
            return lambda: np.asarray(self._run_verify(batch))

        pairs = {}
        for size in range(1, max_seqs + 1):
            pairs[size] = (buckets.select(size, size),
                           buckets.select(min(size * (self.k + 1), max_tokens), size))
        best: dict[tuple, float] = {}
        for plain_shape, spec_shape in set(pairs.values()):
            # Interleaved runs, so that load from elsewhere hits both alike.
            runs = {("plain", plain_shape): plain_step(plain_shape),
                    ("spec", spec_shape): spec_step(spec_shape)}
            for _ in range(_TIMING_RUNS):
                for key, run in runs.items():
                    start = time.perf_counter()
                    run()
                    elapsed = time.perf_counter() - start
                    best[key] = min(best.get(key, elapsed), elapsed)
        ratio = {size: best[("spec", s)] / best[("plain", pl)] for size, (pl, s) in pairs.items()}
        log.info("speculative step cost / plain step cost by batch size: %s",
                 {b: round(r, 2) for b, r in ratio.items()})
        return ratio

    # ---- one step ----------------------------------------------------------------------
    def execute(self, plan: StepPlan) -> StepResult:
        if self.own_draft_cache:
            self._draft_swaps(plan)
        if not any(c.num_draft_tokens for c in plan.chunks):
            if self.own_draft_cache and plan.chunks:
                self._run_sync(build_host_batch(plan, self.base.buckets, self.base.page_size))
            return self.base.execute(plan)
        self.base.execute(StepPlan(swap_out=plan.swap_out, swap_in=plan.swap_in,
                                   dropped_swaps=plan.dropped_swaps))
        batch = build_spec_batch(plan, self.base.buckets, self.base.page_size, self.k)
        packed = np.asarray(self._run_verify(batch))  # [2, S, k+1]
        n = len(plan.chunks)
        return StepResult(packed[0, :n].copy(), packed[1, :n].view(np.float32).copy())

    def _run_verify(self, batch):
        exe = self._verify_exes.get(batch.shape)
        if exe is None:
            raise RuntimeError(f"no compiled speculative step for bucket (T, S)={batch.shape}")
        if self.draft_config is None:
            packed, self.base.kv = exe(*self._verify_args(batch))
        else:
            packed, self.base.kv, draft_kv = exe(*self._verify_args(batch))
            if self.own_draft_cache:
                self.draft_kv = draft_kv
        packed.copy_to_host_async()
        return packed

    def _run_sync(self, batch):
        exe = self._sync_exes.get(batch.shape)
        if exe is None:
            raise RuntimeError(f"no compiled draft sync pass for bucket (T, S)={batch.shape}")
        self.draft_kv = exe(self.draft_state, self.draft_kv, *batch.model_inputs()[:7])
        return self.draft_kv[0]

    def _draft_swaps(self, plan: StepPlan) -> None:
        """The draft cache follows the target's swaps, page for page."""
        for request_id in plan.dropped_swaps:
            self._draft_host_pages.pop(request_id, None)
        for op in plan.swap_out:
            self._draft_host_pages[op.request_id] = self.draft_swapper.swap_out(self.draft_kv,
                                                                                op.page_ids)
        for op in plan.swap_in:
            self.draft_kv = self.draft_swapper.swap_in(
                self.draft_kv, self._draft_host_pages.pop(op.request_id), op.page_ids)
