"""jaxserve's CPU kernels (kernels/*.cc): built on first use, loaded, and registered with
XLA as FFI targets, once per process and set of settings.

A kernel is used only where `ready(name)`: XLA's backend is the CPU with one device (GSPMD
would replicate a custom call's operands, so tensor parallelism keeps XLA's own ops), the CPU
is x86-64 with AVX2 and FMA on Linux (the kernels are AVX2 code, built with -march=native;
elsewhere no build is attempted), the settings do not say off, a compiler is found, the build
succeeded and the library passed kernel_cache.py's ownership checks. Otherwise its caller runs
the XLA formulation it replaces, and the reason is logged once (a refused library with a
warning naming its path). XLA takes each FFI target once per process: the first library
registered serves every later caller whose own cache passes the checks (whose library is then
not loaded).

The settings (`KernelSettings`: on or off, the cache directory, the compiler) come from the
engine's runner settings (cpu_kernels, cpu_kernel_cache_dir, cpu_kernel_compiler); the engine
traces its steps inside `using(settings)`, and code that traces outside one gets the defaults.
Libraries are cached in the cache directory keyed by the source, jaxlib's version, the CPU
(model and flags: -march=native code built on one CPU may not run on another sharing the cache)
and the compiler and its flags. This module knows nothing of what the kernels compute.
"""

from __future__ import annotations

import contextlib
import contextvars
import ctypes
import hashlib
import logging
import os
import platform
import subprocess
import threading
from dataclasses import dataclass
from pathlib import Path

import jax
import jaxlib

from jaxserve.config.settings import CPU_KERNEL_MODES
from jaxserve.model.cpu import kernel_cache

log = logging.getLogger(__name__)

SOURCES = Path(__file__).parent / "kernels"
FLAGS = ("-O3", "-march=native", "-std=c++17", "-shared", "-fPIC")
X86_64 = ("x86_64", "amd64")
NEEDED_FLAGS = ("avx2", "fma")  # /proc/cpuinfo's names for what the kernels' code uses


@dataclass(frozen=True)
class KernelSettings:
    """mode: auto (used wherever they can run) or off (XLA's ops); cache_dir: None is
    ~/.cache/jaxserve/kernels; compiler: None is c++, else g++, from PATH."""
    mode: str = "auto"
    cache_dir: str | None = None
    compiler: str | None = None

    def __post_init__(self):
        if self.mode not in CPU_KERNEL_MODES:
            raise ValueError(f"cpu_kernels={self.mode!r} is invalid: must be one of "
                             f"{CPU_KERNEL_MODES}")


_active: contextvars.ContextVar[KernelSettings] = contextvars.ContextVar(
    "jaxserve_cpu_kernels", default=KernelSettings())
_lock = threading.Lock()
_reasons: dict[tuple[str, KernelSettings], str | None] = {}  # None: registered; else why not
_said: set[str] = set()  # process-wide lines already logged
_descriptors: list[int] = []  # of the libraries loaded
_registered: set[str] = set()  # FFI targets registered with XLA


@contextlib.contextmanager
def using(settings: KernelSettings):
    """Kernels asked for inside (in this thread) follow `settings`."""
    token = _active.set(settings)
    try:
        yield settings
    finally:
        _active.reset(token)


def current() -> KernelSettings:
    return _active.get()


def _cpu_flags() -> set[str] | None:
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return None
    line = next((x for x in lines if x.startswith("flags")), None)
    return None if line is None else set(line.partition(":")[2].split())


def cpu_problem() -> str | None:
    """Why this CPU can't run the kernels (None: it can): they are x86-64 AVX2 + FMA code."""
    machine = platform.machine()
    if machine.lower() not in X86_64:
        return f"the CPU is {machine or 'unknown'}, not x86-64"
    flags = _cpu_flags()
    if flags is None:
        return "no /proc/cpuinfo to read the CPU's flags from (Linux only)"
    missing = [f for f in NEEDED_FLAGS if f not in flags]
    return f"the CPU lacks {', '.join(missing)}" if missing else None


