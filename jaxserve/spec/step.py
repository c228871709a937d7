"""The compiled functions of speculative steps, each `fn(state, kv, inputs) -> (out, kv)`:
verify (target forward over a ragged batch that includes draft rows, logits at every
verification row, acceptance), the same preceded by the draft model's proposal passes, and the
draft model's sync pass for steps that do not speculate.

Verification returns one packed [2, S, k+1] i32 array (tokens, logprob bits; -1 after each
request's accepted run) so a step costs one device-to-host copy, and the KV caches, which are
donated. Pure functions of their arguments: weights come in as state, nothing is closed over
but the graph definitions, attention backends and static sizes bound with functools.partial.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from flax import nnx

from jaxserve.model.decoder.lora import Adapters
from jaxserve.runner.grammar_mask import maybe_apply_bitmask
from jaxserve.spec import draft, rejection
from jaxserve.model.decoder.step_inputs import SpecStepInputs, StepInputs, VerifyInputs


def _verify(graphdef, attention, k, state, kv, step: StepInputs, verify: VerifyInputs,
            draft_probs, stacks=None):
    sp = step.sampling
    num_req = step.attention.kv_lens.shape[0]
    model = nnx.merge(graphdef, state)
    logits, kv = model(step.model, step.attention, kv, attention,
                       adapters=Adapters.of(stacks, step.model.adapter_slots))  # [R, V]
    logits = maybe_apply_bitmask(logits, verify.grammar_bitmask, verify.has_grammar,
                                 verify.any_grammar)  # a draft its grammar refuses: -inf
    seq = jnp.minimum(verify.row_seq, num_req - 1)  # padding rows borrow request 0's settings
    accepted, tokens, logprobs = rejection.verify_rows(
        logits, verify.row_draft, draft_probs, sp.temperature[seq], sp.top_k[seq],
        sp.top_p[seq], sp.min_p[seq], sp.seeds[seq], sp.output_index[seq] + verify.row_j,
        sp.any_sampling)
    packed = rejection.accepted_runs(accepted, tokens, logprobs, verify.row_seq, verify.row_j,
                                     num_req, k + 1)
    return packed, kv


def ngram_step(graphdef, attention, k, state, kv, inputs: SpecStepInputs):
    """Verify host-proposed drafts (q one-hot). Returns (packed [2, S, k+1], kv).

    kv: (the KV pages, the LoRA stacks: model/decoder/lora.py, read and handed back unchanged, or
    None: no adapters); with stacks each row, draft rows included, adds its adapter slot's
    deltas (inputs.step.model.adapter_slots)."""
    pages, stacks = kv
    packed, pages = _verify(graphdef, attention, k, state, pages, inputs.step, inputs.verify,
                            None, stacks)
    return packed, (pages, stacks)


def draft_model_step(graphdef, draft_graphdef, attention, draft_attention, k, own_cache,
                     state, kv, inputs: SpecStepInputs):
    """Draft passes, then verification of their proposals.

    state: (target, draft) weights. kv: with own_cache, (target kv, draft kv); else the
    target's kv alone: the draft is the target's first layers and works in the target's own
    cache (its K/V there are the target's; the verification rewrites every slot it wrote).
    Returns (packed [2, S, k+1], kv) with kv shaped as it came."""
    target_state, draft_state = state
    target_kv, draft_kv = kv if own_cache else (kv, None)
    step, verify, d = inputs.step, inputs.verify, inputs.draft
    draft_model = nnx.merge(draft_graphdef, draft_state)
    drafts, q, cache = draft.propose(draft_model, draft_attention,
                                     draft_kv if own_cache else target_kv, d, step.sampling,
                                     k)  # [S, k], [S, k, V]
    if own_cache:
        draft_kv = cache
    else:
        target_kv = cache
    # The proposals take their places among the target's rows and in the verification rows.
    token_ids = step.model.token_ids.at[d.draft_rows.reshape(-1)].set(drafts.reshape(-1),
                                                                       mode="drop")
    step = dataclasses.replace(step, model=dataclasses.replace(step.model, token_ids=token_ids))
    num_req = step.attention.kv_lens.shape[0]
    seq = jnp.minimum(verify.row_seq, num_req - 1)
    j = jnp.minimum(verify.row_j, k - 1)
    verify = dataclasses.replace(verify, row_draft=jnp.where(
        verify.row_device_draft, drafts[seq, j], verify.row_draft))
    draft_probs = q[seq, j]  # [R, V]; bonus rows ignore theirs
    packed, target_kv = _verify(graphdef, attention, k, target_state, target_kv, step, verify,
                                draft_probs)
    return packed, ((target_kv, draft_kv) if own_cache else target_kv)


def draft_sync_step(draft_graphdef, attention, state, kv, inputs: StepInputs):
    """The draft model writes the K/V of a plain step's tokens; no logits. Returns (None, kv)."""
    model = nnx.merge(draft_graphdef, state)
    rows = dataclasses.replace(inputs.model, logits_indices=jnp.zeros((0,), jnp.int32))
    _, kv = model(rows, inputs.attention, kv, attention)
    return None, kv
