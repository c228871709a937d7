"""One device's share of the mixture-of-experts FFN under tensor or expert parallelism.

Every device holds the same tokens and routes them the same way (the router is replicated), so
each knows every (token, expert) pair. A device holds `num_local` experts from `first_expert`
on (all of them under plain tensor parallelism), each cut to its share of the width F. It
computes only its own pairs through model/decoder/moe.py's two paths, unchanged:
* gathered (few pairs): a pair held elsewhere reads a local expert's matrices (any: it stays
  finite) and gets router weight 0, so it adds nothing;
* grouped: a pair held elsewhere gets the id num_local, so it sorts after every local group,
  counts in no group of the ragged_dot, and is masked out of the sum.
The result is this device's partial [T, D] float32 sum: over its experts, and over its share
of F (the down projection's rows), so the runner's psum over the whole mesh completes it. An
expert's down-projection bias is added once per expert, by the device holding its first F
share (owns_down_bias). This module knows no mesh and no axis names: the runner
(runner/tensor_parallel.py) passes the device's place in them.
"""

from __future__ import annotations

import jax.numpy as jnp

from jaxserve.model.decoder import moe


def local_experts(x, weights, experts, w: dict, config, *, first_expert, num_local: int,
                  owns_down_bias):
    """x [T, D]; weights [T, k] float32, experts [T, k] int32 (global ids, as routed on every
    device); w: this device's expert weights (e_gate / e_up [num_local, D, F_local], e_down
    [num_local, F_local, D], the biases likewise). first_expert: the global id of w's first
    expert; owns_down_bias: whether this device adds its experts' e_down_bias (both may be
    traced scalars). Returns this device's partial sum [T, D] float32."""
    local_id = experts - first_expert
    here = (local_id >= 0) & (local_id < num_local)
    weights = jnp.where(here, weights, 0.0)
    if "e_down_bias" in w:
        w = {**w, "e_down_bias": jnp.where(owns_down_bias, w["e_down_bias"],
                                           jnp.zeros_like(w["e_down_bias"]))}
    if experts.size <= config.num_experts:  # the same choice as moe.compute_experts
        return moe.gathered_experts(x, weights, jnp.where(here, local_id, 0), w, config)
    return moe.grouped_experts(x, weights, jnp.where(here, local_id, num_local), w, config,
                               num_experts=num_local)
