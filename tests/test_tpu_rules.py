"""The TPU tiling/packing rules (pallas_kernels/tpu_rules.py) and the TPU kernel against them.

Three layers, all on the CPU: the rule functions on hand-written accesses (legal ones pass, the
old per-head page copy and strided loads over packed rows fail); `tpu_rules.check` on every
configuration the engine can select from tuning.py's "tpu" row; and the kernel itself, traced
(its DMAs, folds, bitcasts and strided loads read out of the kernel's jaxpr and held to the
same rules, and compared with what the rules model says it issues) and lowered for "tpu"
(Pallas -> Mosaic MLIR in a tpu_custom_call). Mosaic's own layout passes and VMEM allocation
run in libtpu and are not exercised here.
"""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import metadata, tpu_rules, tuning
from pallas_kernels.tpu_rules import DYNAMIC, Access, TpuConfig

E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2
HEAD_DIMS, KV_HEADS, PAGE_SIZES = (64, 96, 128, 256), (1, 2, 4, 8, 16), (16, 32, 64, 128)
KV_DTYPES, Q_DTYPES = (jnp.float32, jnp.bfloat16, E4M3, E5M2), (jnp.bfloat16, jnp.float32)
GROUPS = (1, 8)              # query heads per KV head: rows of a decode block are 8 either way
MAX_SEQS, MAX_MODEL_LEN, MAX_TOKENS = 256, 8192, 8192   # a serving-size page table and batch


def problems(a: Access) -> list[str]:
    return tpu_rules.RULES[a.kind](a)


def test_a_dma_of_whole_pages_with_all_heads_is_legal():
    for dtype in KV_DTYPES:
        page = Access("dma", "page", (2, 64, 16, 8, 128), dtype, (DYNAMIC, DYNAMIC, None, None,
                                                                   None))
        assert problems(page) == [], f"whole-page DMA of {dtype.__name__} refused"


@pytest.mark.parametrize("dtype,rows", [(jnp.float32, 8), (jnp.bfloat16, 16), (E4M3, 32)])
def test_a_dma_slice_on_tile_boundaries_is_legal_and_one_off_it_is_not(dtype, rows):
    legal = Access("dma", "rows", (4, 4 * rows, 128), dtype, (0, (rows, 2 * rows), None))
    cut = Access("dma", "rows", (4, 4 * rows, 128), dtype, (0, (rows, rows + 1), None))
    assert problems(legal) == [], f"a slice of whole {rows}-row tiles was refused"
    assert problems(cut), f"a slice ending inside a {rows}-row tile was allowed"


@pytest.mark.parametrize("dtype", KV_DTYPES)
@pytest.mark.parametrize("num_kv_heads", [h for h in KV_HEADS if h > 1])
def test_the_old_per_head_page_copy_cuts_a_tile(dtype, num_kv_heads):
    """`k_hbm.at[layer, page, :, h, :]`: one sublane row of each (Hkv, D) tile."""
    for h in (0, num_kv_heads - 1):
        old = Access("dma", "one head of a page", (2, 64, 16, num_kv_heads, 128), dtype,
                     (DYNAMIC, DYNAMIC, None, h, None))
        assert any("not whole tiles" in p for p in problems(old)), (
            f"head {h} of {num_kv_heads} in {dtype.__name__} passed the DMA rule")
    head_from_program_id = Access("dma", "one head", (2, 64, 16, num_kv_heads, 128), dtype,
                                  (DYNAMIC, DYNAMIC, None, DYNAMIC, None))
    assert problems(head_from_program_id), "a run-time head index of a tiled dim was allowed"


@pytest.mark.parametrize("dtype,packing", [(jnp.bfloat16, 2), (E4M3, 4), (E5M2, 4)])
def test_strided_loads_on_packed_rows_need_a_step_of_whole_words(dtype, packing):
    for step in range(1, 2 * packing + 1):
        access = Access("strided_load", "head", (1024, 128), dtype, step=step)
        assert (problems(access) == []) == (step % packing == 0), (
            f"step {step} over {dtype.__name__} judged wrongly")


def test_strided_loads_on_32_bit_rows_take_any_step():
    for dtype, step in itertools.product((jnp.float32, np.uint32), range(1, 17)):
        assert problems(Access("strided_load", "head", (1024, 128), dtype, step=step)) == []


@pytest.mark.parametrize("dtype,exact,padded", [
    (jnp.float32, (1, 2, 4, 8, 16), (3, 5, 6, 12)),
    (jnp.bfloat16, (2, 4, 8, 16, 32), (1, 3, 6, 12)),
    (E4M3, (4, 8, 16, 32), (1, 2, 6, 12))])
def test_a_head_dimension_folds_only_where_its_tiling_has_no_padding(dtype, exact, padded):
    for heads in exact:
        assert problems(Access("fold", "buf", (128, heads, 128), dtype)) == [], (
            f"{heads} heads of {np.dtype(dtype).name} should fold")
    for heads in padded:
        assert problems(Access("fold", "buf", (128, heads, 128), dtype)), (
            f"{heads} heads of {np.dtype(dtype).name} are tile-padded, yet folded")


