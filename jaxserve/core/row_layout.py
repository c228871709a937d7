"""RowLayout: a step's scheduled requests laid out as the plan's rows, and counted as computed.

The scheduler decides which requests run and how many tokens each computes; this lays them out:
steady decoders (one token, a plain request whose batch slot already holds its sampling
settings and this very page table: decode_rows) as plan.DecodeRows arrays, first; every other
request as a ScheduledChunk (step_rows.build_chunk), decode chunks before prefill chunks. A
scheduled chunk's tokens count as computed at once and its sample as pending (update()
confirms them when the step's results are in, one step later under async scheduling). Plain
Python: no jax, no scheduling decisions, no page accounting.
"""

from __future__ import annotations

import numpy as np

from jaxserve.core.page_manager import PageManager
from jaxserve.core.plan import DecodeRows, SamplingRow, StepPlan
from jaxserve.core.processor_slots import ProcessorSlots
from jaxserve.core.request import Request
from jaxserve.core.step_rows import build_chunk


class RowLayout:
    def __init__(self, pages: PageManager, processor_slots: ProcessorSlots):
        self.pages = pages
        self.processor_slots = processor_slots
        # request id -> the page table its batch slot's settings were last sent with: a decode
        # whose table is still that one (equal values) is a DecodeRows row
        self.sent_tables: dict[str, tuple[int, ...]] = {}

    def forget(self, request_id: str) -> None:
        """The request left its batch slot (finished, preempted) or got a new one: nothing
        of it is in a slot now."""
        self.sent_tables.pop(request_id, None)

    def prepare(self, request: Request, decode_rows: bool) -> None:
        """When a request is queued: the SamplingRow of its plain steps, whether that row is
        all its steps need (no logits processor, no prompt logprobs), and whether its decodes
        may be DecodeRows (decode_rows: the runner keeps each batch slot's settings and page
        table; plain rows, no top logprobs, no grammar)."""
        sp = request.sampling
        request.sampling_row = SamplingRow(sp.temperature, sp.top_k, sp.top_p, sp.min_p,
                                           request.seed, sp.top_logprobs)
        request.plain_rows = not sp.uses_processors and (sp.prompt_logprobs is None
                                                         or request.sample_index != 0)
        request.steady_rows = (decode_rows and request.plain_rows and not sp.top_logprobs
                               and sp.structured_outputs is None)

    def lay_out(self, plan: StepPlan, scheduled: list[tuple[Request, int]]) -> None:
        """plan.decode and plan.chunks from (request, tokens it computes this step)."""
        table_of, sent = self.pages.page_table_tuple, self.sent_tables
        ids, tables, rows, meta, chunk_rows = [], [], [], [], []
        for request, num_new in scheduled:  # (per request and step: plain locals)
            table = table_of(request.request_id)
            if num_new != 1 or not request.steady_rows or sent.get(request.request_id) != table:
                chunk_rows.append((request, num_new, table))
                continue
            start, pending = request.num_computed_tokens, request.num_pending_tokens
            outputs = request.output_token_ids
            ids.append(request.request_id)
            tables.append(table)
            rows.append(request.sampling_row)
            meta += (start, 0 if pending else outputs[-1] if outputs
                     else request.prompt_token_ids[-1], request.batch_slot, pending,
                     len(outputs) + pending)
            request.num_computed_tokens = start + 1
            request.num_pending_tokens = pending + 1
        plan.decode = DecodeRows(ids, tables, rows, np.array(meta, np.int64).reshape(-1, 5))
        chunk_rows.sort(key=lambda item: item[1] != 1)  # decode chunks first (a stable sort)
        chunks, drafts = plan.chunks, plan.drafts
        for request, num_new, table in chunk_rows:
            chunk = build_chunk(request, num_new, table, self.processor_slots,
                                drafts[request.request_id].token_ids
                                if request.request_id in drafts else ())
            chunks.append(chunk)
            request.num_computed_tokens += num_new  # being computed; update() confirms
            if chunk.sampling is not None:
                request.num_pending_tokens += 1
                if request.steady_rows:  # its slot gets its settings and this table
                    sent[request.request_id] = table
