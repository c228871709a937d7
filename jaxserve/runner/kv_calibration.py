"""fp8 KV scales computed at start-up (calculate_kv_scales): one calibration pass of the model
over a short built-in text with float KV pages, then k_scale = amax|K| / fp8 max and
v_scale = amax|V| / fp8 max of each layer. vLLM's --calculate-kv-scales also takes a per-layer
amax, but of the first batch it serves, over fixed constants (200 for K, 100 for V by default);
here the amax is CALIBRATION_TEXT's, so the scales do not depend on which request happens to
arrive first, and warm-up's all-padding batches never set them.

The pass runs the runner's own model (its graph and placed weights, so a tensor-parallel model is
calibrated where it lives) over a pool of float pages in the activation dtype, with the
reference attention, and reads the amax off the written pages: they hold K after RoPE and V,
exactly what fp8 pages would store. The pool is freed before the serving pool is made.

This module decides nothing about when scales are computed (engine/builder.py) and changes no
weight: it returns a copy of the model state with its kv_scales variable replaced.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxserve.model.quant import kv as kv_quant
from jaxserve.model.decoder.step_inputs import AttentionMetadata, ModelInputs

# Varied on purpose (prose, code, figures, a table, dialogue, a list): each kind of text moves
# a layer's K/V amax differently, and a scale below the serving text's amax clips.
CALIBRATION_TEXT = """\
The river rose three feet overnight, and by morning the lower fields were a brown lake. \
Farmers moved their cattle to the ridge while the county engineers argued about the levee.

def merge_sorted(a, b):
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        if a[i] <= b[j]:
            out.append(a[i]); i += 1
        else:
            out.append(b[j]); j += 1
    return out + a[i:] + b[j:]

Quarterly revenue: Q1 $4.2M (+12%), Q2 $3.9M (-7%), Q3 $5.1M (+31%), Q4 $6.0M (+18%).
| city | population | area (km2) |
| Lagos | 15,388,000 | 1,171 |
| Osaka | 19,060,000 | 225.2 |

"Are you coming tonight?" she asked. "Only if the train is on time," he said.
SELECT name, COUNT(*) FROM orders GROUP BY name HAVING COUNT(*) > 10 ORDER BY 2 DESC;
1. Preheat the oven to 220 C. 2. Whisk 3 eggs with 250 ml of milk. 3. Bake for 25 minutes.
Die Katze schläft auf dem Sofa. La lune brille au-dessus de la mer. 東京は日本の首都です。
"""


def wanted(calculate_kv_scales: bool, page_dtype, checkpoint_scales) -> bool:
    """Whether start-up runs the calibration pass: asked for, fp8 pages, and no scales in the
    checkpoint (the checkpoint's scales win; float pages take no scale)."""
    return bool(calculate_kv_scales) and kv_quant.is_fp8(page_dtype) and checkpoint_scales is None


def calibration_tokens(tokenizer, max_tokens: int) -> list[int]:
    """CALIBRATION_TEXT's token ids, at most max_tokens of them."""
    return tokenizer.encode(CALIBRATION_TEXT, add_special_tokens=False)[:max_tokens]


def scales_from_amax(amax: np.ndarray, page_dtype) -> np.ndarray:
    """[2, L] (k_scale, v_scale) from the [2, L] amax of |K| and |V|: amax / the fp8 format's
    largest finite value, so each layer's largest calibration value lands on the format's top;
    a layer whose amax is 0 keeps 1.0 (no value to place)."""
    amax = np.asarray(amax, np.float32)
    return np.where(amax > 0, amax / kv_quant.fp8_max(page_dtype), 1.0).astype(np.float32)


def layer_amax(k_pages: jax.Array, v_pages: jax.Array) -> jax.Array:
    """[2, L] float32 max |x| of each layer's K and V pages [L, N, page_size, Hkv, Dh]."""
    amax = lambda pages: jnp.max(jnp.abs(pages.astype(jnp.float32)), axis=(1, 2, 3, 4))
    return jnp.stack([amax(k_pages), amax(v_pages)])


def calibration_amax(graphdef, state, placement, token_ids: list[int], page_size: int,
                     dtype) -> np.ndarray:
    """[2, L] amax of |K| and |V| per layer over one prefill of token_ids by the model
    (graphdef, state), its pages in `dtype` (a float type) placed by `placement`."""
    n = len(token_ids)
    if n == 0:
        raise ValueError("the KV calibration text has no tokens")
    num_pages = 1 + -(-n // page_size)  # page 0 is the scratch page padding rows write to
    positions = np.arange(n, dtype=np.int32)
    inputs = ModelInputs(np.asarray(token_ids, np.int32), positions,
                         (page_size + positions).astype(np.int32),  # pages 1.. in order
                         np.asarray([n - 1], np.int32))
    metadata = AttentionMetadata(np.asarray([0, n], np.int32), np.asarray([n], np.int32),
                                 np.arange(1, num_pages, dtype=np.int32)[None, :],
                                 np.asarray(1, np.int32), np.asarray(0, np.int32))
    attention = placement.attention("reference", page_size, dtype, dtype)

    def run(state, kv, inputs, metadata):
        _, (k_pages, v_pages) = nnx.merge(graphdef, state)(inputs, metadata, kv, attention)
        return layer_amax(k_pages, v_pages)

    kv = placement.kv_cache(num_pages, page_size, dtype)
    amax = np.asarray(jax.jit(run)(state, kv, inputs, metadata))
    del kv
    return amax


def with_kv_scales(state, scales: np.ndarray):
    """A copy of the model state whose kv_scales variable holds `scales` [2, L] (same shape,
    dtype and placement as the one it replaces); every other leaf is the same array."""
    def replace(path, leaf):
        if getattr(path[0], "key", None) != "kv_scales":
            return leaf
        if tuple(leaf.shape) != scales.shape:
            raise ValueError(f"kv_scales has shape {tuple(leaf.shape)}, the computed scales "
                             f"{scales.shape}")
        return jax.device_put(jnp.asarray(scales, leaf.dtype), leaf.sharding)

    return jax.tree_util.tree_map_with_path(replace, state)
