"""LoRA inside the compiled step: each targeted projection adds its row's adapter delta.

The resident adapters' weights are stacked per target, A [S, L, in, R] and B [S, L, R, out]
(S device slots, slot 0 all zeros: no adapter; R = max_lora_rank, smaller ranks zero-padded,
which adds exact zeros; the scaling is folded into B), and every token row names its slot
(`slots` [T] i32). A projection y = x @ W of layer l becomes y + (x @ A[slot, l]) @ B[slot, l],
computed in one of two forms with the same result:

* "gather": each row's A and B gathered, [T, in, R] and [T, R, out], then two batched
  matrix-vector products. Reads T * (in + out) * R weights: cheap for a few rows.
* "masked": every row times every slot's A at once (x @ concat_s A_s: [T, S * R]), all but the
  row's own slot's R columns zeroed, then @ concat_s B_s. Two plain matmuls over S * R columns,
  no gather: S times the LoRA FLOPs, but what matrix units and CPU dot kernels run best.

Which is faster is measured (scripts/lora_matmul_options.py); `choose_form` picks by backend and
token bucket T (static per compiled bucket). No state, no host work: the runner owns the
stacks (lora/device.py) and the step passes them in; this module never loads adapters.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp

FORMS = ("gather", "masked")
# 'auto' | 'gather' | 'masked' (a measurement or a test pins one)
FORM = os.environ.get("JAXSERVE_LORA_FORM", "auto")
# auto on the CPU: gather up to this many token rows, masked above (measured; see choose_form)
CPU_GATHER_MAX_ROWS = 16


def choose_form(num_rows: int, backend: str | None = None, form: str | None = None) -> str:
    """The form a step of num_rows token rows computes its deltas in.

    Measured on the 2-core CPU with the default model's sizes at rank 16 and 4 adapters
    (scripts/lora_matmul_options.py): the gather form wins at one and 16 rows (it reads a
    few rows' weights; the masked form reads all S slots' for each), the masked form at 256
    (the gathered [T, in, R] copies cost more than S times the LoRA FLOPs). On TPU and GPU
    the masked form's two dense matmuls run on the matrix units at any T, while a per-row
    gather of weight blocks is slow on a TPU (no fast gather) and memory-bound on a GPU:
    masked everywhere but the CPU."""
    form = form or FORM
    if form in FORMS:
        return form
    if form != "auto":
        raise ValueError(f"JAXSERVE_LORA_FORM={form!r} is invalid: must be one of "
                         f"{('auto',) + FORMS}")
    backend = backend or jax.default_backend()
    if backend == "cpu":
        return "gather" if num_rows <= CPU_GATHER_MAX_ROWS else "masked"
    return "masked"


def gather_delta(x, a, b, slots, layer):
    """x [T, in]; a [S, L, in, R]; b [S, L, R, out]; slots [T]; layer: a scalar (traced in a
    scan) -> [T, out]."""
    a_rows = a[slots, layer]  # [T, in, R]
    b_rows = b[slots, layer]  # [T, R, out]
    h = jnp.einsum("ti,tir->tr", x, a_rows.astype(x.dtype))
    return jnp.einsum("tr,tro->to", h, b_rows.astype(x.dtype))


def masked_delta(x, a, b, mask, layer):
    """x [T, in]; a [S, L, in, R]; b [S, L, R, out]; mask [T, S] one-hot of each row's slot
    -> [T, out]."""
    a_layer = jax.lax.dynamic_index_in_dim(a, layer, axis=1, keepdims=False)  # [S, in, R]
    b_layer = jax.lax.dynamic_index_in_dim(b, layer, axis=1, keepdims=False)  # [S, R, out]
    h = jnp.einsum("ti,sir->tsr", x, a_layer.astype(x.dtype))  # [T, S, R]
    h = h * mask[:, :, None]
    return jnp.einsum("tsr,sro->to", h, b_layer.astype(x.dtype))


class StepAdapters:
    """The adapters of one step, prepared once before the layer loop (the masked form's
    one-hot rows, the form itself) and applied per projection."""

    def __init__(self, stacks: dict, slots, dtype, form: str | None = None):
        """stacks: our parameter name ("wq", ...) -> (A, B); slots: [T] i32 each row's slot."""
        self.stacks = stacks
        self.form = choose_form(slots.shape[0], form=form)
        self.slots = slots
        num_slots = next(iter(stacks.values()))[0].shape[0] if stacks else 1
        self.mask = (jax.nn.one_hot(slots, num_slots, dtype=dtype)
                     if self.form == "masked" else None)  # [T, S]

    def add(self, y, x, key: str, layer):
        """y = x @ W (the base projection `key` of `layer`) plus each row's adapter delta."""
        if key not in self.stacks:
            return y
        a, b = self.stacks[key]
        if self.form == "gather":
            delta = gather_delta(x, a, b, self.slots, layer)
        else:
            delta = masked_delta(x, a, b, self.mask, layer)
        return y + delta.astype(y.dtype)
