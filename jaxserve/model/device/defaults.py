"""Per-device defaults: how many requests and tokens a step holds, which token buckets are
compiled and how much of the device's memory jaxserve fills, by device class, in one table.

`chip(device, memory_bytes)` finds the device's class (DeviceClass: its figures and where they
come from) from a DeviceDescription (device_select.py) and the card's total memory
(engine/device_memory.py's card_bytes; None where the backend gives no memory figures).
`apply(config, device, memory_bytes)` returns the EngineConfig with every setting the user left
unset (see EngineConfig.is_explicit) replaced by the class's figure, and one Choice per setting
with the reason, for the start-up log. The same table gives the roofline scripts
(scripts/gpu_check.py, scripts/tpu_check.py) each chip's nominal memory bandwidth.

Where the figures come from (vLLM's EngineArgs defaults for its OpenAI server, the usage this
engine serves; tpu-inference runs on the same vLLM arguments):
* GPUs with >= 70 GiB other than the A100 (H100, H200, and unknown large GPUs): 1024
  sequences, 8192 batched tokens (vLLM measured smaller budgets as faster on the A100, so it
  keeps the A100 at the small-GPU figures; we follow it).
* Every other GPU (A100 40/80 GB, L4, T4): 256 sequences, 2048 batched tokens.
* TPUs: 256 sequences; batched tokens by chip as vLLM's TPU defaults (v6e 1024, v5e 512, v5p
  256; other chips the generic 2048). Token buckets start at 16 (vLLM's TPU runner pads to at
  least 16 tokens: a TPU step below that costs what 16 rows cost), then powers of two.
* GPU token buckets: 1, 4, then every power of two from 16 (the step's cost on a GPU is flat
  at small sizes, so one or a few decoding requests get buckets of their own).
* gpu_memory_utilization 0.9 on every accelerator (vLLM's and tpu-inference's default), a share
  of the card's total memory as in vLLM; the KV pool gets what the weights and one step of the
  largest bucket leave of it (engine/memory_profile.py).
* The CPU keeps its measured defaults: 16 sequences, 256 tokens, buckets 1, 4, 16, 64, 256
  (every other power of two: compiles are what a CPU start-up costs), and no memory fraction
  (the pool is sized from kv_cache_memory, at most 1 GiB).
Nominal bandwidths and memory sizes are the vendors' data-sheet figures.

This module must not import jax, compile anything or touch device arrays: a mocked
DeviceDescription and memory figure must get exactly the answer the real device gets.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

from jaxserve.config import EngineConfig
from jaxserve.model.device.select import DeviceDescription

GIB = 1 << 30


@dataclass(frozen=True)
class DeviceClass:
    """One row of the table: a device class, its defaults and its nominal figures."""
    name: str                       # "H100", "TPU v5e", "CPU", ...
    max_num_seqs: int
    max_num_batched_tokens: int
    gpu_memory_utilization: float | None  # None: the pool is sized from kv_cache_memory
    smallest_bucket: int            # 1: buckets 1 and 4 before 16; 16: start at 16
    bucket_ratio: int               # growth from one token bucket to the next (from 16 on)
    source: str                     # where the figures come from
    memory_gib: float | None = None       # nominal device memory
    bandwidth_gbs: float | None = None    # nominal memory bandwidth, GB/s (rooflines)

    def token_buckets(self, max_num_batched_tokens: int) -> tuple[int, ...]:
        """The compiled step sizes up to max_num_batched_tokens: runner/buckets.py's
        default_token_buckets rule (1 and 4, then 16 * ratio**k, then the budget), without the
        sizes below this class's smallest bucket."""
        top = max_num_batched_tokens
        sizes = [b for b in (1, 4) if b < min(16, top) and b >= self.smallest_bucket]
        size = min(16, top)
        while size < top:
            sizes.append(size)
            size *= self.bucket_ratio
        return tuple(sizes) + (top,)

    def describe_buckets(self) -> str:
        every = "every power of two" if self.bucket_ratio == 2 else (
            f"x{self.bucket_ratio} each time")
        start = "1, 4, then 16" if self.smallest_bucket == 1 else str(self.smallest_bucket)
        return f"{start}, {every} up to max_num_batched_tokens"


