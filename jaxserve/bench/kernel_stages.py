"""Device-check stages of the attention kernels: a compile-only sweep over kernel
configurations, and the kernels against pallas_kernels/reference.py at realistic sizes.

`sweep` lowers and compiles paged_attention (decode; each KV-split count) and
ragged_paged_attention (decode rows plus prefill chunks) for every head_dim x KV heads x KV
dtype in its grid, on abstract shapes (nothing is allocated or run), and records each
configuration as OK (compiled), REFUSED (the kernel's own ValueError / NotImplementedError: a
limit it states) or ERROR (any other exception, with its text). On a GPU each configuration is
also put to model/device/kernel_fit.py, the formula the engine selects by: a failure it predicts is
FALLBACK (the engine takes fewer splits or the XLA path there, the row says why), and a
verdict it gets wrong either way is MISMATCH, a failing row. Lowering is serial (Python);
compiles run in a thread pool. Without the device (--allow-cpu) it lowers for the device's
platform from the CPU instead (tuning.backend patched in this stage's own process) and
compiles nothing.

`kernels` runs both kernels on random batches (shuffled page tables, contexts up to 4k, a few
prefill chunks) in bf16 and fp8 KV against the reference (relative error <= 2e-2, no NaN) and
times each path that runs here beside the reference, with the KV-read bandwidth it reaches.
Without the device it runs a tiny batch with the kernels in interpret mode.
Both run in a stage process of stage_runner.py; neither changes an engine setting.
"""

from __future__ import annotations

import concurrent.futures
import functools
import itertools
import statistics
import time
import traceback
from pathlib import Path

FULL = dict(num_seqs=64, num_kv_heads=8, num_heads=32, head_dim=128, max_context=4096,
            page_size=16, num_prefill=16, chunk=32)
TINY = dict(num_seqs=4, num_kv_heads=2, num_heads=8, head_dim=64, max_context=128,
            page_size=16, num_prefill=2, chunk=8)
GRID = dict(head_dims=(64, 96, 128, 256), kv_heads=(1, 2, 4, 8), kv_dtypes=("bf16", "fp8"),
            kv_splits=(1, 4, 16))
TINY_GRID = dict(head_dims=(64, 96), kv_heads=(2,), kv_dtypes=("bf16", "fp8"), kv_splits=(1, 4))
DTYPES = {"bf16": "bfloat16", "fp8": "float8_e4m3fn"}
LOWERING_PLATFORM = {"gpu": "cuda", "tpu": "tpu"}


def on_device(platform: str) -> bool:
    import jax

    return jax.default_backend() == platform


def sweep(rec, cfg: dict) -> None:
    import jax

    platform = cfg["platform"]
    device = on_device(platform)
    if not device:
        from pallas_kernels import tuning
        tuning.backend = lambda: platform  # lower the device's formulation from this CPU
    grid = {**(GRID if device else TINY_GRID), **(cfg.get("grid") or {})}
    configs = sweep_configs(grid)
    how = "lower + compile" if device else f"lower for {platform} only (no device)"
    rec.row("sweep", f"{len(configs)} configurations, {how}", "",
            backend=jax.default_backend(), grid=grid)
    # no `with`: leaving it would wait for compiles still running at the deadline
    pool = concurrent.futures.ThreadPoolExecutor(cfg.get("threads", 4) if device else 1)
    pending = _lower_all(rec, configs, platform, device, pool)
    try:
        for done in concurrent.futures.as_completed(pending, timeout=max(rec.left(), 0)):
            label, config = pending.pop(done)
            error, seconds = done.result()
            _record(rec, label, config, platform, error, f"compiled in {seconds:.1f} s")
    except concurrent.futures.TimeoutError:
        _record_unreached(rec, list(pending.values()), "compiling", labelled=True)
    pool.shutdown(wait=False, cancel_futures=True)


