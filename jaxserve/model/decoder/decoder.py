"""The decoder every supported family runs (Llama 2/3, SmolLM2, Mistral, Qwen2/3, Gemma 3, Phi-3,
and the mixture-of-experts Qwen3-MoE, Mixtral and gpt-oss).

One forward pass over the ragged token batch of a step, reading and writing the paged KV
cache. What differs between families is read from data, never from the family's name: the
`Family` record (norm kind, q/k norm, sandwich norms, embedding scale) and the checkpoint's
`ModelConfig` (biases, activation, partial rotary, RoPE and sliding window per layer, attention
scale, logit soft-caps, experts: model/decoder/moe.py). With LoRA adapters each projection adds its
token rows' adapter deltas (model/decoder/lora.py).

With `layer_loop="scan"` the layer weights stay stacked [L, ...] and `jax.lax.scan` walks them
(compile time flat in depth). A scan body is one static layer, so when layers differ in their
sliding window or RoPE (Gemma 3's local/global alternation, Qwen's max_window_layers) the loop
is unrolled whatever layer_loop says. With "unroll" each layer gets its own arrays: on the CPU,
slicing a layer out of a stacked array copies it every step, which measured 2.5-5x slower than
separate per-layer arrays (measured on the 2-core CPU), so the unrolled loop never slices.
KV pages of an fp8 dtype are written quantized with the layer's k_scale / v_scale (a [2, L]
variable, 1.0 unless the checkpoint gives them) and read through model/quant/kv.py's scaled
query and output; float pages trace none of it. This module knows nothing of requests or
scheduling, and never runs the sampler.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxserve.model.quant import kv as kv_quant
from jaxserve.model.decoder import layers
from jaxserve.model.decoder import moe
from jaxserve.model.decoder import rope
from jaxserve.model.decoder import lora as lora_ops
from jaxserve.model.quant.qlinear import QuantizedWeight, head, linear, lookup
from jaxserve.model.quant.formats import QuantizedTensor
from jaxserve.model.quant.select import MatmulForm
from jaxserve.model.decoder import pytrees  # noqa: F401  (registers the step inputs as pytrees)
from jaxserve.model.decoder.attention import PagedAttention
from jaxserve.model.config import ModelConfig
from jaxserve.model.decoder.step_inputs import AttentionMetadata, ModelInputs

# Every per-layer weight name a config can have (ModelConfig.param_shapes() says which it has).
LAYER_KEYS = ("attn_norm", "wq", "wk", "wv", "wo", "bq", "bk", "bv", "bo", "q_norm", "k_norm",
              "sinks", "post_attn_norm", "mlp_norm", "w_gate", "w_up", "w_down", "post_mlp_norm",
              "router", "router_bias", "e_gate", "e_up", "e_down", "e_gate_bias", "e_up_bias",
              "e_down_bias")


class LayerKind(NamedTuple):
    """What may differ between layers, statically: the attention window and which RoPE."""

    sliding_window: int | None
    rope: int  # index into the model's distinct RoPEs


def layer_plan(config: ModelConfig):
    """(distinct (theta, scaling) RoPEs, each layer's LayerKind)."""
    ropes = list(dict.fromkeys(config.layer_rope(i) for i in range(config.num_layers)))
    kinds = tuple(LayerKind(config.layer_windows[i], ropes.index(config.layer_rope(i)))
                  for i in range(config.num_layers))
    return ropes, kinds


class LayerStack(nnx.Module):
    """One or all decoder layers' weights (stacked on axis 0 for the scan); a quantized matrix
    is a QuantizedWeight, whose value() the matmuls dequantize (model/quant/qlinear.py)."""

    def __init__(self, arrays: dict):
        for key, value in arrays.items():
            setattr(self, key, _param(value))

    def as_dict(self) -> dict:
        return {k: _value(getattr(self, k)) for k in LAYER_KEYS if hasattr(self, k)}


def _value(param):
    """A weight as the step reads it: an array, or a QArray of a quantized one."""
    return param.value() if isinstance(param, QuantizedWeight) else param[...]


def _param(value):
    return value if isinstance(value, QuantizedWeight) else nnx.Param(value)


def _layer(value, index: int):
    return value.layer(index) if isinstance(value, QuantizedTensor) else value[index]


class Llama(nnx.Module):
    def __init__(self, config: ModelConfig, params: dict[str, np.ndarray], dtype=jnp.float32,
                 layer_loop: str = "scan", experts=None, quant_form: MatmulForm | None = None,
                 kv_scales=None):
        """experts: how a MoE layer computes its routed pairs (moe.moe_mlp's experts_fn; None:
        all experts here, unsharded); quant_form: how quantized matrices are multiplied
        (model/quant/select.py; None: the backend's "auto"); both static in the graph.
        kv_scales: [2, L] k_scale and v_scale of each layer for fp8 KV pages (None: 1.0)."""
        expected = config.param_shapes()
        missing = sorted(set(expected) - set(params))
        if missing:
            raise ValueError(f"missing parameters: {', '.join(missing)}")
        for name, shape in expected.items():
            if tuple(params[name].shape) != shape:
                raise ValueError(f"parameter {name} has shape {tuple(params[name].shape)}, "
                                 f"expected {shape} from the model config")
        if layer_loop not in ("scan", "unroll"):
            raise ValueError(f"layer_loop must be 'scan' or 'unroll', got {layer_loop!r}")
        def cast(a):  # quantized weights keep their stored dtypes
            if isinstance(a, QuantizedTensor):
                return QuantizedWeight(a, quant_form)
            # a jax array stays one: traced weights (nnx.eval_shape) must not reach numpy
            return jnp.asarray(a if isinstance(a, jax.Array) else np.asarray(a), dtype=dtype)

        self.compute_dtype = jnp.dtype(dtype)
        self.config = config
        self.experts = experts
        ropes, self.kinds = layer_plan(config)
        if len(set(self.kinds)) > 1:
            layer_loop = "unroll"  # a scan body cannot change its window or RoPE per layer
        self.layer_loop = layer_loop
        self.embed = _param(cast(params["embed"]))
        stacked = {k[len("layers."):]: v for k, v in expected.items() if k.startswith("layers.")}
        if layer_loop == "scan":
            self.layers = LayerStack({k: cast(params[f"layers.{k}"]) for k in stacked})
        else:
            self.layers = nnx.List([LayerStack({k: cast(_layer(params[f"layers.{k}"], i))
                                                for k in stacked})
                                    for i in range(config.num_layers)])
        self.final_norm = nnx.Param(cast(params["final_norm"]))
        if not config.tie_word_embeddings:
            self.lm_head = _param(cast(params["lm_head"]))
        # [num_ropes, rotary_dim // 2]; cos and sin are scaled by each RoPE's attention factor.
        self.inv_freq = nnx.Variable(jnp.asarray(np.stack(
            [rope.inv_freq(theta, config.rotary_dim, scaling) for theta, scaling in ropes])))
        self.rope_factors = tuple(rope.attention_factor(scaling) for _, scaling in ropes)
        self.kv_scales = nnx.Variable(jnp.asarray(kv_quant.check_scales(
            kv_quant.default_scales(config.num_layers) if kv_scales is None else kv_scales,
            config.num_layers)))  # [2, L] float32

    def __call__(self, inputs: ModelInputs, metadata: AttentionMetadata,
                 kv: tuple[jax.Array, jax.Array], attention: PagedAttention, *,
                 return_hidden: bool = False, adapters: lora_ops.Adapters | None = None):
        """Returns (logits [R, V] float32, updated kv), and with return_hidden the last layer's
        output of every row [T, D] too (model.logits of it: every row's logits). K/V pages:
        [L, N, page_size, Hkv, Dh]. adapters: the resident LoRA adapters and each row's slot
        (model/decoder/lora.py); None: no adapters.

        The attention backend prepares its per-step metadata once here, before the layer loop;
        every layer then reads the same prepared object."""
        cfg, family = self.config, self.config.family
        prepared = attention.prepare(metadata, inputs.token_ids.shape[0])
        x = lookup(_value(self.embed), inputs.token_ids, self.compute_dtype)  # [T, D]
        if family.embed_scale:  # transformers rounds the scale to the model dtype first
            x = x * jnp.asarray(np.float32(math.sqrt(cfg.hidden_size))).astype(x.dtype)
        ropes = [layers.rope_cos_sin(inputs.positions, self.inv_freq[...][r], factor)
                 for r, factor in enumerate(self.rope_factors)]  # each [T, 1, rotary_dim // 2]
        page_size = kv[0].shape[2]
        kv_scales = self.kv_scales[...]  # [2, L]: read by fp8 pages only
        write_page = inputs.slot_mapping // page_size
        write_offset = inputs.slot_mapping % page_size
        deltas = (None if adapters is None
                  else lora_ops.StepAdapters(adapters.stacks, adapters.slots, x.dtype))

        def norm(h, weight):
            return layers.rms_norm(h, weight, cfg.rms_norm_eps, family.norm_plus_one)

        def layer(x, k_pages, v_pages, idx, w, kind: LayerKind, lw):
            def proj(h, key):  # a projection, and the rows' adapter deltas (lw: the layer's)
                y = linear(h, w[key])
                return y if deltas is None else deltas.add(y, h, lw, key)

            h = norm(x, w["attn_norm"])
            q, k, v = proj(h, "wq"), proj(h, "wk"), proj(h, "wv")
            if cfg.attention_bias:
                q, k, v = q + w["bq"], k + w["bk"], v + w["bv"]
            q = q.reshape(-1, cfg.num_heads, cfg.head_dim)     # [T, Hq, Dh]
            k = k.reshape(-1, cfg.num_kv_heads, cfg.head_dim)  # [T, Hkv, Dh]
            v = v.reshape(-1, cfg.num_kv_heads, cfg.head_dim)
            if family.qk_norm:
                q, k = norm(q, w["q_norm"]), norm(k, w["k_norm"])
            cos, sin = ropes[kind.rope]
            q, k = layers.apply_rope(q, cos, sin), layers.apply_rope(k, cos, sin)
            k_scale, v_scale = kv_quant.layer_scales(kv_scales, idx, k_pages.dtype)
            k_pages = k_pages.at[idx, write_page, write_offset].set(
                kv_quant.store(k, k_pages.dtype, k_scale))
            v_pages = v_pages.at[idx, write_page, write_offset].set(
                kv_quant.store(v, v_pages.dtype, v_scale))
            attn = attention(kv_quant.scaled_query(q, k_scale), k_pages, v_pages, idx, prepared,
                             sm_scale=cfg.attention_scale, sliding_window=kind.sliding_window,
                             soft_cap=cfg.attn_logit_softcap,
                             sinks=w.get("sinks"))  # [T, Hq, Dh]
            attn = kv_quant.scaled_output(attn, v_scale)
            out = proj(attn.reshape(x.shape[0], cfg.q_size).astype(x.dtype), "wo")
            if cfg.output_bias:
                out = out + w["bo"]
            if family.sandwich_norms:
                out = norm(out, w["post_attn_norm"])
            x = x + out
            h = norm(x, w["mlp_norm"])
            if cfg.num_experts:
                out = moe.moe_mlp(h, w, cfg, self.experts)
            else:  # layers.gated_mlp, each projection through proj
                act = layers.ACTIVATIONS[cfg.hidden_act]
                out = proj(act(proj(h, "w_gate")) * proj(h, "w_up"), "w_down")
            if family.sandwich_norms:
                out = norm(out, w["post_mlp_norm"])
            return x + out, k_pages, v_pages

        k_pages, v_pages = kv
        if self.layer_loop == "scan":
            def body(carry, xs):
                x, k_pages, v_pages = carry
                idx, w, lw = xs
                return layer(x, k_pages, v_pages, idx, w, self.kinds[0], lw), None

            idxs = jnp.arange(cfg.num_layers, dtype=jnp.int32)
            lws = {} if adapters is None else lora_ops.stacked_weights(adapters.stacks)
            (x, k_pages, v_pages), _ = jax.lax.scan(body, (x, k_pages, v_pages),
                                                    (idxs, self.layers.as_dict(), lws))
        else:
            for i, weights in enumerate(self.layers):
                lw = {} if adapters is None else lora_ops.layer_weights(adapters.stacks, i)
                x, k_pages, v_pages = layer(x, k_pages, v_pages, jnp.int32(i),
                                            weights.as_dict(), self.kinds[i], lw)

        logits = self.logits(x[inputs.logits_indices])
        if return_hidden:
            return logits, (k_pages, v_pages), x
        return logits, (k_pages, v_pages)

    def logits(self, x):
        """The final norm and head (and final soft-cap) of hidden rows [R, D] -> [R, V] f32."""
        cfg = self.config
        h = layers.rms_norm(x, self.final_norm[...], cfg.rms_norm_eps, cfg.family.norm_plus_one)
        if cfg.tie_word_embeddings:
            logits = head(h, _value(self.embed), transposed=False)
        else:
            logits = head(h, _value(self.lm_head), transposed=True)
        return layers.soft_cap(logits, cfg.final_logit_softcap)


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
    unit = 0.0 if config.family.norm_plus_one else 1.0  # norm weights that scale by about 1
    params = {}
    for name, shape in config.param_shapes().items():
        if name.endswith("norm"):
            params[name] = (unit + 0.1 * rng.standard_normal(shape)).astype(np.float32)
        else:
            params[name] = (scale * rng.standard_normal(shape)).astype(np.float32)
    return params