_VLLM_LARGE = "vLLM's default on GPUs with >= 70 GiB other than the A100"
_VLLM_GPU = "vLLM's default on GPUs other than H100-class ones"
_VLLM_TPU = "vLLM's TPU default for this chip (sequences: vLLM's generic 256)"
_GPU_BUCKETS = dict(smallest_bucket=1, bucket_ratio=2)
_TPU_BUCKETS = dict(smallest_bucket=16, bucket_ratio=2)

CPU = DeviceClass("CPU", 16, 256, None, 1, 4, "jaxserve's CPU defaults, measured on the CPU")
H200 = DeviceClass("H200", 1024, 8192, 0.9, **_GPU_BUCKETS, source=_VLLM_LARGE,
                   memory_gib=141, bandwidth_gbs=4800)
H100 = DeviceClass("H100 SXM", 1024, 8192, 0.9, **_GPU_BUCKETS, source=_VLLM_LARGE,
                   memory_gib=80, bandwidth_gbs=3350)
H100_PCIE = dataclasses.replace(H100, name="H100 PCIe", bandwidth_gbs=2000)
H100_NVL = dataclasses.replace(H100, name="H100 NVL", memory_gib=94, bandwidth_gbs=3900)
LARGE_GPU = DeviceClass("GPU >= 70 GiB", 1024, 8192, 0.9, **_GPU_BUCKETS, source=_VLLM_LARGE)
A100_80 = DeviceClass("A100 80GB", 256, 2048, 0.9, **_GPU_BUCKETS, source=_VLLM_GPU,
                      memory_gib=80, bandwidth_gbs=2039)
A100_40 = DeviceClass("A100 40GB", 256, 2048, 0.9, **_GPU_BUCKETS, source=_VLLM_GPU,
                      memory_gib=40, bandwidth_gbs=1555)
L4 = DeviceClass("L4", 256, 2048, 0.9, **_GPU_BUCKETS, source=_VLLM_GPU, memory_gib=24,
                 bandwidth_gbs=300)
T4 = DeviceClass("T4", 256, 2048, 0.9, **_GPU_BUCKETS, source=_VLLM_GPU, memory_gib=16,
                 bandwidth_gbs=320)
GPU = DeviceClass("GPU", 256, 2048, 0.9, **_GPU_BUCKETS, source=_VLLM_GPU)
TPU_V6E = DeviceClass("TPU v6e", 256, 1024, 0.9, **_TPU_BUCKETS, source=_VLLM_TPU,
                      memory_gib=32, bandwidth_gbs=1640)
TPU_V5E = DeviceClass("TPU v5e", 256, 512, 0.9, **_TPU_BUCKETS, source=_VLLM_TPU,
                      memory_gib=16, bandwidth_gbs=819)
TPU_V5P = DeviceClass("TPU v5p", 256, 256, 0.9, **_TPU_BUCKETS, source=_VLLM_TPU,
                      memory_gib=95, bandwidth_gbs=2765)
TPU_V4 = DeviceClass("TPU v4", 256, 2048, 0.9, **_TPU_BUCKETS,
                     source="vLLM's generic default (no TPU figure for this chip)",
                     memory_gib=32, bandwidth_gbs=1200)
TPU = dataclasses.replace(TPU_V4, name="TPU", memory_gib=None, bandwidth_gbs=None)

# (platform, pattern on the lower-cased device_kind, least card memory in GiB or None, class):
# the first row whose pattern matches and whose memory bound the card meets wins. A kind that
# names its size ("NVIDIA A100-SXM4-80GB", "NVIDIA A100 80GB PCIe") decides by itself; one
# that does not is placed by the card's total memory (memory_bytes).
_KINDS = (
    ("gpu", r"(?<!g)h200", None, H200),  # not the GH200 superchip: its own memory sizes
    ("gpu", r"h100.*pcie", None, H100_PCIE),
    ("gpu", r"h100.*nvl", None, H100_NVL),
    ("gpu", r"h100", None, H100),
    ("gpu", r"a100.*80\s*gb", None, A100_80),
    ("gpu", r"a100.*40\s*gb", None, A100_40),
    ("gpu", r"a100", 60, A100_80),
    ("gpu", r"a100", None, A100_40),
    ("gpu", r"\bl4\b", None, L4),
    ("gpu", r"\bt4\b", None, T4),
    ("tpu", r"v6", None, TPU_V6E),
    ("tpu", r"v5\s*lite|v5e", None, TPU_V5E),
    ("tpu", r"v5p|v5$", None, TPU_V5P),
    ("tpu", r"v4", None, TPU_V4),
)

