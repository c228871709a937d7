"""The device side of step_layout.py: a plain step's fields sliced back out of its one buffer.

Runs inside the compiled step (traced once per bucket): each field is a static slice of the
int32 buffer, reshaped, and bit-cast (float32, uint32) or compared with 0 (bool), so the step
body sees the same StepInputs, dtypes and shapes as when every field was its own argument.
No host work, no layout decisions here (step_layout.py makes them).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxserve.model.decoder import pytrees  # noqa: F401  (registers PackedStepInputs as a pytree)
from jaxserve.model.decoder.step_inputs import StepInputs
from jaxserve.model.decoder.step_layout import PackedStepInputs


def unpack(packed: PackedStepInputs) -> StepInputs:
    words, layout = packed.words, packed.layout
    values = {}
    for f in layout.fields:
        x = jax.lax.slice(words, (f.offset,), (f.offset + f.size,)).reshape(f.shape)
        if f.dtype == "bool":
            x = x != 0
        elif f.dtype != "int32":
            x = jax.lax.bitcast_convert_type(x, jnp.dtype(f.dtype))
        values[f.path] = x
    return layout.assemble(values, packed.grammar_bitmask)
