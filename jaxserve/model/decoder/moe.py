"""The mixture-of-experts feed-forward layer: a router picks each token's top-k experts, and the
experts run as a grouped matmul over the (token, expert) pairs sorted by expert.

Dropless: every pair is computed (no capacity factor), and every shape is static per bucket
(T tokens give M = T * k pairs whatever the router chose), so a new expert mix never compiles.
How the pairs meet their experts is chosen statically from M:
* M <= num_experts (decode of a few requests): each pair gathers its expert's matrices, so a
  step reads only the experts it uses -- the active parameters, not the total.
* otherwise: the pairs sorted by expert, one group per expert, through a grouped matmul
  (expert_matmul.grouped): `jax.lax.ragged_dot` on TPU, which XLA keeps grouped there; on the
  CPU and GPU, where XLA computes ragged_dot as one dot over every expert, each group padded
  to whole tiles and a loop over the tiles (expert_matmul.tiled): at most about 2M rows of
  work.
Routers (families/base.py Family.router): a softmax over every expert then the top k, optionally
renormalised (Qwen3-MoE's norm_topk_prob, Mixtral always), or the top k logits then a softmax
over them (gpt-oss). The expert matrices may be quantized (int8 / int4;
model/decoder/expert_matmul.py
does the matmuls either way); the router stays float. Pure functions of arrays; this module
holds no weights and knows nothing of paging, meshes or files (one device's share under expert
parallelism: moe_shard.py).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxserve.model.decoder import expert_matmul
from jaxserve.model.families.base import ROUTE_TOPK_SOFTMAX
from jaxserve.model.decoder.layers import ACTIVATIONS
from jaxserve.model.quant.qlinear import linear


def route(logits, k: int, router: str, renormalize: bool):
    """logits [T, E] float32 -> (weights [T, k] float32, experts [T, k] int32)."""
    if router == ROUTE_TOPK_SOFTMAX:
        top, experts = jax.lax.top_k(logits, k)
        return jax.nn.softmax(top, axis=-1), experts.astype(jnp.int32)
    top, experts = jax.lax.top_k(jax.nn.softmax(logits, axis=-1), k)
    if renormalize:
        top = top / jnp.sum(top, axis=-1, keepdims=True)
    return top, experts.astype(jnp.int32)


def expert_activation(gate, up, config):
    """The gated product of one expert's two projections (float32 in and out)."""
    if config.family.expert_activation == "clamped_swiglu":
        limit, alpha = config.swiglu_limit, config.swiglu_alpha
        gate = jnp.minimum(gate, limit)
        up = jnp.clip(up, -limit, limit)
        return (up + 1.0) * gate * jax.nn.sigmoid(gate * alpha)
    return ACTIVATIONS[config.hidden_act](gate) * up


def moe_mlp(x, w: dict, config, experts_fn=None):
    """x [T, D] -> [T, D]: the routed experts' outputs weighted by the router. w: one layer's
    weights ("router" [D, E], "e_gate"/"e_up" [E, D, F], "e_down" [E, F, D], the family's
    biases). experts_fn(x, weights, experts, w, config) computes the routed pairs (default
    `compute_experts`; under tensor or expert parallelism the runner's sharded one, which calls
    moe_shard.local_experts on each device)."""
    logits = linear(x.astype(jnp.float32), w["router"]).astype(jnp.float32)
    if "router_bias" in w:
        logits = logits + w["router_bias"].astype(jnp.float32)
    # (in float32 whatever the model's dtype: a bfloat16 router flips near-tied experts)
    weights, experts = route(logits, config.num_experts_per_tok, config.family.router,
                             config.norm_topk_prob)
    return (experts_fn or compute_experts)(x, weights, experts, w, config).astype(x.dtype)


def compute_experts(x, weights, experts, w: dict, config):
    """[T, D] float32: every routed pair through its expert, all experts held here."""
    if experts.size <= config.num_experts:
        return gathered_experts(x, weights, experts, w, config)
    return grouped_experts(x, weights, experts, w, config)


def gathered_experts(x, weights, experts, w: dict, config):
    """Each (token, expert) pair reads its own expert's matrices: [T, k] pairs, M <= E."""
    def project(h, name):  # h [T, k, in] -> [T, k, out], each pair through its expert
        out = expert_matmul.gathered(h, w[name], experts)
        if f"{name}_bias" in w:
            out = out + w[f"{name}_bias"][experts].astype(jnp.float32)
        return out

    h = jnp.broadcast_to(x[:, None, :], (*experts.shape, x.shape[-1]))
    hidden = expert_activation(project(h, "e_gate"), project(h, "e_up"), config)
    out = project(hidden.astype(x.dtype), "e_down")              # [T, k, D]
    return jnp.einsum("tkd,tk->td", out, weights)


def grouped_experts(x, weights, experts, w: dict, config, num_experts: int | None = None):
    """The pairs sorted by expert, each group through its expert by ragged_dot, then summed
    back per token with the router's weights. num_experts: the experts w holds (default all);
    a pair whose expert id is num_experts or more is held elsewhere: it sorts last, outside
    every group, and adds nothing."""
    k = experts.shape[-1]
    num_experts = config.num_experts if num_experts is None else num_experts
    flat = experts.reshape(-1)                                    # [M]
    order = jnp.argsort(flat, stable=True)
    token = order // k
    expert_of_row = jnp.minimum(flat[order], num_experts - 1)  # (for the bias gathers)
    held = flat[order] < num_experts
    sizes = jnp.bincount(flat, length=num_experts).astype(jnp.int32)
    rows = x[token]                                               # [M, D]

    def project(h, name):
        out = expert_matmul.grouped(h, w[name], sizes, expert_of_row)
        if f"{name}_bias" in w:
            out = out + w[f"{name}_bias"][expert_of_row].astype(jnp.float32)
        return out

    hidden = expert_activation(project(rows, "e_gate"), project(rows, "e_up"), config)
    out = project(hidden.astype(x.dtype), "e_down") * weights.reshape(-1)[order][:, None]
    out = jnp.where(held[:, None], out, 0.0)  # rows of no group
    return jnp.zeros((x.shape[0], out.shape[-1]), jnp.float32).at[token].add(out)
