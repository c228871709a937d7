"""The CPU's int8 x int8 -> int32 matmul as an XLA FFI kernel (cpu_kernels/int8_matmul.cc),
built on first use with the machine's C++ compiler and registered with XLA.

Why: XLA on the CPU hands an int8 dot to YNNPACK, whose every call repacks the weight matrix
(the weights are runtime arguments, never constants), so per-channel int8 layers read their
bytes about three times. The kernel reads them once, as stored, over XLA's intra-op threads.
Measured on the 2-core CPU, SmolLM2's 30 layers of seven matrices in one jit (README,
"Quantized weights"): 2 rows (batch 1's two activation levels) 11.8 ms against YNNPACK's 24.7
and float32's 37.8; it is no slower than YNNPACK up to 1024 rows. Its sums are exact int32s,
so its result is XLA's dot_general bit for bit: which one runs never changes a token.

`matmul(a, w)` is the kernel where `available()`, else XLA's dot_general. It runs only on a
process with one CPU device (GSPMD would replicate a custom call's operands: tensor
parallelism keeps XLA's dot). The shared library is cached under $JAXSERVE_CACHE (default
~/.cache/jaxserve)/kernels, keyed by the source, jaxlib's version and the flags;
JAXSERVE_CPU_INT8_KERNEL=off keeps XLA's dot (logged). This module knows nothing of models.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import jax
import jax.numpy as jnp
import jaxlib

log = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "cpu_kernels" / "int8_matmul.cc"
TARGET = "jaxserve_int8_matmul"
FLAGS = ("-O3", "-march=native", "-std=c++17", "-shared", "-fPIC")
SETTING = os.environ.get("JAXSERVE_CPU_INT8_KERNEL", "auto")  # 'auto' | 'off'
_lock = threading.Lock()
_state: dict = {}


def _library_path(compiler: str) -> Path:
    from jaxserve.model.default_model import cache_dir
    key = hashlib.sha256(SOURCE.read_bytes() + jaxlib.__version__.encode()
                         + " ".join((compiler, *FLAGS)).encode()).hexdigest()[:16]
    return cache_dir() / "kernels" / f"int8_matmul-{key}.so"


def _build(compiler: str, target: Path) -> None:
    """Compile into a temporary file beside target, then rename: processes building at once
    each finish with a whole library."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        subprocess.run([compiler, *FLAGS, "-I", jax.ffi.include_dir(), str(SOURCE), "-o", tmp],
                       check=True, capture_output=True, text=True, timeout=300)
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _load() -> str | None:
    """Build (or find) and register the kernel; None when done, else why it is not used."""
    if SETTING == "off":
        return "JAXSERVE_CPU_INT8_KERNEL=off"
    compiler = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if compiler is None:
        return "no C++ compiler (c++, g++ or $CXX) on PATH"
    target = _library_path(compiler)
    try:
        if not target.exists():
            _build(compiler, target)
        library = ctypes.cdll.LoadLibrary(str(target))
        jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(library.JaxserveInt8Matmul),
                                    platform="cpu")
    except subprocess.CalledProcessError as exc:
        return f"{compiler} failed: {exc.stderr.strip().splitlines()[-1:]}"
    except (OSError, subprocess.SubprocessError, AttributeError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


def available() -> bool:
    """Whether matmul runs the kernel here (built and registered once per process, logged)."""
    if jax.default_backend() != "cpu" or jax.device_count() != 1:
        return False
    with _lock:
        if "reason" not in _state:
            _state["reason"] = _load()
            if _state["reason"] is None:
                log.info("int8 x int8 dots on the CPU: jaxserve's kernel (%s)", SOURCE.name)
            else:
                log.info("int8 x int8 dots on the CPU: XLA's dot (%s)", _state["reason"])
    return _state["reason"] is None


def _xla_dot(a, w):
    return jax.lax.dot_general(a, w, (((1,), (1,)), ((), ())), preferred_element_type=jnp.int32)


def matmul(a: jax.Array, w: jax.Array) -> jax.Array:
    """a int8 [R, K] (values in [-127, 127]) times w int8 [N, K] -> int32 [R, N], exact."""
    if not available():
        return _xla_dot(a, w)
    out = jax.ShapeDtypeStruct((a.shape[0], w.shape[0]), jnp.int32)
    return jax.ffi.ffi_call(TARGET, out, vmap_method="sequential")(a, w)
