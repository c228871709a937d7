"""Which attention implementation and default dtype a device runs: one table, by platform,
device kind and compute capability as JAX reports them.

`select(attention_impl, dtype, device, shape)` resolves "auto" for both fields from a
DeviceDescription and checks an explicit choice against it, returning each answer with the
reason, for the start-up log. An explicit choice the device can't run (the compiled Pallas
kernel off Hopper / TPU or in float32 on a GPU, bfloat16 on a GPU without bfloat16 tensor
cores) is a ValueError naming the field here, before anything reaches a compiler. Given the
model's attention shape (kernel_fit.KernelShape), a Hopper GPU also checks the kernel's
shape limits (head_dim, page size, shared memory) and caps its decode KV splits where fewer fit,
and a TPU the tiling and packing rules of its kernel (pallas_kernels/tpu_rules.py).

The implementations: "pallas" (the compiled kernels), "xla" (pallas_kernels/xla_blocked.py:
the kernels' blocked algorithm in XLA ops, what "auto" picks on a GPU the kernel can't serve),
"reference" (the CPU-tuned XLA path of model/decoder/attention.py's ReferenceAttention, "auto" on
the
CPU), "pallas-interpret" (the kernels in Pallas' interpreter, for tests).

This module must not import the kernels, compile anything or touch device arrays: a mocked
DeviceDescription must get exactly the answer the real device gets (the tests rely on it).

What JAX 0.10.2 offers, read from its source: Pallas' Mosaic GPU backend has two matmul
primitives, `plgpu.wgmma` (sm_90a only) and `plgpu.tcgen05_mma` (Blackwell), and our kernel
also needs TMA copies (sm_90+). Mosaic GPU's core library has a warp-level `mma.sync` op, but
Pallas exposes no primitive for it, so there is no pre-Hopper Mosaic GPU kernel to write on this
JAX. The Pallas Triton backend is still present (deprecated from JAX 0.11), but no kernel of
ours is written for it. Pre-Hopper GPUs and Blackwell therefore take the XLA path.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from jaxserve.config import DTYPES
from jaxserve.model.device import kernel_fit

log = logging.getLogger(__name__)

ATTENTION_IMPLS = ("auto", "reference", "xla", "pallas", "pallas-interpret")


@dataclass(frozen=True)
class DeviceDescription:
    """What JAX says about the device a step runs on (the first device of its platform)."""

    platform: str                    # "cpu" | "gpu" | "tpu" (JAX's cuda / rocm folded to gpu)
    device_kind: str                 # e.g. "Tesla T4", "NVIDIA H100 80GB HBM3", "TPU v5 lite"
    compute_capability: str | None = None  # GPUs only: "7.5" on NVIDIA, "gfx90a" on ROCm

    @classmethod
    def from_device(cls, device) -> "DeviceDescription":
        platform = "gpu" if device.platform in ("cuda", "rocm") else device.platform
        capability = getattr(device, "compute_capability", None)
        return cls(platform, device.device_kind, None if capability is None else str(capability))

    @classmethod
    def current(cls, platform: str | None = None) -> "DeviceDescription":
        """The first device of `platform` (default: JAX's default backend)."""
        import jax
        platform = "gpu" if platform in ("cuda", "rocm") else platform
        return cls.from_device(jax.devices(platform)[0])

    @property
    def sm(self) -> tuple[int, int] | None:
        """NVIDIA compute capability as (major, minor); None off NVIDIA GPUs."""
        if self.platform != "gpu" or not self.compute_capability:
            return None
        major, _, minor = self.compute_capability.partition(".")
        if not (major.isdigit() and minor.isdigit()):
            return None  # ROCm reports a gfx name
        return int(major), int(minor)

    def __str__(self) -> str:
        sm = self.sm
        detail = f"sm_{sm[0]}{sm[1]}" if sm else self.compute_capability
        return f"{self.device_kind} ({self.platform}{', ' + detail if detail else ''})"


@dataclass(frozen=True)
class Selection:
    """The attention implementation and dtype a step uses, and why."""

    device: DeviceDescription
    attention_impl: str      # "reference" | "xla" | "pallas" | "pallas-interpret"
    attention_reason: str
    dtype: str               # "float32" | "bfloat16" | "float16"
    dtype_reason: str
    max_kv_splits: int | None = None  # "pallas" on a GPU: the most decode splits that fit

    def describe(self) -> str:
        return (f"device: {self.device}\nattention: {self.attention_impl} ({self.attention_reason})"
                f"\ndtype: {self.dtype} ({self.dtype_reason})")


def _kernel(device: DeviceDescription, dtype: str) -> tuple[bool, str]:
    """(can the compiled Pallas kernel run here in `dtype`, why)."""
    sm = device.sm
    if device.platform == "tpu":
        return True, "the Pallas TPU (Mosaic) kernels"
    if device.platform == "cpu":
        return False, "the compiled Pallas kernels need a TPU or a Hopper GPU"
    if sm is None:
        return False, "Mosaic GPU compiles only for NVIDIA GPUs"
    if sm[0] == 9 and dtype == "float32":
        return False, ("the Mosaic GPU kernel takes bfloat16 or float16 (tf32 WGMMA can't take "
                       "the transposed K of Q·Kᵀ), not float32")
    if sm[0] == 9:
        return True, "Hopper: the Mosaic GPU kernel (WGMMA, TMA)"
    if sm[0] >= 10:
        return False, ("the Mosaic GPU kernel is built on WGMMA, an sm_90a instruction newer "
                       "GPUs lack (theirs is tcgen05, for which no kernel is written)")
    return False, (f"sm_{sm[0]}{sm[1]} is before Hopper: the Mosaic GPU kernel needs WGMMA and "
                   "TMA (sm_90), and this JAX's Pallas has no pre-Hopper Mosaic GPU matmul")


def _default_dtype(device: DeviceDescription) -> tuple[str, str]:
    sm = device.sm
    if device.platform == "cpu":
        return "float32", "the CPU reference precision"
    if device.platform == "tpu":
        return "bfloat16", "TPUs compute in bfloat16 natively"
    if sm is None or sm >= (8, 0):
        return "bfloat16", "bfloat16 tensor cores (sm_80+)" if sm else "bfloat16 on this GPU"
    if sm >= (7, 0):
        # Not float32: the default model's float16 greedy tokens matched float32 as closely as
        # bfloat16's did (4 chat prompts x 48 tokens, XLA on the CPU; no overflow, no NaN).
        return "float16", (f"sm_{sm[0]}{sm[1]} has float16 but no bfloat16 tensor cores "
                           "(sm_80+): bfloat16 would be emulated")
    return "float32", f"sm_{sm[0]}{sm[1]} has no tensor cores (sm_70+) and slow float16"


def _dtype_refusal(dtype: str, device: DeviceDescription) -> str | None:
    sm = device.sm
    if dtype == "bfloat16" and sm is not None and sm < (8, 0):
        return ("no bfloat16 tensor cores before sm_80, so XLA would emulate it; use 'float16' "
                "or 'float32'")
    return None


def _fallback(device: DeviceDescription) -> str:
    """"auto"'s choice where the compiled kernel can't run."""
    return "reference" if device.platform == "cpu" else "xla"


def select(attention_impl: str = "auto", dtype: str = "auto",
           device: DeviceDescription | None = None,
           shape: kernel_fit.KernelShape | None = None) -> Selection:
    """Resolve "auto" and check explicit choices for one device (default: the current one)
    and, when given, the model's attention shape."""
    if attention_impl not in ATTENTION_IMPLS:
        raise ValueError(f"attention_impl must be one of {', '.join(ATTENTION_IMPLS)}, "
                         f"got {attention_impl!r}")
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    device = device or DeviceDescription.current()
    if dtype == "auto":
        dtype_name, dtype_reason = _default_dtype(device)
    else:
        refusal = _dtype_refusal(dtype, device)
        if refusal:
            raise ValueError(f"dtype={dtype!r} can't run natively on {device}: {refusal}")
        dtype_name, dtype_reason = dtype, "chosen explicitly"
    kernel_runs, kernel_reason = _kernel(device, dtype_name)
    max_splits = None
    if kernel_runs and device.platform in ("gpu", "tpu") and shape is not None:
        fit = (kernel_fit.hopper_fit if device.platform == "gpu" else kernel_fit.tpu_fit)(shape)
        kernel_runs, kernel_reason = fit.impl == "pallas", fit.reason
        max_splits = fit.max_kv_splits if kernel_runs else None
    if attention_impl == "auto":
        impl = "pallas" if kernel_runs else _fallback(device)
        impl_reason = kernel_reason
    elif attention_impl == "pallas" and not kernel_runs:
        raise ValueError(f"attention_impl='pallas' can't run on {device}: {kernel_reason}; "
                         f"use 'auto' or '{_fallback(device)}' ('pallas-interpret' to debug "
                         "the kernel)")
    else:
        impl, impl_reason = attention_impl, "chosen explicitly"
    return Selection(device, impl, impl_reason, dtype_name, dtype_reason,
                     max_splits if impl == "pallas" else None)


_logged: set[tuple[str, str, DeviceDescription]] = set()  # (field, value, device) logged


def log_choice(field: str, value: str, reason: str, device: DeviceDescription) -> None:
    """Log a start-up choice once per process: the runner resolves "auto", then drafts and the
    attention factory resolve the value it chose again, which must not log "chosen explicitly"."""
    if (field, value, device) not in _logged:
        _logged.add((field, value, device))
        log.info("%s=%s on %s: %s", field, value, device, reason)
