"""Quantized weights of the real default model: their bytes on device, and int8's accuracy
against float32, teacher-forced (tests/quant_accuracy.py measures; these tests hold the
accuracy targets).

int8 here is quantized from the float32 weights (per output channel), the path every Hugging
Face or Orbax model takes; the GGUF's own int8 mapping is exact (test_quant.py).
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

from jaxserve.model import quant
from jaxserve.model.loader import load_model
from jaxserve.runner.tensor_parallel import Placement
from model_fixtures import real_default_model
from quant_accuracy import measure

NOT_WEIGHTS = ("inv_freq", "kv_scales")  # the model's other variables (RoPE, fp8 KV scales)


def bytes_on_device(loaded, params) -> int:
    """The weights' bytes, summed over the arrays Placement puts on the device."""
    _, state = Placement(None, loaded.config).model(params, np.float32, "scan")
    return sum(leaf.nbytes for path, leaf in jax.tree_util.tree_leaves_with_path(state)
               if not any(v in jax.tree_util.keystr(path) for v in NOT_WEIGHTS))


@pytest.mark.parametrize("mode,limit", [("int8", 0.30), ("int4", 0.17)])
def test_quantized_weights_take_a_fraction_of_float32_on_device(mode, limit):
    base = real_default_model()
    float32 = bytes_on_device(base, base.params)
    for source, params in (("GGUF blocks", load_model("default", progress=False,
                                                      quantization=mode).params),
                           ("from float32", quant.quantize_params(base.params, mode))):
        ratio = bytes_on_device(base, params) / float32
        assert ratio <= limit, f"{mode} ({source}): {ratio:.1%} of float32's bytes > {limit:.0%}"


@pytest.fixture(scope="module")
def int8_accuracy():
    base = real_default_model()
    return measure(base, {"int8": quant.quantize_params(base.params, "int8")})["int8"]


def test_int8_argmax_agrees_with_float32_at_95_percent_of_teacher_forced_positions(
        int8_accuracy):
    agreement, _ = int8_accuracy
    assert agreement >= 0.95, f"int8 argmax agrees at {agreement:.1%} of 32 x 64 positions"


def test_int8_next_token_distributions_stay_within_kl_0_01_of_float32(int8_accuracy):
    _, kl = int8_accuracy
    assert kl < 0.01, f"mean KL(float32 || int8) over 1,000 tokens is {kl:.5f}"
