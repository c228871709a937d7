"""HostBatch: a StepPlan laid out as fixed-shape numpy arrays, padded to a bucket.

Pure numpy; it must not import jax. The runner copies these arrays to the device as one
transfer per array. Padding rows write their K/V into reserved page 0 and sample nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from jaxserve.plan import StepPlan
from jaxserve.runner.buckets import BucketTable


@dataclass
class HostBatch:
    token_ids: np.ndarray       # [T] i32
    positions: np.ndarray       # [T] i32
    slot_mapping: np.ndarray    # [T] i32
    cu_q_lens: np.ndarray       # [S+1] i32
    kv_lens: np.ndarray         # [S] i32
    page_table: np.ndarray      # [S, P] i32
    num_seqs: np.ndarray        # [] i32
    logits_indices: np.ndarray  # [S] i32 last row of each request
    temperature: np.ndarray     # [S] f32 (0 = greedy)
    top_k: np.ndarray           # [S] i32 (0 = off)
    top_p: np.ndarray           # [S] f32
    min_p: np.ndarray           # [S] f32
    seeds: np.ndarray           # [S] u32
    output_index: np.ndarray    # [S] i32
    any_sampling: np.ndarray    # [] bool: False lets the step skip the sort for top-k/top-p

    @property
    def shape(self) -> tuple[int, int]:
        return self.token_ids.shape[0], self.kv_lens.shape[0]

    def model_inputs(self) -> tuple[np.ndarray, ...]:
        return (self.token_ids, self.positions, self.slot_mapping, self.cu_q_lens, self.kv_lens,
                self.page_table, self.num_seqs, self.logits_indices)

    def sampling_inputs(self) -> tuple[np.ndarray, ...]:
        return (self.temperature, self.top_k, self.top_p, self.min_p, self.seeds,
                self.output_index, self.any_sampling)


def build_host_batch(plan: StepPlan, buckets: BucketTable, page_size: int) -> HostBatch:
    num_tokens = plan.num_tokens + plan.num_padding_rows
    num_seqs = len(plan.chunks)
    finished_slots = plan.num_finished_slots if plan.chunks else 0  # static batching only
    t, s = buckets.select(num_tokens, num_seqs + finished_slots)
    p = buckets.max_pages_per_request
    b = empty_host_batch(t, s, p)
    row = 0
    for i, chunk in enumerate(plan.chunks):
        n = chunk.num_tokens
        pos = np.arange(chunk.start_position, chunk.kv_len, dtype=np.int32)
        table = np.asarray(chunk.page_table, dtype=np.int32)
        if len(table) > p or len(table) * page_size < chunk.kv_len:
            raise ValueError(f"request {chunk.request_id}: {len(table)} pages for "
                             f"{chunk.kv_len} tokens (page-table width {p})")
        b.token_ids[row:row + n] = chunk.token_ids
        b.positions[row:row + n] = pos
        b.slot_mapping[row:row + n] = table[pos // page_size] * page_size + pos % page_size
        b.page_table[i, :len(table)] = table
        b.kv_lens[i] = chunk.kv_len
        b.cu_q_lens[i + 1] = row + n
        b.logits_indices[i] = row + n - 1
        if chunk.sampling is not None:
            sr = chunk.sampling
            b.temperature[i], b.top_k[i], b.top_p[i], b.min_p[i] = (
                sr.temperature, sr.top_k, sr.top_p, sr.min_p)
            b.seeds[i], b.output_index[i] = sr.seed, sr.output_index
        row += n
    if finished_slots:
        row = _fill_finished_slots(b, plan, num_seqs, row, finished_slots)
        num_seqs += finished_slots
    b.cu_q_lens[num_seqs + 1:] = row
    b.num_seqs[...] = num_seqs
    b.any_sampling[...] = bool(np.any(b.temperature[:num_seqs] > 0))
    return b


def _fill_finished_slots(b: HostBatch, plan: StepPlan, first: int, row: int, count: int) -> int:
    """Static batching: a finished member's slot is a decode row over the longest member's
    pages (read only); its own K/V goes to scratch page 0 and nothing samples it. Returns the
    next free row."""
    longest = max(plan.chunks, key=lambda c: c.kv_len)
    table = np.asarray(longest.page_table, dtype=np.int32)
    for i in range(first, first + count):
        b.positions[row] = longest.kv_len - 1
        b.page_table[i, :len(table)] = table
        b.kv_lens[i] = longest.kv_len
        b.cu_q_lens[i + 1] = row + 1
        b.logits_indices[i] = row
        row += 1
    return row


def empty_host_batch(t: int, s: int, p: int) -> HostBatch:
    """All-padding batch of bucket (t, s): also what warm-up compiles and runs."""
    return HostBatch(
        token_ids=np.zeros(t, np.int32), positions=np.zeros(t, np.int32),
        slot_mapping=np.zeros(t, np.int32), cu_q_lens=np.zeros(s + 1, np.int32),
        kv_lens=np.zeros(s, np.int32), page_table=np.zeros((s, p), np.int32),
        num_seqs=np.zeros((), np.int32), logits_indices=np.zeros(s, np.int32),
        temperature=np.zeros(s, np.float32), top_k=np.zeros(s, np.int32),
        top_p=np.ones(s, np.float32), min_p=np.zeros(s, np.float32),
        seeds=np.zeros(s, np.uint32), output_index=np.zeros(s, np.int32),
        any_sampling=np.zeros((), np.bool_))
