"""BatchTokens: each batch slot's last sampled token, kept on the device between steps.

Async scheduling plans step N+1 before step N's tokens reach the host, so a decode row of
step N+1 reads its input token here (ModelInputs.token_slots) and every plain step writes its
samples back (SamplingInputs.sample_slots). The array is donated through each step like the
KV cache (`arrays`, as CompiledStep's caches have). Slot 0 is scratch: rows without a slot
write there and no row reads it. No host transfer, no scheduling here.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


class BatchTokens:
    def __init__(self, num_slots: int, sharding=None):
        """num_slots: max_num_seqs + 1 (scratch slot 0); sharding: where it lives (None: the
        default device; tensor parallel: replicated)."""
        zeros = jnp.zeros(num_slots, jnp.int32)
        self.arrays = zeros if sharding is None else jax.device_put(zeros, sharding)

    def warmup(self) -> None:
        pass


def feed(token_ids, token_slots, last_tokens):
    """Rows whose token is still on the device read it from their slot."""
    return jnp.where(token_slots > 0, last_tokens[token_slots], token_ids)


def record(last_tokens, sample_slots, sampled):
    """Each sampled row's token into its slot (rows without one: scratch slot 0)."""
    return last_tokens.at[sample_slots].set(sampled.astype(jnp.int32))
