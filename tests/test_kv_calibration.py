"""calculate_kv_scales (runner/kv_calibration.py): each layer's fp8 k_scale / v_scale is the
amax of that layer's K / V over the calibration pass divided by the fp8 format's largest value,
the pass is asked for only with fp8 pages and no checkpoint scales, and the engine serves with
the scales it computed. The default model's accuracy with them: test_fp8_kv_default.py.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from conftest import make_llm
from jaxserve import SamplingParams
from jaxserve.runner import kv_calibration
from jaxserve.runner.tensor_parallel import Placement

E4M3, E5M2 = jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2)


def _pages(layer_values):
    """K or V pages [L, 3, 4, 2, 8], zero but for one element per layer set to its value."""
    pages = np.zeros((len(layer_values), 3, 4, 2, 8), np.float32)
    for layer, value in enumerate(layer_values):
        pages[layer, 1 + layer % 2, layer, layer % 2, 5] = value
    return jnp.asarray(pages)


@pytest.mark.parametrize("page_dtype,largest", [(E4M3, 448.0), (E5M2, 57344.0)])
def test_scales_are_each_layers_amax_over_the_fp8_formats_largest_value(page_dtype, largest):
    k_values, v_values = [3.5, -12.0, 0.75], [-0.5, 2.0, -40.0]  # largest |x| may be negative
    amax = np.asarray(kv_calibration.layer_amax(_pages(k_values), _pages(v_values)))
    np.testing.assert_array_equal(amax, np.abs([k_values, v_values]),
                                  err_msg="amax is not each layer's largest |K| and |V|")
    scales = kv_calibration.scales_from_amax(amax, page_dtype)
    assert scales.shape == (2, 3) and scales.dtype == np.float32, (scales.shape, scales.dtype)
    np.testing.assert_allclose(scales, np.abs([k_values, v_values]) / largest, rtol=1e-6,
                               err_msg="scales are not amax / the format's largest value")


def test_a_layer_whose_amax_is_zero_keeps_scale_one():
    scales = kv_calibration.scales_from_amax(np.array([[0.0, 4.48], [8.96, 0.0]]), E4M3)
    np.testing.assert_allclose(scales, [[1.0, 0.01], [0.02, 1.0]], rtol=1e-6)


def test_calibration_runs_only_for_fp8_pages_without_checkpoint_scales():
    ones = np.ones((2, 2), np.float32)
    assert kv_calibration.wanted(True, E4M3, None)
    assert kv_calibration.wanted(True, E5M2, None)
    assert not kv_calibration.wanted(True, E4M3, ones), "checkpoint scales must win"
    assert not kv_calibration.wanted(True, jnp.bfloat16, None), "float pages take no scale"
    assert not kv_calibration.wanted(False, E4M3, None), "calibration was not asked for"


def test_calibrated_scales_put_each_layers_largest_kv_on_the_fp8_maximum(monkeypatch):
    """The calibration text through fp8 pages quantized with the scales computed from it: the
    first layer's largest |K| and |V| element is exactly e4m3's 448 (its K/V are the float
    pass's); later layers' K/V move by the fp8 error of the layers before, so theirs is near
    448 and never above (a value above would clip)."""
    import quant_accuracy as qa
    from tiny_models import tiny_model

    for name, value in dict(NUM_PAGES=32, S=4, SEQ_PAGES=6).items():
        monkeypatch.setattr(qa, name, value)
    config, params = tiny_model(seed=3)
    tokens = [3 + (7 * i) % 90 for i in range(40)]
    placement = Placement(None, config)
    graphdef, state = placement.model(params, jnp.float32, "scan")
    amax = kv_calibration.calibration_amax(graphdef, state, placement, tokens, qa.PAGE_SIZE,
                                           jnp.float32)
    assert amax.shape == (2, config.num_layers) and np.all(amax > 0), amax
    scales = kv_calibration.scales_from_amax(amax, E4M3)
    model = qa.Forward(config, params, kv_dtype=E4M3, kv_scales=scales)
    model.step([(tokens, 0)], 64, 4)
    stored = np.stack([np.abs(np.asarray(p, np.float32)).max(axis=(1, 2, 3, 4))
                       for p in model.kv])  # [2, L]
    np.testing.assert_array_equal(stored[:, 0], [448.0, 448.0],
                                  err_msg="layer 0's largest K/V is not on the fp8 maximum")
    assert np.all(stored[:, 1:] >= 300.0), f"later layers' largest |K|, |V| in fp8: {stored}"


def test_with_kv_scales_replaces_the_scales_and_nothing_else():
    from tiny_models import tiny_model

    config, params = tiny_model(seed=1)
    placement = Placement(None, config)
    _, state = placement.model(params, jnp.float32, "scan")
    scales = np.array([[0.5, 0.25], [2.0, 4.0]], np.float32)
    new = kv_calibration.with_kv_scales(state, scales)
    np.testing.assert_array_equal(np.asarray(new["kv_scales"][...]), scales)
    np.testing.assert_array_equal(np.asarray(state["kv_scales"][...]), np.ones((2, 2)),
                                  err_msg="the state given was changed in place")
    np.testing.assert_array_equal(np.asarray(new["embed"][...]), np.asarray(state["embed"][...]))


def test_the_engine_serves_fp8_pages_with_the_scales_of_its_calibration_pass():
    from tiny_models import tiny_loaded

    llm = make_llm(kv_cache_dtype="fp8", calculate_kv_scales=True)  # tiny_loaded(seed=0)
    runner = llm.engine.runner
    served = np.asarray(runner.step.state["kv_scales"][...])  # what every compiled step reads
    np.testing.assert_array_equal(served, runner.kv_scales)
    loaded = tiny_loaded(seed=0)
    placement = Placement(None, loaded.config)
    graphdef, state = placement.model(loaded.params, jnp.float32, "scan")
    tokens = kv_calibration.calibration_tokens(loaded.tokenizer, 512)  # max_model_len 512
    amax = kv_calibration.calibration_amax(graphdef, state, placement, tokens, 16, jnp.float32)
    np.testing.assert_allclose(served, amax / 448.0, rtol=1e-6,
                               err_msg="served scales are not the calibration text's amax / 448")
    out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4, temperature=0.0),
                       use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4, "the engine did not serve"
