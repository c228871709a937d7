"""build_step_inputs: a StepPlan laid out as its step's inputs (step_inputs.py), bucket-padded.

Pure numpy; it must not import jax (so it never imports runner/input_batch.py: the runner's
InputBatch comes in as an argument, and the layout updates its host rows from the plan). Built
once per step; the model runner lays its steps out in one buffer (step_layout.py: the fields
are views of it, one transfer per step), the speculative runner as separate arrays (one
transfer per array). Padding rows write their K/V into reserved page 0 and sample nothing.
Decode rows come first (the scheduler orders them so: plan.decode's, then the decode chunks),
and num_decode_seqs says where they end. plan.decode's rows are laid out from its arrays (their
slots' page tables and settings are already the InputBatch's). Each request's slot is the
runner's (runner/batch_rows.py, kept with the host page tables): the layout frees those of
plan.released, then gives each request new to the batch a free one.
"""

from __future__ import annotations

import numpy as np

from jaxserve.core.plan import ProcessorRow, ScheduledChunk, StepPlan
from jaxserve.runner.buckets import BucketTable
from jaxserve.model.decoder.step_inputs import SamplingInputs, StepInputs
from jaxserve.model.decoder.step_layout import PackedStepInputs, StepLayout


def build_step_inputs(plan: StepPlan, buckets: BucketTable, page_size: int,
                      chunks: list[ScheduledChunk] | None = None,
                      shape: tuple[int, int] | None = None, mask_words: int = 1,
                      batch=None, layouts: dict[tuple[int, int], StepLayout] | None = None,
                      tables=None) -> StepInputs | PackedStepInputs:
    """chunks: the rows to lay out (default plan.chunks; speculation passes them with their
    draft rows appended); shape: a fixed (T, S) bucket instead of the smallest that fits;
    mask_words: grammar bitmask words per row (the step's compiled width); batch: the runner's
    InputBatch (runner/input_batch.py), whose host page tables and sampling rows the plan
    updates: the step then carries each request's slot and only the table rows the device
    lacks (StepInputs.tables; batch.host_tables.changed lists them all) and gathers its
    settings by slot; tables: without batch, the runner's HostPageTables
    (runner/page_tables.py), whose rows the plan updates and each request's table is copied
    from, each row's settings written; layouts: one buffer layout per bucket (step_layout.py;
    with batch): the result is then a PackedStepInputs whose `views` were filled, its
    grammar_bitmask None when no row has a grammar. Every row carries its request's LoRA
    adapter slot (every row of a chunk, draft rows included, its request's; 0: none), which a
    step without adapter stacks never reads."""
    chunks = plan.chunks if chunks is None else chunks
    host = batch.host_tables if batch is not None else tables
    if host is None:
        raise ValueError("build_step_inputs needs the runner's page tables (batch= or tables=)")
    padding = plan.static_padding if plan.chunks or plan.decode else None
    num_finished = 0 if padding is None else padding.num_finished_slots
    num_steady = plan.num_decode_rows
    num_seqs = num_steady + len(chunks)
    # every chunk's scalars in one pass: start, tokens, pages (below), row (below), token on
    # device, first token, prompt-logprob rows, output index, samples, LoRA slot [n, 10] (per
    # request and step)
    meta = np.array([(c.start_position, len(c.token_ids), 0, 0, c.token_on_device,
                      c.token_ids[0], len(c.prompt_logprob_next), c.output_index,
                      c.sampling is not None, c.lora_slot)
                     for c in chunks], np.int64).reshape(len(chunks), 10)
    if num_steady:  # the same scalars of plan.decode's rows, before the chunks'
        if batch is None:
            raise ValueError("plan.decode rows need the runner's InputBatch (batch=)")
        meta = np.concatenate([_steady_meta(plan.decode), meta])
    host.rows.release(plan)  # (before any request new to the batch takes a row)
    ids = [c.request_id for c in chunks]
    meta[:, 3] = host.rows.rows(plan.decode.request_ids + ids if num_steady else ids)
    slots = meta[:, 3].astype(np.int32)
    host.apply_all(chunks, slots[num_steady:].tolist())
    meta[:, 2] = host.lengths[slots]
    starts, lens, num_pages = meta[:, 0], meta[:, 1], meta[:, 2]
    kv_lens = starts + lens
    num_rows = int(lens.sum()) + plan.num_padding_rows
    t, s = shape or buckets.select(num_rows, num_seqs + num_finished)
    p = buckets.max_pages_per_request
    if layouts is None:
        packed, b = None, StepInputs.empty(t, s, p, mask_words, device_tables=batch is not None)
    else:
        packed = layouts[t, s].new(with_bitmask=False)  # made below if a row has a grammar
        b = packed.views
    longer = np.flatnonzero(lens != 1)
    num_decode = int(longer[0]) if longer.size else num_seqs  # decode rows come first
    bad = np.flatnonzero(num_pages * page_size < kv_lens)
    if bad.size:
        i = int(bad[0])
        rid = plan.decode.request_ids[i] if i < num_steady else chunks[i - num_steady].request_id
        raise ValueError(f"request {rid}: {int(num_pages[i])} pages for {int(kv_lens[i])} "
                         f"tokens")
    if batch is None:
        _layout_rows(b, chunks, 0, 0, page_size, host.tables, slots, copy_tables=True)
    else:
        _layout_with_slots(b, chunks, meta, slots, num_decode, page_size, host, num_steady)
    _fill_sampling(b, chunks, meta, slots, None if batch is None else batch.sampling,
                   mask_words, num_steady)
    # (a request's rows are contiguous, in meta's order)
    b.model.adapter_slots[:int(lens.sum())] = np.repeat(meta[:, 9], lens)
    a = b.attention
    row = int(a.cu_q_lens[num_seqs])
    a.num_decode_seqs[...] = num_decode
    if num_finished:
        row = _fill_finished_slots(b, chunks, num_seqs, row, num_finished, slots, host.tables)
        num_seqs += num_finished
    a.cu_q_lens[num_seqs + 1:] = row
    a.num_seqs[...] = num_seqs
    if packed is None:
        return b
    packed.grammar_bitmask = b.sampling.grammar_bitmask  # None: no row has a grammar
    return packed


