"""The int8 form of each token bucket on the CPU (model/quant/bucket_forms.py, measured by
model/quant/measure.py, applied by the runner): the fastest measured candidate is chosen, the
choice is stored beside the compile cache and read back instead of measuring again, and each
bucket's step is traced in its own form. Timings are injected: nothing here reads a clock.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.model.quant import qlinear
from jaxserve.model.quant import formats as quant
from jaxserve.model.quant import bucket_forms as qbf
from jaxserve.model.quant import measure as quant_measure
from jaxserve.model.quant.select import MatmulForm

BASE = MatmulForm(int8_activations=True, chunked=True)
NAMES = ("int8-kernel", "int8-xla", "dequantize")
FINGERPRINT = {"cpu": "AMD EPYC avx2 fma", "matrices": [[64, 64]]}


def _never(rows):
    raise AssertionError(f"measured bucket {rows} although its choice was stored")


def test_the_fastest_candidate_is_chosen_for_each_bucket():
    timings = {1: {"int8-kernel": 0.012, "int8-xla": 0.024, "dequantize": 0.035},
               64: {"int8-kernel": 0.61, "int8-xla": 0.95, "dequantize": 0.43}}
    assert qbf.choose(timings) == {1: "int8-kernel", 64: "dequantize"}, \
        "each bucket must take its least time"


def test_equal_timings_choose_the_earlier_candidate():
    assert qbf.fastest({"int8-kernel": 0.5, "dequantize": 0.5}) == "int8-kernel", \
        "a tie must go to the candidate listed first"


def test_without_the_kernel_only_xla_int8_and_dequantize_are_candidates():
    assert tuple(qbf.candidates(BASE, kernel_available=False)) == ("int8-xla", "dequantize")
    forms = qbf.candidates(BASE, kernel_available=True)
    assert forms["int8-xla"] == MatmulForm(True, True, int8_kernel=False), forms
    assert forms["dequantize"] == MatmulForm(False, True), "dequantize keeps the dequant form"


def test_a_measured_choice_is_stored_and_read_back_without_measuring(tmp_path):
    rows = {1: (1, 1), 16: (16, 16)}
    measured = {(1, 1): {"int8-kernel": 1.0, "int8-xla": 2.0, "dequantize": 3.0},
                (16, 16): {"int8-kernel": 3.0, "int8-xla": 2.0, "dequantize": 1.0}}
    first, record = qbf.select(rows, NAMES, FINGERPRINT, tmp_path, lambda r: measured[r])
    assert first == {1: "int8-kernel", 16: "dequantize"}, first
    assert record["source"] == "measured", record
    again, record = qbf.select(rows, NAMES, FINGERPRINT, tmp_path, _never)
    assert again == first, f"read back {again}, stored {first}"
    assert record["source"] == "cached", record
    assert ("T=16 dequantize (int8-kernel 3000.0 ms, int8-xla 2000.0 ms, dequantize 1000.0 ms)"
            in qbf.describe(again, record)), \
        "the log line must name each bucket's form and the stored timings"


def test_another_cpu_measures_again(tmp_path):
    rows = {4: (4, 4)}
    qbf.select(rows, NAMES, FINGERPRINT, tmp_path, lambda r: {"int8-kernel": 1.0,
                                                              "dequantize": 2.0})
    other = {**FINGERPRINT, "cpu": "Intel Xeon avx512f avx512_vnni"}
    forms, record = qbf.select(rows, NAMES, other, tmp_path,
                               lambda r: {"int8-kernel": 2.0, "dequantize": 1.0})
    assert forms == {4: "dequantize"} and record["source"] == "measured", \
        "a choice stored for one CPU must not be read on another"


def test_a_damaged_record_is_measured_again(tmp_path):
    rows = {1: (1, 1)}
    qbf.select(rows, NAMES, FINGERPRINT, tmp_path, lambda r: {"int8-xla": 1.0})
    for stored in (tmp_path / qbf.SUBDIR).glob("*.json"):
        stored.write_text("{not json")
    forms, record = qbf.select(rows, NAMES, FINGERPRINT, tmp_path,
                               lambda r: {"dequantize": 1.0})
    assert forms == {1: "dequantize"} and record["source"] == "measured", record


def _int8_weight(out: int = 48, inp: int = 64) -> qlinear.QArray:
    w = np.random.default_rng(0).standard_normal((out, inp)).astype(np.float32)
    t = quant.quantize_int8(w, transposed=False)
    return qlinear.QArray(jnp.asarray(t.q), jnp.asarray(t.scale), None, 8, inp, BASE)


def _dot_operand_dtypes(fn, *args) -> set[str]:
    jaxpr = jax.make_jaxpr(fn)(*args)
    return {str(e.invars[0].aval.dtype) for e in jaxpr.jaxpr.eqns
            if e.primitive.name == "dot_general"}


def test_a_bucket_form_outranks_the_weights_own_form():
    w, x = _int8_weight(), jnp.ones((4, 64), jnp.float32)
    own = _dot_operand_dtypes(lambda a: qlinear.linear(a, w), x)

    def dequantized(a):
        with qlinear.matmul_form(MatmulForm(False, True)):
            return qlinear.linear(a, w)

    assert "float32" not in own, f"int8 activations expected by the weight's form: {own}"
    assert _dot_operand_dtypes(dequantized, x) == {"float32"}, \
        "inside matmul_form(dequantize) the matmul must be a float dot"


def test_the_runner_traces_each_bucket_in_its_measured_form(tmp_path, monkeypatch):
    from jaxserve.runner import model_runner
    from tiny_models import tiny_model

    config, params = tiny_model()
    monkeypatch.setattr(model_runner, "compile_cache_path", lambda cache_dir: str(tmp_path))
    fake = {1: {"int8-kernel": 1.0, "int8-xla": 2.0, "dequantize": 3.0},
            4: {"int8-kernel": 3.0, "int8-xla": 2.0, "dequantize": 1.0}}
    monkeypatch.setattr(quant_measure, "time_forms",
                        lambda model, forms, rows, dtype: {n: fake[rows[0]][n] for n in forms})
    runner = model_runner.ModelRunner(
        config, quant.quantize_params(params, "int8"), num_pages=8, page_size=16,
        max_model_len=64, max_num_seqs=2, max_num_batched_tokens=4, token_buckets=(1, 4))
    runner.measure_bucket_forms()
    kernel = "int8-kernel" if runner.bucket_forms[1] == "int8-kernel" else "int8-xla"
    assert runner.bucket_forms == {1: kernel, 4: "dequantize"}, runner.bucket_forms
    step = runner.step
    for (t, s), int8 in (((1, 1), True), ((4, 2), False)):
        text = step._jitted.trace(step.leaves, step.kv, step.empty_inputs((t, s))).lower(
            ).as_text()
        quantized_rows = f"tensor<{2 * t}x64xi8>"  # [2T, hidden]: two int8 levels of T rows
        assert (quantized_rows in text) == int8, \
            f"bucket T={t}: int8 activations {'expected' if int8 else 'not expected'}"