def engine_configs():
    """Every configuration the engine's TPU backend can give the kernel."""
    sizes = tuning.block_sizes("tpu")
    for hd, hkv, kv, q, ps, group, stats in itertools.product(
            HEAD_DIMS, KV_HEADS, KV_DTYPES, Q_DTYPES, PAGE_SIZES, GROUPS, (False, True)):
        tile_pages = tuning.pages_per_tile(ps, sizes)
        tokens = tuning.tokens_per_block(group, sizes.q_block_rows)
        entries = MAX_SEQS * (MAX_MODEL_LEN // ps)
        yield "ragged", TpuConfig(hd, hkv, kv, q, ps, tile_pages,
                                  tuning.block_rows(group, tokens, sizes), stats,
                                  metadata.num_ragged_blocks(MAX_TOKENS, MAX_SEQS, tokens),
                                  entries)
        yield "decode", TpuConfig(hd, hkv, kv, q, ps, tile_pages,
                                  tuning.block_rows(group, 1, sizes), stats, MAX_SEQS, entries)


def test_every_engine_configuration_passes_the_rules():
    failures = {f"{kind} {c}": tpu_rules.check(c) for kind, c in engine_configs()}
    failures = {k: v for k, v in failures.items() if v}
    assert not failures, f"{len(failures)} engine configurations break the rules, e.g. " \
                         f"{next(iter(failures.items()))}"


def test_the_engine_configurations_take_both_head_reads():
    taken = {tpu_rules.head_access(c) for _, c in engine_configs()}
    assert taken == {"fold", "widen"}, f"head reads taken: {taken}"


def test_a_configuration_over_the_vmem_budget_is_refused_naming_vmem():
    big = TpuConfig(256, 16, jnp.float32, jnp.float32, 128, 8, 128, True)
    assert any(p.startswith("VMEM") for p in tpu_rules.check(big)), tpu_rules.check(big)


def test_a_page_table_over_scalar_memory_is_refused_naming_smem():
    huge = TpuConfig(128, 8, jnp.bfloat16, jnp.bfloat16, 16, 8, 128,
                     page_table_entries=1024 * 1024)
    assert any(p.startswith("SMEM") for p in tpu_rules.check(huge)), tpu_rules.check(huge)


def test_head_counts_that_no_dtype_tiles_exactly_are_refused_naming_kv_heads():
    for heads in (3, 5, 6, 7):
        c = TpuConfig(128, heads, jnp.bfloat16, jnp.bfloat16, 16, 8, 128)
        assert any("KV heads" in p for p in tpu_rules.check(c)), f"{heads} heads accepted"


# The kernel itself: traced and lowered for "tpu" at abstract shapes.

SPREAD = [  # head_dim, KV heads, KV dtype, q dtype, page size, kernel, sinks
    (128, 1, jnp.bfloat16, jnp.bfloat16, 16, "ragged", False),
    (64, 2, E4M3, jnp.bfloat16, 32, "decode", False),
    (256, 16, jnp.float32, jnp.float32, 128, "ragged", True),
    (96, 4, E5M2, jnp.bfloat16, 64, "split decode", False),
    (128, 8, jnp.bfloat16, jnp.bfloat16, 16, "ragged", True),
    (128, 1, jnp.float32, jnp.float32, 32, "decode", True),
    (64, 16, E4M3, jnp.float32, 128, "ragged", False),
]


def kernel_fn(kind, sinks):
    from pallas_kernels.paged_attention import paged_attention
    from pallas_kernels.ragged_paged_attention import ragged_paged_attention
    kw = {"sm_scale": 0.1}
    if kind == "ragged":
        return lambda q, k, v, layer, kv, table, cu, n, s: ragged_paged_attention(
            q, k, v, layer, kv, table, cu, n, sinks=s if sinks else None, soft_cap=30.0,
            sliding_window=256, **kw)
    splits = 4 if kind == "split decode" else 1
    return lambda q, k, v, layer, kv, table, cu, n, s: paged_attention(
        q, k, v, layer, kv, table, sinks=s if sinks else None, num_kv_splits=splits, **kw)


def abstract_args(hd, hkv, kv, q, ps, kind, group=4):
    sds = jax.ShapeDtypeStruct
    seqs, tokens = 8, (8 if "decode" in kind else 64)
    cache = sds((2, 64, ps, hkv, hd), kv)
    return (sds((tokens, group * hkv, hd), q), cache, cache, sds((), jnp.int32),
            sds((seqs,), jnp.int32), sds((seqs, 8), jnp.int32), sds((seqs + 1,), jnp.int32),
            sds((), jnp.int32), sds((group * hkv,), jnp.float32))


def _index(indexer, shape):
    out = []
    for i, dim in zip(indexer.indices, shape):
        if isinstance(i, int):
            out.append(i)
        elif hasattr(i, "start") and hasattr(i, "size"):
            static = isinstance(i.start, int) and isinstance(i.size, int)
            out.append(None if (static and i.start == 0 and i.size == dim) else
                       (i.start, i.size) if static else DYNAMIC)
        else:
            out.append(DYNAMIC)
    return tuple(out)


def _ref_accesses(kind, aval, transforms):
    shape, dtype, found = tuple(aval.shape), np.dtype(aval.dtype), []
    for t in transforms:
        name = type(t).__name__
        if name == "NDIndexer":
            if kind == "dma":
                found.append(Access("dma", "traced DMA", shape, dtype, _index(t, shape)))
            elif t.indices and getattr(t.indices[0], "stride", 1) > 1:
                found.append(Access("strided_load", "traced load", shape, dtype,
                                    step=t.indices[0].stride))
            shape = tuple(t.get_indexer_shape())
        elif name == "ReshapeTransform":
            found.append(Access("fold", "traced fold", shape, dtype))
            shape = tuple(t.shape)
        elif name == "BitcastTransform":
            found.append(Access("bitcast", "traced bitcast", shape, dtype))
            ratio = np.dtype(t.dtype).itemsize / dtype.itemsize
            shape, dtype = shape[:-2] + (int(shape[-2] / ratio), shape[-1]), np.dtype(t.dtype)
    return found


def traced_accesses(fn, args) -> list[Access]:
    """Every DMA and VMEM load access inside the kernel jaxpr of fn(*args)."""
    found = []

    def visit(jaxpr):
        for e in jaxpr.eqns:
            name = e.primitive.name
            if name in ("dma_start", "get"):
                leaves = [v.aval for v in e.invars]
                if name == "dma_start":
                    refs = jax.tree_util.tree_unflatten(e.params["tree"], leaves)[:2]
                    for ref in refs:
                        found.extend(_ref_accesses("dma", ref.ref, ref.transforms))
                else:
                    transforms = jax.tree_util.tree_unflatten(e.params["tree"], leaves[1:])
                    found.extend(_ref_accesses("load", leaves[0], transforms))
            for value in e.params.values():
                for sub in value if isinstance(value, (tuple, list)) else (value,):
                    sub = getattr(sub, "jaxpr", sub)
                    if hasattr(sub, "eqns"):
                        visit(sub)

    visit(jax.make_jaxpr(fn)(*args).jaxpr)
    return found


def _signature(accesses):
    return {(a.kind, a.shape, np.dtype(a.dtype).name, a.step) for a in accesses
            if a.kind != "dma"}


@pytest.mark.parametrize("hd,hkv,kv,q,ps,kind,sinks", SPREAD)
def test_the_traced_kernel_issues_what_the_rules_model_says_and_it_is_legal(
        hd, hkv, kv, q, ps, kind, sinks, monkeypatch):
    monkeypatch.setattr(tuning, "backend", lambda: "tpu")
    accesses = traced_accesses(kernel_fn(kind, sinks), abstract_args(hd, hkv, kv, q, ps, kind))
    dmas = [a for a in accesses if a.kind == "dma"]
    assert dmas, "no DMA traced: the walk of the kernel jaxpr found nothing"
    broken = {p for a in accesses for p in problems(a)}
    assert not broken, f"the traced kernel breaks the rules: {sorted(broken)}"
    sizes = tuning.block_sizes("tpu")
    config = TpuConfig(hd, hkv, kv, q, ps, tuning.pages_per_tile(ps, sizes), 8)
    assert _signature(accesses) == _signature(tpu_rules.accesses(config)), (
        f"traced {sorted(_signature(accesses))} != modelled "
        f"{sorted(_signature(tpu_rules.accesses(config)))}")


@pytest.mark.parametrize("hd,hkv,kv,q,ps,kind,sinks", SPREAD)
def test_the_kernel_lowers_to_a_tpu_custom_call(hd, hkv, kv, q, ps, kind, sinks, monkeypatch):
    monkeypatch.setattr(tuning, "backend", lambda: "tpu")
    lowered = jax.jit(kernel_fn(kind, sinks)).trace(
        *abstract_args(hd, hkv, kv, q, ps, kind)).lower(lowering_platforms=("tpu",))
    assert "custom_call @tpu_custom_call" in lowered.as_text(), (
        f"{kind} with {hkv} {np.dtype(kv).name} KV heads: no Mosaic kernel in the HLO")


def test_the_kernel_refuses_a_configuration_the_rules_reject_naming_the_limit(monkeypatch):
    monkeypatch.setattr(tuning, "backend", lambda: "tpu")
    args = abstract_args(128, 3, jnp.bfloat16, jnp.bfloat16, 16, "decode")
    with pytest.raises(ValueError, match="3 KV heads per device"):
        jax.jit(kernel_fn("decode", False)).trace(*args)
