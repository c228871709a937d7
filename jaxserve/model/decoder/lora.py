"""LoRA inside the compiled step: each targeted projection adds its row's adapter delta.

The resident adapters' weights (lora/device.py) come per target and layer as the slots side by
side: A [in, N * R] (columns (s - 1) * R .. s * R - 1: slot s's A, [in, R]) and B [N * R, out]
(the same rows: slot s's B), for device slots s = 1 .. N = max_loras; slot 0 is the base
model, no adapter, and has no block: its rows' deltas are zero (so S = N + 1 slots, and no
work is spent on the zeros slot 0 would hold). R = max_lora_rank (smaller ranks are
zero-padded, which adds exact zeros); the scaling is folded into B.
`LoRAStacks.weights` holds them per layer (a tuple of L arrays: the unrolled loop's, which
never slices) or stacked [L, ...] (the scan's, sliced by the scan like the layer weights).
Every token row names its slot (ModelInputs.adapter_slots [T]); a step gets the stacks and
the slots together as one optional model input, `Adapters` (None: the model adds no deltas,
and since a pytree's presence is static under jit, a step without stacks compiles none).
A projection y = x @ W becomes y + (x @ A[slot]) @ B[slot], in one of two forms with the same
result:

* "gather": each row's slot blocks gathered, [T, in, R] and [T, R, out], then two batched
  matrix-vector products (rows of slot 0 zeroed): reads T * R columns of weights, copied per
  row.
* "masked": x @ A for all slots at once ([T, N * R]), every column outside the row's own
  slot's block zeroed, then @ B: two plain matmuls over N * R columns, no gather.

Measured on the 2-core CPU (scripts/lora_matmul_options.py, the default model's 30 layers of
projections, rank 16, 4 adapters; one shared-machine run, medians, relative figures only):
over the base projections' 31 / 78 / 104 / 790 ms at T = 1 / 4 / 16 / 256 rows, the masked
form added 2 / 15 / 34 / 416 ms, the gather form 1 / 63 / 238 / 4946 ms (its per-row copies
grow with T). Each target's slots stacked over layers and sliced per layer ([L, in, N * R])
added 56 / 68 / 78 ms at 1 / 4 / 16 rows in copies (hence the per-layer arrays on the CPU's
unrolled loop), but only 91 ms at 256 (a second run: 199 against the per-layer arrays' 480),
which is left to measure further. choose_form picks per compiled bucket.
No state, no host work; this module never loads adapters.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import jax
import jax.numpy as jnp

FORMS = ("gather", "masked")
# 'auto' | 'gather' | 'masked' (a measurement or a test pins one)
FORM = os.environ.get("JAXSERVE_LORA_FORM", "auto")


@dataclass(frozen=True)
class LoRAStacks:
    """The resident adapters as the step reads them."""

    # our parameter name ("wq", ...) -> (A, B): tuples of L arrays [in, N * R] / [N * R, out],
    # or arrays [L, in, N * R] / [L, N * R, out]
    weights: dict
    max_loras: int  # N: slots 1..N hold adapters (static)


jax.tree_util.register_dataclass(LoRAStacks, data_fields=["weights"], meta_fields=["max_loras"])


@dataclass(frozen=True)
class Adapters:
    """One step's adapter input to the model: the resident stacks and each token row's slot."""

    stacks: LoRAStacks
    slots: jax.Array  # [T] i32 each row's slot (0: the base model)

    @classmethod
    def of(cls, stacks: LoRAStacks | None, slots) -> "Adapters | None":
        """The step's input from its adapter stacks (None: none resident) and row slots."""
        return None if stacks is None else cls(stacks, slots)


jax.tree_util.register_dataclass(Adapters, data_fields=["stacks", "slots"], meta_fields=[])


def choose_form(num_rows: int, backend: str | None = None, form: str | None = None) -> str:
    """The form a step of num_rows token rows computes its deltas in (FORM unless 'auto').

    auto: the CPU takes the gather form for a one-row step only, where it reads one slot's
    weights instead of all N (measured, module docstring); the masked form otherwise. On TPU
    and GPU the masked form's two dense matmuls run on the matrix units at any T, while a
    per-row gather of weight blocks is slow on a TPU and memory-bound on a GPU: masked."""
    form = form or FORM
    if form in FORMS:
        return form
    if form != "auto":
        raise ValueError(f"JAXSERVE_LORA_FORM={form!r} is invalid: must be one of "
                         f"{('auto',) + FORMS}")
    backend = backend or jax.default_backend()
    return "gather" if backend == "cpu" and num_rows == 1 else "masked"


def layer_weights(stacks: LoRAStacks, index: int) -> dict:
    """Layer `index`'s (A, B) per target (the unrolled loop)."""
    return {name: (a[index], b[index]) for name, (a, b) in stacks.weights.items()}


def stacked_weights(stacks: LoRAStacks) -> dict:
    """Every target's (A [L, ...], B [L, ...]) for a scan to slice (stacked here when held
    per layer)."""
    return {name: (a if not isinstance(a, (tuple, list)) else jnp.stack(a),
                   b if not isinstance(b, (tuple, list)) else jnp.stack(b))
            for name, (a, b) in stacks.weights.items()}


def gather_delta(x, a, b, slots, max_loras: int):
    """x [T, in]; a [in, N * R]; b [N * R, out]; slots [T] (0: none) -> [T, out]."""
    rank = a.shape[-1] // max_loras
    block = jnp.maximum(slots - 1, 0)
    a_rows = a.reshape(a.shape[0], max_loras, rank)[:, block]  # [in, T, R]
    b_rows = b.reshape(max_loras, rank, b.shape[-1])[block]    # [T, R, out]
    h = jnp.einsum("ti,itr->tr", x, a_rows.astype(x.dtype))
    h = jnp.where((slots > 0)[:, None], h, 0)
    return jnp.einsum("tr,tro->to", h, b_rows.astype(x.dtype))


def masked_delta(x, a, b, mask):
    """x [T, in]; a [in, N * R]; b [N * R, out]; mask [T, N * R] (1 on the row's slot's
    block, none for slot 0) -> [T, out]."""
    return ((x @ a.astype(x.dtype)) * mask) @ b.astype(x.dtype)


class StepAdapters:
    """One step's rows' slots, prepared once before the layer loop (the form; the masked
    form's [T, N * R] block mask), applied per projection with that layer's (A, B)."""

    def __init__(self, stacks: LoRAStacks, slots, dtype, form: str | None = None):
        """slots: [T] i32 each row's slot (0: none)."""
        self.max_loras = stacks.max_loras
        self.form = choose_form(slots.shape[0], form=form)
        self.slots = slots
        self.mask = None
        if self.form == "masked" and stacks.weights:
            a = next(iter(stacks.weights.values()))[0]
            rank = (a[0] if isinstance(a, (tuple, list)) else a).shape[-1] // self.max_loras
            one_hot = jax.nn.one_hot(slots - 1, self.max_loras, dtype=dtype)  # [T, N]; 0: none
            self.mask = jnp.repeat(one_hot, rank, axis=1)                     # [T, N * R]

    def add(self, y, x, weights: dict, key: str):
        """y = x @ W (the base projection `key`) plus each row's delta; weights: the layer's
        (A, B) by target (none for `key`: y as it is)."""
        if key not in weights:
            return y
        a, b = weights[key]
        if self.form == "gather":
            delta = gather_delta(x, a, b, self.slots, self.max_loras)
        else:
            delta = masked_delta(x, a, b, self.mask)
        return y + delta.astype(y.dtype)
