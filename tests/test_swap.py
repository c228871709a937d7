"""KV page swap: bit-exact round trips via pinned host memory, no recompiles, swap accounting."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import monitoring

from jaxserve.runner.swap import KVSwapper
from jaxserve.core.swap_space import HostSwapSpace, kv_bytes_per_page

LAYERS, NUM_PAGES, PAGE_SIZE, KV_HEADS, HEAD_DIM = 2, 24, 4, 2, 8
BUCKETS = (1, 2, 4, 8)

_backend_compiles = []
monitoring.register_event_duration_secs_listener(
    lambda event, duration, **kw: _backend_compiles.append(event)
    if event == "/jax/core/compile/backend_compile_duration" else None)


def _random_kv(dtype, seed=0):
    rng = np.random.default_rng(seed)
    shape = (LAYERS, NUM_PAGES, PAGE_SIZE, KV_HEADS, HEAD_DIM)
    return tuple(jnp.asarray(rng.standard_normal(shape, np.float32), dtype) for _ in range(2))


def _host_copy(kv):
    return tuple(np.array(x) for x in kv)  # a real copy: the device buffers may be donated


def _bits(x):
    x = np.asarray(x)
    return x.view({1: np.uint8, 2: np.uint16, 4: np.uint32}[x.dtype.itemsize])


@pytest.fixture(scope="module")
def swapper():
    return KVSwapper(BUCKETS)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float8_e4m3fn])
def test_swap_round_trip_into_different_pages_is_bit_identical(swapper, dtype):
    kv = _random_kv(dtype)
    before = _host_copy(kv)
    old_pages, new_pages = [3, 17, 8, 21, 5], [11, 2, 23, 14, 6]
    host = swapper.swap_out(kv, old_pages)
    kv = swapper.copy_pages(kv, [(1, p) for p in old_pages])  # the freed pages get reused
    kv = swapper.swap_in(kv, host, new_pages)
    after = _host_copy(kv)
    for name, b, a in zip("kv", before, after):
        assert np.array_equal(_bits(a[:, new_pages]), _bits(b[:, old_pages])), (
            f"{name} pages differ after the round trip")
        untouched = [p for p in range(1, NUM_PAGES) if p not in old_pages + new_pages]
        assert np.array_equal(_bits(a[:, untouched]), _bits(b[:, untouched])), (
            f"swap_in wrote {name} pages outside its page ids")


def test_swapped_out_pages_live_in_pinned_host_memory(swapper):
    host = swapper.swap_out(_random_kv(jnp.float32), [4, 9, 2])
    assert host.k.sharding.memory_kind == host.v.sharding.memory_kind == "pinned_host"
    assert host.num_pages == 3 and host.k.shape[1] == 4, "3 pages pad to the 4-page bucket"


def test_copy_pages_copies_for_copy_on_write(swapper):
    kv = _random_kv(jnp.bfloat16, seed=1)
    before = _host_copy(kv)
    after = _host_copy(swapper.copy_pages(kv, [(5, 7), (7, 9), (12, 1)]))
    for b, a in zip(before, after):
        assert np.array_equal(_bits(a[:, [7, 9, 1]]), _bits(b[:, [5, 7, 12]])), (
            "copies must read the pages as they were before the call")


def test_no_compilation_after_warmup():
    swapper = KVSwapper(BUCKETS)
    kv = _random_kv(jnp.float32)
    swapper.warmup(kv)
    assert swapper.num_compilations == 3 * len(BUCKETS)
    _backend_compiles.clear()
    for num_pages in range(1, BUCKETS[-1] + 1):
        pages = list(range(1, num_pages + 1))
        host = swapper.swap_out(kv, pages)
        kv = swapper.swap_in(kv, host, [p + 10 for p in pages])
        kv = swapper.copy_pages(kv, [(p, p + 10) for p in pages])
    jax.block_until_ready(kv)
    assert swapper.num_compilations == 3 * len(BUCKETS), "a swap compiled after warmup"
    assert _backend_compiles == [], f"XLA compiled {len(_backend_compiles)} times after warmup"


def test_more_pages_than_the_largest_bucket_is_an_error(swapper):
    with pytest.raises(ValueError, match=r"9 pages.*largest page bucket is 8"):
        swapper.swap_out(_random_kv(jnp.float32), list(range(1, 10)))


def test_swap_in_needs_one_page_id_per_swapped_page(swapper):
    kv = _random_kv(jnp.float32)
    host = swapper.swap_out(kv, [1, 2])
    with pytest.raises(ValueError, match="3 page ids for 2"):
        swapper.swap_in(kv, host, [4, 5, 6])


def test_swap_space_accounting():
    page_bytes = kv_bytes_per_page(LAYERS, PAGE_SIZE, KV_HEADS, HEAD_DIM, 2)
    assert page_bytes == 2 * LAYERS * PAGE_SIZE * KV_HEADS * HEAD_DIM * 2
    space = HostSwapSpace(10 * page_bytes, page_bytes)
    assert space.reserve("a", 6) and space.used_bytes == 6 * page_bytes
    assert not space.can_reserve(5) and not space.reserve("b", 5), "only 4 pages are left"
    assert space.num_requests == 1 and space.free_bytes == 4 * page_bytes
    assert space.reserve("b", 4) and space.free_bytes == 0
    with pytest.raises(ValueError, match="already holds"):
        space.reserve("a", 1)
    space.release("a")
    space.release("never-reserved")
    assert space.used_bytes == 4 * page_bytes and space.num_requests == 1
    space.release("b")
    assert space.used_bytes == 0 and space.num_requests == 0


def test_swap_space_counts_the_padded_bucket():
    space = HostSwapSpace(8, 1, page_buckets=BUCKETS)
    assert space.reserve("a", 3) and space.used_bytes == 4, "3 pages are swapped as a 4-page bucket"
    assert space.can_reserve(4) and not space.can_reserve(5), "5 pages pad to 8: no room"
    assert not space.can_reserve(9), "beyond the largest bucket a swap is impossible"


def test_swap_space_matches_what_the_swapper_holds(swapper):
    kv = _random_kv(jnp.bfloat16)
    space = HostSwapSpace(1 << 20, kv_bytes_per_page(LAYERS, PAGE_SIZE, KV_HEADS, HEAD_DIM, 2),
                          page_buckets=BUCKETS)
    host = swapper.swap_out(kv, [1, 2, 3, 4, 5])
    assert space.reserve("a", 5) and space.used_bytes == host.nbytes
