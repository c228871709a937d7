"""Scheduler policy on plain Python objects (no model, no jax): budgets, chunking, batching."""

from __future__ import annotations

from jaxserve.core.plan import StepResult
from jaxserve.core.page_manager import PageManager
from jaxserve.core.request import Request, SamplingParams
from jaxserve.core.scheduler import Scheduler
from jaxserve.core.swap_space import HostSwapSpace


def make_scheduler(**kw) -> Scheduler:
    settings = dict(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=512)
    settings.update(kw)
    return Scheduler(PageManager(64, 16), swap_space=HostSwapSpace(1 << 20, 1024), **settings)


def add(sched: Scheduler, n: int, prompt_len: int | list[int], max_tokens: int | list[int] = 8,
        prefix: str = "r") -> list[Request]:
    """Queue n requests; prompt_len / max_tokens are one value for all, or one per request
    (fixed before Scheduler.add, which derives each request's output budget from them)."""
    lens = prompt_len if isinstance(prompt_len, list) else [prompt_len] * n
    budgets = max_tokens if isinstance(max_tokens, list) else [max_tokens] * n
    reqs = []
    for i in range(n):
        r = Request(f"{prefix}{i}", [5 + i] * lens[i],
                    SamplingParams(max_tokens=budgets[i], temperature=0), seed=i)
        r.arrival_seq = len(sched.requests)
        assert sched.add(r) is None
        reqs.append(r)
    return reqs


def run_step(sched: Scheduler):
    plan = sched.schedule()
    return plan, sched.update(plan, StepResult([7] * len(plan.chunks), [0.0] * len(plan.chunks)))


def test_static_batch_takes_all_members_even_when_their_prompts_exceed_the_budget():
    sched = make_scheduler(batching="static")
    add(sched, 4, prompt_len=100)
    plan, _ = run_step(sched)
    assert len(sched.running) == 4, "a static batch must hold max_num_seqs members"
    assert plan.num_tokens + plan.num_padding_rows <= 32


def test_static_batch_admits_nothing_until_every_member_finished():
    sched = make_scheduler(batching="static")
    first = add(sched, 4, prompt_len=10, max_tokens=[1, 3, 3, 3])  # r0 finishes early
    run_step(sched)
    assert first[0].is_finished and not any(r.is_finished for r in first[1:]), (
        "r0 (max_tokens=1) should finish after the first step, the others not")
    add(sched, 2, prompt_len=10, prefix="late")
    steps_with_a_free_seat = 0
    while any(not r.is_finished for r in first):
        steps_with_a_free_seat += len(sched.running) < sched.max_num_seqs
        plan, _ = run_step(sched)
        assert all(c.request_id.startswith("r") for c in plan.chunks), "joined a live batch"
        assert sched.num_waiting == 2, "a late request was admitted into a live batch"
    assert steps_with_a_free_seat >= 2, "the batch never had a finished member's seat free"
    plan, _ = run_step(sched)
    assert sorted(c.request_id for c in plan.chunks) == ["late0", "late1"], (
        "the next batch should start once every member finished")


def test_continuous_batch_cuts_long_prompts_into_chunks_within_the_budget():
    sched = make_scheduler()
    add(sched, 1, prompt_len=100)
    steps = 0
    while sched.running or sched.waiting:
        plan, _ = run_step(sched)
        assert plan.num_tokens <= 32
        steps += 1
        if steps > 50:
            raise AssertionError("request never finished")
    assert steps == 4 + 7, f"100 prompt tokens in chunks of 32 then 7 more decodes, got {steps}"


def test_decode_rows_come_before_prefill_chunks():
    sched = make_scheduler()
    add(sched, 1, prompt_len=10)
    run_step(sched)  # prefill, now decoding
    add(sched, 1, prompt_len=40, prefix="long")
    plan, _ = run_step(sched)
    assert [c.num_tokens for c in plan.chunks][0] == 1
    assert plan.chunks[1].num_tokens == 31