def _lower_all(rec, configs, platform: str, device: bool, pool) -> dict:
    """Lower each configuration here, recording its row unless a compile follows; returns
    {compile future: (label, config)} of those handed to the pool."""
    pending = {}
    for index, config in enumerate(configs):
        if rec.left() <= 0:
            _record_unreached(rec, configs[index:], "lowering")
            break
        label = config_label(config)
        start = time.perf_counter()
        try:
            lowered = lower(config, platform, device)
        except Exception as e:  # noqa: BLE001 (each configuration's failure is its row)
            _record(rec, label, config, platform, e, "")
            continue
        if device:
            pending[pool.submit(_compile, lowered, start)] = (label, config)
        else:
            _record(rec, label, config, platform, None, f"lowered in "
                    f"{time.perf_counter() - start:.2f} s (not compiled: no device)")
    return pending


def predicted_fit(config: dict, platform: str, num_heads: int = 32):
    """kernel_fit's verdict for a sweep configuration (a CallFit), or None off the GPU."""
    if platform != "gpu":
        return None
    from jaxserve.model.device import kernel_fit

    shape = kernel_fit.KernelShape(config["head_dim"], num_heads // config["kv_heads"],
                                   config["kv_heads"], "bfloat16", DTYPES[config["kv_dtype"]],
                                   page_size=16)
    if config["kernel"] == "paged_attention":
        return kernel_fit.decode_fit(shape, config["kv_splits"])
    return kernel_fit.ragged_fit(shape)


def _record(rec, label: str, config: dict, platform: str, error, ok_text: str) -> None:
    """One configuration's row: its outcome, held against kernel_fit's prediction on a GPU."""
    fit = predicted_fit(config, platform)
    if fit is not None and fit.fits != (error is None):
        said = "fits" if fit.fits else f"does not fit ({fit.reason})"
        text = ok_text if error is None else _error_text(error)
        rec.row(label, f"kernel_fit says it {said}, but: {text}", "MISMATCH", **config,
                **({} if error is None else _trace(error)))
    elif error is None:
        rec.row(label, ok_text, "OK", **config)
    elif fit is not None:
        rec.row(label, f"{fit.reason}: the engine falls back here ({_error_text(error)})",
                "FALLBACK", **config)
    else:
        rec.row(label, _error_text(error), _verdict(error), **config, **_trace(error))


def sweep_configs(grid: dict) -> list[dict]:
    """For each head_dim x KV heads x KV dtype: the decode kernel at each KV-split count, then
    the ragged kernel (its splits do not apply), so a budget cut loses whole combinations."""
    configs = []
    for d, h, t in itertools.product(grid["head_dims"], grid["kv_heads"], grid["kv_dtypes"]):
        configs += [dict(kernel="paged_attention", head_dim=d, kv_heads=h, kv_dtype=t,
                         kv_splits=k) for k in grid["kv_splits"]]
        configs.append(dict(kernel="ragged_paged_attention", head_dim=d, kv_heads=h,
                            kv_dtype=t, kv_splits=None))
    return configs


def config_label(c: dict) -> str:
    splits = "" if c["kv_splits"] is None else f" splits={c['kv_splits']}"
    return f"{c['kernel']} D={c['head_dim']} Hkv={c['kv_heads']} {c['kv_dtype']}{splits}"


def abstract_args(config: dict, num_heads: int = 32, num_seqs: int = 64, max_context: int = 4096,
                  page_size: int = 16, num_tokens: int = 256):
    """ShapeDtypeStructs of one kernel call: 32 query heads over config's KV heads."""
    import jax
    import jax.numpy as jnp

    s = jax.ShapeDtypeStruct
    d, h = config["head_dim"], config["kv_heads"]
    pages_per_seq = max_context // page_size
    pages = s((2, num_seqs * pages_per_seq + 1, page_size, h, d), jnp.dtype(
        DTYPES[config["kv_dtype"]]))
    i32 = functools.partial(s, dtype=jnp.int32)
    cache = (pages, pages, i32(()), i32((num_seqs,)), i32((num_seqs, pages_per_seq)))
    if config["kernel"] == "paged_attention":
        return (s((num_seqs, num_heads, d), jnp.bfloat16),) + cache
    return (s((num_tokens, num_heads, d), jnp.bfloat16),) + cache + (i32((num_seqs + 1,)),
                                                                      i32(()))


