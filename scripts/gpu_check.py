"""GPU check of the device selection and the attention paths it can run: correctness, speed,
then the engine bench.

    python scripts/gpu_check.py [--hbm-gbps 4800] [--iters 20] [--bench-args "..."]

On a GPU (JAX with its CUDA plugin) it prints what jaxserve.model.device_select chooses for
this device and why (attention implementation, dtype), then builds a realistic batch in that
dtype (64 requests, 8 KV heads, 32 query heads, head_dim 128, contexts up to 4k, shuffled page
tables, two cache layers) and runs every attention path that can run here: the reference
always, the compiled Pallas kernels only where the selection allows them (Hopper). Each kernel
is checked against pallas_kernels.reference (relative error ≤ 2e-2, no NaN) for paged_attention
(decode) and ragged_paged_attention (decode rows plus prefill chunks); every path is timed side
by side (warm-up, then the median of --iters runs, each ended by block_until_ready) with the
KV-read bandwidth it achieves next to the device's HBM bandwidth. Last it runs
`jaxserve bench offline` once per runnable path (--attention-impl pallas, reference) and prints
each; if the CLI has no offline bench yet it says so and skips that part. Then the host loop on
this device: `jaxserve bench overhead` (the tiny random model's host time per step by
phase and the device's busy fraction at 1 / 16 / 64 / 256 requests), and the default model's
decode tokens/s with 1 / 16 / 64 / 256 requests all decoding (prefill excluded; decode_rates).
Last, the parts it shares with scripts/tpu_check.py (jaxserve/bench/device_check.py): the
default model's greedy tokens against the CPU float32 oracle (agreement rate), the decode
tokens/s next to the roofline bound (weights + KV bytes per step over the chip's nominal
bandwidth from model/device_defaults.py, or --hbm-gbps), each engine's build (compile) time and
the peak device memory, in one table.
Everything fits well inside 10 minutes. Without a GPU it exits with status 2, unless
--allow-cpu, which runs a tiny bf16 batch with the kernels in interpret mode (the Mosaic GPU
simulator when JAX has it), no offline bench, and the host-loop part at 1 and 4 requests: a
smoke test of this script, not a measurement.
"""

from __future__ import annotations

import argparse
import functools
import os
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jaxserve.bench import device_check  # noqa: E402
from jaxserve.bench.device_check import decode_rates  # noqa: E402,F401 (also imported by tests)
from jaxserve.engine.memory_profile import device_memory_bytes  # noqa: E402
from jaxserve.model import device_defaults  # noqa: E402
from jaxserve.model.device_select import DeviceDescription, select  # noqa: E402
from jaxserve.model.loader import load_model  # noqa: E402
from pallas_kernels import reference  # noqa: E402
from pallas_kernels.paged_attention import paged_attention  # noqa: E402
from pallas_kernels.ragged_paged_attention import ragged_paged_attention  # noqa: E402

FULL = dict(num_seqs=64, num_kv_heads=8, num_heads=32, head_dim=128, max_context=4096,
            page_size=16, num_prefill=16, chunk=32)
TINY = dict(num_seqs=4, num_kv_heads=2, num_heads=8, head_dim=64, max_context=128,
            page_size=16, num_prefill=2, chunk=8)


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hbm-gbps", type=float, default=None,
                        help="device HBM bandwidth in GB/s; default: the chip's nominal one "
                             "from jaxserve/model/device_defaults.py (H200: 4800)")
    parser.add_argument("--iters", type=int, default=20, help="timed runs per function")
    parser.add_argument("--bench-args", default="--num-requests 64 --output-len 64",
                        help="extra arguments for `jaxserve bench offline`")
    parser.add_argument("--bench-timeout", type=float, default=180.0,
                        help="seconds allowed to each engine bench run")
    parser.add_argument("--decode-counts", default="1,16,64,256",
                        help="request counts for the overhead table and the default model's "
                             "decode tokens/s")
    parser.add_argument("--decode-steps", type=int, default=32,
                        help="decode steps timed per request count")
    parser.add_argument("--allow-cpu", action="store_true",
                        help="without a GPU, run a tiny batch in interpret mode instead")
    return parser.parse_args()