TABLE = (CPU, H200, H100, H100_PCIE, H100_NVL, LARGE_GPU, A100_80, A100_40, L4, T4, GPU,
         TPU_V6E, TPU_V5E, TPU_V5P, TPU_V4, TPU)


def chip(device: DeviceDescription, memory_bytes: int | None = None) -> DeviceClass:
    """The class of `device`; memory_bytes is the card's total memory (engine/device_memory.py's
    card_bytes, not XLA's allocator limit, which is a fraction of it): it places an A100 whose
    kind does not name its size and an unknown GPU (>= 70 GiB: the large-GPU figures, as
    vLLM)."""
    if device.platform == "cpu":
        return CPU
    kind = device.device_kind.lower().strip()
    for platform, pattern, least_gib, cls in _KINDS:
        if platform != device.platform or not re.search(pattern, kind):
            continue
        if least_gib is None or (memory_bytes is not None and memory_bytes >= least_gib * GIB):
            return cls
    if device.platform == "tpu":
        return TPU
    if memory_bytes is not None and memory_bytes >= 70 * GIB:
        return LARGE_GPU
    return GPU


@dataclass(frozen=True)
class Choice:
    """One setting's value for this run and why (a device default or the user's)."""
    field: str
    value: object
    reason: str
    default: bool  # True: taken from the table; False: the user's setting


def apply(config: EngineConfig, device: DeviceDescription,
          memory_bytes: int | None = None) -> tuple[EngineConfig, list[Choice]]:
    """config with the device class's figure for every per-device setting the user left
    unset, and the choices made (validated)."""
    cls = chip(device, memory_bytes)
    where = f"{cls.name}: {cls.source}"
    sched, run, cache = config.scheduler, config.runner, config.cache
    choices: list[Choice] = []

    def pick(name: str, current, table_value, reason: str):
        if config.is_explicit(name):
            choices.append(Choice(name, current, "set explicitly", False))
            return current
        choices.append(Choice(name, table_value, reason, True))
        return table_value

    seqs = cls.max_num_seqs
    seqs_reason = where
    if config.is_explicit("max_num_batched_tokens") and sched.max_num_batched_tokens < seqs:
        seqs = sched.max_num_batched_tokens
        seqs_reason = f"{where}, capped at the max_num_batched_tokens given"
    max_num_seqs = pick("max_num_seqs", sched.max_num_seqs, seqs, seqs_reason)
    tokens = max(cls.max_num_batched_tokens, max_num_seqs)
    tokens_reason = where if tokens == cls.max_num_batched_tokens else (
        f"{where}, raised to max_num_seqs={max_num_seqs}")
    max_tokens = pick("max_num_batched_tokens", sched.max_num_batched_tokens, tokens,
                      tokens_reason)
    buckets = pick("token_buckets", run.token_buckets, cls.token_buckets(max_tokens),
                   f"{cls.name}: {cls.describe_buckets()}")
    sized = cache.num_pages is not None or cache.kv_cache_memory is not None
    fraction = cache.gpu_memory_utilization
    if config.is_explicit("gpu_memory_utilization") or cls.gpu_memory_utilization is None:
        choices.append(Choice("gpu_memory_utilization", fraction, "set explicitly"
                              if fraction is not None else "unset: the KV pool is sized from "
                              "kv_cache_memory on this device", fraction is None))
    elif sized:
        choices.append(Choice("gpu_memory_utilization", None, "unset: num_pages or "
                              "kv_cache_memory sizes the KV pool", True))
    elif memory_bytes is None:
        choices.append(Choice("gpu_memory_utilization", None, "unset: the device reports no "
                              "memory figure", True))
    else:
        fraction = cls.gpu_memory_utilization
        choices.append(Choice("gpu_memory_utilization", fraction, where, True))
    resolved = dataclasses.replace(
        config,
        scheduler=dataclasses.replace(sched, max_num_seqs=max_num_seqs,
                                      max_num_batched_tokens=max_tokens),
        runner=dataclasses.replace(run, token_buckets=buckets),
        cache=dataclasses.replace(cache, gpu_memory_utilization=fraction))
    return resolved.validate(), choices