def lower(config: dict, platform: str, device: bool):
    import jax

    from pallas_kernels.paged_attention import paged_attention
    from pallas_kernels.ragged_paged_attention import ragged_paged_attention

    scale = config["head_dim"] ** -0.5
    if config["kernel"] == "paged_attention":
        fn = functools.partial(paged_attention, sm_scale=scale, num_kv_splits=config["kv_splits"])
    else:
        fn = functools.partial(ragged_paged_attention, sm_scale=scale)
    traced = jax.jit(fn).trace(*abstract_args(config))
    return traced.lower() if device else traced.lower(
        lowering_platforms=(LOWERING_PLATFORM[platform],))


def _compile(lowered, start: float):
    try:
        lowered.compile()
        return None, time.perf_counter() - start
    except Exception as e:  # noqa: BLE001 (reported as the configuration's row)
        return e, time.perf_counter() - start


def _record_unreached(rec, configs, phase: str, labelled: bool = False) -> None:
    for item in configs:
        label, config = item if labelled else (config_label(item), item)
        rec.row(label, f"not finished: the stage's budget ran out while {phase}", "CUT",
                **config)


def _trace(error: BaseException) -> dict:
    """The traceback's end for an unexpected error (a refusal's message says it all)."""
    if _verdict(error) == "REFUSED":
        return {}
    return {"traceback": "".join(traceback.format_exception(error))[-3000:]}


def _verdict(error: BaseException) -> str:
    return "REFUSED" if isinstance(error, (ValueError, NotImplementedError)) else "ERROR"


def _error_text(error: BaseException) -> str:
    text = " ".join(str(error).split())[:240]
    if not text:  # a bare assert: where it fired
        frames = traceback.extract_tb(error.__traceback__)
        text = f"(no message) at {Path(frames[-1].filename).name}:{frames[-1].lineno} in " \
            f"{frames[-1].name}" if frames else "(no message)"
    return f"{type(error).__name__}: {text}"


# ---- the kernels against the reference -------------------------------------------------------

