"""Run a Llama over a token sequence chunk by chunk through its paged KV cache (test helper).

One jitted forward per model, so a token-by-token decode of 45 positions compiles once (its
inputs are padded to one bucket) instead of dispatching every op eagerly 45 times, as an
un-jitted call would. Request 0 owns the given (shuffled) pages; row 1 of the page table is an
unused padding request.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxserve.model.decoder.attention import ReferenceAttention
from jaxserve.model.decoder.decoder import init_kv_cache
from jaxserve.model.decoder.step_inputs import AttentionMetadata, ModelInputs

PAGE_SIZE = 8
NUM_PAGES = 24


def run_in_chunks(model, config, tokens, chunk_sizes, page_table, bucket=64):
    """Feed `tokens` through the model chunk by chunk; the logits of every position."""
    graphdef, state = nnx.split(model)
    attention = ReferenceAttention()
    forward = jax.jit(lambda state, inputs, metadata, kv: nnx.merge(graphdef, state)(
        inputs, metadata, kv, attention))
    kv = init_kv_cache(config, NUM_PAGES, PAGE_SIZE)
    table = np.zeros((2, 16), np.int32)
    table[0, :len(page_table)] = page_table
    logits, start = [], 0
    for size in chunk_sizes:
        pos = np.arange(start, start + size)
        padded = lambda a: jnp.asarray(np.pad(a, (0, bucket - size)).astype(np.int32))
        slots = np.asarray(page_table)[pos // PAGE_SIZE] * PAGE_SIZE + pos % PAGE_SIZE
        inputs = dataclasses.replace(  # logits of `bucket` rows too: one shape for every chunk
            ModelInputs.empty(bucket, bucket),
            token_ids=padded(np.asarray(tokens[start:start + size])), positions=padded(pos),
            slot_mapping=padded(slots), logits_indices=padded(np.arange(size)))
        metadata = AttentionMetadata(
            jnp.asarray([0, size, size], jnp.int32), jnp.asarray([start + size, 0], jnp.int32),
            jnp.asarray(table), jnp.int32(1), jnp.int32(1 if size == 1 else 0))
        out, kv = forward(state, inputs, metadata, kv)
        logits.append(np.asarray(out)[:size])
        start += size
    return np.concatenate(logits)