def make_batch(rng, num_seqs, num_kv_heads, num_heads, head_dim, max_context, page_size,
               num_prefill, chunk, dtype=jnp.bfloat16):
    """Random cache of two layers, shuffled page tables, decode lengths and prefill chunks."""
    kv_lens = rng.integers(chunk, max_context + 1, size=num_seqs)
    kv_lens[:3] = [max_context, page_size, chunk]                 # full, exact page, short
    pages_per_seq = -(-max_context // page_size)
    num_pages = num_seqs * pages_per_seq + 1                      # page 0 stays scratch
    table = rng.permutation(np.arange(1, num_pages)).reshape(num_seqs, pages_per_seq)
    key_k, key_v, key_q = jax.random.split(jax.random.key(int(rng.integers(1 << 30))), 3)
    shape = (2, num_pages, page_size, num_kv_heads, head_dim)
    k_pages = jax.random.normal(key_k, shape, dtype)
    v_pages = jax.random.normal(key_v, shape, dtype)
    q_lens = np.array([1] * (num_seqs - num_prefill) + [chunk] * num_prefill)
    num_tokens = -(-(q_lens.sum() + 1) // 64) * 64                # padding rows at the end
    cu_q_lens = np.concatenate([[0], np.cumsum(q_lens)])
    q = jax.random.normal(key_q, (num_tokens, num_heads, head_dim), dtype)
    i32 = functools.partial(jnp.asarray, dtype=jnp.int32)
    cache = (k_pages, v_pages, i32(1))
    decode = (q[:num_seqs],) + cache + (i32(kv_lens), i32(table))
    ragged = (q,) + cache + (i32(kv_lens), i32(table), i32(cu_q_lens), i32(num_seqs))
    kv_bytes = int(kv_lens.sum()) * num_kv_heads * head_dim * 2 * jnp.dtype(dtype).itemsize
    return decode, ragged, kv_bytes


def median_seconds(fn, args, iters):
    for _ in range(3):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def check_and_time(name, paths, ref, args, kv_bytes, hbm_gbps, iters) -> bool:
    """Check every path but the reference against it, then time all of them side by side."""
    want = np.asarray(ref(*args), np.float32)
    ok = not np.isnan(want).any()
    print(f"{name}:")
    for label, fn in paths.items():
        if fn is ref:
            print(f"  {label}: the oracle, NaN {int(np.isnan(want).sum())}")
            continue
        out = np.asarray(fn(*args), np.float32)
        err = np.abs(out - want).max() / np.abs(want).max()
        good = not np.isnan(out).any() and err <= 2e-2
        ok &= good
        print(f"  {label}: {'OK' if good else 'FAIL'} relative error {err:.2e} vs reference, "
              f"NaN {int(np.isnan(out).sum())}")
    for label, fn in paths.items():
        seconds = median_seconds(fn, args, iters)
        gbps = kv_bytes / seconds / 1e9
        print(f"  {label:16s} {seconds * 1e3:8.3f} ms   KV read {kv_bytes / 1e6:.1f} MB -> "
              f"{gbps:7.1f} GB/s ({100 * gbps / hbm_gbps:4.1f}% of HBM {hbm_gbps:.0f} GB/s)")
    return ok


def run_engine_bench(impls, extra_args: str, timeout: float) -> None:
    cli = [sys.executable, "-m", "jaxserve.entrypoints.cli", "bench", "offline"]
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    probe = subprocess.run(cli + ["--help"], capture_output=True, text=True, env=env)
    if probe.returncode != 0 or "--attention-impl" not in probe.stdout:
        reason = (probe.stderr.strip().splitlines() or ["no --attention-impl flag"])[-1]
        print(f"engine bench skipped: `jaxserve bench offline` unavailable ({reason})")
        return
    for impl in impls:
        run_and_print(cli + ["--attention-impl", impl] + shlex.split(extra_args), env, timeout)


def run_and_print(cmd: list[str], env: dict, timeout: float) -> None:
    """Run a jaxserve CLI command and print what it printed (or why it failed)."""
    print(f"\n$ {' '.join(cmd[1:])}", flush=True)
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
    except subprocess.TimeoutExpired:
        print(f"  timed out after {timeout:.0f} s")
        return
    print(done.stdout.strip() or "(no output)")
    if done.returncode:
        print(f"  exit status {done.returncode}: {done.stderr.strip()[-2000:]}")


def kernel_paths(selection, on_gpu: bool, interpret, sm_scale: float):
    """{label: (decode fn, ragged fn)} of every path that runs here, the reference first."""
    paths = {"reference": (functools.partial(reference.paged_attention, sm_scale=sm_scale),
                           functools.partial(reference.ragged_paged_attention,
                                             sm_scale=sm_scale))}
    if on_gpu and selection.attention_impl != "pallas":
        return paths  # the compiled kernel can't run on this GPU (the selection says why)
    label = "pallas" if on_gpu else "pallas simulated"
    paths[label] = (functools.partial(paged_attention, sm_scale=sm_scale, interpret=interpret),
                    functools.partial(ragged_paged_attention, sm_scale=sm_scale,
                                      interpret=interpret))
    return paths


def main() -> int:
    args = parse_args()
    backend = jax.default_backend()
    if backend != "gpu" and not args.allow_cpu:
        print(f"gpu_check: no GPU (JAX backend is {backend!r}); install JAX's CUDA plugin and "
              "run on a GPU machine, or pass --allow-cpu for an interpret-mode smoke test",
              file=sys.stderr)
        return 2
    on_gpu = backend == "gpu"
    selection = select()  # what `--attention-impl auto --dtype auto` runs on this device
    print(selection.describe())
    device = jax.local_devices()[0]
    description = DeviceDescription.from_device(device)
    chip = device_defaults.chip(description, device_memory_bytes(device))
    bandwidth = args.hbm_gbps or chip.bandwidth_gbs
    interpret = False
    if not on_gpu:
        try:
            from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams
            interpret = InterpretGPUParams()
        except ImportError:
            interpret = True
    sizes = FULL if on_gpu else TINY
    dtype = jnp.dtype(selection.dtype if on_gpu else "bfloat16")  # the GPU kernel's dtype
    print(f"batch: {sizes['num_seqs']} requests, contexts up to {sizes['max_context']}, "
          f"{dtype.name}; kernels {'compiled' if on_gpu else 'interpreted'}")
    decode, ragged, kv_bytes = make_batch(np.random.default_rng(0), **sizes, dtype=dtype)
    sm_scale = sizes["head_dim"] ** -0.5
    paths = kernel_paths(selection, on_gpu, interpret, sm_scale)
    if len(paths) == 1:
        print("only the reference path runs here: timed alone")
    iters = args.iters if on_gpu else 1
    started = time.perf_counter()
    ok = True
    for index, (name, batch) in enumerate((("paged_attention (decode)", decode),
                                           ("ragged_paged_attention (decode + prefill chunks)",
                                            ragged))):
        jitted = {label: jax.jit(fns[index]) for label, fns in paths.items()}
        ok &= check_and_time(name, jitted, jitted["reference"], batch, kv_bytes,
                             bandwidth or 4800.0, iters)
    print(f"kernel checks took {time.perf_counter() - started:.1f} s")
    if on_gpu:
        run_engine_bench(list(reversed(paths)), args.bench_args, args.bench_timeout)
    else:
        print("engine bench skipped: --allow-cpu runs no offline bench")
    counts = args.decode_counts if on_gpu else "1,4"
    steps = args.decode_steps if on_gpu else 4
    run_overhead_bench(counts, steps, 2 * args.bench_timeout)  # four fresh processes
    rows = [("device", f"{description} as {chip.name}", f"nominal {bandwidth or '?'} GB/s"),
            ("kernels vs reference", "see above", "OK" if ok else "FAIL")]
    loaded = load_model("default", progress=False)
    prompts = device_check.PROMPTS if on_gpu else device_check.PROMPTS[:2]
    max_tokens = 32 if on_gpu else 8
    want = device_check.oracle_tokens(prompts, max_tokens)
    got = device_check.greedy_tokens(loaded, prompts, max_tokens, max_num_seqs=8,
                                     max_num_batched_tokens=64, max_model_len=256)
    rate = device_check.agreement(got, want)
    rows.append(("greedy tokens vs CPU float32", f"{100 * rate:.1f}% agreement "
                 f"({len(prompts)} prompts x {max_tokens})", "OK" if rate >= 0.8 else "LOW"))
    rows += device_check.decode_rows(decode_rates(
        loaded, [int(n) for n in counts.split(",")], steps, bandwidth_gbs=bandwidth))
    peak = device_check.peak_memory_bytes()
    rows.append(("peak device memory", "not reported by this backend" if peak is None
                 else f"{peak / 2**30:.2f} GiB", ""))
    print(f"\ndefault model, {steps} decode steps timed with N requests all decoding "
          f"(greedy, 32-token prompts, prefill excluded; backend {jax.default_backend()}):")
    print(device_check.table(rows))
    return 0 if ok else 1


def run_overhead_bench(counts: str, steps: int, timeout: float) -> None:
    """`jaxserve bench overhead` on this device: the host loop's phases per step."""
    cmd = [sys.executable, "-m", "jaxserve.entrypoints.cli", "bench", "overhead", "--requests", counts,
           "--steps", str(steps)]
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    run_and_print(cmd, env, timeout)


if __name__ == "__main__":
    sys.exit(main())
