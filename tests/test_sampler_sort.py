"""The sampler sorts the vocabulary only when some sampling row asks for top-k or top-p: greedy,
temperature and min-p rows never reach the sort, and the filters' results are unchanged.

The structural checks read the HLO call graph: every sort must sit in a computation reachable
from the entry only through a conditional's branch. The lowered module (for `cuda`, and for
the CPU) is what XLA receives; the CPU's compiled module shows that its passes keep the
branch. A GPU's compiled module is not checked here (no GPU).
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.runner import sampler

S, V = 4, 64


def _abstract_rows():
    f = jax.ShapeDtypeStruct
    return (f((S, V), jnp.float32), f((S,), jnp.float32), f((S,), jnp.int32),
            f((S,), jnp.float32), f((S,), jnp.float32))


def _computations(hlo: str) -> dict[str, str]:
    """HLO text -> {computation name: its body}; the entry is named "ENTRY"."""
    comps, name, body = {}, None, []
    for line in hlo.splitlines():
        head = re.match(r"^(ENTRY\s+)?%?([^\s(]+).*\{\s*$", line)
        if name is None and head:
            name, body = ("ENTRY" if head.group(1) else head.group(2)), []
        elif name is not None and line.startswith("}"):
            comps[name], name = "\n".join(body), None
        elif name is not None:
            body.append(line)
    return comps


def _unconditional_sorts(hlo: str) -> tuple[list[str], int]:
    """(computations holding a sort that the entry reaches without a conditional branch,
    number of sort instructions in the module)."""
    comps = _computations(hlo)
    edges = r"(?:to_apply|calls|body|condition)=%?([\w.\-]+)"
    reached, todo = set(), ["ENTRY"]
    while todo:
        c = todo.pop()
        if c in reached or c not in comps:
            continue
        reached.add(c)
        todo.extend(re.findall(edges, comps[c]))
    has_sort = {c for c, body in comps.items() if re.search(r"\ssort\(", body)}
    total = sum(len(re.findall(r"\ssort\(", body)) for body in comps.values())
    return sorted(has_sort & reached), total


@pytest.mark.parametrize("platform", ["cuda", "cpu"])
def test_the_lowered_filter_sorts_only_inside_a_conditional_branch(platform):
    lowered = jax.jit(sampler.filter_logits).trace(*_abstract_rows()).lower(
        lowering_platforms=(platform,))
    outside, total = _unconditional_sorts(lowered.as_text(dialect="hlo"))
    assert total > 0, "no sort at all: top-k / top-p have nothing to run on"
    assert not outside, f"sorted outside any conditional branch, in {outside}"


def test_the_cpu_compiled_filter_keeps_the_sort_in_a_branch():
    compiled = jax.jit(sampler.filter_logits).lower(*_abstract_rows()).compile()
    outside, total = _unconditional_sorts(compiled.as_text())
    assert total > 0, "XLA removed the sort"
    assert not outside, f"XLA's CPU passes hoisted the sort out of its branch: {outside}"


def test_the_structural_check_sees_an_unconditional_sort():
    """The check can fail: the sorted filter alone sorts unconditionally."""
    lowered = jax.jit(lambda x, k, p, m: sampler._sorted_filter(x, k, p, m)).lower(
        *_abstract_rows()[:1], *_abstract_rows()[2:])
    outside, _ = _unconditional_sorts(lowered.as_text(dialect="hlo"))
    assert outside, "a bare sort was not found outside the branches"


@pytest.mark.parametrize("temperature,top_k,top_p,want", [
    ([0.0, 0.0], [0, 0], [1.0, 1.0], False),      # greedy
    ([0.7, 1.0], [0, 0], [1.0, 1.0], False),      # plain temperature
    ([0.0, 0.8], [5, 0], [0.5, 1.0], False),      # top-k / top-p on a greedy row only
    ([0.8, 0.8], [0, V], [1.0, 1.0], False),      # top-k of the whole vocabulary
    ([0.8, 0.0], [5, 0], [1.0, 1.0], True),       # top-k
    ([0.0, 0.8], [0, 0], [1.0, 0.9], True),       # top-p
])
def test_the_sort_runs_only_for_sampling_rows_with_top_k_or_top_p(temperature, top_k, top_p,
                                                                  want):
    got = sampler.sort_needed(jnp.asarray(temperature), jnp.asarray(top_k, jnp.int32),
                              jnp.asarray(top_p), V)
    assert bool(got) == want, f"sort_needed={bool(got)} for t={temperature} k={top_k} p={top_p}"


@pytest.mark.parametrize("min_p", [0.0, 0.05, 0.3, 1.0])
def test_min_p_without_a_sort_keeps_what_the_sorted_filter_keeps(min_p):
    rng = np.random.default_rng(int(min_p * 100))
    scaled = jnp.asarray(rng.standard_normal((S, V)) * 3, jnp.float32)
    top_k, top_p = jnp.zeros(S, jnp.int32), jnp.ones(S, jnp.float32)
    min_ps = jnp.full(S, min_p, jnp.float32)
    want = sampler._sorted_filter(scaled, top_k, top_p, min_ps)
    got = sampler._min_p_filter(scaled, top_k, top_p, min_ps)
    np.testing.assert_array_equal(np.isfinite(got), np.isfinite(want),
                                  err_msg=f"min_p={min_p}: kept tokens differ")
    np.testing.assert_array_equal(np.asarray(got)[np.isfinite(got)],
                                  np.asarray(want)[np.isfinite(want)])


def test_a_top_k_row_among_temperature_rows_is_still_filtered():
    rng = np.random.default_rng(0)
    logits = jnp.asarray(rng.standard_normal((S, V)), jnp.float32)
    temperature = jnp.asarray([0.7, 1.0, 0.0, 0.5], jnp.float32)
    top_k = jnp.asarray([3, 0, 0, 0], jnp.int32)
    top_p, min_p = jnp.ones(S, jnp.float32), jnp.zeros(S, jnp.float32)
    got = np.asarray(sampler.filter_logits(logits, temperature, top_k, top_p, min_p))
    assert np.isfinite(got[0]).sum() == 3, "the top-k row kept more than its 3 tokens"
    assert np.isfinite(got[1]).all(), "a plain temperature row lost tokens"


@pytest.mark.parametrize("k", [1, 2, 3, 5, 10])
def test_top_k_alone_keeps_exactly_k_tokens(k):
    """top_p = 1: the top k's probability mass may round below 1 in float32; the tail past k
    stays out whatever the rounding."""
    rng = np.random.default_rng(0)
    scaled = jnp.asarray(rng.standard_normal((S, V)), jnp.float32) / 0.7
    got = sampler._sorted_filter(scaled, jnp.full(S, k, jnp.int32), jnp.ones(S, jnp.float32),
                                 jnp.zeros(S, jnp.float32))
    kept = np.isfinite(np.asarray(got)).sum(axis=1)
    assert (kept == k).all(), f"top_k={k} kept {kept} tokens per row"
