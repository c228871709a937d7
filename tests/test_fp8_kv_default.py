"""The fp8 KV cache on the real default model: teacher-forced next-token agreement with float32
KV pages (tests/quant_accuracy.py: 32 prompts x 64 positions, both models fed the float32-KV
model's greedy tokens), float32 weights on both sides, fp8 e4m3 pages with scales 1.0 (a GGUF
has no KV scales). Measured on the CPU: 99.7% (docs/quantization.md, "fp8 KV cache").
"""

from __future__ import annotations

import jax.numpy as jnp

from model_fixtures import real_default_model
from quant_accuracy import PROMPTS, Forward, teacher_forced_agreement


def test_fp8_kv_argmax_agrees_with_float32_kv_at_95_percent_of_teacher_forced_positions():
    base = real_default_model()
    prompts = [base.tokenizer.encode(p, add_special_tokens=False) for p in PROMPTS]
    reference = Forward(base.config, base.params)
    fp8 = Forward(base.config, base.params, kv_dtype=jnp.float8_e4m3fn)
    assert fp8.kv[0].dtype == jnp.float8_e4m3fn
    agreement = teacher_forced_agreement(reference, fp8, prompts)
    assert agreement >= 0.95, f"fp8 KV argmax agrees at {agreement:.1%} of 32 x 64 positions"
