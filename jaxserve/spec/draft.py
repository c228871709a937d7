"""The draft model: where its weights come from, and its k proposal passes inside the step.

`load_draft` makes the draft's (config, params): `layers:N` takes the target's first N layers
with its embedding, final norm and head (zero download; the device arrays are shared with the
target, see share_weights), and any other spec goes through load_model and must share the
target's tokenizer. A loaded draft keeps its own paged KV cache with the target's page ids and
writes K/V for exactly the slots the target writes, so its cache is valid wherever the target's
is: the sync pass covers every step's real tokens, the proposal passes cover the draft rows.
A `layers:N` draft works in the target's own cache: its K/V for layers < N are the target's.

This module never samples the target and never decides how many tokens to propose.
"""

from __future__ import annotations

import dataclasses
import logging

import jax
import jax.numpy as jnp
from flax import nnx

from jaxserve.model.config import ModelConfig
from jaxserve.spec.rejection import draft_sample
from jaxserve.model.decoder.step_inputs import (AttentionMetadata, DraftInputs, ModelInputs,
                                                SamplingInputs)

log = logging.getLogger(__name__)


def default_draft_spec(target: ModelConfig) -> str:
    return f"layers:{max(1, target.num_layers // 4)}"


def load_draft(spec: str | None, target, *,
               progress: bool = True) -> tuple[ModelConfig, dict, bool]:
    """(config, params, shares the target's weights) of the draft for `target` (a LoadedModel);
    spec None: the default."""
    tc = target.config
    spec = spec or default_draft_spec(tc)
    if spec.startswith("layers:"):
        try:
            num_layers = int(spec[len("layers:"):])
        except ValueError:
            raise ValueError(f"speculative_draft={spec!r}: expected layers:N") from None
        if not 1 <= num_layers < tc.num_layers:
            raise ValueError(f"speculative_draft={spec!r}: N must be in [1, {tc.num_layers})")
        config = dataclasses.replace(tc, num_layers=num_layers,
                                     layer_types=tc.layer_types[:num_layers],
                                     name=f"{tc.name} (first {num_layers} layers)")
        params = {k: (v[:num_layers] if k.startswith("layers.") else v)
                  for k, v in target.params.items()}
        return config, params, True
    from jaxserve.model.loaders.loader import load_model
    draft = load_model(spec, progress=progress)
    dc = draft.config
    if dc.vocab_size != tc.vocab_size:
        raise ValueError(f"draft {spec!r} has vocab_size {dc.vocab_size}, the target "
                         f"{tc.vocab_size}: a draft must share the target's tokenizer")
    sample = "The quick brown fox, 12345!"
    if draft.tokenizer.encode(sample) != target.tokenizer.encode(sample):
        raise ValueError(f"draft {spec!r} tokenizes text differently from the target: a draft "
                         "must share the target's tokenizer")
    log.info("draft model %s: %d layers", dc.name, dc.num_layers)
    return dc, draft.params, False


def share_weights(draft_state: nnx.State, target_state: nnx.State) -> nnx.State:
    """The draft's state with every leaf the target has at the same path and shape replaced by
    the target's array (one copy of the shared embedding, head and first layers)."""
    target = dict(nnx.to_flat_state(target_state))
    flat = []
    for path, var in nnx.to_flat_state(draft_state):
        other = target.get(path)
        if other is not None and other.shape == var.shape and other.dtype == var.dtype:
            var = var.replace(other[...])
        flat.append((path, var))
    return nnx.from_flat_state(flat)


def propose(model, attention, kv, d: DraftInputs, sampling: SamplingInputs,
            num_speculative_tokens: int):
    """Run the draft over the step's real tokens, then k single-token passes per request.

    d.model / d.attention: the step's chunks without their draft rows; d.model.logits_indices
    [S] is each chunk's last row. d.num_drafts [S]: draft rows per request (0: it does not
    speculate). Returns (drafts [S, k] i32, q [S, k, V] f32, kv): drafts[i, j] is proposed for
    output index output_index[i] + j, and pass j (1..k) writes the K/V of drafts[i, j-1] at
    position kv_lens[i] - 1 + j for requests with num_drafts[i] >= j.
    """
    k = num_speculative_tokens
    sp = sampling
    settings = (sp.temperature, sp.top_k, sp.top_p, sp.min_p, sp.seeds)
    page_table, kv_lens = d.attention.page_table, d.attention.kv_lens
    num_seqs = kv_lens.shape[0]
    page_size = kv[0].shape[2]
    rows = jnp.arange(num_seqs, dtype=jnp.int32)
    logits, kv = model(d.model, d.attention, kv, attention)  # [S, V]
    first, q_first = draft_sample(logits, *settings, sp.output_index, sp.any_sampling)
    last_position = kv_lens - 1  # [S] position of each request's last real token

    def one_pass(carry, j):
        kv, tokens = carry
        active = j <= d.num_drafts
        pos = jnp.where(active, last_position + j, 0)
        page = page_table[rows, jnp.clip(pos // page_size, 0, page_table.shape[1] - 1)]
        inputs = ModelInputs(tokens, pos, jnp.where(active, page * page_size + pos % page_size, 0),
                             rows, jnp.zeros_like(rows))
        metadata = AttentionMetadata(jnp.arange(num_seqs + 1, dtype=jnp.int32),
                                     jnp.where(active, pos + 1, 0), page_table,
                                     jnp.int32(num_seqs), jnp.int32(num_seqs))  # all decodes
        logits, kv = model(inputs, metadata, kv, attention)
        nxt, q = draft_sample(logits, *settings, sp.output_index + j, sp.any_sampling)
        return (kv, nxt), (nxt, q)

    # Pass k only writes the K/V of the last draft; its proposal is thrown away.
    (kv, _), (later, q_later) = jax.lax.scan(one_pass, (kv, first),
                                             jnp.arange(1, k + 1, dtype=jnp.int32))
    drafts = jnp.concatenate([first[None], later[:-1]], axis=0).T  # [S, k]
    q = jnp.swapaxes(jnp.concatenate([q_first[None], q_later[:-1]], axis=0), 0, 1)  # [S, k, V]
    return drafts, q, kv