def make_batch(rng, num_seqs, num_kv_heads, num_heads, head_dim, max_context, page_size,
               num_prefill, chunk, kv_dtype="bfloat16"):
    """Random two-layer cache (bf16 draws, stored in kv_dtype), shuffled page tables, decode
    lengths and prefill chunks. Returns (decode args, ragged args, KV bytes read)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    kv_lens = rng.integers(chunk, max_context + 1, size=num_seqs)
    kv_lens[:3] = [max_context, page_size, chunk]                 # full, exact page, short
    pages_per_seq = -(-max_context // page_size)
    num_pages = num_seqs * pages_per_seq + 1                      # page 0 stays scratch
    table = rng.permutation(np.arange(1, num_pages)).reshape(num_seqs, pages_per_seq)
    key_k, key_v, key_q = jax.random.split(jax.random.key(int(rng.integers(1 << 30))), 3)
    shape = (2, num_pages, page_size, num_kv_heads, head_dim)
    k_pages = jax.random.normal(key_k, shape, jnp.bfloat16).astype(kv_dtype)
    v_pages = jax.random.normal(key_v, shape, jnp.bfloat16).astype(kv_dtype)
    q_lens = np.array([1] * (num_seqs - num_prefill) + [chunk] * num_prefill)
    num_tokens = -(-(q_lens.sum() + 1) // 64) * 64                # padding rows at the end
    cu_q_lens = np.concatenate([[0], np.cumsum(q_lens)])
    q = jax.random.normal(key_q, (num_tokens, num_heads, head_dim), jnp.bfloat16)
    i32 = functools.partial(jnp.asarray, dtype=jnp.int32)
    cache = (k_pages, v_pages, i32(1))
    decode = (q[:num_seqs],) + cache + (i32(kv_lens), i32(table))
    ragged = (q,) + cache + (i32(kv_lens), i32(table), i32(cu_q_lens), i32(num_seqs))
    kv_bytes = int(kv_lens.sum()) * num_kv_heads * head_dim * 2 * jnp.dtype(kv_dtype).itemsize
    return decode, ragged, kv_bytes


def median_seconds(fn, args, iters: int, warmup: int = 3) -> float:
    import jax

    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def interpret_params(platform: str):
    """The kernels' interpret argument off the device: the Mosaic GPU simulator (or the
    generic interpreter where this JAX has none) for a GPU check, the TPU interpreter else."""
    if platform == "tpu":
        from jax.experimental.pallas import tpu as pltpu
        return pltpu.InterpretParams()
    try:
        from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams
        return InterpretGPUParams()
    except ImportError:
        return True


def kernel_paths(selection, on_gpu: bool, interpret, sm_scale: float):
    """{label: (decode fn, ragged fn)} of every path that runs here, the reference first; on a
    GPU the compiled kernels only where the device selection allows them."""
    from pallas_kernels import reference
    from pallas_kernels.paged_attention import paged_attention
    from pallas_kernels.ragged_paged_attention import ragged_paged_attention

    paths = {"reference": (functools.partial(reference.paged_attention, sm_scale=sm_scale),
                           functools.partial(reference.ragged_paged_attention,
                                             sm_scale=sm_scale))}
    if on_gpu and selection.attention_impl != "pallas":
        return paths  # the compiled kernel can't run on this GPU (the selection says why)
    label = "pallas" if on_gpu or interpret is False else "pallas interpreted"
    paths[label] = (functools.partial(paged_attention, sm_scale=sm_scale, interpret=interpret),
                    functools.partial(ragged_paged_attention, sm_scale=sm_scale,
                                      interpret=interpret))
    return paths


def kernel_cases(device: bool) -> list[tuple[str, dict, str]]:
    if not device:
        return [("D64 Hkv2 bf16", TINY, "bfloat16")]
    return [("D128 Hkv8 bf16", FULL, "bfloat16"), ("D128 Hkv8 fp8", FULL, "float8_e4m3fn"),
            ("D64 Hkv4 bf16", dict(FULL, head_dim=64, num_kv_heads=4, num_heads=16),
             "bfloat16")]


def kernels(rec, cfg: dict) -> None:
    import jax
    import numpy as np

    from jaxserve.model.device.select import select

    platform = cfg["platform"]
    device = on_device(platform)
    selection = select()
    bandwidth = cfg.get("bandwidth_gbs")
    interpret = False if device else interpret_params(platform)
    iters = cfg.get("iters", 20) if device else 1
    for case, sizes, kv_dtype in kernel_cases(device):
        if rec.left() <= 0:
            rec.row(f"kernels {case}", "not run: the stage's budget ran out", "CUT")
            continue
        decode, ragged, kv_bytes = make_batch(np.random.default_rng(0), **sizes,
                                              kv_dtype=kv_dtype)
        paths = kernel_paths(selection, platform == "gpu" and device, interpret,
                             sizes["head_dim"] ** -0.5)
        for index, (kernel, batch) in enumerate((("paged_attention", decode),
                                                 ("ragged_paged_attention", ragged))):
            jitted = {label: jax.jit(fns[index]) for label, fns in paths.items()}
            _check_and_time(rec, f"{kernel} {case}", jitted, batch, kv_bytes, bandwidth, iters,
                            time_kernel=device)


def _check_and_time(rec, name, paths, args, kv_bytes, bandwidth, iters, time_kernel) -> None:
    import numpy as np

    want = np.asarray(paths["reference"](*args), np.float32)
    if np.isnan(want).any():
        rec.row(f"{name} reference", f"NaN {int(np.isnan(want).sum())}", "FAIL")
    for label, fn in paths.items():
        if label == "reference":
            continue
        out = np.asarray(fn(*args), np.float32)
        err = float(np.abs(out - want).max() / np.abs(want).max())
        nans = int(np.isnan(out).sum())
        rec.row(f"{name} {label} vs reference", f"relative error {err:.2e}, NaN {nans}",
                "OK" if nans == 0 and err <= 2e-2 else "FAIL", relative_error=err, nan=nans)
    for label, fn in paths.items():
        if label != "reference" and not time_kernel:
            continue  # an interpreted kernel's time says nothing: off the device, only its check
        seconds = median_seconds(fn, args, iters, warmup=min(iters, 3) if time_kernel else 0)
        gbps = kv_bytes / seconds / 1e9
        share = f", {100 * gbps / bandwidth:.1f}% of HBM {bandwidth:.0f} GB/s" if bandwidth \
            else ""
        rec.row(f"{name} {label} time", f"{seconds * 1e3:.3f} ms, KV read "
                f"{kv_bytes / 1e6:.1f} MB at {gbps:.1f} GB/s{share}", "",
                ms=seconds * 1e3, kv_gbps=gbps, iters=iters)