def cpu_identity() -> bytes:
    """The CPU's model and instruction-set flags, for the cache key."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor().encode()
    wanted = ("model name", "flags")
    return "\n".join(next((x for x in lines if x.startswith(w)), "") for w in wanted).encode()


def _library_name(source: Path, compiler: str) -> str:
    key = hashlib.sha256(source.read_bytes() + jaxlib.__version__.encode() + cpu_identity()
                         + " ".join((compiler, *FLAGS)).encode()).hexdigest()[:16]
    return f"{source.stem}-{key}.so"


def _compile(compiler: str, source: Path, out: str) -> None:
    subprocess.run([compiler, *FLAGS, "-I", jax.ffi.include_dir(), str(source), "-o", out],
                   check=True, capture_output=True, text=True, timeout=300)


def _load(name: str, symbols: dict[str, str], settings: KernelSettings) -> str | None:
    """Build (or find) kernels/<name>.cc and register {target: symbol}; None when done,
    else why not."""
    if settings.mode == "off":
        return "cpu_kernels=off"
    problem = cpu_problem()
    if problem:
        return problem
    compiler, looked_for = kernel_cache.find_compiler(settings.compiler)
    if compiler is None:
        return f"no C++ compiler ({looked_for})"
    source = SOURCES / f"{name}.cc"
    directory = Path(settings.cache_dir or kernel_cache.default_dir())
    try:
        fd = kernel_cache.trusted_library(directory, _library_name(source, compiler),
                                          lambda out: _compile(compiler, source, out))
        if all(target in _registered for target in symbols):
            os.close(fd)  # an earlier trusted library serves them (XLA takes a target once)
            return None
        # The descriptor's file is the one checked, whatever its path holds by now. It stays
        # open while the library is loaded (for good): the dynamic loader takes a name it has
        # loaded before for that library, so a /proc/self/fd name must not be reused.
        _descriptors.append(fd)
        library = ctypes.CDLL(f"/proc/self/fd/{fd}")
        for ffi_target, symbol in symbols.items():
            if ffi_target not in _registered:
                jax.ffi.register_ffi_target(
                    ffi_target, jax.ffi.pycapsule(getattr(library, symbol)), platform="cpu")
                _registered.add(ffi_target)
    except kernel_cache.Untrusted as exc:
        log.warning("jaxserve's CPU kernel %s.cc: refusing to build or load it: %s (kernels "
                    "load only from a directory and library owned by this user and writable by "
                    "no one else: make it so, or set cpu_kernel_cache_dir to another "
                    "directory); XLA's ops run instead", name, exc)
        return f"refused: {exc}"
    except subprocess.CalledProcessError as exc:
        return f"{compiler} failed on {source.name}: {exc.stderr.strip().splitlines()[-1:]}"
    except (OSError, subprocess.SubprocessError, AttributeError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


def _say_once(line: str) -> None:
    if line not in _said:
        _said.add(line)
        log.info(line)


def ready(name: str, symbols: dict[str, str], what: str) -> bool:
    """Whether kernel `name` runs here under the current settings (built and registered on the
    first call; `what` it computes is logged with the choice)."""
    if jax.default_backend() != "cpu" or jax.device_count() != 1:
        return False
    settings = current()
    key = (name, settings)
    with _lock:
        if key not in _reasons:
            problem = "cpu_kernels=off" if settings.mode == "off" else cpu_problem()
            _reasons[key] = problem or _load(name, symbols, settings)
            if problem:  # one line for every kernel: none is built
                _say_once(f"jaxserve's CPU kernels are not used: {problem}; XLA's ops run "
                          "instead")
            else:
                log.info("%s on the CPU: %s", what, "jaxserve's kernel (%s.cc)" % name
                         if _reasons[key] is None else f"XLA's ops ({_reasons[key]})")
    return _reasons[key] is None


def reason(name: str) -> str | None:
    """Why kernel `name` is not in use under the current settings (None: it is, or it was
    never asked for)."""
    return _reasons.get((name, current()))
