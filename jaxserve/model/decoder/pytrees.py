"""Registers the step-input dataclasses of jaxserve/model/decoder/step_inputs.py (and
step_layout.py's
PackedStepInputs) as jax pytrees.

step_inputs.py stays jax-free (the scheduler side and runner/prepare_inputs.py build it with
numpy); the jax side imports this module (the model does) before any of them crosses a jit
boundary, and Python runs the registration once, at first import. It registers and does nothing else.
"""

from __future__ import annotations

import dataclasses

import jax

from jaxserve.model.decoder import step_inputs
from jaxserve.model.decoder.step_layout import PackedStepInputs

_CLASSES = (step_inputs.ModelInputs, step_inputs.AttentionMetadata, step_inputs.SamplingInputs,
            step_inputs.StepInputs, step_inputs.PageTableInputs, step_inputs.VerifyInputs,
            step_inputs.DraftInputs, step_inputs.SpecStepInputs)
for _cls in _CLASSES:
    jax.tree_util.register_dataclass(
        _cls, data_fields=[f.name for f in dataclasses.fields(_cls)], meta_fields=[])

# The buffer and the bitmask are leaves, the layout is static; the host's views are not sent.
jax.tree_util.register_pytree_node(
    PackedStepInputs, lambda p: ((p.words, p.grammar_bitmask), p.layout),
    lambda layout, leaves: PackedStepInputs(leaves[0], leaves[1], layout))
