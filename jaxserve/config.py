"""EngineConfig: every engine setting, with the same name as its CLI flag and LLM(...) keyword.

Frozen plain data plus validate(); each field carries its documentation (help, unit, choices,
vLLM's name) as metadata, which the CLI's help and docs/cli.md's table are made from. No jax
import, no defaults that depend on the device (those are resolved by the runner, e.g.
dtype="auto").
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

PREEMPTION_MODES = ("recompute", "swap")
BATCHING_MODES = ("continuous", "static")
DTYPES = ("auto", "float32", "bfloat16", "float16")
QUANTIZATIONS = ("none", "int8", "int4")  # jaxserve/model/quant.py
LAYER_LOOPS = ("auto", "scan", "unroll")
SPECULATIVE_METHODS = ("ngram", "draft")
SIZE_UNITS = {"b": 1, "k": 2**10, "kib": 2**10, "kb": 10**3, "m": 2**20, "mib": 2**20,
              "mb": 10**6, "g": 2**30, "gib": 2**30, "gb": 10**9, "t": 2**40, "tib": 2**40,
              "tb": 10**12}


def parse_size(text: str | int | float, plain_unit: str = "B") -> int:
    """Bytes from '4GiB', '512MiB', '1.5G' (binary), '2GB' (decimal) or a plain number in
    plain_unit (vLLM's unit for the same flag: --swap-space 4 is 4 GiB)."""
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        number, unit = float(text), plain_unit
    else:
        t = str(text).strip().lower().replace(" ", "")
        digits = t.rstrip("abcdefghijklmnopqrstuvwxyz")
        number, unit = digits, t[len(digits):] or plain_unit
        try:
            number = float(number)
        except ValueError:
            raise ValueError(f"{text!r} is not a size: expected a number with an optional "
                             f"unit (B, KiB, MiB, GiB, TiB, KB, MB, GB, TB)") from None
    scale = SIZE_UNITS.get(unit.lower())
    if scale is None:
        raise ValueError(f"{text!r}: unknown size unit {unit!r}; known: B, KiB, MiB, GiB, "
                         "TiB (also K, M, G, T) and KB, MB, GB, TB")
    if number < 0:
        raise ValueError(f"{text!r} is not a size: negative")
    return int(number * scale)


def setting(default, help: str, *, unit: str | None = None, choices=None, vllm: str = "",
            cli_plain_unit: str | None = None, cli_alias: tuple[str, ...] = ()):
    """A field with its documentation: the CLI's help, docs/cli.md's table and errors read it.

    unit: what a number means (tokens, bytes, ...); cli_plain_unit: sizes only, the unit of a
    plain number on the command line (vLLM's for the same flag; the Python API takes bytes or a
    string with a unit); vllm: vLLM's name for the same setting ("=" when it is the same);
    cli_alias: extra flag spellings (vLLM's)."""
    return dataclasses.field(default=default, metadata=dict(
        help=help, unit=unit, choices=choices, vllm=vllm, cli_plain_unit=cli_plain_unit,
        cli_alias=cli_alias))


@dataclass(frozen=True)
class EngineConfig:
    model: str = setting(
        "default", "'default' (the embedded SmolLM2-135M-Instruct), a .gguf file, a Hugging "
        "Face directory, a jaxserve (Orbax) checkpoint directory, or a Hugging Face hub id "
        "org/name[@revision] already in the local hub cache (never downloaded)", vllm="=")
    dtype: str = setting(
        "auto", "weight and activation float type; auto: float32 on CPU, bfloat16 on TPU/GPU",
        choices=DTYPES, vllm="=")
    max_num_seqs: int = setting(16, "most requests in one step", unit="requests", vllm="=")
    max_num_batched_tokens: int = setting(
        256, "most tokens in one step (decode rows plus prefill chunks); the largest token "
        "bucket", unit="tokens", vllm="=")
    max_model_len: int | None = setting(
        None, "longest prompt plus output of a request; unset: min(model's, 2048)",
        unit="tokens", vllm="=")
    page_size: int = setting(16, "tokens per KV page (a power of two)", unit="tokens",
                             vllm="--block-size", cli_alias=("--block-size",))
    num_pages: int | None = setting(
        None, "KV pages in the pool, page 0 reserved; unset: sized from kv_cache_memory",
        unit="pages", vllm="--num-gpu-blocks-override",
        cli_alias=("--num-gpu-blocks-override",))
    kv_cache_memory: int | None = setting(
        None, "device memory for the KV pool; unset: enough for max_num_seqs full-length "
        "requests, at most 1 GiB (or from gpu_memory_utilization on an accelerator)",
        unit="bytes", cli_plain_unit="B", vllm="--kv-cache-memory-bytes",
        cli_alias=("--kv-cache-memory-bytes",))
    gpu_memory_utilization: float | None = setting(
        None, "accelerators: the fraction of device memory jaxserve may fill (weights, KV, "
        "activations); the KV pool gets the fraction less what the loaded weights use. "
        "Ignored on the CPU (with a warning)", unit="fraction in (0, 1]", vllm="=")
    swap_space: int = setting(
        256 * 2**20, "host memory for swapped-out KV pages (preemption_mode=swap)",
        unit="bytes", cli_plain_unit="GiB", vllm="=")
    host_prefix_cache_size: int = setting(
        0, "host memory for a second tier of the prefix cache: pages evicted from the device "
        "pool are kept there and copied back on a hit instead of recomputed (0: off). Counted "
        "like swap_space: whole pages of K and V of every layer (a draft model's included)",
        unit="bytes", cli_plain_unit="B")
    preemption_mode: str = setting(
        "recompute", "what a preempted request loses: recompute (its pages, re-prefilled "
        "later) or swap (pages copied to host memory)", choices=PREEMPTION_MODES, vllm="=")
    enable_prefix_caching: bool = setting(
        True, "share KV pages of equal prompt prefixes between requests", vllm="=")
    enable_chunked_prefill: bool = setting(
        True, "split long prompts into chunks that fit the step's token budget", vllm="=")
    batching: str = setting(
        "continuous", "continuous (requests join and leave every step) or static (a fixed "
        "batch until all its members finish: the baseline)", choices=BATCHING_MODES)
    attention_impl: str = setting(
        "auto", "paged attention: auto (pallas on TPU/GPU, reference on CPU), reference "
        "(XLA), pallas, pallas-interpret (kernel tests)",
        choices=("auto", "reference", "pallas", "pallas-interpret"))
    layer_loop: str = setting(
        "auto", "how the step runs the layers: auto (unroll on CPU, scan elsewhere), scan "
        "(flat compile time), unroll", choices=LAYER_LOOPS)
    async_scheduling: bool = setting(
        True, "plan and dispatch the next step before this one's tokens reach the host, so "
        "the device never waits for the host's bookkeeping (falls back to one step at a time "
        "while speculation, static batching, a grammar or a multi-token bad word needs every "
        "result first)", vllm="--async-scheduling")
    xla_cpu_nice: int = setting(
        10, "CPU backend only: how much lower XLA's compute threads run than the engine's own "
        "thread, so the host loop keeps a core while the next step computes (0: as they are)",
        unit="nice levels")
    max_queued_requests: int | None = setting(
        None, "waiting requests beyond which new ones are refused (gRPC RESOURCE_EXHAUSTED, "
        "HTTP 429); unset: no bound", unit="requests")
    seed: int = setting(0, "engine seed: the sampling keys of requests without a seed",
                        vllm="=")
    token_buckets: tuple[int, ...] | None = setting(
        None, "compiled step sizes T; unset: 1, 4, then powers of two from 16 up to "
        "max_num_batched_tokens (CPU: every other power of two, see runner/buckets.py)",
        unit="tokens")
    seq_buckets: tuple[int, ...] | None = setting(
        None, "compiled request counts S; unset: one per token bucket, min(T, max_num_seqs)",
        unit="requests")
    compile_cache_dir: str | None = setting(
        None, "JAX persistent compilation cache; unset: ~/.cache/jaxserve/xla; '' disables it",
        unit="directory")
    tensor_parallel_size: int = setting(
        1, "devices the weights and KV heads are sharded over", unit="devices", vllm="=",
        cli_alias=("-tp",))
    quantization: str = setting(
        "none", "weight-only quantization at load, kept on device and dequantized inside the "
        "step: int8 (per output channel; a GGUF's Q8_0 / Q4 / Q5 blocks exactly), int4 "
        "(groups of 32, scale + zero; a GGUF's Q4 blocks exactly), none (float weights)",
        choices=QUANTIZATIONS, vllm="=")
    speculative_method: str | None = setting(
        None, "speculative decoding: ngram (prompt lookup) or draft (a smaller model); unset: "
        "off", choices=SPECULATIVE_METHODS, vllm="--speculative-config method")
    num_speculative_tokens: int = setting(
        0, "k: drafts verified per request and step", unit="tokens",
        vllm="--speculative-config num_speculative_tokens")
    speculative_draft: str | None = setting(
        None, "draft: 'layers:N' (the target's first N layers) or a model spec",
        vllm="--speculative-config model")
    speculative_ngram_min: int = setting(1, "ngram: shortest suffix looked up", unit="tokens",
                                         vllm="--speculative-config prompt_lookup_min")
    speculative_ngram_max: int = setting(4, "ngram: longest suffix looked up", unit="tokens",
                                         vllm="--speculative-config prompt_lookup_max")
    speculative_disable_by_batch_size: int | None = setting(
        None, "no speculation when this many requests run; unset: measured at warm-up",
        unit="requests", vllm="--speculative-config disable_by_batch_size")

    def validate(self) -> "EngineConfig":
        def need(ok, field, value, limit):
            if not ok:
                raise ValueError(f"{field}={value!r} is invalid: must be {limit}")

        need(self.max_num_seqs >= 1, "max_num_seqs", self.max_num_seqs, ">= 1")
        need(self.max_num_batched_tokens >= self.max_num_seqs, "max_num_batched_tokens",
             self.max_num_batched_tokens, f">= max_num_seqs ({self.max_num_seqs})")
        need(self.page_size >= 1 and self.page_size & (self.page_size - 1) == 0, "page_size",
             self.page_size, "a power of two")
        need(self.num_pages is None or self.num_pages >= 2, "num_pages", self.num_pages,
             ">= 2 (page 0 is reserved)")
        need(self.num_pages is None or self.kv_cache_memory is None, "kv_cache_memory",
             self.kv_cache_memory, "unset when num_pages is given")
        need(self.kv_cache_memory is None or self.kv_cache_memory > 0, "kv_cache_memory",
             self.kv_cache_memory, "> 0 bytes")
        need(self.gpu_memory_utilization is None or 0 < self.gpu_memory_utilization <= 1,
             "gpu_memory_utilization", self.gpu_memory_utilization, "in (0, 1]")
        need(self.gpu_memory_utilization is None or (self.num_pages is None
                                                     and self.kv_cache_memory is None),
             "gpu_memory_utilization", self.gpu_memory_utilization,
             "unset when num_pages or kv_cache_memory is given")
        need(self.swap_space >= 0, "swap_space", self.swap_space, ">= 0 bytes")
        need(self.host_prefix_cache_size >= 0, "host_prefix_cache_size",
             self.host_prefix_cache_size, ">= 0 bytes")
        need(self.host_prefix_cache_size == 0 or self.enable_prefix_caching,
             "host_prefix_cache_size", self.host_prefix_cache_size,
             "0 when enable_prefix_caching is off (it is the prefix cache's second tier)")
        need(self.preemption_mode in PREEMPTION_MODES, "preemption_mode", self.preemption_mode,
             f"one of {PREEMPTION_MODES}")
        need(self.batching in BATCHING_MODES, "batching", self.batching,
             f"one of {BATCHING_MODES}")
        need(self.dtype in DTYPES, "dtype", self.dtype, f"one of {DTYPES}")
        need(self.quantization in QUANTIZATIONS, "quantization", self.quantization,
             f"one of {QUANTIZATIONS}")
        need(self.layer_loop in LAYER_LOOPS, "layer_loop", self.layer_loop,
             f"one of {LAYER_LOOPS}")
        need(self.max_model_len is None or self.max_model_len >= 1, "max_model_len",
             self.max_model_len, ">= 1")
        need(0 <= self.xla_cpu_nice <= 19, "xla_cpu_nice", self.xla_cpu_nice, "in [0, 19]")
        need(self.max_queued_requests is None or self.max_queued_requests >= 1,
             "max_queued_requests", self.max_queued_requests, ">= 1")
        need(self.tensor_parallel_size >= 1, "tensor_parallel_size", self.tensor_parallel_size,
             ">= 1")
        need(self.speculative_method in (None,) + SPECULATIVE_METHODS, "speculative_method",
             self.speculative_method, f"one of {SPECULATIVE_METHODS} or unset")
        need(self.num_speculative_tokens >= (1 if self.speculative_method else 0),
             "num_speculative_tokens", self.num_speculative_tokens,
             ">= 1 with a speculative_method" if self.speculative_method else ">= 0")
        need(1 <= self.speculative_ngram_min <= self.speculative_ngram_max,
             "speculative_ngram_min", self.speculative_ngram_min,
             f"in [1, speculative_ngram_max={self.speculative_ngram_max}]")
        need(self.speculative_draft is None or self.speculative_method == "draft",
             "speculative_draft", self.speculative_draft, "unset unless speculative_method=draft")
        need(self.speculative_disable_by_batch_size is None
             or self.speculative_disable_by_batch_size >= 0,
             "speculative_disable_by_batch_size", self.speculative_disable_by_batch_size, ">= 0")
        for name in ("token_buckets", "seq_buckets"):
            buckets = getattr(self, name)
            need(buckets is None or (len(buckets) > 0 and all(b >= 1 for b in buckets)), name,
                 buckets, "a non-empty list of positive sizes")
        return self

    def replace(self, **changes) -> "EngineConfig":
        return dataclasses.replace(self, **changes).validate()

    @classmethod
    def from_kwargs(cls, **kwargs) -> "EngineConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise TypeError(f"unknown engine setting(s): {', '.join(unknown)}; "
                            f"known: {', '.join(sorted(known))}")
        for f in dataclasses.fields(cls):
            if f.metadata.get("cli_plain_unit") and isinstance(kwargs.get(f.name), str):
                kwargs[f.name] = parse_size(kwargs[f.name])  # "4GiB"; a plain int is bytes
        for name in ("token_buckets", "seq_buckets"):
            if kwargs.get(name) is not None:
                kwargs[name] = tuple(sorted(set(int(b) for b in kwargs[name])))
        return cls(**kwargs).validate()