def test_static_batch_computes_finished_members_slots_over_the_longest_context():
    from jaxserve.runner.buckets import BucketTable
    from jaxserve.runner.page_tables import HostPageTables
    from jaxserve.runner.prepare_inputs import build_step_inputs

    table = BucketTable.build(32, 4, 512, 16)
    host = HostPageTables(5, table.max_pages_per_request)  # the runner's, kept from each plan

    def step():
        plan, _ = run_step(sched)
        host.rows.release(plan)
        host.apply_all(plan.chunks, host.rows.rows([c.request_id for c in plan.chunks]))

    sched = make_scheduler(batching="static")
    # member 0 finishes after its first token; member 3, the longest, has 30 prompt tokens
    members = add(sched, 4, prompt_len=[10, 10, 10, 30], max_tokens=[1, 6, 6, 6])
    step()  # members 0-2 prefill, member 3 its first 2 prompt tokens
    assert members[0].is_finished
    step()  # the batch still steps member 0's slot; member 3 prefills the rest
    plan = sched.schedule()
    assert len(plan.chunks) == 3 and plan.static_padding.num_finished_slots == 1
    assert plan.num_padding_rows >= 1
    assert [c.kv_len for c in plan.chunks] == [12, 12, 31], (
        "members 1, 2 decode at kv_len 12 and member 3 (the longest, last) at 31")
    inputs = build_step_inputs(plan, table, 16, tables=host)
    batch, rows = inputs.attention, inputs.model
    longest = max(plan.chunks, key=lambda c: c.kv_len)
    pages = sched.pages.page_table(longest.request_id)
    slot = len(plan.chunks)  # the finished slot is the sequence after the live ones
    assert int(batch.num_seqs) == 4
    assert batch.kv_lens[slot] == longest.kv_len
    assert list(batch.page_table[slot, :len(pages)]) == pages
    row = batch.cu_q_lens[slot]
    assert batch.cu_q_lens[slot + 1] == row + 1
    assert rows.positions[row] == longest.kv_len - 1
    assert rows.slot_mapping[row] == 0, "a finished slot must write only scratch page 0"


def test_a_running_requests_page_table_crosses_as_its_changes():
    """The plan carries a request's whole table when it is new to its batch slot, then only
    the pages it gains (none while its last page has room), and whole again in a new slot."""
    from jaxserve.core.plan import PageUpdate

    sched = make_scheduler(max_num_batched_tokens=64, preemption_mode="recompute")
    r, = add(sched, 1, prompt_len=30, max_tokens=20)
    plan, _ = run_step(sched)  # the prompt: 2 pages of 16
    pages = sched.pages.page_table("r0")
    assert plan.chunks[0].pages == PageUpdate.whole(pages)
    for _ in range(2):  # positions 30 and 31 fit in page 2
        plan, _ = run_step(sched)
        assert plan.chunks[0].pages is None
    plan, _ = run_step(sched)  # position 32 opens page 3
    assert plan.chunks[0].pages == PageUpdate(2, (sched.pages.page_table("r0")[2],))
    sched._preempt(r, plan)  # (by recompute: it comes back in a new slot)
    plan, _ = run_step(sched)
    assert plan.chunks[0].pages == PageUpdate.whole(sched.pages.page_table("r0"))


def test_commit_slices_the_tokens_across_the_prompt_output_boundary():
    from jaxserve.core.token_prefix import TokenPrefix

    r = Request("a", [1, 2, 3, 4, 5], SamplingParams(max_tokens=8), seed=0)
    r.output_token_ids = [6, 7, 8]
    view = TokenPrefix(r, 7)
    every = r.all_token_ids[:7]
    assert len(view) == 7 and len(TokenPrefix(r, 20)) == 8  # (at most every token, as [:20])
    for start in range(8):
        for stop in range(start, 9):
            assert view[start:stop] == every[start:stop], (start, stop)
