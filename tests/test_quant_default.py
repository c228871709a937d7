"""Quantized weights of the real default model: their bytes on device, and int8's accuracy
against float32, teacher-forced (tests/quant_accuracy.py measures; these tests hold the
accuracy targets).

int8 here is what `--quantization int8` serves where int8 activations run (the CPU, TPUs with
an int8 MXU): the GGUF's blocks requantized per output channel at load, the same arrays as
quantizing the float32 weights (the path every Hugging Face or Orbax model takes). It is
measured in both forms model/quant/select.py chooses: the CPU's (jaxserve's int8 kernel,
chunked dequantization) and the accelerators' (XLA's int8 x int8 -> int32 dot, as a TPU's MXU
runs it, fused dequantization); the GGUF's own int8 mapping is exact (test_quant.py).
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

from jaxserve.model.cpu import ffi as cpu_ffi
from jaxserve.model.quant import formats as quant
from jaxserve.model.loaders.loader import load_model
from jaxserve.model.quant.select import MatmulForm
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


def test_the_served_int8_is_the_float32_weights_quantized_per_channel():
    served = load_model("default", progress=False, quantization="int8", int8_per_channel=True)
    want = quant.quantize_params(real_default_model().params, "int8")
    for name, t in served.params.items():
        if isinstance(t, quant.QuantizedTensor):
            assert np.array_equal(t.q, want[name].q), name
            assert np.array_equal(t.scale, want[name].scale), name


FORMS = {"cpu": (MatmulForm(int8_activations=True, chunked=True), "auto"),
         "accelerator": (MatmulForm(int8_activations=True, chunked=False), "off")}


@pytest.fixture(scope="module", params=list(FORMS))
def int8_accuracy(request):
    base = real_default_model()
    form, kernels = FORMS[request.param]
    served = load_model("default", progress=False, quantization="int8", int8_per_channel=True)
    with cpu_ffi.using(cpu_ffi.KernelSettings(mode=kernels)):
        return request.param, measure(base, {"int8": served.params}, form)["int8"]


def test_int8_argmax_agrees_with_float32_at_95_percent_of_teacher_forced_positions(
        int8_accuracy):
    form, (agreement, _) = int8_accuracy
    assert agreement >= 0.95, \
        f"int8 ({form} form) argmax agrees at {agreement:.1%} of 32 x 64 positions"


def test_int8_next_token_distributions_stay_within_kl_0_01_of_float32(int8_accuracy):
    form, (_, kl) = int8_accuracy
    assert kl < 0.01, f"mean KL(float32 || int8, {form} form) over 1,000 tokens is {kl:.5f}"
