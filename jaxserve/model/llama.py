"""The Llama-family decoder (Llama 2/3, SmolLM2, TinyLlama, Mistral, Qwen2) in Flax NNX.

One forward pass over the ragged token batch of a step, reading and writing the paged KV
cache. With `layer_loop="scan"` the layer weights stay stacked [L, ...] and `jax.lax.scan`
walks them (compile time flat in depth). With "unroll" each layer gets its own arrays: on the
CPU, slicing a layer out of a stacked array copies it every step, which measured 2.5-5x slower
than separate per-layer arrays (see the issue note), so the unrolled loop never slices.
This module knows nothing of requests or scheduling, and never runs the sampler.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxserve.model import layers
from jaxserve.model import pytrees  # noqa: F401  (registers the step inputs as pytrees)
from jaxserve.model.attention import PagedAttention
from jaxserve.model.config import ModelConfig
from jaxserve.step_inputs import AttentionMetadata, ModelInputs

# Names of the stacked per-layer weights, in ModelConfig.param_shapes() order.
LAYER_KEYS = ("attn_norm", "wq", "wk", "wv", "wo", "mlp_norm", "w_gate", "w_up", "w_down")
BIAS_KEYS = ("bq", "bk", "bv")


class LayerStack(nnx.Module):
    """All decoder layers' weights, stacked on axis 0."""

    def __init__(self, arrays: dict[str, jax.Array]):
        for key, value in arrays.items():
            setattr(self, key, nnx.Param(value))

    def as_dict(self) -> dict[str, jax.Array]:
        keys = LAYER_KEYS + tuple(k for k in BIAS_KEYS if hasattr(self, k))
        return {k: getattr(self, k)[...] for k in keys}


class Llama(nnx.Module):
    def __init__(self, config: ModelConfig, params: dict[str, np.ndarray], dtype=jnp.float32,
                 layer_loop: str = "scan"):
        expected = config.param_shapes()
        missing = sorted(set(expected) - set(params))
        if missing:
            raise ValueError(f"missing parameters: {', '.join(missing)}")
        for name, shape in expected.items():
            if tuple(params[name].shape) != shape:
                raise ValueError(f"parameter {name} has shape {tuple(params[name].shape)}, "
                                 f"expected {shape} from the model config")
        cast = lambda a: jnp.asarray(np.asarray(a), dtype=dtype)
        self.config = config
        self.embed = nnx.Param(cast(params["embed"]))
        if layer_loop not in ("scan", "unroll"):
            raise ValueError(f"layer_loop must be 'scan' or 'unroll', got {layer_loop!r}")
        stacked = {k[len("layers."):]: v for k, v in params.items() if k.startswith("layers.")}
        self.layer_loop = layer_loop
        if layer_loop == "scan":
            self.layers = LayerStack({k: cast(v) for k, v in stacked.items()})
        else:
            self.layers = nnx.List([LayerStack({k: cast(v[i]) for k, v in stacked.items()})
                                    for i in range(config.num_layers)])
        self.final_norm = nnx.Param(cast(params["final_norm"]))
        if not config.tie_word_embeddings:
            self.lm_head = nnx.Param(cast(params["lm_head"]))
        self.inv_freq = nnx.Variable(jnp.asarray(layers.rope_inv_freq(config)))

    def __call__(self, inputs: ModelInputs, metadata: AttentionMetadata,
                 kv: tuple[jax.Array, jax.Array], attention: PagedAttention):
        """Returns (logits [R, V] float32, updated kv). K/V pages: [L, N, page_size, Hkv, Dh].

        The attention backend prepares its per-step metadata once here, before the layer loop;
        every layer then reads the same prepared object."""
        cfg = self.config
        prepared = attention.prepare(metadata, inputs.token_ids.shape[0])
        x = self.embed[...][inputs.token_ids]  # [T, D]
        cos, sin = layers.rope_cos_sin(inputs.positions, self.inv_freq[...])
        page_size = kv[0].shape[2]
        write_page = inputs.slot_mapping // page_size
        write_offset = inputs.slot_mapping % page_size

        def layer(x, k_pages, v_pages, idx, w):
            h = layers.rms_norm(x, w["attn_norm"], cfg.rms_norm_eps)
            q, k, v = h @ w["wq"], h @ w["wk"], h @ w["wv"]
            if cfg.attention_bias:
                q, k, v = q + w["bq"], k + w["bk"], v + w["bv"]
            q = layers.apply_rope(q.reshape(-1, cfg.num_heads, cfg.head_dim), cos, sin)
            k = layers.apply_rope(k.reshape(-1, cfg.num_kv_heads, cfg.head_dim), cos, sin)
            v = v.reshape(-1, cfg.num_kv_heads, cfg.head_dim)
            k_pages = k_pages.at[idx, write_page, write_offset].set(k.astype(k_pages.dtype))
            v_pages = v_pages.at[idx, write_page, write_offset].set(v.astype(v_pages.dtype))
            attn = attention(q, k_pages, v_pages, idx, prepared,
                             sm_scale=1.0 / math.sqrt(cfg.head_dim))  # [T, Hq, Dh]
            x = x + attn.reshape(x.shape[0], cfg.q_size).astype(x.dtype) @ w["wo"]
            h = layers.rms_norm(x, w["mlp_norm"], cfg.rms_norm_eps)
            x = x + layers.swiglu(h, w["w_gate"], w["w_up"], w["w_down"])
            return x, k_pages, v_pages

        k_pages, v_pages = kv
        if self.layer_loop == "scan":
            def body(carry, xs):
                x, k_pages, v_pages = carry
                idx, w = xs
                return layer(x, k_pages, v_pages, idx, w), None

            idxs = jnp.arange(cfg.num_layers, dtype=jnp.int32)
            (x, k_pages, v_pages), _ = jax.lax.scan(body, (x, k_pages, v_pages),
                                                    (idxs, self.layers.as_dict()))
        else:
            for i, weights in enumerate(self.layers):
                x, k_pages, v_pages = layer(x, k_pages, v_pages, jnp.int32(i),
                                            weights.as_dict())

        h = layers.rms_norm(x[inputs.logits_indices], self.final_norm[...], cfg.rms_norm_eps)
        head = self.embed[...].T if cfg.tie_word_embeddings else self.lm_head[...]
        logits = jnp.dot(h, head, preferred_element_type=jnp.float32)
        return logits, (k_pages, v_pages)


def init_kv_cache(config: ModelConfig, num_pages: int, page_size: int, dtype=jnp.float32,
                  sharding=None) -> tuple[jax.Array, jax.Array]:
    """Zeroed K and V pages, each [L, num_pages, page_size, Hkv, Dh]."""
    shape = (config.num_layers, num_pages, page_size, config.num_kv_heads, config.head_dim)
    make = lambda: jnp.zeros(shape, dtype) if sharding is None else jax.device_put(
        jnp.zeros(shape, dtype), sharding)
    return make(), make()


def random_params(config: ModelConfig, seed: int = 0, scale: float = 0.05) -> dict[str, np.ndarray]:
    """Random float32 weights in the parameter layout (tests and benchmarks of tiny models)."""
    rng = np.random.default_rng(seed)
    params = {}
    for name, shape in config.param_shapes().items():
        if name.endswith("norm"):
            params[name] = (1.0 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
        else:
            params[name] = (scale * rng.standard_normal(shape)).astype(np.float32)
    return params
