"""Acceptance of proposed tokens, inside the compiled step: greedy, and rejection sampling.

Every verification row r holds the target's logits after some prefix and the draft token
proposed for the next position (-1 on a request's last row: nothing to verify there, it yields
the bonus token). Row r samples output token number output_index + j (j = the row's index within
its request), so its key is the sampler's own `request_keys(seed, output_index + j)`:

* greedy rows: accept while argmax(target) == draft; the first mismatch emits the argmax.
* draft-model rows (q a distribution): accept with probability min(1, p(d) / q(d)); on rejection
  sample from norm(max(0, p - q)); the bonus row samples from p. This leaves every emitted token
  distributed exactly as the target's own sampling (Leviathan et al., 2023).
* n-gram rows (q one-hot on d): the row draws the target's own sample t (the same draw the
  non-speculative sampler makes for that output index) and accepts iff t == d. That is the
  rejection rule for a one-hot q: P(accept) = p(d), and a rejected row's token is p conditioned
  on != d, i.e. norm(max(0, p - onehot(d))). It also keeps seeded sampling token-identical to a
  run without speculation.

p is the distribution the request samples from (temperature, top-k, top-p, min-p applied); the
draft model's q is filtered the same way. Logprobs are the model's own, as the sampler reports.
No host sync, no Python control flow on values.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxserve.runner.sampler import filter_logits, request_keys

ACCEPT_SALT = 1   # fold_in salt of the uniform draw that accepts or rejects a draft
DRAFT_SALT = 2    # fold_in salt of the draft model's own sample at that output index


def rejection_sample(target_probs, draft_probs, draft_tokens, keys):
    """The draft-model rule on rows of probabilities.

    target_probs, draft_probs: [R, V]; draft_tokens: [R] (-1: bonus row, sample from p);
    keys: [R] PRNG keys. Returns (accepted [R] bool, token [R] i32): the emitted token is the
    draft where accepted, else the resampled (or bonus) token."""
    has_draft = draft_tokens >= 0
    d = jnp.maximum(draft_tokens, 0)[:, None]
    p_d = jnp.take_along_axis(target_probs, d, axis=-1)[:, 0]
    q_d = jnp.take_along_axis(draft_probs, d, axis=-1)[:, 0]
    u = jax.vmap(lambda k: jax.random.uniform(jax.random.fold_in(k, ACCEPT_SALT)))(keys)
    accepted = has_draft & (u * q_d < p_d)  # u < p/q without dividing by a tiny q
    residual = jnp.where(has_draft[:, None], jnp.maximum(target_probs - draft_probs, 0.0),
                         target_probs)
    # p == q leaves no residual mass; rejection then has probability 0, so any fallback works.
    residual = jnp.where(residual.sum(-1, keepdims=True) > 0, residual, target_probs)
    resampled = jax.vmap(jax.random.categorical)(keys, jnp.log(residual)).astype(jnp.int32)
    return accepted, jnp.where(accepted, draft_tokens, resampled)


def sample_and_compare(filtered_logits, draft_tokens, keys):
    """The one-hot-q rule: the target's own sample, accepted iff it equals the draft.

    filtered_logits: [R, V]; draft_tokens: [R] (-1: bonus row); keys: [R]. Returns
    (accepted [R] bool, token [R] i32)."""
    sampled = jax.vmap(jax.random.categorical)(keys, filtered_logits).astype(jnp.int32)
    return (draft_tokens >= 0) & (sampled == draft_tokens), sampled


def verify_rows(logits, draft_tokens, draft_probs, temperature, top_k, top_p, min_p, seeds,
                output_index, any_sampling):
    """Per verification row: accepted, emitted token, its logprob.

    logits [R, V] f32; draft_tokens [R] i32 (-1: none); draft_probs [R, V] or None (one-hot,
    n-gram); sampling settings, seeds and output_index (already + j) per row [R]."""
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)

    def sampled(_):
        filtered = filter_logits(logits, temperature, top_k, top_p, min_p)
        keys = request_keys(seeds, output_index)
        if draft_probs is None:
            acc, tok = sample_and_compare(filtered, draft_tokens, keys)
        else:
            acc, tok = rejection_sample(jax.nn.softmax(filtered, axis=-1), draft_probs,
                                        draft_tokens, keys)
        is_sampled = temperature > 0
        return (jnp.where(is_sampled, acc, greedy == draft_tokens),
                jnp.where(is_sampled, tok, greedy))

    accepted, tokens = jax.lax.cond(any_sampling, sampled,
                                    lambda _: (greedy == draft_tokens, greedy), None)
    accepted = accepted & (draft_tokens >= 0)
    logprobs = jax.nn.log_softmax(logits, axis=-1)
    return accepted, tokens, jnp.take_along_axis(logprobs, tokens[:, None], axis=-1)[:, 0]


def draft_sample(logits, temperature, top_k, top_p, min_p, seeds, output_index, any_sampling):
    """The draft model's proposal for one position per request: (tokens [S] i32, q [S, V]).

    Greedy requests take the argmax (q is unused for them); sampled ones draw from their
    filtered q with a key salted apart from the target's draw for the same output index."""
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)

    def sampled(_):
        filtered = filter_logits(logits, temperature, top_k, top_p, min_p)
        keys = jax.vmap(lambda k: jax.random.fold_in(k, DRAFT_SALT))(
            request_keys(seeds, output_index))
        tokens = jax.vmap(jax.random.categorical)(keys, filtered).astype(jnp.int32)
        return jnp.where(temperature > 0, tokens, greedy), jax.nn.softmax(filtered, axis=-1)

    return jax.lax.cond(any_sampling, sampled,
                        lambda _: (greedy, jnp.zeros(logits.shape, jnp.float32)), None)


def accepted_runs(accepted, tokens, logprobs, row_seq, row_j, num_seqs: int, width: int):
    """Scatter per-row results into per-request runs: [2, S, width] i32 (tokens; logprob bits).

    A request's run is its accepted drafts then the token of its first non-accepted row; the
    rest is -1. Rows with row_seq == num_seqs are padding and dropped."""
    shape = (num_seqs, width)
    grid_acc = jnp.zeros(shape, jnp.bool_).at[row_seq, row_j].set(accepted, mode="drop")
    grid_tok = jnp.full(shape, -1, jnp.int32).at[row_seq, row_j].set(tokens, mode="drop")
    grid_lp = jnp.zeros(shape, jnp.float32).at[row_seq, row_j].set(logprobs, mode="drop")
    num_accepted = jnp.cumprod(grid_acc.astype(jnp.int32), axis=1).sum(axis=1)  # [S]
    keep = jnp.arange(width)[None, :] <= num_accepted[:, None]
    out_tok = jnp.where(keep, grid_tok, -1)
    return jnp.stack([out_tok, jax.lax.bitcast_convert_type(grid_lp, jnp.int32)])
