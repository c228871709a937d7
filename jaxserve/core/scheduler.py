"""Scheduler: decides, every step, which requests run and how many tokens each gets.

Order within a step: running requests (one decode token or the next prefill chunk), then
swapped-out requests coming back, then waiting requests (priority, then arrival), all within
`max_num_batched_tokens` and `max_num_seqs`. When a page can't be found, the lowest-priority,
latest-arrived running request is preempted (recompute, or swap with recompute as fallback).
Async scheduling: a scheduled chunk's tokens count as computed and its sample as pending at
once, so the next step can be planned before this one's tokens reach the host (the pending
token is read on the device from the request's row of the runner's batch, which the runner
holds from its first chunk until a plan lists it in StepPlan.released); update()
(scheduler_results.py) takes them in one step late.

Features arrive as objects it asks, never as branches here: the batching policy
(batching_policy.py: when to admit, what padding costs), the speculation (speculation.py:
each step's drafter; StepPlan.drafts), the sliding window (sliding_window.py: pages given
back), prompt sharing of n > 1 samples (prompt_sharing.py), the LoRA adapters (lora_slots.py:
which adapters are in use, and a request runs only with its adapter in a slot; one call per
request event, never a branch on a request's adapter here), and the row layout
(row_layout.py: DecodeRows or chunks). Plain Python: no jax, no device arrays, no text (stop
strings are the engine's job, finish()).
"""

from __future__ import annotations

import bisect

from jaxserve.core.batching_policy import make_batching_policy
from jaxserve.core.lora_slots import LoRASlots
from jaxserve.core.page_manager import PageManager
from jaxserve.core.plan import StepPlan, SwapIn, SwapOut
from jaxserve.core.processor_slots import ProcessorSlots
from jaxserve.core.prompt_sharing import PromptSharing
from jaxserve.core.request import FinishReason, Request, RequestStatus, StopSets, TokenEvent
from jaxserve.core.row_layout import RowLayout
from jaxserve.core.scheduler_results import SchedulerResults
from jaxserve.core import sliding_window
from jaxserve.core.speculation import NoSpeculation, Speculation
from jaxserve.core.swap_space import HostSwapSpace


