"""The compiled functions of speculative steps: verify (target forward over a ragged batch that
includes draft rows, logits at every verification row, acceptance), the same preceded by the
draft model's proposal passes, and the draft model's sync pass for steps that do not speculate.

Each returns one packed [2, S, k+1] i32 array (tokens, logprob bits; -1 after each request's
accepted run) so a step costs one device-to-host copy, and the KV caches, which are donated.
Pure functions of their arguments: weights come in as state, nothing is closed over.
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from jaxserve.model.llama import StepInputs
from jaxserve.spec import draft, rejection


def _verify(graphdef, attention_fn, k, state, kv, token_ids, positions, slot_mapping,
            cu_q_lens, kv_lens, page_table, num_seqs, logits_indices, row_seq, row_j,
            row_draft, draft_probs, sampling):
    temperature, top_k, top_p, min_p, seeds, output_index, any_sampling = sampling
    num_req = kv_lens.shape[0]
    model = nnx.merge(graphdef, state)
    inputs = StepInputs(token_ids, positions, slot_mapping, cu_q_lens, kv_lens, page_table,
                        num_seqs, logits_indices)
    logits, kv = model(inputs, kv, attention_fn)  # [R, V]
    seq = jnp.minimum(row_seq, num_req - 1)  # padding rows borrow request 0's settings
    accepted, tokens, logprobs = rejection.verify_rows(
        logits, row_draft, draft_probs, temperature[seq], top_k[seq], top_p[seq], min_p[seq],
        seeds[seq], output_index[seq] + row_j, any_sampling)
    packed = rejection.accepted_runs(accepted, tokens, logprobs, row_seq, row_j, num_req, k + 1)
    return packed, kv


def ngram_step(graphdef, attention_fn, k, state, kv, token_ids, positions, slot_mapping,
               cu_q_lens, kv_lens, page_table, num_seqs, logits_indices, row_seq, row_j,
               row_draft, row_device_draft, *sampling):
    """Verify host-proposed drafts (q one-hot). Returns (packed [2, S, k+1], kv)."""
    del row_device_draft  # every draft came from the host
    return _verify(graphdef, attention_fn, k, state, kv, token_ids, positions, slot_mapping,
                   cu_q_lens, kv_lens, page_table, num_seqs, logits_indices, row_seq, row_j,
                   row_draft, None, sampling)


def draft_model_step(graphdef, draft_graphdef, attention_fn, k, state, kv, draft_state,
                     draft_kv, token_ids, positions, slot_mapping, cu_q_lens, kv_lens,
                     page_table, num_seqs, logits_indices, row_seq, row_j, row_draft,
                     row_device_draft, sync_token_ids, sync_positions, sync_slot_mapping,
                     sync_cu_q_lens, sync_kv_lens, sync_logits_indices, draft_rows, num_drafts,
                     *sampling):
    """Draft passes, then verification of their proposals.

    draft_kv None: the draft is the target's first layers and works in the target's own cache
    (its K/V there are the target's; the verification rewrites every slot it wrote).
    Returns (packed [2, S, k+1], kv, draft_kv)."""
    temperature, top_k, top_p, min_p, seeds, output_index, any_sampling = sampling
    draft_model = nnx.merge(draft_graphdef, draft_state)
    sync = StepInputs(sync_token_ids, sync_positions, sync_slot_mapping, sync_cu_q_lens,
                      sync_kv_lens, page_table, num_seqs, sync_logits_indices)
    drafts, q, cache = draft.propose(draft_model, attention_fn,
                                     kv if draft_kv is None else draft_kv, sync, num_drafts, k,
                                     temperature, top_k, top_p, min_p, seeds, output_index,
                                     any_sampling)  # [S, k], [S, k, V]
    if draft_kv is None:
        kv = cache
    else:
        draft_kv = cache
    # The proposals take their places among the target's rows and in the verification rows.
    token_ids = token_ids.at[draft_rows.reshape(-1)].set(drafts.reshape(-1), mode="drop")
    num_req = kv_lens.shape[0]
    seq = jnp.minimum(row_seq, num_req - 1)
    j = jnp.minimum(row_j, k - 1)
    row_draft = jnp.where(row_device_draft, drafts[seq, j], row_draft)
    draft_probs = q[seq, j]  # [R, V]; bonus rows ignore theirs
    packed, kv = _verify(graphdef, attention_fn, k, state, kv, token_ids, positions,
                         slot_mapping, cu_q_lens, kv_lens, page_table, num_seqs, logits_indices,
                         row_seq, row_j, row_draft, draft_probs, sampling)
    return packed, kv, draft_kv


def draft_sync_step(draft_graphdef, attention_fn, draft_state, draft_kv, token_ids, positions,
                    slot_mapping, cu_q_lens, kv_lens, page_table, num_seqs):
    """The draft model writes the K/V of a plain step's tokens; no logits. Returns draft_kv."""
    model = nnx.merge(draft_graphdef, draft_state)
    inputs = StepInputs(token_ids, positions, slot_mapping, cu_q_lens, kv_lens, page_table,
                        num_seqs, jnp.zeros((0,), jnp.int32))
    _, draft_kv = model(inputs, draft_kv, attention_fn)
    return draft_kv
