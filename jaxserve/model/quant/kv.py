"""The KV cache's element type: kv_cache_dtype's names, and fp8 pages' quantization.

`resolve(name, activation_dtype)` turns a kv_cache_dtype setting (vLLM's names: auto, bfloat16,
float16, float32, fp8 = fp8_e4m3, fp8_e5m2) into the pages' dtype. fp8 pages hold each K/V
element divided by its layer's scale (k_scale, v_scale: from the checkpoint where it has them,
else from a calibration pass at start-up with calculate_kv_scales: runner/kv_calibration.py,
else 1.0), clipped to the format's finite range and rounded: `store` writes that, in the
model's layer, for every page dtype (a float page dtype is a plain cast, no scale). Reading
back, every attention path converts the fp8 elements to floats in its own kernel, and the
scales enter outside the kernels: `scaled_query` multiplies the query by k_scale (q . (k_scale
k) = (k_scale q) . k) and `scaled_output` the attention output by v_scale (sum_i p_i (v_scale
v_i) = v_scale sum_i p_i v_i), exactly the dequantized attention up to float rounding. Pages of
a float dtype take none of this: their traced step is the one without fp8.

This module holds no state and knows nothing of pages or requests.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from jaxserve.config.settings import KV_CACHE_DTYPES

FP8_DTYPES = {"fp8": jnp.float8_e4m3fn, "fp8_e4m3": jnp.float8_e4m3fn,
              "fp8_e5m2": jnp.float8_e5m2}
FLOAT_DTYPES = {"bfloat16": jnp.bfloat16, "float16": jnp.float16, "float32": jnp.float32}


def resolve(name: str, activation_dtype) -> jnp.dtype:
    """The pages' dtype for kv_cache_dtype `name` (auto: activation_dtype); any other name is
    a ValueError naming kv_cache_dtype and the allowed values."""
    if name == "auto":
        return jnp.dtype(activation_dtype)
    if name in FP8_DTYPES:
        return jnp.dtype(FP8_DTYPES[name])
    if name in FLOAT_DTYPES:
        return jnp.dtype(FLOAT_DTYPES[name])
    raise ValueError(f"kv_cache_dtype={name!r} is invalid: must be one of {KV_CACHE_DTYPES}")


def is_fp8(dtype) -> bool:
    return jnp.dtype(dtype) in (jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2))


def fp8_max(dtype) -> float:
    """The largest finite value of an fp8 dtype (448 for e4m3fn, 57344 for e5m2)."""
    return float(jnp.finfo(dtype).max)


def default_scales(num_layers: int) -> np.ndarray:
    """[2, L] float32 ones: (k_scale, v_scale) of each layer for a checkpoint without scales."""
    return np.ones((2, num_layers), np.float32)


def check_scales(scales: np.ndarray, num_layers: int) -> np.ndarray:
    """scales as [2, L] float32, or a ValueError naming kv_scales (shape, non-positive or
    non-finite values)."""
    scales = np.asarray(scales, np.float32)
    if scales.shape != (2, num_layers):
        raise ValueError(f"kv_scales has shape {scales.shape}, expected (2, {num_layers}): "
                         f"k_scale and v_scale of each layer")
    if not np.all(np.isfinite(scales)) or np.any(scales <= 0):
        raise ValueError(f"kv_scales must be finite and > 0; got {scales.tolist()}")
    return scales


def store(x, page_dtype, scale):
    """x [..., D] as the page dtype stores it: fp8 = round(clip(x / scale, -max, max)) (scale: a
    float32 scalar); a float dtype = a plain cast (scale unused)."""
    if not is_fp8(page_dtype):
        return x.astype(page_dtype)
    limit = fp8_max(page_dtype)
    return jnp.clip(x.astype(jnp.float32) / scale, -limit, limit).astype(page_dtype)


def layer_scales(scales, layer, page_dtype):
    """(k_scale, v_scale) float32 scalars of `layer` from the [2, L] scales when the pages are
    fp8, else (None, None): float pages trace no scale at all."""
    if not is_fp8(page_dtype):
        return None, None
    return scales[0, layer], scales[1, layer]


def scaled_query(q, k_scale):
    """q [T, Hq, D] times k_scale (None: q as it is), in float32, back in q's dtype."""
    return q if k_scale is None else (q.astype(jnp.float32) * k_scale).astype(q.dtype)


def scaled_output(out, v_scale):
    """Attention output [T, Hq, D] times v_scale (None: as it is)."""
    return out if v_scale is None else (out.astype(jnp.float32) * v_scale).astype(out.dtype)


def describe(page_dtype, scales, calibrated: bool = False) -> str:
    """The pages' dtype for the start-up log, with where fp8 scales came from (calibrated: a
    calibration pass at start-up, else the checkpoint; scales None: 1.0)."""
    name = jnp.dtype(page_dtype).name
    if not is_fp8(page_dtype):
        return name
    if scales is None:
        return f"{name} (k_scale = v_scale = 1.0: the checkpoint has no KV scales)"
    scales = np.asarray(scales)
    source = "KV scales from the calibration pass" if calibrated else "the checkpoint's KV scales"
    return (f"{name} ({source}: k_scale {scales[0].min():.4g}..{scales[0].max():.4g}, "
            f"v_scale {scales[1].min():.4g}..{scales[1].max():.4g})")
