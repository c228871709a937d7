"""plan.DecodeRows (Scheduler(decode_rows=True)) changes no step input and no token.

Two schedulers run the same mixed requests in lockstep, one laying the steady decoders out as
DecodeRows, one as a chunk each; each has its own runner-side persistent state (an InputBatch,
as ModelRunner keeps one) and lays every step out as ModelRunner does. A fake
device samples token f(request, output index) from each step's inputs, so tokens do not depend
on row order (which differs: DecodeRows come first). Per request and step the rows must match:
tokens (or the batch slot the token is read from), positions, KV slots, KV length, page table,
sampling settings; the events and final outputs must match too, and both pools end empty. The
mix: small pages (a decode crosses a page every 4 tokens), chunked prefill, preemption
(recompute and swap), stop tokens, max_tokens, aborts, top logprobs and a logits processor
(never DecodeRows), with and without the async one-step lag. No model, and no step on a device
(the InputBatch's device arrays are made and never used).
"""

from __future__ import annotations

import zlib

import numpy as np
import pytest

from jaxserve.core.plan import StepResult
from jaxserve.core.page_manager import PageManager
from jaxserve.core.request import DecodeTokens, FinishReason, Request, SamplingParams
from jaxserve.runner.buckets import BucketTable
from jaxserve.runner.input_batch import InputBatch
from jaxserve.runner.prepare_inputs import build_step_inputs
from jaxserve.core.scheduler import Scheduler
from jaxserve.model.decoder.step_layout import layouts_for
from jaxserve.core.swap_space import HostSwapSpace

SEQS, BUDGET, MAX_LEN, PAGE = 8, 32, 96, 4


def fake_token(request_id: str, output_index: int) -> int:
    return 3 + (zlib.crc32(f"{request_id}/{output_index}".encode()) % 97 if output_index % 5
                else 47)


class Side:
    """One scheduler and the runner-side state ModelRunner keeps for it."""

    def __init__(self, decode_rows: bool, mode: str, num_pages: int):
        self.pages = PageManager(num_pages=num_pages, page_size=PAGE)
        swap = HostSwapSpace(1 << 20, 64) if mode == "swap" else None
        self.sched = Scheduler(self.pages, max_num_seqs=SEQS, max_num_batched_tokens=BUDGET,
                               max_model_len=MAX_LEN, preemption_mode=mode, swap_space=swap,
                               decode_rows=decode_rows)
        self.buckets = BucketTable.build(BUDGET, SEQS, MAX_LEN, PAGE, (SEQS, BUDGET), (SEQS,))
        p = self.buckets.max_pages_per_request
        self.batch = InputBatch(SEQS, p)
        self.layouts = layouts_for(self.buckets.shapes(), p, 1)
        self.device_tables = np.zeros_like(self.batch.host_tables.tables)  # as the device's
        self.num_decode_rows = 0

    def step(self):
        """Schedule and lay out one step: (plan, {request id: its rows}, tokens, logprobs)."""
        plan = self.sched.schedule()
        self.num_decode_rows += plan.num_decode_rows
        self.batch.rows.release(plan)  # (as ModelRunner.dispatch: a plan without rows too)
        if not plan.num_seqs:
            return plan, {}, np.zeros(0, np.int32), np.zeros(0, np.float32)
        b = build_step_inputs(plan, self.buckets, PAGE, batch=self.batch,
                              layouts=self.layouts).views
        t = b.tables
        k = len(self.batch.host_tables.changed)  # (these steps never overflow the carried rows)
        self.device_tables[t.update_slots[:k]] = t.update_rows[:k]
        m, a, sp = b.model, b.attention, b.sampling
        rows, tokens = {}, []
        for i, chunk in enumerate(plan.all_chunks()):
            r0, r1 = int(a.cu_q_lens[i]), int(a.cu_q_lens[i + 1])
            sampled = r1 - 1 == int(m.logits_indices[i]) and chunk.sampling is not None
            rows[chunk.request_id] = (
                m.token_ids[r0:r1].tolist(), m.token_slots[r0:r1].tolist(),
                m.positions[r0:r1].tolist(), m.slot_mapping[r0:r1].tolist(), int(a.kv_lens[i]),
                self.device_tables[t.slots[i]].tolist(),
                (float(sp.temperature[i]), int(sp.seeds[i]), int(sp.output_index[i]),
                 int(sp.sample_slots[i]), int(sp.top_k[i])) if sampled else None)
            tokens.append(fake_token(chunk.request_id, int(sp.output_index[i])))
        assert int(a.num_seqs) == plan.num_seqs
        return plan, rows, np.array(tokens, np.int32), np.zeros(len(tokens), np.float32)


