"""Token sampling inside the compiled step: greedy, temperature, top-k, top-p, min-p, and the
top-k log-probabilities a request may ask for.

Each request's key derives from (its seed, the index of the output token), so a seeded request
samples the same tokens whatever else shares the batch. When no row samples, a lax.cond skips
sampling entirely; when rows sample but none asks for top-k or top-p (greedy, temperature,
min-p), another skips the vocabulary sort. No host sync happens here.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxserve.model.decoder.step_inputs import MAX_TOP_LOGPROBS, SamplingInputs

_BASE_KEY = 0x6A61  # arbitrary fixed root; keys differ per (seed, output index)


def request_keys(seeds, output_index):
    """[S] uint32 seeds, [S] i32 output indices -> [S] PRNG keys."""
    base = jax.random.key(_BASE_KEY)
    return jax.vmap(lambda s, i: jax.random.fold_in(jax.random.fold_in(base, s), i))(
        seeds, output_index)


def sort_needed(temperature, top_k, top_p, vocab: int):
    """[] bool: some sampling row (temperature > 0) has top-k or top-p in force, the filters
    that need the vocabulary sorted; greedy rows sample nothing, so their settings do not
    count."""
    top_k_on = (top_k > 0) & (top_k < vocab)
    return jnp.any((temperature > 0) & (top_k_on | (top_p < 1.0)))


def _sorted_filter(scaled, top_k, top_p, min_p):
    """top-k, top-p and min-p over the vocabulary sorted per row. [S, V]."""
    vocab = scaled.shape[-1]
    sorted_desc = -jnp.sort(-scaled, axis=-1)
    ranks = jnp.arange(vocab)[None, :]
    past_top_k = (top_k[:, None] > 0) & (ranks >= top_k[:, None])
    sorted_desc = jnp.where(past_top_k, -jnp.inf, sorted_desc)
    probs = jax.nn.softmax(sorted_desc, axis=-1)
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    # (past_top_k too: with top_p = 1 the top k's mass can round below 1, which would keep
    # the -inf tail and with it, through the threshold, the whole vocabulary)
    keep = ((mass_before < top_p[:, None]) & (probs >= min_p[:, None] * probs[:, :1])
            & ~past_top_k)
    keep = keep.at[:, 0].set(True)
    threshold = jnp.min(jnp.where(keep, sorted_desc, jnp.inf), axis=-1)
    return jnp.where(scaled >= threshold[:, None], scaled, -jnp.inf)


def _min_p_filter(scaled, top_k, top_p, min_p):
    """min-p alone (no row has top-k or top-p in force): a token stays when its probability is
    at least min_p times the row's largest, which needs the maximum, not a sort. [S, V]."""
    del top_k, top_p
    probs = jax.nn.softmax(scaled, axis=-1)
    keep = (probs >= min_p[:, None] * jnp.max(probs, axis=-1, keepdims=True)) | (
        scaled == jnp.max(scaled, axis=-1, keepdims=True))
    return jnp.where(keep, scaled, -jnp.inf)


def filter_logits(logits, temperature, top_k, top_p, min_p):
    """Scaled logits with everything outside top-k / top-p / min-p set to -inf. [S, V].
    The vocabulary is sorted only when some sampling row asks for top-k or top-p (a lax.cond,
    which XLA keeps as a conditional: the sort sits in one branch)."""
    scaled = logits / jnp.where(temperature > 0, temperature, 1.0)[:, None]
    return jax.lax.cond(sort_needed(temperature, top_k, top_p, logits.shape[-1]),
                        _sorted_filter, _min_p_filter, scaled, top_k, top_p, min_p)


def sample(logits, sampling: SamplingInputs):
    """logits [S, V] f32 -> (token ids [S] i32, their log-probabilities [S] f32).

    Log-probabilities are the model's own (before temperature and filters), as vLLM reports.
    """
    sp = sampling
    temperature, top_k, top_p, min_p = sp.temperature, sp.top_k, sp.top_p, sp.min_p
    seeds, output_index, any_sampling = sp.seeds, sp.output_index, sp.any_sampling
    vocab = logits.shape[-1]
    row_max = jnp.max(logits, axis=-1)
    # argmax as two plain reductions (the first index of the maximum, as jnp.argmax): XLA on
    # the CPU runs argmax's (value, index) reduction several times slower (docs/host_loop.md)
    greedy = jnp.min(jnp.where(logits == row_max[:, None], jnp.arange(vocab, dtype=jnp.int32),
                               vocab - 1), axis=-1)  # (a NaN row: the last token)

    def sampled(_):
        filtered = filter_logits(logits, temperature, top_k, top_p, min_p)
        keys = request_keys(seeds, output_index)
        tokens = jax.vmap(jax.random.categorical)(keys, filtered).astype(jnp.int32)
        return jnp.where(temperature > 0, tokens, greedy)

    tokens = jax.lax.cond(any_sampling, sampled, lambda _: greedy, None)
    # log_softmax's arithmetic for the sampled token only (no [S, V] of log-probabilities)
    log_sum = jnp.log(jnp.sum(jnp.exp(logits - row_max[:, None]), axis=-1))
    chosen = jnp.take_along_axis(logits, tokens[:, None], axis=-1)[:, 0]
    return tokens, (chosen - row_max) - log_sum


def top_logprobs(logits, sampling: SamplingInputs):
    """The MAX_TOP_LOGPROBS most likely tokens of each row and their log-probabilities:
    (ids [S, K] i32, logprobs [S, K] f32); zeros, without the top-k, when no row asked."""
    num_rows = logits.shape[0]

    def top(x):
        values, ids = jax.lax.top_k(jax.nn.log_softmax(x, axis=-1), MAX_TOP_LOGPROBS)
        return ids.astype(jnp.int32), values

    def none(x):
        return (jnp.zeros((num_rows, MAX_TOP_LOGPROBS), jnp.int32),
                jnp.zeros((num_rows, MAX_TOP_LOGPROBS), jnp.float32))

    return jax.lax.cond(sampling.any_top_logprobs, top, none, logits)


def prompt_logprobs(model, hidden, sampling: SamplingInputs):
    """Per token row, the log-probability of the prompt token that follows it, then the
    MAX_TOP_LOGPROBS most likely tokens': (ids [T, 1 + K] i32, logprobs [T, 1 + K] f32); zeros,
    without computing any row's logits, when no row asked. hidden: the model's last layer
    output of every row [T, D] (model.logits gives their logits)."""
    num_rows = hidden.shape[0]
    nxt = sampling.prompt_next_token

    def rows(h):
        logprobs = jax.nn.log_softmax(model.logits(h), axis=-1)
        values, ids = jax.lax.top_k(logprobs, MAX_TOP_LOGPROBS)
        own = jnp.take_along_axis(logprobs, jnp.maximum(nxt, 0)[:, None], axis=-1)
        return (jnp.concatenate([nxt[:, None], ids.astype(jnp.int32)], axis=1),
                jnp.concatenate([own, values], axis=1))

    def none(h):
        return (jnp.zeros((num_rows, 1 + MAX_TOP_LOGPROBS), jnp.int32),
                jnp.zeros((num_rows, 1 + MAX_TOP_LOGPROBS), jnp.float32))

    return jax.lax.cond(sampling.any_prompt_logprobs, rows, none, hidden)
