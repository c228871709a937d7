"""Random scheduler workloads for the property tests (test_scheduler_properties.py): the specs
and configs hypothesis draws, and run_workload, which drives a Scheduler + PageManager to the
end with a fake runner and checks what each step may not break. No model, no jax.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field, replace

from hypothesis import HealthCheck, currently_in_test_context
from hypothesis import event as note_event
from hypothesis import strategies as st

from jaxserve.core.plan import StepResult
from jaxserve.core.page_manager import NULL_PAGE, PageManager
from jaxserve.core.request import (DecodeTokens, FinishReason, Request, RequestStatus,
                                   SamplingParams)
from jaxserve.core.scheduler import Scheduler
from jaxserve.core.swap_space import HostSwapSpace

STOP = 2            # the stop token of requests that have one; other tokens are 3..52
PAGE_BYTES = 64     # HostSwapSpace accounting unit in these tests
BASE = [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26]  # shared prefix source
SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow])


def fake_token(request_id: str, output_index: int, stops: bool) -> int:
    h = zlib.crc32(f"{request_id}/{output_index}".encode())
    return STOP if stops and h % 7 == 0 else 3 + h % 50


@dataclass(frozen=True)
class Spec:
    request_id: str
    prompt: tuple[int, ...]
    max_tokens: int
    stops: bool      # STOP is a stop token of this request (the fake runner samples it at times)
    arrival: int     # step at which it is added


@dataclass(frozen=True)
class Config:
    page_size: int
    num_pages: int
    max_num_seqs: int
    budget: int              # max_num_batched_tokens
    max_model_len: int
    chunked: bool
    mode: str                # preemption_mode
    swap_pages: int          # host swap space, in pages (swap mode)
    decode_rows: bool
    lag: bool                # async: update() of step N after schedule() of step N+1


@dataclass
class Run:
    """What one workload did."""

    requests: dict[str, Request] = field(default_factory=dict)
    refused: set[str] = field(default_factory=set)
    arrival_step: dict[str, int] = field(default_factory=dict)
    older_live_at_arrival: dict[str, int] = field(default_factory=dict)
    first_step: dict[str, int] = field(default_factory=dict)   # first step with a row of it
    tokens: dict[str, list[int]] = field(default_factory=dict)  # from the events
    finishes: dict[str, list[FinishReason]] = field(default_factory=dict)
    num_steps: int = 0
    num_preemptions: int = 0
    num_swaps: int = 0


# ---- strategies -------------------------------------------------------------------------
@st.composite
def configs(draw, mode=None, chunked=None) -> Config:
    page_size = draw(st.sampled_from([2, 4, 8]))
    max_model_len = draw(st.sampled_from([32, 48]))
    max_num_seqs = draw(st.integers(1, 6))
    chunked = draw(st.booleans()) if chunked is None else chunked
    if chunked:
        budget = draw(st.integers(max_num_seqs, 40))
    else:  # a whole prompt (or a recompute's prompt + outputs) must fit one step
        budget = draw(st.integers(max_model_len, max_model_len + 16))
    mode = draw(st.sampled_from(["recompute", "swap"])) if mode is None else mode
    return Config(page_size=page_size, num_pages=0,  # set by workloads()
                  max_num_seqs=max_num_seqs, budget=budget, max_model_len=max_model_len,
                  chunked=chunked, mode=mode,
                  swap_pages=draw(st.sampled_from([0, 2, 6, 1000])) if mode == "swap" else 0,
                  decode_rows=draw(st.booleans()), lag=draw(st.booleans()))


@st.composite
def workloads(draw, mode=None, chunked=None, max_requests=10):
    """(Config, [Spec]): requests with shared prefixes, arriving over the first steps."""
    cfg = draw(configs(mode=mode, chunked=chunked))
    n = draw(st.integers(1, max_requests))
    specs = []
    for i in range(n):
        shared = draw(st.integers(0, len(BASE)))
        tail = draw(st.lists(st.integers(3, 9), max_size=cfg.max_model_len - 1 - shared))
        prompt = (BASE[:shared] + tail)[:cfg.max_model_len - 1] or [3]
        specs.append(Spec(f"r{i}", tuple(prompt), draw(st.integers(1, 24)), draw(st.booleans()),
                          draw(st.integers(0, 8))))
    # The pool: mostly just above what the largest request needs, so that requests preempt
    # each other; at times smaller, so that some are refused.
    largest = max(-(-min(len(s.prompt) + s.max_tokens, cfg.max_model_len) // cfg.page_size)
                  for s in specs)
    num_pages = draw(st.one_of(st.integers(largest + 1, largest + 4),
                               st.integers(largest + 1, largest + 24),
                               st.integers(3, max(3, largest))))
    return replace(cfg, num_pages=num_pages), specs


# ---- the harness ------------------------------------------------------------------------
def output_budget(cfg: Config, spec: Spec) -> int:
    return min(spec.max_tokens, cfg.max_model_len - len(spec.prompt))


def fits_pool(cfg: Config, spec: Spec) -> bool:
    total = min(len(spec.prompt) + spec.max_tokens, cfg.max_model_len)
    return -(-total // cfg.page_size) <= cfg.num_pages - 1


def step_bound(cfg: Config, specs: list[Spec]) -> int:
    """L = max(P + M) + 2 steps for the oldest running request (the module docstring)."""
    return max(len(s.prompt) + output_budget(cfg, s) for s in specs) + 2


def check_plan_budgets(cfg: Config, sched: Scheduler, plan, step: int) -> None:
    ids = [c.request_id for c in plan.all_chunks()]
    assert plan.num_tokens <= cfg.budget, (
        f"step {step}: {plan.num_tokens} tokens > max_num_batched_tokens={cfg.budget}")
    assert plan.num_seqs <= cfg.max_num_seqs, (
        f"step {step}: {plan.num_seqs} requests > max_num_seqs={cfg.max_num_seqs}")
    assert len(sched.running) <= cfg.max_num_seqs, (
        f"step {step}: {len(sched.running)} running > max_num_seqs={cfg.max_num_seqs}")
    assert len(set(ids)) == len(ids), f"step {step}: a request appears twice in the plan: {ids}"
    for chunk in plan.all_chunks():
        request = sched.requests.get(chunk.request_id)
        assert request is not None and request.status == RequestStatus.RUNNING, (
            f"step {step}: {chunk.request_id} has rows but is not running")
        if not cfg.chunked:
            assert chunk.sampling is not None, (
                f"step {step}: without chunked prefill {chunk.request_id} got a partial chunk "
                f"of {chunk.num_tokens} tokens")


def check_pages(cfg: Config, sched: Scheduler, pm: PageManager, swap, run: Run,
                when: str) -> None:
    """Page conservation: the pool's books balance, only running requests hold pages, the
    pages in use are exactly the (distinct, shared by prefix) pages the running requests hold,
    and only swapped requests hold host swap space."""
    try:
        pm.check_invariants()
    except AssertionError as e:
        raise AssertionError(f"{when}: PageManager invariant broken: {e}") from None
    held = set()
    for rid, request in run.requests.items():
        running = request.status == RequestStatus.RUNNING
        assert pm.has_request(rid) == running, (
            f"{when}: {rid} is {request.status.value} but "
            f"{'holds' if pm.has_request(rid) else 'holds no'} pages")
        if running:
            held.update(p for p in pm.page_table(rid) if p != NULL_PAGE)
        if swap is not None:
            swapped = request.status == RequestStatus.SWAPPED
            assert swap.has_request(rid) == swapped, (
                f"{when}: {rid} is {request.status.value} but "
                f"{'holds' if swap.has_request(rid) else 'holds no'} swap space")
    in_use = pm.num_pages - 1 - pm.num_free_pages
    assert in_use == len(held), (
        f"{when}: {in_use} pages in use but running requests hold {len(held)}: "
        f"{in_use - len(held)} leaked")
    if swap is not None:
        assert swap.num_requests == len(sched.swapped), (
            f"{when}: swap space holds {swap.num_requests} requests, "
            f"{len(sched.swapped)} are swapped")


def check_victims(run: Run, plan, running_before: set[str], step: int) -> None:
    """Each preempted request is the latest-arrived running one the step gave no rows to:
    newer than every request that was running and has rows in the plan (the rows were given
    in arrival order, and a victim is the newest running request without rows so far)."""
    kept = running_before & {c.request_id for c in plan.all_chunks()}
    for victim in plan.preempted:
        older_kept = [rid for rid in kept
                      if run.requests[rid].sort_key() > run.requests[victim].sort_key()]
        assert not older_kept, (f"step {step}: preempted {victim} but kept newer running "
                                f"requests {sorted(older_kept)}")


def check_page_tables(plan, pm: PageManager, held: dict[str, tuple[int, ...]],
                      step: int) -> None:
    """The page tables a runner keeps per request from the plans' diffs (plan.PageUpdate;
    none for DecodeRows and unchanged chunks), dropped when a plan releases the request's row,
    are the page manager's, every step."""
    for rid in plan.released:
        held.pop(rid, None)
    for rid in plan.decode.request_ids:
        assert held.get(rid) == tuple(pm.page_table(rid)), (
            f"step {step}: decode row {rid} reads the table {held.get(rid)}, not its own "
            f"{pm.page_table(rid)}")
    for chunk in plan.chunks:
        rid = chunk.request_id
        if chunk.pages is not None:
            held[rid] = chunk.pages.apply(held.get(rid, ()))
        assert held.get(rid) == tuple(pm.page_table(rid)), (
            f"step {step}: {rid}'s row holds {held.get(rid)}, not its table "
            f"{pm.page_table(rid)}")


