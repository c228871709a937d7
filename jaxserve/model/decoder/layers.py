"""Stateless building blocks of the decoder: RMSNorm (w or 1 + w), RoPE (full or partial), the
gated MLP (SwiGLU / GeGLU) and logit soft-capping.

Pure functions over jnp arrays; they hold no weights and know nothing about paging or families.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxserve.model.quant.qlinear import linear


def rms_norm(x, weight, eps: float, plus_one: bool = False):
    """x: [..., D]; computed in float32, returned in x's dtype. plus_one: scale by (1 + w)."""
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    w = weight.astype(jnp.float32)
    return (xf * (1.0 + w if plus_one else w)).astype(x.dtype)


def rope_cos_sin(positions, inv_freq, attention_factor: float = 1.0):
    """positions: [T] -> cos, sin: [T, 1, rotary_dim // 2] (float32)."""
    angles = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]
    cos, sin = jnp.cos(angles)[:, None, :], jnp.sin(angles)[:, None, :]
    if attention_factor != 1.0:
        cos, sin = cos * attention_factor, sin * attention_factor
    return cos, sin


def apply_rope(x, cos, sin):
    """Rotate-half RoPE (Hugging Face layout) on the first 2 * cos.shape[-1] features of each
    head; the rest pass through (partial rotary). x: [T, H, head_dim]."""
    half = cos.shape[-1]
    xf = x.astype(jnp.float32)
    x1, x2, rest = xf[..., :half], xf[..., half:2 * half], xf[..., 2 * half:]
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest], axis=-1)
    return out.astype(x.dtype)


ACTIVATIONS = {"silu": jax.nn.silu,
                "gelu_pytorch_tanh": lambda x: jax.nn.gelu(x, approximate=True),
                "gelu_new": lambda x: jax.nn.gelu(x, approximate=True),
                "gelu": lambda x: jax.nn.gelu(x, approximate=False)}


def gated_mlp(x, w_gate, w_up, w_down, activation: str = "silu"):
    """act(x @ w_gate) * (x @ w_up) @ w_down (SwiGLU for silu, GeGLU for gelu). x: [T, D];
    weights float [in, out] or quantized (qlinear.linear dequantizes them next to the matmul)."""
    gate = ACTIVATIONS[activation](linear(x, w_gate))
    return linear(gate * linear(x, w_up), w_down)


def swiglu(x, w_gate, w_up, w_down):
    """x: [T, D] -> [T, D]."""
    return gated_mlp(x, w_gate, w_up, w_down, "silu")


def soft_cap(x, cap: float | None):
    """cap * tanh(x / cap), or x when cap is None."""
    return x if cap is None else cap * jnp.tanh(x / cap)
