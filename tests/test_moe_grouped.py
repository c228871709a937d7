"""The MoE layer lowered for a GPU stays grouped: at the largest token bucket of an H100's
defaults, with Qwen3-30B-A3B's expert shapes, its expert matmuls do work in proportion to the
(token, expert) pairs, not to tokens x experts.

XLA's GPU backend rewrites any ragged_dot (at its default flags) into one dot over every
expert, the rows masked per expert: an [E, M, D] temporary and E times the work. The checks,
on abstract arrays lowered for `cuda` on the CPU (no weights, nothing compiled):
* the StableHLO module holds no ragged_dot and no array near [E, M, D];
* the dots of the branch a `cuda` lowering keeps, loop trip counts included, multiply at most
  the routed pairs' rows padded to whole tiles (about 2M rows) through the expert matrices.
What only a GPU's compiled HLO can show is not checked here: that XLA's GPU passes keep each
batched dot one batched GEMM, where the expert gathers land, the step's peak memory and time.
"""

from __future__ import annotations

import math
import re

import jax
import jax.numpy as jnp
import pytest
from jax.extend import core as jex_core

from jaxserve.model.device import defaults as device_defaults
from jaxserve.model.decoder import expert_matmul
from jaxserve.model.decoder import moe
from jaxserve.model.config import ModelConfig

# Qwen3-30B-A3B's mixture of experts
E, K, D, F = 128, 8, 2048, 768
T = max(device_defaults.H100.token_buckets(device_defaults.H100.max_num_batched_tokens))
M = T * K
CONFIG = ModelConfig(vocab_size=151936, hidden_size=D, intermediate_size=6144, num_layers=1,
                     num_heads=32, num_kv_heads=4, head_dim=128, architecture="qwen3moe",
                     num_experts=E, num_experts_per_tok=K, moe_intermediate_size=F,
                     norm_topk_prob=True)


def _abstract_layer():
    s, bf16 = jax.ShapeDtypeStruct, jnp.bfloat16
    w = {"router": s((D, E), bf16), "e_gate": s((E, D, F), bf16), "e_up": s((E, D, F), bf16),
         "e_down": s((E, F, D), bf16)}
    return s((T, D), bf16), w


def _traced(form: str):
    """The layer traced with JAXSERVE_MOE_GROUPED=form (a fresh function: read at trace)."""
    saved, expert_matmul.GROUPED = expert_matmul.GROUPED, form
    try:
        return jax.jit(lambda x, w: moe.moe_mlp(x, w, CONFIG)).trace(*_abstract_layer())
    finally:
        expert_matmul.GROUPED = saved


def _array_sizes(module: str) -> list[int]:
    """Elements of every ranked tensor type the StableHLO text names."""
    return [math.prod(int(d) for d in dims.split("x")[:-1])
            for dims in re.findall(r"tensor<((?:\d+x)+)\w+>", module)]


def _dot_flops(jaxpr, platform: str) -> int:
    """2 x multiply-adds of every dot_general, scan and while bodies times their trip count,
    of the platform_dependent branch a lowering for `platform` keeps."""
    total = 0
    for eqn in jaxpr.eqns:
        params = eqn.params
        if eqn.primitive.name == "dot_general":
            (contract, _), _ = params["dimension_numbers"]
            lhs = eqn.invars[0].aval.shape
            total += 2 * math.prod(eqn.outvars[0].aval.shape) * math.prod(
                lhs[i] for i in contract)
        elif eqn.primitive.name == "ragged_dot_general":
            raise AssertionError("ragged_dot in the step: XLA's GPU backend expands it over "
                                 "every expert")
        elif eqn.primitive.name == "cond" and params.get("branches_platforms"):
            kept = next(b for b, ps in zip(params["branches"], params["branches_platforms"])
                        if ps is None or platform in ps)
            total += _dot_flops(kept.jaxpr, platform)
        elif eqn.primitive.name == "cond":
            total += max(_dot_flops(b.jaxpr, platform) for b in params["branches"])
        else:
            trips = params["length"] if eqn.primitive.name == "scan" else 1
            for sub in jex_core.jaxprs_in_params(params):
                total += trips * _dot_flops(sub, platform)
    return total


def test_the_largest_h100_bucket_is_qwen3_30b_a3b_sized():
    assert (T, M) == (8192, 65536), f"the H100's largest bucket is {T} tokens, not 8192"


def test_the_cuda_lowering_holds_no_ragged_dot():
    module = _traced("auto").lower(lowering_platforms=("cuda",)).as_text()
    assert "ragged_dot" not in module, "a ragged_dot reaches XLA's GPU backend"


def test_no_array_of_the_cuda_lowering_approaches_experts_times_pairs():
    module = _traced("auto").lower(lowering_platforms=("cuda",)).as_text()
    # the largest arrays the grouped form needs: an expert stack, and the padded tiles of pairs
    # (at most 2M rows); the masked expansion's [E, M, D] is E / 4 times this bound
    bound = 2 * max(E * D * F, 2 * M * D)
    largest = max(_array_sizes(module))
    assert largest <= bound, f"an array of {largest:.3g} elements (bound {bound:.3g})"


def test_the_cuda_branch_multiplies_about_twice_the_routed_rows_at_most():
    routed = 3 * 2 * M * D * F                                  # gate, up, down per pair
    router = 2 * T * D * E
    tile = M // E
    # each expert's group padded to whole tiles, and one tile for rows of no group
    padded = routed * (M + (E + 1) * tile) / M
    flops = _dot_flops(_traced("auto").jaxpr.jaxpr, "cuda")
    assert routed + router <= flops <= padded + router, (
        f"{(flops - router) / routed:.3f}x the routed pairs' work, "
        f"tiles pad to {padded / routed:.3f}x")


@pytest.mark.parametrize("form", ["ragged_dot"])
def test_the_work_count_sees_a_dot_over_every_expert(form):
    """The checks can fail: the ragged_dot form, as XLA's GPU backend rewrites it, is one dot
    over every expert."""
    with pytest.raises(AssertionError, match="ragged_dot in the step"):
        _dot_flops(_traced(form).jaxpr.jaxpr, "cuda")
    module = _traced(form).lower(lowering_platforms=("cuda",)).as_text()
    assert "chlo.ragged_dot" in module, "the ragged_dot form lowered without a ragged_dot"


def test_the_tpu_lowering_keeps_ragged_dot():
    """XLA's TPU backend keeps ragged_dot a grouped matmul: the TPU's form stays it."""
    module = _traced("auto").lower(lowering_platforms=("tpu",)).as_text()
    assert module.count("\"chlo.ragged_dot\"(") == 3, "the TPU step lost its three ragged_dots"