class Scheduler(SchedulerResults):
    def __init__(self, page_manager: PageManager, *, max_num_seqs: int,
                 max_num_batched_tokens: int, max_model_len: int,
                 preemption_mode: str = "recompute", enable_chunked_prefill: bool = True,
                 batching: str = "continuous", swap_space: HostSwapSpace | None = None,
                 speculation=None, kv_window: int | None = None, decode_rows: bool = False,
                 max_loras: int = 0):
        if not enable_chunked_prefill and max_num_batched_tokens < max_model_len:
            # a prompt (or a recompute's prompt + outputs) is prefilled in one step
            raise ValueError(f"max_num_batched_tokens={max_num_batched_tokens} is too small: "
                             f"without chunked prefill it must be >= max_model_len "
                             f"({max_model_len}), or enable chunked prefill")
        self.pages = page_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.preemption_mode = preemption_mode
        self.enable_chunked_prefill = enable_chunked_prefill
        self.batching = make_batching_policy(batching)
        self.swap_space = swap_space
        # drafts to verify (spec/policy.py's SpeculationPolicy), or none
        self.speculation: Speculation = speculation or NoSpeculation()
        self.window = sliding_window.kv_window(page_manager, kv_window)  # pages it left behind
        # steady decoders as plan.DecodeRows: only for a runner that keeps each request's
        # settings and page table in its row (ModelRunner's plain steps)
        self.decode_rows = decode_rows
        self.requests: dict[str, Request] = {}
        self.waiting: list[Request] = []   # sorted by Request.sort_key
        self.running: list[Request] = []   # sorted by Request.sort_key
        self.swapped: list[Request] = []   # FIFO
        # n > 1: the other samples are held until sample 0's prompt KV is computed, then fork it
        self.sharing = PromptSharing(page_manager, self.requests)
        self._leave_queue = {RequestStatus.WAITING: self._leave_waiting,  # by request status
                             RequestStatus.RUNNING: self._leave_running,
                             RequestStatus.SWAPPED: self._leave_swapped,
                             RequestStatus.FINISHED: lambda request: None}
        self._dropped_swaps: list[str] = []
        self.processor_slots = ProcessorSlots(max_num_seqs + 1)
        self.lora_slots = LoRASlots(max_loras)  # LoRA adapters in use and in device slots
        self.layout = RowLayout(page_manager, self.processor_slots, self.lora_slots)
        self._num_plain_only = 0  # requests only plain steps compute: none speculates meanwhile
        self._num_host_bound = 0  # requests whose inputs need their last token on the host
        self._released: list[str] = []  # stopped running since the last plan: rows to free
        self._host_drafts = self.speculation.method == "ngram"
        self.num_preemptions = 0
        self.num_swaps = 0
        self._stop_sets = StopSets()

    # ---- lifecycle -------------------------------------------------------------------
    def add(self, request: Request) -> TokenEvent | None:
        """Queue a request. One that can never fit is finished at once; its event is returned
        (a defensive invariant, else it would wait forever: the engine's requests were refused
        already by core/intake.py, which tells clients)."""
        self.requests[request.request_id] = request
        request.stop_ids = self._stop_sets.of(request)
        request.max_output_tokens = min(request.sampling.max_tokens,
                                        self.max_model_len - request.num_tokens)
        self.layout.add(request, self.decode_rows)
        self._num_plain_only += request.sampling.needs_plain_steps(self._host_drafts)
        self._num_host_bound += request.needs_host_tokens
        request.error = self.lora_slots.add(request) or self._never_fits(request)
        if request.error is not None:
            request.status = RequestStatus.FINISHED  # (in no queue yet)
            self._finish(request, FinishReason.ERROR)
            return TokenEvent(request.request_id, (), (), FinishReason.ERROR, request.error)
        request.status = RequestStatus.WAITING
        if self.sharing.hold(request):
            return None
        bisect.insort(self.waiting, request, key=Request.sort_key)
        return None

    def _never_fits(self, request: Request) -> str | None:
        """Why the request can never fit the page pool, or None."""
        total = min(request.num_tokens + request.sampling.max_tokens, self.max_model_len)
        needed, capacity = self.pages.num_pages_for(total), self.pages.num_pages - 1
        return None if needed <= capacity else (
            f"request needs {needed} KV pages ({total} tokens) but the page pool holds "
            f"{capacity}; lower max_tokens or the prompt length")

    def finish(self, request_id: str, reason: FinishReason) -> bool:
        """Finish a request from outside (abort, stop string). False if unknown or done."""
        request = self.requests.get(request_id)
        if request is None or request.is_finished:
            return False
        self._finish(request, reason)
        return True

    def _finish(self, request: Request, reason: FinishReason) -> None:
        self._release_held(request.request_id)  # its samples prefill on their own now
        if not self.sharing.drop(request):  # (a held sample is in no queue)
            self._leave_queue[request.status](request)
        self.pages.free(request.request_id)
        self.processor_slots.release(request.request_id)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        del self.requests[request.request_id]
        self.lora_slots.finish(request)
        self.layout.finish(request.request_id)
        self._num_plain_only -= request.sampling.needs_plain_steps(self._host_drafts)
        self._num_host_bound -= request.needs_host_tokens

    def _leave_waiting(self, request: Request) -> None:
        self.waiting.remove(request)

    def _leave_running(self, request: Request) -> None:
        self.running.remove(request)
        self._stop_running(request)

    def _leave_swapped(self, request: Request) -> None:
        self.swapped.remove(request)
        self.swap_space.release(request.request_id)
        self._dropped_swaps.append(request.request_id)

    def release_all_kv(self) -> None:
        """Every request gives its KV back (the rollout API's sleep frees the pool): running
        ones are preempted to recompute, swapped-out ones drop their host copies and recompute
        too. Call with no step in flight."""
        mode, self.preemption_mode = self.preemption_mode, "recompute"
        try:
            for request in list(reversed(self.running)):
                self._preempt(request, StepPlan())
        finally:
            self.preemption_mode = mode
        for request in list(self.swapped):
            self._leave_swapped(request)
            request.num_computed_tokens = 0
            request.status = RequestStatus.WAITING
            bisect.insort(self.waiting, request, key=Request.sort_key)

    def may_plan_ahead(self) -> bool:
        """Whether the next step can be planned before this one's tokens reach the host: no
        request needs its last token on the host to build its inputs, and no speculation or
        static batching (both read every result before planning)."""
        return (self._num_host_bound == 0 and not self.speculation.reads_every_result
                and not self.batching.reads_every_result)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped or self.sharing.held)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting) + self.sharing.num_held

    def _release_held(self, request_id: str) -> None:
        """The samples waiting for this one's prompt KV join the waiting queue."""
        for request in self.sharing.release(request_id):
            bisect.insort(self.waiting, request, key=Request.sort_key)

    # ---- scheduling ----------------------------------------------------------------
    def schedule(self) -> StepPlan:
        """Running requests, then swapped-out ones coming back, then waiting ones."""
        plan = StepPlan(dropped_swaps=self._dropped_swaps)
        self._dropped_swaps = []
        self.batching.begin_step(self.requests)
        scheduled: list[tuple[Request, int]] = []  # (request, tokens it computes this step)
        budget, preempted = self._schedule_running(plan, scheduled, self.max_num_batched_tokens)
        if not preempted:
            budget = self._schedule_swapped(plan, scheduled, budget)
        if not preempted and not self.swapped and self.batching.may_admit(len(self.running)):
            budget = self._schedule_waiting(scheduled, budget)
        plan.static_padding = self.batching.padding(budget, self.requests)
        self.layout.lay_out(plan, scheduled)
        plan.prefix_stores, plan.prefix_loads = self.pages.take_prefix_ops()
        plan.lora_loads = self.lora_slots.take_loads()
        plan.released, self._released = self._released, []
        return plan

    def _schedule_running(self, plan: StepPlan, scheduled, budget: int) -> tuple[int, bool]:
        """Each running request's next token or prefill chunk (plus the draft rows the
        speculation proposes), preempting others for pages. Returns (budget left, whether
        anything was preempted)."""
        preempted = False
        propose = self.speculation.drafter(self.running, self.max_model_len,
                                           self._num_plain_only)
        chunked, num_running = self.enable_chunked_prefill, len(self.running)
        for index, request in enumerate(list(self.running)):
            if budget == 0:
                break
            if request.status != RequestStatus.RUNNING:
                continue  # preempted earlier in this loop
            # (this runs per request and step: plain locals, no helper calls)
            num_outputs, pending = len(request.output_token_ids), request.num_pending_tokens
            if pending and num_outputs + pending >= request.max_output_tokens:
                continue  # its token in flight is its last (max_tokens within max_model_len)
            remaining = (len(request.prompt_token_ids) + num_outputs + pending
                         - request.num_computed_tokens)
            # a prefill chunk that doesn't fit waits unless chunked prefill is on
            num_new = 0 if remaining > budget and not chunked else min(remaining, budget)
            if num_new == 0:
                continue
            # (drafts never take the row another running request needs for its decode)
            num_draft, draft_ids = propose(request, remaining,
                                           budget - 1 - (num_running - index - 1))
            while not self.pages.append_slots(request.request_id,
                                              request.num_computed_tokens + num_new + num_draft):
                victim = self._pick_victim({r.request_id for r, _ in scheduled})
                self._preempt(victim, plan)
                preempted = True
                if victim is request:
                    break
            else:
                budget -= num_new + num_draft
                scheduled.append((request, num_new))
                plan.add_drafts(request.request_id, num_draft, draft_ids)
        return budget, preempted

    def _schedule_swapped(self, plan: StepPlan, scheduled, budget: int) -> int:
        while self.swapped and budget > 0 and len(self.running) < self.max_num_seqs:
            request = self.swapped[0]
            if request.num_pending_tokens or not self.lora_slots.can_acquire(request):
                break  # swapped out while its last step ran: resumes once its token is in;
                # or every LoRA slot holds an adapter in use: resumes when one is free
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            num_released = self.window.num_dead_pages(request.num_computed_tokens)  # as at swap-out
            if self.pages.allocate(request.request_id, (), request.num_computed_tokens + num_new,
                                   num_released_pages=num_released,
                                   lora_id=request.lora_id) is None:
                break
            self.swapped.pop(0)
            num_pages = self.pages.num_pages_for(request.num_computed_tokens)
            page_ids = tuple(self.pages.page_table(request.request_id)[num_released:num_pages])
            plan.swap_in.append(SwapIn(request.request_id, page_ids))
            self.swap_space.release(request.request_id)
            self._start_running(request)
            scheduled.append((request, num_new))
            budget -= num_new
        return budget

    def _schedule_waiting(self, scheduled, budget: int) -> int:
        new_batch, index = [], 0
        while (index < len(self.waiting) and self.batching.admits_more(budget)
               and len(self.running) < self.max_num_seqs):
            request = self.waiting[index]
            if ((request.sampling.structured_outputs is not None and request.grammar is None)
                    or request.num_pending_tokens or not self.lora_slots.can_acquire(request)):
                index += 1  # its grammar is still compiling, (preempted while its last step
                continue    # ran) its token is not in yet, or every LoRA slot holds an adapter
                # in use: the others go on without it
            tokens = request.all_token_ids
            got = self._admit_pages(request, budget)
            if got is None:
                break
            self.waiting.pop(index)
            # (its prefix cache hit counts at its first admission only)
            request.num_cached_tokens = got if not request.num_preemptions else (
                request.num_cached_tokens)
            request.num_computed_tokens = got
            num_new = min(len(tokens) - got, budget)
            self._start_running(request)
            if num_new > 0:
                scheduled.append((request, num_new))
            new_batch.append(request)
            budget -= num_new
        self.batching.admitted(new_batch)
        return budget

    def _admit_pages(self, request: Request, budget: int) -> int | None:
        """Pages to admit a waiting request: the prompt pages of the sample it shares them with
        (n > 1) while that one holds them, else its cached prefix; then fresh pages for what it
        computes this step. Returns the tokens whose KV it has, or None, nothing changed, when
        pages run out (or its prompt doesn't fit the budget and chunked prefill is off)."""
        tokens = request.prefix_cache_tokens
        source = self.sharing.source_of(request)
        num_shared = (len(self.pages.lookup_prefix(tokens, lora_id=request.lora_id))
                      * self.pages.page_size
                      if source is None else self.sharing.num_shared_tokens(request))
        num_new = request.num_tokens - num_shared
        if num_new > budget and not self.enable_chunked_prefill:
            return None
        num_new = min(num_new, budget)
        if source is None:
            return self.pages.allocate(request.request_id, tokens, num_shared + num_new,
                                       lora_id=request.lora_id)
        return self.sharing.fork(source, request, num_shared, num_new)

    def _start_running(self, request: Request) -> None:
        request.status = RequestStatus.RUNNING
        self.layout.forget(request.request_id)  # a new row: its settings and table not sent yet
        self.lora_slots.acquire(request)  # (the callers checked can_acquire)
        bisect.insort(self.running, request, key=Request.sort_key)

    def _stop_running(self, request: Request) -> None:
        """The request leaves the running set (finished, preempted): its device row is freed
        with the next plan (StepPlan.released)."""
        self._released.append(request.request_id)
        self.lora_slots.release(request)
        self.layout.forget(request.request_id)

    def _pick_victim(self, exclude: set[str]) -> Request:
        # The request asking for a page is never in `exclude`, so this is never empty.
        return max((r for r in self.running if r.request_id not in exclude),
                   key=Request.sort_key)

    def _preempt(self, victim: Request, plan: StepPlan) -> None:
        self.running.remove(victim)
        self._stop_running(victim)
        victim.num_preemptions += 1
        self.num_preemptions += 1
        self.processor_slots.release(victim.request_id)  # refilled from histories on resume
        plan.preempted.append(victim.request_id)
        num_pages = self.pages.num_pages_for(victim.num_computed_tokens)
        # only pages still in the window move
        num_released = self.window.release(victim.request_id, victim.num_computed_tokens)
        page_ids = tuple(self.pages.page_table(victim.request_id)[num_released:num_pages])
        if (self.preemption_mode == "swap" and self.swap_space is not None and page_ids
                and self.swap_space.reserve(victim.request_id, len(page_ids))):
            plan.swap_out.append(SwapOut(victim.request_id, page_ids))
            self.pages.free(victim.request_id)
            victim.status = RequestStatus.SWAPPED
            self.swapped.append(victim)
            self.num_swaps += 1
            return
        self.pages.free(victim.request_id)
        victim.num_computed_tokens = 0
        victim.status = RequestStatus.WAITING
        bisect.insort(self.waiting, victim, key=Request.sort_key)