def run_workload(cfg: Config, specs: list[Spec], *, check_budgets=False,
                 check_page_books=False, check_preemption_order=False) -> Run:
    pm = PageManager(cfg.num_pages, cfg.page_size)
    swap = HostSwapSpace(cfg.swap_pages * PAGE_BYTES, PAGE_BYTES) if cfg.mode == "swap" else None
    sched = Scheduler(pm, max_num_seqs=cfg.max_num_seqs, max_num_batched_tokens=cfg.budget,
                      max_model_len=cfg.max_model_len, preemption_mode=cfg.mode,
                      enable_chunked_prefill=cfg.chunked, swap_space=swap,
                      decode_rows=cfg.decode_rows)
    run = Run()
    arrivals = sorted(specs, key=lambda s: s.arrival)  # stable: ties keep the list order
    last_arrival = arrivals[-1].arrival
    max_steps = last_arrival + (len(specs) + 1) * (cfg.max_num_seqs + 1) * step_bound(cfg,
                                                                                      specs)
    stops = {s.request_id: s.stops for s in specs}
    swapped_out: dict[str, int] = {}  # request id -> pages its SwapOut copied
    next_arrival, in_flight, step = 0, None, 0
    held_tables: dict[int, tuple[int, ...]] = {}  # batch slot -> the runner's page table
    while True:
        while next_arrival < len(arrivals) and arrivals[next_arrival].arrival <= step:
            spec = arrivals[next_arrival]
            request = Request(spec.request_id, list(spec.prompt),
                              SamplingParams(max_tokens=spec.max_tokens, temperature=0,
                                             stop_token_ids=(STOP,) if spec.stops else ()),
                              seed=next_arrival)
            request.arrival_seq = next_arrival
            run.requests[spec.request_id] = request
            run.arrival_step[spec.request_id] = step
            run.older_live_at_arrival[spec.request_id] = sum(
                not r.is_finished for r in run.requests.values()) - 1
            run.tokens[spec.request_id], run.finishes[spec.request_id] = [], []
            event = sched.add(request)
            if event is not None:
                assert event.finish_reason == FinishReason.ERROR and event.error, (
                    f"{spec.request_id}: add() returned a non-error event {event}")
                assert request.is_finished, f"{spec.request_id}: refused but not finished"
                run.refused.add(spec.request_id)
            next_arrival += 1
        if (next_arrival == len(arrivals) and not sched.has_unfinished()
                and in_flight is None):
            break
        step += 1
        assert step <= max_steps, (
            f"no end after {max_steps} steps (bound: last arrival + (n + 1) * "
            f"(max_num_seqs + 1) * L); live: "
            f"{[(r.request_id, r.status.value) for r in run.requests.values() if not r.is_finished]}")
        running_before = {r.request_id for r in sched.running}
        plan = sched.schedule()
        if check_preemption_order:
            check_victims(run, plan, running_before, step)
        if check_budgets:
            check_plan_budgets(cfg, sched, plan, step)
        for out in plan.swap_out:
            swapped_out[out.request_id] = len(out.page_ids)
        for back in plan.swap_in:
            assert swapped_out.pop(back.request_id, None) == len(back.page_ids), (
                f"step {step}: {back.request_id} swaps in {len(back.page_ids)} pages, not the "
                "number it swapped out")
            assert set(back.page_ids) <= set(pm.page_table(back.request_id))
        for rid in plan.dropped_swaps:
            swapped_out.pop(rid, None)
        if check_page_books:
            check_pages(cfg, sched, pm, swap, run, f"step {step} after schedule()")
        check_page_tables(plan, pm, held_tables, step)
        rows = plan.all_chunks()
        for chunk in rows:
            run.first_step.setdefault(chunk.request_id, step)
        tokens = [fake_token(c.request_id, c.output_index, stops[c.request_id]) for c in rows]
        done = (plan, StepResult(tokens, [0.0] * len(tokens)))
        if cfg.lag:
            done, in_flight = in_flight, (done if plan.num_seqs else None)
        events = sched.update(*done) if done is not None else []
        for event in events:
            flat = event.events() if isinstance(event, DecodeTokens) else [event]
            for e in flat:
                run.tokens[e.request_id] += e.new_token_ids
                if e.finish_reason is not None:
                    run.finishes[e.request_id].append(e.finish_reason)
        if check_page_books:
            check_pages(cfg, sched, pm, swap, run, f"step {step} after update()")
    run.num_steps, run.num_preemptions, run.num_swaps = step, sched.num_preemptions, sched.num_swaps
    if check_page_books:
        pm.check_invariants()
        assert pm.num_free_pages == pm.num_pages - 1, (
            f"{pm.num_pages - 1 - pm.num_free_pages} pages still in use after every request ended")
        assert swap is None or swap.used_bytes == 0, f"swap space leaked {swap.used_bytes} bytes"
        assert not swapped_out, f"swapped out and never back nor dropped: {swapped_out}"
    if currently_in_test_context():  # coverage, in --hypothesis-show-statistics
        note_event("preempted" if run.num_preemptions else "no preemption")
        note_event(f"{cfg.mode}: swapped out" if run.num_swaps else f"{cfg.mode}: no swap")
        note_event("some refused" if run.refused else "none refused")
    return run
