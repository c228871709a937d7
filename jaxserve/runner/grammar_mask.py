"""Apply packed allowed-token bitmasks to logits inside the compiled step.

The host (jaxserve/structured) packs each constrained row's allowed set as int32
[ceil(V / 32)] words, bit `t % 32` of word `t // 32` for token t. Here the words are unpacked to
a [S, V] boolean and disallowed logits become -inf; rows whose `has_mask` is False are left
untouched, so unconstrained requests in the same batch sample exactly as without a grammar.
Pure jnp over fixed shapes (no host callbacks, nothing data-dependent in a shape); this module
must not know about grammars, requests or the tokenizer.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def unpack_bitmask(bitmask: jax.Array, vocab_size: int) -> jax.Array:
    """bitmask i32[S, W] -> allowed bool[S, vocab_size] (W * 32 >= vocab_size)."""
    num_rows, num_words = bitmask.shape
    if num_words * 32 < vocab_size:
        raise ValueError(f"bitmask of {num_words} words can't cover a vocab of {vocab_size}")
    shifts = jnp.arange(32, dtype=jnp.int32)
    # arithmetic shift of a negative word still leaves bit k in position 0
    bits = (bitmask[:, :, None] >> shifts) & 1                   # [S, W, 32]
    return bits.reshape(num_rows, num_words * 32)[:, :vocab_size].astype(jnp.bool_)


def apply_bitmask(logits: jax.Array, bitmask: jax.Array, has_mask: jax.Array) -> jax.Array:
    """logits f32[S, V], bitmask i32[S, ceil(V/32)], has_mask bool[S] -> logits with the tokens
    a masked row does not allow at -inf."""
    allowed = unpack_bitmask(bitmask, logits.shape[-1])          # [S, V]
    keep = allowed | ~has_mask[:, None]
    return jnp.where(keep, logits, jnp.asarray(-jnp.inf, logits.dtype))


def maybe_apply_bitmask(logits: jax.Array, bitmask: jax.Array, has_mask: jax.Array,
                        any_mask: jax.Array | None = None) -> jax.Array:
    """apply_bitmask, skipped by lax.cond when no row has a mask. any_mask: bool[] computed on
    the host (default: jnp.any(has_mask) on the device)."""
    any_mask = jnp.any(has_mask) if any_mask is None else any_mask
    return jax.lax.cond(any_mask, apply_bitmask, lambda l, b, h: l, logits, bitmask, has_mask)
