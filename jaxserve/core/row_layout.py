"""RowLayout: a step's scheduled requests laid out as the plan's rows, and counted as computed.

The scheduler decides which requests run and how many tokens each computes; this lays them out:
steady decoders (one token, a plain request whose device row already holds its sampling
settings and its unchanged page table: decode_rows) as plan.DecodeRows arrays, first; every
other request as a ScheduledChunk (step_rows.build_chunk), decode chunks before prefill chunks.
Which row a request has is the runner's (plan.py); what its row holds is known here by request
id, from what the plans sent since the request started running. A page table crosses to the
runner as a diff (plan.PageUpdate) against the one this request's row last got: whole when the
request is new to its row, else the pages it gained, the leading pages a sliding window
released, or where rejected drafts cut it. A scheduled chunk's
tokens count as computed at once and its sample as pending (update() confirms them when the
step's results are in, one step later under async scheduling). Plain Python: no jax, no
scheduling decisions, no page accounting.
"""

from __future__ import annotations

import numpy as np

from jaxserve.core.lora_slots import LoRASlots
from jaxserve.core.page_manager import NULL_PAGE, PageManager
from jaxserve.core.plan import DecodeRows, PageUpdate, SamplingRow, StepPlan
from jaxserve.core.processor_slots import ProcessorSlots
from jaxserve.core.request import Request
from jaxserve.core.step_rows import build_chunk


def page_update(held: tuple[int, ...] | None, table: tuple[int, ...]) -> PageUpdate | None:
    """The PageUpdate that turns held (None: nothing) into table; None when they are equal."""
    if held is None:
        return PageUpdate.whole(table)
    if held == table:
        return None
    n = len(held)
    if table[:n] == held:  # it gained pages (the usual change)
        return PageUpdate(n, table[n:])
    released = 0  # leading pages a window gave back (NULL_PAGE only ever leads a table)
    while released < len(table) and table[released] == NULL_PAGE:
        released += 1
    kept, common = released, min(n, len(table))
    while kept < common and held[kept] == table[kept]:
        kept += 1
    return PageUpdate(kept, table[kept:], released)


class RowLayout:
    def __init__(self, pages: PageManager, processor_slots: ProcessorSlots,
                 lora_slots: LoRASlots):
        self.pages = pages
        self.processor_slots = processor_slots
        self.lora_slots = lora_slots  # each running request's adapter slot
        # request id -> the page table its row last got (every chunk sends its diff)
        self.sent_tables: dict[str, tuple[int, ...]] = {}
        # requests whose row holds their plain sampling row (steady ones that sampled)
        self.settled: set[str] = set()
        # request id -> its SamplingRow for life, of requests whose steps need no more (no
        # logits processor, no prompt logprobs): building their rows reads no SamplingParams
        self.plain_rows: dict[str, SamplingRow] = {}
        # requests whose decodes may be plan.DecodeRows (plain, no top logprobs, no grammar)
        self.steady: set[str] = set()

    def forget(self, request_id: str) -> None:
        """The request left its row (finished, preempted) or gets a new one: nothing of it is
        in a row now."""
        self.sent_tables.pop(request_id, None)
        self.settled.discard(request_id)

    def finish(self, request_id: str) -> None:
        """The request ended: nothing of it is kept."""
        self.forget(request_id)
        self.plain_rows.pop(request_id, None)
        self.steady.discard(request_id)

    def add(self, request: Request, decode_rows: bool) -> None:
        """When a request is queued: its SamplingRow for life when that row is all its steps
        need (no logits processor, no prompt logprobs), and whether its decodes may be
        DecodeRows (decode_rows: the runner keeps each row's settings and page table; plain
        rows, no top logprobs, no grammar)."""
        sp, rid = request.sampling, request.request_id
        if sp.uses_processors or (sp.prompt_logprobs is not None and request.sample_index == 0):
            return
        self.plain_rows[rid] = SamplingRow(sp.temperature, sp.top_k, sp.top_p, sp.min_p,
                                           request.seed, sp.top_logprobs)
        if decode_rows and not sp.top_logprobs and sp.structured_outputs is None:
            self.steady.add(rid)

    def lay_out(self, plan: StepPlan, scheduled: list[tuple[Request, int]]) -> None:
        """plan.decode and plan.chunks from (request, tokens it computes this step)."""
        table_of, sent, settled = self.pages.page_table_tuple, self.sent_tables, self.settled
        adapter_slot, plain_rows, steady = self.lora_slots.slot_of, self.plain_rows, self.steady
        ids, rows, meta, chunk_rows = [], [], [], []
        for request, num_new in scheduled:  # (per request and step: plain locals)
            rid = request.request_id
            table = table_of(rid)
            if num_new != 1 or rid not in settled or sent[rid] != table:
                chunk_rows.append((request, num_new, table))
                continue
            start, pending = request.num_computed_tokens, request.num_pending_tokens
            outputs = request.output_token_ids
            ids.append(rid)
            rows.append(plain_rows[rid])  # (settled: steady, so plain)
            meta += (start, 0 if pending else outputs[-1] if outputs
                     else request.prompt_token_ids[-1], pending,
                     len(outputs) + pending, adapter_slot(rid))
            request.num_computed_tokens = start + 1
            request.num_pending_tokens = pending + 1
        plan.decode = DecodeRows(ids, rows,
                                 np.array(meta, np.int64).reshape(-1, DecodeRows.WIDTH))
        chunk_rows.sort(key=lambda item: item[1] != 1)  # decode chunks first (a stable sort)
        chunks, drafts = plan.chunks, plan.drafts
        for request, num_new, table in chunk_rows:
            rid = request.request_id
            chunk = build_chunk(request, num_new, page_update(sent.get(rid), table),
                                plain_rows.get(rid), self.processor_slots,
                                drafts[rid].token_ids if rid in drafts else (),
                                adapter_slot(rid))
            chunks.append(chunk)
            sent[rid] = table
            request.num_computed_tokens += num_new  # being computed; update() confirms
            if chunk.sampling is not None:
                request.num_pending_tokens += 1
                if rid in steady:  # its row gets its settings now
                    settled.add(rid)