# SamplingInputs field <- SamplingRow field (HostSamplingRows names its arrays as the former)
_SETTINGS = (("temperature", "temperature"), ("top_k", "top_k"), ("top_p", "top_p"),
             ("min_p", "min_p"), ("seeds", "seed"))


def _steady_meta(decode) -> np.ndarray:
    """build_step_inputs' per-chunk scalars of plan.decode's rows, from its arrays."""
    d, meta = decode.meta, np.empty((len(decode.meta), 10), np.int64)
    meta[:, 0], meta[:, 1], meta[:, 2] = d[:, decode.POSITION], 1, 0
    meta[:, 3], meta[:, 4] = 0, d[:, decode.ON_DEVICE]
    meta[:, 5], meta[:, 6] = d[:, decode.TOKEN], 0
    meta[:, 7], meta[:, 8] = d[:, decode.OUTPUT_INDEX], 1
    meta[:, 9] = d[:, decode.LORA_SLOT]
    return meta


def _layout_with_slots(b: StepInputs, chunks, meta: np.ndarray, slots: np.ndarray,
                       num_decode: int, page_size: int, tables, num_steady: int) -> None:
    """Page tables from the slots' persistent rows (tables: the InputBatch's HostPageTables,
    this plan's updates applied; b.tables: the rows of this step's slots the device lacks, the
    first num_table_updates of them; tables.changed lists them all); the decode rows in one
    go each field, from meta (build_step_inputs' per-chunk scalars; the first num_steady rows
    plan.decode's)."""
    m, a = b.model, b.attention
    n = len(meta)
    tables.changed = tables.take_stale(slots)
    t = b.tables
    t.slots[:n] = slots
    sent = tables.changed[:len(t.update_slots)]
    t.update_slots[:len(sent)] = sent
    t.update_rows[:len(sent)] = tables.tables[sent]
    if num_decode:
        d = meta[:num_decode]
        pos = d[:, 0]
        m.token_ids[:num_decode] = d[:, 5]
        m.positions[:num_decode] = pos
        pages = tables.tables[slots[:num_decode], pos // page_size]
        m.slot_mapping[:num_decode] = pages * page_size + pos % page_size
        m.logits_indices[:num_decode] = np.arange(num_decode, dtype=np.int32)
        m.token_slots[:num_decode] = np.where(d[:, 4] != 0, d[:, 3], 0)
        a.kv_lens[:num_decode] = pos + 1
        a.cu_q_lens[1:num_decode + 1] = np.arange(1, num_decode + 1, dtype=np.int32)
    _layout_rows(b, chunks, num_decode, num_decode, page_size, tables.tables, slots,
                 copy_tables=False, offset=num_steady)


def _layout_rows(b: StepInputs, chunks, first: int, row: int, page_size: int,
                 tables: np.ndarray, slots: np.ndarray, copy_tables: bool,
                 offset: int = 0) -> None:
    """Requests from `first` on, one at a time, their rows from `row` on (request i is
    chunks[i - offset], its page table tables[slots[i]])."""
    m, a = b.model, b.attention
    for i in range(first, offset + len(chunks)):
        chunk = chunks[i - offset]
        n = chunk.num_tokens
        pos = np.arange(chunk.start_position, chunk.kv_len, dtype=np.int32)
        table = tables[slots[i]]
        m.token_ids[row:row + n] = chunk.token_ids
        if chunk.token_on_device:  # its last token: the step before sampled it, on the device
            m.token_slots[row + n - 1] = slots[i]
        m.positions[row:row + n] = pos
        m.slot_mapping[row:row + n] = table[pos // page_size] * page_size + pos % page_size
        m.logits_indices[i] = row + n - 1
        if copy_tables:
            a.page_table[i] = table
        a.kv_lens[i] = chunk.kv_len
        a.cu_q_lens[i + 1] = row + n
        row += n


def _fill_sampling(b: StepInputs, chunks, meta: np.ndarray, slots: np.ndarray | None,
                   samplers, mask_words: int, num_steady: int) -> None:
    """Each sampling row's settings, gathered by slot from the persistent rows (samplers: the
    InputBatch's HostSamplingRows, with slots; plan.decode's first num_steady rows are in their
    slots already; None: each row's own are written); processors, grammars and prompt logprobs
    (rare) row by row."""
    sp = b.sampling
    any_top = any_processors = any_prompt = False
    rows = [c.sampling for c in chunks]  # (request i's: rows[i - num_steady])
    if samplers is not None:
        samplers.store(slots[num_steady:].tolist(), rows)
    index = np.flatnonzero(meta[:, 8])
    if index.size:
        at = slice(0, index.size) if index[-1] == index.size - 1 else index  # 0..k-1: usual
        if samplers is None:  # (so no plan.decode rows: row i is rows[i])
            own = [rows[i] for i in index.tolist()]
            for name, field in _SETTINGS:
                getattr(sp, name)[at] = [getattr(r, field) for r in own]
            any_top = any(r.top_logprobs for r in own)
            special = [i for i, r in zip(index.tolist(), own)
                       if r.processors is not None or r.grammar_bitmask is not None]
        else:
            by_slot = slots[index]
            for name, _ in _SETTINGS:
                getattr(sp, name)[at] = getattr(samplers, name)[by_slot]
            any_top = bool(samplers.top_logprobs[by_slot].any())
            special = index[samplers.special[by_slot]].tolist()
        sp.output_index[at] = meta[index, 7]
        sp.sample_slots[at] = meta[index, 3]
        for i in special:
            sr = rows[i - num_steady]  # (never a plan.decode row: those are plain)
            if sr.processors is not None:
                _fill_processors(sp, i, sr.processors)
                any_processors = True
            if sr.grammar_bitmask is not None:
                if sp.grammar_bitmask is None:  # (a packed layout's: made on first use)
                    sp.grammar_bitmask = np.full((len(sp.temperature), mask_words), -1, np.int32)
                sp.grammar_bitmask[i] = np.frombuffer(sr.grammar_bitmask, np.int32)
                sp.has_grammar[i] = True
    row = num_steady
    for chunk in chunks if meta[:, 6].any() else ():
        if chunk.prompt_logprob_next:
            first = row + chunk.prompt_logprob_first_row
            sp.prompt_next_token[first:first + len(chunk.prompt_logprob_next)] = \
                chunk.prompt_logprob_next
            any_prompt = True
        row += len(chunk.token_ids)
    sp.any_sampling[...] = bool(np.any(sp.temperature > 0))
    sp.any_processors[...] = any_processors
    sp.any_top_logprobs[...] = any_top
    sp.any_prompt_logprobs[...] = any_prompt
    sp.any_grammar[...] = bool(sp.has_grammar.any())


def _fill_processors(sp: SamplingInputs, i: int, pr: ProcessorRow) -> None:
    sp.processor_slot[i] = pr.slot
    sp.presence_penalty[i], sp.frequency_penalty[i] = pr.presence_penalty, pr.frequency_penalty
    sp.repetition_penalty[i], sp.suppress_stop[i] = pr.repetition_penalty, pr.suppress_stop
    sp.banned[i, :len(pr.banned)] = pr.banned


def _fill_finished_slots(b: StepInputs, chunks: list[ScheduledChunk], first: int, row: int,
                         count: int, slots: np.ndarray, tables: np.ndarray) -> int:
    """Static batching: a finished member's slot is a decode row over the longest member's
    pages (read only); its own K/V goes to scratch page 0 and nothing samples it. slots: each
    chunk's table slot (device tables: the row reads the longest's); tables: the host's rows.
    Returns the next free row."""
    longest = max(range(len(chunks)), key=lambda i: chunks[i].kv_len)
    a = b.attention
    for i in range(first, first + count):
        b.model.positions[row] = chunks[longest].kv_len - 1
        b.model.logits_indices[i] = row
        if b.tables is not None:
            b.tables.slots[i] = slots[longest]
        else:
            a.page_table[i] = tables[slots[longest]]
        a.kv_lens[i] = chunks[longest].kv_len
        a.cu_q_lens[i + 1] = row + 1
        row += 1
    return row
