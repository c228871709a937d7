"""SpeculativeRunner: runs plans that carry draft rows; every other plan goes to the ModelRunner.

It is built on the engine's ModelRunner (same weights, KV cache, buckets and placement) and
adds CompiledSteps: per (T, S) bucket, one verification step (with the draft model's passes in
front for the draft method) and, for a draft with a KV cache of its own, the draft's sync pass,
so that cache follows every step and every swap. A `layers:N` draft needs neither: it is the
target's first N layers, so it works in the target's own cache. The draft model goes through
the same tensor-parallel Placement as the target. All steps are compiled and timed at warm-up:
the timings give the policy the cost of speculating at each batch size. Serving never
compiles. It never decides what runs or how many tokens to propose: the scheduler and policy do.
With LoRA adapters (n-gram only) the verify step reads the base runner's adapter stacks and
each row, draft rows included, runs under its request's adapter slot.
"""

from __future__ import annotations

import functools
import logging
import time

import numpy as np

from jaxserve.core.plan import StepPlan
from jaxserve.runner.prepare_inputs import build_step_inputs
from jaxserve.runner.compiled_step import CompiledStep
from jaxserve.runner.model_runner import ModelRunner, unpack
from jaxserve.runner.protocol import RunsInDispatch, StepResult
from jaxserve.runner.tensor_parallel import Placement
from jaxserve.spec import step
from jaxserve.spec.spec_inputs import build_spec_inputs, empty_spec_inputs
from jaxserve.spec.draft import share_weights
from jaxserve.spec.policy import SpeculationPolicy
from jaxserve.model.decoder.step_inputs import StepInputs

log = logging.getLogger(__name__)
_TIMING_RUNS = 5


class SpeculativeRunner(RunsInDispatch):
    """Runs plain steps on its base ModelRunner and speculative ones (plan.drafts) on its
    verify step; every step inside dispatch: the scheduler reads each result before the next
    plan."""

    rollout_refusal = ("weight updates, sleep and wake_up are not supported with speculative "
                       "decoding yet (the draft's weights and cache would need the same verbs)")

    def __init__(self, base: ModelRunner, policy: SpeculationPolicy, *, draft=None):
        """draft: (config, params, shares the target's weights) for the draft method."""
        self.base = base
        self.policy = policy
        self.k = k = policy.num_speculative_tokens
        self.buckets = buckets = base.buckets
        p = buckets.max_pages_per_request
        self.with_draft_model = draft is not None
        self.draft_cache = None  # a draft model's own paged KV cache, when it has one
        self.sync = None
        w = base.mask_words
        self.adapters = base.adapters  # the resident LoRA adapters (lora/device.py)
        empty = lambda shape: empty_spec_inputs(*shape, p, k, self.with_draft_model, w)  # noqa: E731
        if draft is None:
            fn = functools.partial(step.ngram_step, base.graphdef, base.attention, k)
            self.verify = CompiledStep("speculative verify", fn, base.state,
                                       (base.cache, self.adapters), buckets, empty,
                                       **base.placement.jit_shardings(
                                           adapters=(self.adapters.shardings,)))
            return
        if self.adapters.max_loras:
            raise ValueError("enable_lora=True is invalid with speculative_method='draft': a "
                             "draft model has no adapter slots (use speculative_method='ngram')")
        config, params, shares_target = draft
        placement = Placement(base.mesh, config)
        draft_graphdef, draft_state = placement.model(params, base.dtype, base.layer_loop,
                                                      quant_form=base.quant_form)
        if shares_target:
            draft_state = share_weights(draft_state, base.state)
        draft_attention = placement.attention(base.attention_impl, base.page_size, base.dtype,
                                              base.kv_dtype)
        caches = (base.cache,)
        if not shares_target:
            self.draft_cache = base.new_cache(placement)
            caches = (base.cache, self.draft_cache)
            sync = functools.partial(step.draft_sync_step, draft_graphdef, draft_attention)
            self.sync = CompiledStep("draft sync", sync, draft_state, (self.draft_cache,),
                                     buckets, lambda shape: StepInputs.empty(*shape, p),
                                     **placement.jit_shardings(with_out=False))
        fn = functools.partial(step.draft_model_step, base.graphdef, draft_graphdef,
                               base.attention, draft_attention, k, not shares_target)
        self.verify = CompiledStep("speculative verify", fn, (base.state, draft_state), caches,
                                   buckets, empty, **base.placement.jit_shardings(len(caches)))

    @property
    def state(self):
        return self.verify.state

    @property
    def kv(self):
        return self.verify.kv

    @property
    def num_host_swapped(self) -> int:
        draft = 0 if self.draft_cache is None else self.draft_cache.num_host_swapped
        return self.base.num_host_swapped + draft

    def wait(self) -> None:
        self.base.wait()
        if self.draft_cache is not None:
            self.draft_cache.arrays[0].block_until_ready()

    def close(self) -> None:
        self.base.close()

    # ---- compilation and timing ------------------------------------------------------------
    def warmup(self, progress: bool = True) -> None:
        self.base.warmup(progress=progress)
        self.verify.warmup(progress)
        if self.sync is not None:
            self.sync.warmup(progress)
            self.draft_cache.warmup()
        self.policy.set_step_costs(self._measure_costs())

    def _measure_costs(self) -> dict[int, float]:
        """Batch size B -> time of a step verifying k drafts for B requests over the time of a
        plain step for B requests (plus the draft's sync pass), from all-padding batches. Each
        time is the minimum of a few interleaved runs: the least disturbed by other work."""
        buckets, p = self.buckets, self.buckets.max_pages_per_request
        max_tokens, max_seqs = buckets.token_buckets[-1], buckets.seq_buckets[-1]

        def plain_step(shape):
            inputs = self.base.step.empty_inputs(shape)
            if self.sync is None:
                return lambda: np.asarray(self.base.step.run(inputs)[0])
            sync_inputs = self.sync.empty_inputs(shape)
            return lambda: (self.sync.run(sync_inputs),
                            self.draft_cache.arrays[0].block_until_ready(),
                            np.asarray(self.base.step.run(inputs)[0]))

        def spec_step(shape):
            inputs = self.verify.empty_inputs(shape)
            return lambda: np.asarray(self.verify.run(inputs))

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
        if self.draft_cache is not None:
            self.draft_cache.apply_swaps(plan)  # the draft cache follows the target's swaps
        if not plan.drafts:
            if self.sync is not None and plan.chunks:
                self.sync.run(build_step_inputs(plan, self.buckets, self.base.page_size,
                                                tables=self.base.input_batch.host_tables))
            return self.base.execute(plan)
        self.base.cache.apply_swaps(plan)
        # adapters this step's requests need, into their slots first
        self.adapters.apply_loads(plan.lora_loads, self.base.lora_registry)
        inputs = build_spec_inputs(plan, self.buckets, self.base.page_size, self.k,
                                   self.with_draft_model, self.base.input_batch.host_tables,
                                   self.base.mask_words)
        return unpack(np.asarray(self.verify.run(inputs)), len(plan.chunks))
