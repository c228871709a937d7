"""Logits processors inside the compiled step, and the device state they read.

ProcessorState holds one row per processor slot (jaxserve/core/processor_slots.py assigns them):
  counts [slots, V] i32   output-token counts, updated on device from each step's own samples
  prompt [slots, V] bool  prompt-token presence (repetition_penalty reads prompt and output)
  bias   [slots, V] f32   logit_bias, -inf outside allowed_token_ids and on single-token bad words
  stop   [slots, V] bool  EOS and stop_token_ids, masked while a row is below min_tokens
A row is filled once when its slot is assigned (fill, from the host's histories); no step uploads
a history. Slot 0 is scratch: rows without processors point there, their samples are added
to it and nothing reads it.

apply() runs in vLLM's order: the fixed bias and masks, this step's bad-word bans, min_tokens,
then repetition, frequency and presence penalties. Everything is fixed-shape; the step skips
apply and record with a lax.cond when no row uses a processor. No host sync here.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.model.decoder import pytrees  # noqa: F401  (registers the step inputs as pytrees)
from jaxserve.core.plan import ProcessorInit, StepPlan
from jaxserve.model.decoder.step_inputs import SamplingInputs


def empty_arrays(num_slots: int, vocab_size: int) -> tuple:
    """(counts, prompt, bias, stop), zeroed (numpy)."""
    return (np.zeros((num_slots, vocab_size), np.int32),
            np.zeros((num_slots, vocab_size), np.bool_),
            np.zeros((num_slots, vocab_size), np.float32),
            np.zeros((num_slots, vocab_size), np.bool_))


def init_rows(init: ProcessorInit, vocab_size: int) -> tuple:
    """A slot's four rows [V] (numpy) from the host's view of the request."""
    counts = np.bincount(np.asarray(init.output_token_ids, np.int64),
                         minlength=vocab_size).astype(np.int32)
    prompt = np.zeros(vocab_size, np.bool_)
    prompt[np.asarray(init.prompt_token_ids, np.int64)] = True
    if init.allowed_token_ids is None:
        bias = np.zeros(vocab_size, np.float32)
    else:
        bias = np.full(vocab_size, -np.inf, np.float32)
        bias[np.asarray(init.allowed_token_ids, np.int64)] = 0.0
    for token, value in init.logit_bias:
        bias[token] += value
    stop = np.zeros(vocab_size, np.bool_)
    stop[np.asarray(init.stop_token_ids, np.int64)] = True
    return counts, prompt, bias, stop


def apply(logits, sp: SamplingInputs, arrays):
    """logits [S, V] f32 -> processed logits [S, V]."""
    counts_all, prompt_all, bias_all, stop_all = arrays
    slot = sp.processor_slot
    counts = counts_all[slot]
    num_rows, vocab = logits.shape
    logits = logits + bias_all[slot]
    banned = jnp.zeros((num_rows, vocab), jnp.bool_).at[
        jnp.arange(num_rows)[:, None], jnp.where(sp.banned >= 0, sp.banned, vocab)].set(
        True, mode="drop")
    logits = jnp.where(banned | (stop_all[slot] & sp.suppress_stop[:, None]), -jnp.inf, logits)
    seen = prompt_all[slot] | (counts > 0)
    rep = sp.repetition_penalty[:, None]
    logits = jnp.where(seen, jnp.where(logits > 0, logits / rep, logits * rep), logits)
    logits = logits - sp.frequency_penalty[:, None] * counts.astype(jnp.float32)
    return logits - sp.presence_penalty[:, None] * (counts > 0).astype(jnp.float32)


def record(arrays, sp: SamplingInputs, tokens):
    """The step's samples added to their rows' output counts (scratch rows add to slot 0)."""
    counts, prompt, bias, stop = arrays
    return counts.at[sp.processor_slot, tokens].add(1), prompt, bias, stop


def apply_if_any(logits, sp: SamplingInputs, arrays):
    return jax.lax.cond(sp.any_processors, lambda x: apply(x, sp, arrays), lambda x: x, logits)


def record_if_any(arrays, sp: SamplingInputs, tokens):
    return jax.lax.cond(sp.any_processors, lambda a: record(a, sp, tokens), lambda a: a, arrays)


def _fill(arrays, slot, rows):
    return tuple(a.at[slot].set(r) for a, r in zip(arrays, rows))


class ProcessorState:
    """The device arrays (donated through every plain step, like the KV cache) and their fill."""

    def __init__(self, num_slots: int, vocab_size: int, sharding=None):
        """sharding: where the arrays live (tensor parallel: replicated); None: default device."""
        self.vocab_size = vocab_size
        put = (lambda a: jnp.asarray(a)) if sharding is None else (
            lambda a: jax.device_put(a, sharding))
        self.arrays = tuple(put(a) for a in empty_arrays(num_slots, vocab_size))
        shardings = {} if sharding is None else {"out_shardings": (sharding,) * 4}
        self._fill = jax.jit(_fill, donate_argnums=(0,), **shardings)

    def warmup(self) -> None:
        """Compile the fill (serving never compiles): scratch slot 0 set to zeros."""
        self.arrays = self._fill(self.arrays, np.int32(0),
                                 tuple(a[0] for a in empty_arrays(1, self.vocab_size)))

    def apply_inits(self, plan: StepPlan) -> None:
        """Before the plan's step runs: fill the rows of slots assigned this step."""
        for chunk in plan.chunks:
            row = chunk.sampling.processors if chunk.sampling is not None else None
            if row is not None and row.init is not None:
                self.arrays = self._fill(self.arrays, np.int32(row.slot),
                                         init_rows(row.init, self.vocab_size))
