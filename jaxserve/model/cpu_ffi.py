"""jaxserve's CPU kernels (cpu_kernels/*.cc): built on first use with the machine's C++
compiler, loaded, and registered with XLA as FFI targets, once per process.

A kernel is used only where `ready(name)`: XLA's backend is the CPU with one device (GSPMD
would replicate a custom call's operands, so tensor parallelism keeps XLA's own ops), the
build succeeded, and JAXSERVE_CPU_KERNELS is not 'off'. Otherwise its caller runs the XLA
formulation it replaces, and the reason is logged once. Libraries are cached under
$JAXSERVE_CACHE (default ~/.cache/jaxserve)/kernels, keyed by the source, jaxlib's version,
the CPU (model and flags: they are built with -march=native) and the compiler flags;
processes building at once each rename a whole file into place. This module knows nothing of
what the kernels compute.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import jax
import jaxlib

log = logging.getLogger(__name__)

SOURCES = Path(__file__).parent / "cpu_kernels"
FLAGS = ("-O3", "-march=native", "-std=c++17", "-shared", "-fPIC")
SETTING = os.environ.get("JAXSERVE_CPU_KERNELS", "auto")  # 'auto' | 'off'
_lock = threading.Lock()
_reasons: dict[str, str | None] = {}  # kernel -> None (registered) or why not


def _cpu_identity() -> bytes:
    """The CPU's model and instruction-set flags: -march=native code built on one CPU may not
    run on another sharing the cache (a network home, a mounted volume)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor().encode()
    wanted = ("model name", "flags")
    return "\n".join(next((x for x in lines if x.startswith(w)), "") for w in wanted).encode()


def _library_path(source: Path, compiler: str) -> Path:
    from jaxserve.model.default_model import cache_dir
    key = hashlib.sha256(source.read_bytes() + jaxlib.__version__.encode() + _cpu_identity()
                         + " ".join((compiler, *FLAGS)).encode()).hexdigest()[:16]
    return cache_dir() / "kernels" / f"{source.stem}-{key}.so"


def _build(compiler: str, source: Path, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        subprocess.run([compiler, *FLAGS, "-I", jax.ffi.include_dir(), str(source), "-o", tmp],
                       check=True, capture_output=True, text=True, timeout=300)
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _load(name: str, symbols: dict[str, str]) -> str | None:
    """Build (or find) cpu_kernels/<name>.cc and register {target: symbol}; None when done,
    else why not."""
    if SETTING == "off":
        return "JAXSERVE_CPU_KERNELS=off"
    compiler = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if compiler is None:
        return "no C++ compiler (c++, g++ or $CXX) on PATH"
    source = SOURCES / f"{name}.cc"
    target = _library_path(source, compiler)
    try:
        if not target.exists():
            _build(compiler, source, target)
        library = ctypes.cdll.LoadLibrary(str(target))
        for ffi_target, symbol in symbols.items():
            jax.ffi.register_ffi_target(ffi_target, jax.ffi.pycapsule(getattr(library, symbol)),
                                        platform="cpu")
    except subprocess.CalledProcessError as exc:
        return f"{compiler} failed on {source.name}: {exc.stderr.strip().splitlines()[-1:]}"
    except (OSError, subprocess.SubprocessError, AttributeError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


def ready(name: str, symbols: dict[str, str], what: str) -> bool:
    """Whether kernel `name` runs here (built and registered on the first call; `what` it
    computes is logged with the choice)."""
    if jax.default_backend() != "cpu" or jax.device_count() != 1:
        return False
    with _lock:
        if name not in _reasons:
            _reasons[name] = _load(name, symbols)
            log.info("%s on the CPU: %s", what, "jaxserve's kernel (%s.cc)" % name
                     if _reasons[name] is None else f"XLA's ops ({_reasons[name]})")
    return _reasons[name] is None


def reason(name: str) -> str | None:
    """Why kernel `name` is not in use (None: it is, or it was never asked for)."""
    return _reasons.get(name)
