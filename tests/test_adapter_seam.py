"""LoRA behind one seam: the compiled steps, the runner's input builders and the model take
adapter data as one optional input (model/decoder/lora.py's Adapters), never a LoRA flag, and an
engine without adapters passes None in its place."""

from __future__ import annotations

import inspect

import numpy as np

from jaxserve.lora.device import NoAdapters
from jaxserve.model.decoder.decoder import Llama
from jaxserve.model.decoder.lora import Adapters, LoRAStacks
from jaxserve.model.decoder.step_inputs import StepInputs
from jaxserve.model.decoder.step_layout import StepLayout, layouts_for
from jaxserve.runner.model_runner import ModelRunner, plain_step
from jaxserve.runner.prepare_inputs import build_step_inputs
from jaxserve.runner.tensor_parallel import Placement
from jaxserve.spec import step
from jaxserve.spec.spec_inputs import build_spec_inputs, empty_spec_inputs


def test_no_step_builder_or_model_call_takes_a_lora_parameter():
    functions = (plain_step, step.ngram_step, step.draft_model_step, step.draft_sync_step,
                 step._verify, build_step_inputs, build_spec_inputs, empty_spec_inputs,
                 StepInputs.empty, StepLayout.__init__, layouts_for, Llama.__call__,
                 Placement.jit_shardings, ModelRunner.dispatch, ModelRunner._launch)
    flagged = {f.__qualname__: [p for p in inspect.signature(f).parameters if "lora" in p]
               for f in functions}
    flagged = {name: params for name, params in flagged.items() if params}
    assert not flagged, f"LoRA flags or parameters in step signatures: {flagged}"


def test_without_stacks_the_model_gets_no_adapter_input():
    assert Adapters.of(None, np.zeros(4, np.int32)) is None
    assert NoAdapters().arrays is None, "an engine without adapters must pass None as stacks"


def test_the_adapter_input_carries_the_stacks_and_each_rows_slot():
    stacks = LoRAStacks({"wq": (np.zeros((2, 3)), np.zeros((3, 2)))}, max_loras=1)
    slots = np.array([0, 1, 1, 0], np.int32)
    adapters = Adapters.of(stacks, slots)
    assert adapters.stacks is stacks and adapters.slots is slots
    import jax
    assert len(jax.tree.leaves(adapters)) == 3, "the stacks' A, B and the row slots"


def test_every_step_layout_carries_row_adapter_slots():
    layout = layouts_for([(8, 2)], 4, 1)[(8, 2)]
    paths = {f.path for f in layout.fields}
    assert ("model", "adapter_slots") in paths, f"no per-row adapter slots in {sorted(paths)}"