def requests():
    rng = np.random.default_rng(3)
    out = []
    for i in range(20):
        kind = dict(max_tokens=int(rng.integers(1, 30)), ignore_eos=True, temperature=0.0)
        if i % 5 == 1:
            kind.update(temperature=0.8, seed=i)
        if i % 5 == 2:
            kind.update(stop_token_ids=[50])  # fake_token's every fifth output
        if i == 7:
            kind.update(logprobs=2)  # top logprobs: chunks only
        if i == 11:
            kind.update(presence_penalty=0.5)  # a logits processor: chunks only
        prompt = rng.integers(3, 100, int(rng.integers(1, 50))).tolist()
        out.append((f"r{i}", prompt, SamplingParams(**kind)))
    return out


def event_key(events):
    """The events as comparable data (a DecodeTokens as the TokenEvents it stands for)."""
    flat = [x for e in events for x in (e.events() if isinstance(e, DecodeTokens) else [e])]
    return sorted((e.request_id, tuple(e.new_token_ids), tuple(e.new_logprobs), e.finish_reason)
                  for e in flat)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
@pytest.mark.parametrize("lag", [False, True])
def test_decode_rows_lay_out_the_same_inputs_and_tokens_as_chunks(mode, lag):
    sides = [Side(True, mode, num_pages=40), Side(False, mode, num_pages=40)]
    for rid, prompt, params in requests():
        for side in sides:
            side.sched.add(Request(rid, list(prompt), params, seed=7))
    in_flight = [None, None]
    num_steps = 0
    while any(s.sched.has_unfinished() for s in sides) or in_flight[0] is not None:
        num_steps += 1
        assert num_steps < 2000
        results = [side.step() for side in sides]
        assert results[0][1] == results[1][1], f"step {num_steps}: rows differ"
        assert results[0][0].preempted == results[1][0].preempted
        keys = []
        for j, (side, (plan, _, tokens, logprobs)) in enumerate(zip(sides, results)):
            done = (plan, StepResult(tokens, logprobs))
            if lag:  # take the step before in (async: plan N+1 is made before N's update)
                done, in_flight[j] = in_flight[j], done if plan.num_seqs else None
            events = side.sched.update(*done) if done is not None else []
            if num_steps == 9:  # an abort in mid-stream
                side.sched.finish("r4", FinishReason.ABORT)
            keys.append(event_key(events))
        assert keys[0] == keys[1], f"step {num_steps}: events differ"
    assert sides[0].num_decode_rows > 100 and sides[1].num_decode_rows == 0
    assert sides[0].sched.num_preemptions > 0
    assert mode == "recompute" or sides[0].sched.num_swaps > 0
    for side in sides:
        assert side.pages.num_free_pages == side.pages.num_pages - 1, "a KV page leaked"


def test_a_decode_after_its_table_changed_is_a_chunk_again():
    """A decode that crosses into a new page sends its table once as a chunk (the slot's
    table would be stale), then decodes as DecodeRows again."""
    side = Side(True, "recompute", num_pages=40)
    side.sched.add(Request("a", [5, 6, 7], SamplingParams(max_tokens=12, ignore_eos=True), 1))
    kinds = []
    while side.sched.has_unfinished():
        plan, _, tokens, logprobs = side.step()
        kinds.append("d" if plan.num_decode_rows else "c")
        side.sched.update(plan, StepResult(tokens, logprobs))
    # prefill at 0-2 (chunk), decodes at positions 3.. ; positions 4, 8, 12 start a page
    assert kinds == list("cdcdddcdddcd"), kinds
