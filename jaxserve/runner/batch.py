"""A StepPlan laid out as the step's input dataclasses (step_inputs.py), padded to a bucket.

Pure numpy; it must not import jax. Built once per step; the runner hands the whole StepInputs
to the compiled step (one transfer per array). Padding rows write their K/V into reserved page
0 and sample nothing. Decode rows come first (the scheduler orders them so), and
num_decode_seqs says where they end.
"""

from __future__ import annotations

import numpy as np

from jaxserve.plan import ProcessorRow, ScheduledChunk, StepPlan
from jaxserve.runner.buckets import BucketTable
from jaxserve.step_inputs import SamplingInputs, StepInputs


def build_step_inputs(plan: StepPlan, buckets: BucketTable, page_size: int,
                      chunks: list[ScheduledChunk] | None = None,
                      shape: tuple[int, int] | None = None, mask_words: int = 1) -> StepInputs:
    """chunks: the rows to lay out (default plan.chunks; speculation passes them with their
    draft rows appended); shape: a fixed (T, S) bucket instead of the smallest that fits;
    mask_words: grammar bitmask words per row (the step's compiled width)."""
    chunks = plan.chunks if chunks is None else chunks
    padding = plan.static_padding if plan.chunks else None
    num_finished = 0 if padding is None else padding.num_finished_slots
    num_rows = sum(c.num_tokens for c in chunks) + plan.num_padding_rows
    t, s = shape or buckets.select(num_rows, len(chunks) + num_finished)
    p = buckets.max_pages_per_request
    b = StepInputs.empty(t, s, p, mask_words)
    m, a, sp = b.model, b.attention, b.sampling
    row, any_processors, any_top, any_prompt = 0, False, False, False
    for i, chunk in enumerate(chunks):
        n = chunk.num_tokens
        pos = np.arange(chunk.start_position, chunk.kv_len, dtype=np.int32)
        table = np.asarray(chunk.page_table, dtype=np.int32)
        if len(table) > p or len(table) * page_size < chunk.kv_len:
            raise ValueError(f"request {chunk.request_id}: {len(table)} pages for "
                             f"{chunk.kv_len} tokens (page-table width {p})")
        m.token_ids[row:row + n] = chunk.token_ids
        if chunk.token_on_device:  # its last token: the step before sampled it, on the device
            m.token_slots[row + n - 1] = chunk.batch_slot
        m.positions[row:row + n] = pos
        m.slot_mapping[row:row + n] = table[pos // page_size] * page_size + pos % page_size
        m.logits_indices[i] = row + n - 1
        a.page_table[i, :len(table)] = table
        a.kv_lens[i] = chunk.kv_len
        a.cu_q_lens[i + 1] = row + n
        if chunk.sampling is not None:
            sr = chunk.sampling
            sp.temperature[i], sp.top_k[i], sp.top_p[i], sp.min_p[i] = (
                sr.temperature, sr.top_k, sr.top_p, sr.min_p)
            sp.seeds[i], sp.output_index[i] = sr.seed, sr.output_index
            sp.sample_slots[i] = chunk.batch_slot
            any_top |= sr.top_logprobs > 0
            if sr.processors is not None:
                _fill_processors(sp, i, sr.processors)
                any_processors = True
            if sr.grammar_bitmask is not None:
                sp.grammar_bitmask[i] = np.frombuffer(sr.grammar_bitmask, np.int32)
                sp.has_grammar[i] = True
        if chunk.prompt_logprob_next:
            first = row + chunk.prompt_logprob_first_row
            sp.prompt_next_token[first:first + len(chunk.prompt_logprob_next)] = \
                chunk.prompt_logprob_next
            any_prompt = True
        row += n
    num_seqs = len(chunks)
    a.num_decode_seqs[...] = next((i for i, c in enumerate(chunks) if c.num_tokens != 1),
                                  num_seqs)
    if num_finished:
        row = _fill_finished_slots(b, chunks, num_seqs, row, num_finished)
        num_seqs += num_finished
    a.cu_q_lens[num_seqs + 1:] = row
    a.num_seqs[...] = num_seqs
    sp.any_sampling[...] = bool(np.any(sp.temperature[:num_seqs] > 0))
    sp.any_processors[...] = any_processors
    sp.any_top_logprobs[...] = any_top
    sp.any_prompt_logprobs[...] = any_prompt
    sp.any_grammar[...] = bool(sp.has_grammar.any())
    return b


def _fill_processors(sp: SamplingInputs, i: int, pr: ProcessorRow) -> None:
    sp.processor_slot[i] = pr.slot
    sp.presence_penalty[i], sp.frequency_penalty[i] = pr.presence_penalty, pr.frequency_penalty
    sp.repetition_penalty[i], sp.suppress_stop[i] = pr.repetition_penalty, pr.suppress_stop
    sp.banned[i, :len(pr.banned)] = pr.banned


def _fill_finished_slots(b: StepInputs, chunks: list[ScheduledChunk], first: int, row: int,
                         count: int) -> int:
    """Static batching: a finished member's slot is a decode row over the longest member's
    pages (read only); its own K/V goes to scratch page 0 and nothing samples it. Returns the
    next free row."""
    longest = max(chunks, key=lambda c: c.kv_len)
    table = np.asarray(longest.page_table, dtype=np.int32)
    a = b.attention
    for i in range(first, first + count):
        b.model.positions[row] = longest.kv_len - 1
        b.model.logits_indices[i] = row
        a.page_table[i, :len(table)] = table
        a.kv_lens[i] = longest.kv_len
        a.cu_q_lens[i + 1] = row + 1
        row += 1
    return row
