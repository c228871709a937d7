"""build_spec_inputs: a StepPlan with draft rows laid out as SpecStepInputs for the verification
step (and, with a draft model, the draft's own view of the plan).

The verification rows of a request are its last real row and its draft rows; they get logits.
The layout reuses runner/prepare_inputs.py's build_step_inputs: `step` is the plan with each
request's draft rows appended to its tokens (ids from the plan, or 0 where the draft model fills
them in on the device), `draft` the plan as scheduled; both padded to the same (T, S) bucket.
Logit rows are a flat list of R = min(T, S*(k+1)) rows. Pure numpy; it must not import jax.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jaxserve.core.plan import StepPlan
from jaxserve.runner.prepare_inputs import build_step_inputs
from jaxserve.runner.buckets import BucketTable
from jaxserve.model.decoder.step_inputs import (DraftInputs, SpecStepInputs, StepInputs,
VerifyInputs,
                                  num_logit_rows)


def build_spec_inputs(plan: StepPlan, buckets: BucketTable, page_size: int,
                      num_speculative_tokens: int, with_draft_model: bool, tables,
                      mask_words: int = 1) -> SpecStepInputs:
    """tables: the runner's HostPageTables (runner/page_tables.py), which the plan's page-table
    changes update; mask_words: grammar bitmask words per row (the compiled width). A
    request's draft rows carry its own adapter's slot, so they are verified under it."""
    k = num_speculative_tokens
    num_rows = plan.num_tokens + plan.num_draft_tokens
    t, s = buckets.select(num_rows + plan.num_padding_rows, len(plan.chunks))
    chunks = []
    for c in plan.chunks:
        d = plan.drafts.get(c.request_id)
        extra = () if d is None else (d.token_ids or (0,) * d.num_tokens)
        chunks.append(dataclasses.replace(c, token_ids=c.token_ids + extra))
    step = build_step_inputs(plan, buckets, page_size, chunks=chunks, shape=(t, s),
                             mask_words=mask_words, tables=tables)
    if step.sampling.any_processors or step.sampling.any_top_logprobs:
        # The scheduler never speculates while such a request is in the engine.
        raise ValueError("a speculative step carries logits processors or top logprobs; the "
                         "verification does not compute them")
    r = num_logit_rows(t, s, k)
    step.model.logits_indices = np.zeros(r, np.int32)  # [R] verification rows (padding: 0)
    verify = VerifyInputs.empty(r, s, mask_words)
    draft = DraftInputs.empty(t, s, buckets.max_pages_per_request, k)
    row = 0
    for i, chunk in enumerate(plan.chunks):
        n = plan.num_drafts_of(chunk.request_id)
        draft.num_drafts[i] = n
        if chunk.sampling is None:
            continue
        last_real = int(step.attention.cu_q_lens[i + 1]) - n - 1  # the chunk's last real row
        step.model.logits_indices[row:row + n + 1] = np.arange(last_real, last_real + n + 1)
        verify.row_seq[row:row + n + 1] = i
        verify.row_j[row:row + n + 1] = np.arange(n + 1)
        if n and plan.drafts[chunk.request_id].token_ids:
            verify.row_draft[row:row + n] = plan.drafts[chunk.request_id].token_ids
        else:
            verify.row_device_draft[row:row + n] = True
        draft.draft_rows[i, :n] = np.arange(last_real + 1, last_real + n + 1)
        masks = (chunk.sampling.grammar_bitmask,) + chunk.sampling.grammar_draft_bitmasks
        for j, mask in enumerate(masks[:n + 1]):
            if mask is not None:
                verify.grammar_bitmask[row + j] = np.frombuffer(mask, np.int32)
                verify.has_grammar[row + j] = True
        row += n + 1
    verify.any_grammar[...] = bool(verify.has_grammar.any())
    if not with_draft_model:
        return SpecStepInputs(step, verify, None)
    scheduled = build_step_inputs(plan, buckets, page_size, shape=(t, s), mask_words=mask_words,
                                  tables=tables)
    draft.model, draft.attention = scheduled.model, scheduled.attention
    return SpecStepInputs(step, verify, draft)


def empty_spec_inputs(t: int, s: int, p: int, num_speculative_tokens: int,
                      with_draft_model: bool, mask_words: int = 1) -> SpecStepInputs:
    """All-padding inputs of bucket (t, s): what warm-up compiles, runs and times."""
    k, r = num_speculative_tokens, num_logit_rows(t, s, num_speculative_tokens)
    step = StepInputs.empty(t, s, p, mask_words)
    step.model.logits_indices = np.zeros(r, np.int32)
    draft = DraftInputs.empty(t, s, p, k) if with_draft_model else None
    return SpecStepInputs(step, VerifyInputs.empty(r, s, mask_words), draft)
