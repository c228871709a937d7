"""What one scheduled request's rows carry into a step, and what their results give back.

`build_chunk` lays out a request's next tokens as a ScheduledChunk: its sampling row (settings,
top-k logprobs, its logits-processor slot, its grammar's bitmask) when the chunk ends at the
request's last token, and
the prompt positions whose prompt logprobs the chunk reports. `prompt_logprob_entries` and
`top_logprob_pairs` read those rows' results. Plain Python for the scheduler: no jax, no
scheduling decisions, no page accounting.
"""

from __future__ import annotations

import numpy as np

from jaxserve.core.plan import PageUpdate, SamplingRow, ScheduledChunk
from jaxserve.core.processor_slots import ProcessorSlots
from jaxserve.core.request import Request


def build_chunk(request: Request, num_new: int, pages: PageUpdate | None,
                plain_row: SamplingRow | None, processor_slots: ProcessorSlots,
                drafts: tuple[int, ...] = (), adapter_slot: int = 0) -> ScheduledChunk:
    """The request's next num_new tokens, from num_computed_tokens on; pages: its page table's
    change since its row last got it (None: none); plain_row: its SamplingRow for life, when
    that is all its steps need (row_layout.py makes it when the request is queued; None: its
    SamplingParams are read). drafts: the host's
    proposals verified after them (speculative steps), which its grammar masks too;
    adapter_slot: its LoRA adapter's device slot (core/lora_slots.py; 0: none). Called
    per request and step: the common cases (a decode, no grammar) take the fewest steps."""
    start = request.num_computed_tokens
    end = start + num_new
    # (its SamplingParams are read only where its rows need more than plain_row)
    sp = None if plain_row is not None else request.sampling
    prompt, outputs = request.prompt_token_ids, request.output_token_ids
    num_prompt = len(prompt)
    known = num_prompt + len(outputs)  # the rest, to num_scheduled_tokens, is on the device
    sampling, output_index = None, 0
    if end == known + request.num_pending_tokens:
        output_index = len(outputs) + request.num_pending_tokens
        sampling = plain_row  # the request's own, for life (the usual case)
        if request.grammar is not None or sp is not None:  # settings of this step only
            sp = request.sampling
            mask, draft_masks = None, ()
            if request.grammar is not None:  # the tokens its grammar allows next, per draft
                from jaxserve.structured.matcher import fill_draft_rows
                rows = np.empty((len(drafts) + 1, request.grammar.num_words), np.int32)
                has = fill_draft_rows([(request.grammar, drafts, 0)], rows)
                masks = [row.tobytes() if ok else None for row, ok in zip(rows, has)]
                mask, draft_masks = masks[0], tuple(masks[1:])
            sampling = SamplingRow(sp.temperature, sp.top_k, sp.top_p, sp.min_p, request.seed,
                                   sp.top_logprobs,
                                   processor_slots.row(request) if sp.uses_processors else None,
                                   mask, draft_masks)
    k, first, nxt = 0, 0, ()
    if sp is not None and sp.prompt_logprobs is not None and request.sample_index == 0:
        # positions p < len(prompt) - 1 not reported yet (a recompute skips those that were)
        p0 = max(start, len(request.prompt_logprobs))
        p1 = min(end, num_prompt - 1)
        if p0 < p1:
            k, first = sp.prompt_logprobs, p0 - start
            nxt = tuple(prompt[p0 + 1:p1 + 1])
    if start >= known:  # a decode of the token the step in flight samples: a placeholder
        tokens = (0,) * num_new
    else:
        if end <= num_prompt:
            tokens = tuple(prompt[start:end])
        elif start >= num_prompt:
            tokens = tuple(outputs[start - num_prompt:end - num_prompt])
        else:
            tokens = tuple(prompt[start:]) + tuple(outputs[:end - num_prompt])
        if end > known:  # its last tokens: the step in flight samples them, placeholders
            tokens += (0,) * (end - known)
    return ScheduledChunk(request.request_id, tokens, start, pages, sampling, k,
                          first, nxt, end > known, output_index, adapter_slot)


def prompt_logprob_entries(chunk: ScheduledChunk, first_row: int,
                           prompt) -> list[dict[int, float]]:
    """{token id: logprob} per prompt position the chunk reported: the prompt token's own, then
    its k alternatives. first_row: the chunk's first row in the step; prompt: (ids, logprobs)
    [T, 1 + K] of every row (None when no chunk asked)."""
    if not chunk.prompt_logprob_next:
        return []
    start = first_row + chunk.prompt_logprob_first_row
    stop, k = start + len(chunk.prompt_logprob_next), chunk.prompt_logprobs
    entries = []
    for token, ids, lps in zip(chunk.prompt_logprob_next, prompt[0][start:stop],
                               prompt[1][start:stop]):
        entry = {token: float(lps[0])}
        entry.update(zip(ids[1:1 + k].tolist(), lps[1:1 + k].tolist()))
        entries.append(entry)
    return entries


def top_logprob_pairs(chunk: ScheduledChunk, top_ids, top_logprobs, row: int,
                      new_tokens) -> tuple:
    """The sampled token's k = sampling.top_logprobs alternatives as ((id, logprob), ...),
    best first, for the event; () when it asked for none, sampled nothing, or the step
    reports none (steps that verify drafts). top_ids / top_logprobs: the step's [S, K]
    results, the chunk's at `row`."""
    k = chunk.sampling.top_logprobs
    if top_ids is None or not new_tokens or not k:
        return ()
    return (tuple(zip(top_ids[row][:k].tolist(), top_logprobs[row][:k].tolist())),)
