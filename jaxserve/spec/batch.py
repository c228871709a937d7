"""SpecBatch: a StepPlan with draft rows laid out as fixed-shape numpy arrays for the
verification step (and, with a draft model, for its sync pass).

The verification rows of a request are its last real row and its draft rows; they get logits.
The layout reuses runner.batch.build_host_batch: `verify` is the plan with each chunk's draft
rows appended to its tokens (ids from the plan, or 0 where the draft model fills them in on the
device), `sync` the plan as scheduled; both padded to the same (T, S) bucket. Logit rows are a
flat list of R = min(T, S*(k+1)) rows. Pure numpy; it must not import jax.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from jaxserve.plan import StepPlan
from jaxserve.runner.batch import HostBatch, build_host_batch, empty_host_batch
from jaxserve.runner.buckets import BucketTable


@dataclass
class SpecBatch:
    verify: HostBatch          # chunks with their draft rows
    sync: HostBatch            # chunks without draft rows (the draft model's sync pass)
    logits_indices: np.ndarray  # [R] i32 verification rows (padding: row 0)
    row_seq: np.ndarray        # [R] i32 request of each row (padding: S, dropped)
    row_j: np.ndarray          # [R] i32 index of the row within its request's rows
    row_draft: np.ndarray      # [R] i32 draft verified at the row (-1: none or device-proposed)
    row_device_draft: np.ndarray  # [R] bool: the draft model proposes this row's draft
    draft_rows: np.ndarray     # [S, k] i32 verify rows that hold draft tokens (padding: T)
    num_drafts: np.ndarray     # [S] i32 draft rows per request

    @property
    def shape(self) -> tuple[int, int]:
        return self.verify.shape

    def verify_inputs(self) -> tuple[np.ndarray, ...]:
        v = self.verify
        return (v.token_ids, v.positions, v.slot_mapping, v.cu_q_lens, v.kv_lens, v.page_table,
                v.num_seqs, self.logits_indices, self.row_seq, self.row_j, self.row_draft,
                self.row_device_draft)

    def sampling_inputs(self) -> tuple[np.ndarray, ...]:
        return self.verify.sampling_inputs()

    def draft_inputs(self) -> tuple[np.ndarray, ...]:
        s = self.sync
        return (s.token_ids, s.positions, s.slot_mapping, s.cu_q_lens, s.kv_lens,
                s.logits_indices, self.draft_rows, self.num_drafts)


def num_logit_rows(t: int, s: int, num_speculative_tokens: int) -> int:
    return min(t, s * (num_speculative_tokens + 1))


def build_spec_batch(plan: StepPlan, buckets: BucketTable, page_size: int,
                     num_speculative_tokens: int) -> SpecBatch:
    k = num_speculative_tokens
    num_rows = plan.num_tokens + sum(c.num_draft_tokens for c in plan.chunks)
    t, s = buckets.select(num_rows + plan.num_padding_rows, len(plan.chunks))
    fixed = BucketTable((t,), (s,), buckets.max_pages_per_request)
    chunks = [dataclasses.replace(c, token_ids=c.token_ids + (c.draft_token_ids or
                                                              (0,) * c.num_draft_tokens))
              for c in plan.chunks]
    verify = build_host_batch(dataclasses.replace(plan, chunks=chunks), fixed, page_size)
    sync = build_host_batch(plan, fixed, page_size)
    r = num_logit_rows(t, s, k)
    b = SpecBatch(verify, sync, np.zeros(r, np.int32), np.full(r, s, np.int32),
                  np.zeros(r, np.int32), np.full(r, -1, np.int32), np.zeros(r, np.bool_),
                  np.full((s, k), t, np.int32), np.zeros(s, np.int32))
    row = 0
    for i, chunk in enumerate(plan.chunks):
        n = chunk.num_draft_tokens
        b.num_drafts[i] = n
        if chunk.sampling is None:
            continue
        last_real = int(verify.cu_q_lens[i + 1]) - n - 1  # row of the chunk's last real token
        b.logits_indices[row:row + n + 1] = np.arange(last_real, last_real + n + 1)
        b.row_seq[row:row + n + 1] = i
        b.row_j[row:row + n + 1] = np.arange(n + 1)
        if chunk.draft_token_ids:
            b.row_draft[row:row + n] = chunk.draft_token_ids
        else:
            b.row_device_draft[row:row + n] = True
        b.draft_rows[i, :n] = np.arange(last_real + 1, last_real + n + 1)
        row += n + 1
    return b


def empty_spec_batch(t: int, s: int, p: int, num_speculative_tokens: int) -> SpecBatch:
    """All-padding batch of bucket (t, s): what warm-up compiles, runs and times."""
    k, r = num_speculative_tokens, num_logit_rows(t, s, num_speculative_tokens)
    return SpecBatch(empty_host_batch(t, s, p), empty_host_batch(t, s, p),
                     np.zeros(r, np.int32), np.full(r, s, np.int32), np.zeros(r, np.int32),
                     np.full(r, -1, np.int32), np.zeros(r, np.bool_),
                     np.full((s, k), t, np.int32), np.zeros(s, np.int32))
