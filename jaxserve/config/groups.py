"""The engine's settings by group, as vLLM groups them: model, cache, scheduler, parallel,
speculative, runner. Each group is frozen plain data plus validate() for the checks that concern
it alone.

A field's name is its CLI flag's and LLM(...) keyword's (`page_size` -> `--page-size`); names
are unique across groups, so a flat keyword names one field. ModelSettings is what to load and
how; the architecture read from the checkpoint is jaxserve/model/config.py's ModelConfig.
"""

from __future__ import annotations

from dataclasses import dataclass

from jaxserve.config.kv_events import parse_kv_events_config
from jaxserve.config.settings import (BATCHING_MODES, CPU_KERNEL_MODES, DEQUANT_FORMS, DTYPES,
                                      INT8_ACTIVATION_MODES, KV_CACHE_DTYPES, LAYER_LOOPS,
                                      PREEMPTION_MODES,
                                      QUANTIZATIONS, SPECULATIVE_METHODS, need, setting)


@dataclass(frozen=True)
class ModelSettings:
    """Which model, in which float type and quantization, for how long a request."""
    model: str = setting(
        "default", "'default' (the embedded SmolLM2-135M-Instruct), a .gguf file, a Hugging "
        "Face directory, a jaxserve (Orbax) checkpoint directory, or a Hugging Face hub id "
        "org/name[@revision][/file.gguf] (from the local hub cache; downloaded there first "
        "unless HF_HUB_OFFLINE=1 or `serve --offline`)", vllm="=")
    revision: str | None = setting(
        None, "hub ids: the branch, tag or commit to load (as org/name@revision); unset: main",
        unit="revision", vllm="=")
    dtype: str = setting(
        "auto", "weight and activation float type; auto: float32 on CPU, bfloat16 on TPU/GPU",
        choices=DTYPES, vllm="=")
    max_model_len: int | None = setting(
        None, "longest prompt plus output of a request; unset: min(model's, 2048)",
        unit="tokens", vllm="=")
    quantization: str = setting(
        "none", "weight-only quantization at load, kept on device and dequantized inside the "
        "step: int8 (per output channel; a GGUF's blocks requantized per channel where "
        "int8_activations is on, else its Q8_0 / Q4 / Q5 blocks exactly), int4 (groups of 32, "
        "scale + zero; a GGUF's Q4 blocks exactly), none (float weights)",
        choices=QUANTIZATIONS, vllm="=")
    cache_quantized_weights: bool = setting(
        True, "keep weights quantized at load in the compile cache directory "
        "(jaxserve-quantized/), keyed by the source files' paths, sizes and modification "
        "times and the quantized form, so a restart reads them instead of quantizing again; "
        "off, or compile_cache_dir='': quantize at every start")
    seed: int = setting(0, "engine seed: the sampling keys of requests without a seed",
                        vllm="=")

    def validate(self) -> None:
        need(self.dtype in DTYPES, "dtype", self.dtype, f"one of {DTYPES}")
        need(self.quantization in QUANTIZATIONS, "quantization", self.quantization,
             f"one of {QUANTIZATIONS}")
        need(isinstance(self.cache_quantized_weights, bool), "cache_quantized_weights",
             self.cache_quantized_weights, "true or false")
        need(self.max_model_len is None or self.max_model_len >= 1, "max_model_len",
             self.max_model_len, ">= 1")


@dataclass(frozen=True)
class CacheConfig:
    """The KV page pool on the device, its prefix cache, and the host memory behind it."""
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
    enable_prefix_caching: bool = setting(
        True, "share KV pages of equal prompt prefixes between requests", vllm="=")
    kv_events_config: str | None = setting(
        None, "publish the prefix cache's changes as vLLM's KV-cache events: a JSON object "
        "with vLLM's keys (enable_kv_cache_events, publisher zmq or null, endpoint, "
        "replay_endpoint, buffer_steps, hwm, max_queue_size, topic; docs/kv_events.md); unset: "
        "off", unit="JSON", vllm="=")
    kv_cache_dtype: str = setting(
        "auto", "float type of the KV pages; auto: the activation dtype. fp8 (= fp8_e4m3) and "
        "fp8_e5m2 store one byte an element (twice the pages of bfloat16 for the same bytes) "
        "with per-layer scales from the checkpoint, else 1.0 or, with calculate_kv_scales, "
        "computed at start-up (docs/quantization.md)",
        choices=KV_CACHE_DTYPES, vllm="=")
    calculate_kv_scales: bool = setting(
        False, "fp8 KV pages of a checkpoint without KV scales: compute each layer's k_scale "
        "and v_scale (amax / fp8 max) from a calibration pass over a short built-in text at "
        "start-up instead of 1.0; the checkpoint's scales win when it has them",
        vllm="=")

    def validate(self) -> None:
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
        need(self.kv_cache_dtype in KV_CACHE_DTYPES, "kv_cache_dtype", self.kv_cache_dtype,
             f"one of {KV_CACHE_DTYPES}")
        need(not self.calculate_kv_scales or self.kv_cache_dtype.startswith("fp8"),
             "calculate_kv_scales", self.calculate_kv_scales,
             f"False with kv_cache_dtype={self.kv_cache_dtype!r} (scales are for fp8 pages)")
        need(self.swap_space >= 0, "swap_space", self.swap_space, ">= 0 bytes")
        need(self.host_prefix_cache_size >= 0, "host_prefix_cache_size",
             self.host_prefix_cache_size, ">= 0 bytes")
        need(self.host_prefix_cache_size == 0 or self.enable_prefix_caching,
             "host_prefix_cache_size", self.host_prefix_cache_size,
             "0 when enable_prefix_caching is off (it is the prefix cache's second tier)")
        parse_kv_events_config(self.kv_events_config)  # (its own errors name the key)


@dataclass(frozen=True)
class SchedulerConfig:
    """What one step may hold, how requests share it, and how many may wait."""
    max_num_seqs: int = setting(16, "most requests in one step", unit="requests", vllm="=")
    max_num_batched_tokens: int = setting(
        256, "most tokens in one step (decode rows plus prefill chunks); the largest token "
        "bucket", unit="tokens", vllm="=")
    preemption_mode: str = setting(
        "recompute", "what a preempted request loses: recompute (its pages, re-prefilled "
        "later) or swap (pages copied to host memory)", choices=PREEMPTION_MODES, vllm="=")
    enable_chunked_prefill: bool = setting(
        True, "split long prompts into chunks that fit the step's token budget", vllm="=")
    batching: str = setting(
        "continuous", "continuous (requests join and leave every step) or static (a fixed "
        "batch until all its members finish: the baseline)", choices=BATCHING_MODES)
    async_scheduling: bool = setting(
        True, "plan and dispatch the next step before this one's tokens reach the host, so "
        "the device never waits for the host's bookkeeping (falls back to one step at a time "
        "while speculation, static batching, a grammar or a multi-token bad word needs every "
        "result first)", vllm="--async-scheduling")
    max_queued_requests: int | None = setting(
        None, "waiting requests beyond which new ones are refused (gRPC RESOURCE_EXHAUSTED, "
        "HTTP 429); unset: no bound", unit="requests")
    max_queued_requests_per_key: int | None = setting(
        None, "requests one client may have in flight (queued or running) before its next "
        "is refused (gRPC RESOURCE_EXHAUSTED, HTTP 429, with a retry-after hint) while other "
        "clients are still admitted; a client is its API key when one is configured, else its "
        "address; unset: no bound", unit="requests")

    def validate(self) -> None:
        need(self.max_num_seqs >= 1, "max_num_seqs", self.max_num_seqs, ">= 1")
        need(self.max_num_batched_tokens >= self.max_num_seqs, "max_num_batched_tokens",
             self.max_num_batched_tokens, f">= max_num_seqs ({self.max_num_seqs})")
        need(self.preemption_mode in PREEMPTION_MODES, "preemption_mode", self.preemption_mode,
             f"one of {PREEMPTION_MODES}")
        need(self.batching in BATCHING_MODES, "batching", self.batching,
             f"one of {BATCHING_MODES}")
        need(self.max_queued_requests is None or self.max_queued_requests >= 1,
             "max_queued_requests", self.max_queued_requests, ">= 1")
        need(self.max_queued_requests_per_key is None or self.max_queued_requests_per_key >= 1,
             "max_queued_requests_per_key", self.max_queued_requests_per_key, ">= 1")


@dataclass(frozen=True)
class ParallelConfig:
    """How many devices share the model (multi-host: entrypoints/distributed.py's flags)."""
    tensor_parallel_size: int = setting(
        1, "devices the weights and KV heads are sharded over", unit="devices", vllm="=",
        cli_alias=("-tp",))
    enable_expert_parallel: bool = setting(
        False, "mixture-of-experts models: split the experts over groups of the "
        "tensor-parallel devices (expert_parallel_size) instead of splitting every expert's "
        "width over all of them; attention stays tensor-parallel. Ignored, with a warning, for "
        "a dense model", vllm="=")
    expert_parallel_size: int | None = setting(
        None, "with enable_expert_parallel: how many groups of devices the experts are split "
        "over (SGLang's --ep-size); within a group each expert's width is split "
        "tensor_parallel_size / N ways, so it must divide tensor_parallel_size; unset: "
        "tensor_parallel_size (each device holds whole experts)", unit="device groups")

    def validate(self) -> None:
        need(self.tensor_parallel_size >= 1, "tensor_parallel_size", self.tensor_parallel_size,
             ">= 1")
        ep = self.expert_parallel_size
        need(ep is None or self.enable_expert_parallel, "expert_parallel_size", ep,
             "unset unless enable_expert_parallel is on")
        need(ep is None or (ep >= 1 and self.tensor_parallel_size % ep == 0),
             "expert_parallel_size", ep,
             f"a divisor of tensor_parallel_size={self.tensor_parallel_size}")

    @property
    def expert_parallel_groups(self) -> int:
        """The expert-parallel size in effect: 1 when off, else expert_parallel_size or the
        whole tensor-parallel group."""
        if not self.enable_expert_parallel:
            return 1
        return self.expert_parallel_size or self.tensor_parallel_size


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding (vLLM's --speculative-config, one flag per key here)."""
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

    def validate(self) -> None:
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


@dataclass(frozen=True)
class RunnerConfig:
    """How the device step is built and run: attention path, layer loop, compiled shapes, the
    compilation cache, the CPU backend's threads and jaxserve's CPU kernels."""
    attention_impl: str = setting(
        "auto", "paged attention: auto (pallas on TPU and on Hopper where the model's shape "
        "fits, xla on other GPUs, reference on CPU), reference (XLA, CPU-tuned), xla (the "
        "kernels' blocked algorithm in XLA), pallas, pallas-interpret (kernel tests)",
        choices=("auto", "reference", "xla", "pallas", "pallas-interpret"))
    layer_loop: str = setting(
        "auto", "how the step runs the layers: auto (unroll on CPU, scan elsewhere), scan "
        "(flat compile time), unroll", choices=LAYER_LOOPS)
    int8_activations: str = setting(
        "auto", "per-channel int8 weights times activations quantized per token (two int8 "
        "levels), one int8 x int8 -> int32 dot: auto (on for the CPU and TPU v5e/v5p/v6e, off "
        "elsewhere), on, off (the weights dequantized next to a float dot)",
        choices=INT8_ACTIVATION_MODES)
    dequant_form: str = setting(
        "auto", "how quantized matrices not multiplied in int8 are dequantized in the step: "
        "auto (chunked on CPU, fused elsewhere), chunked (pieces of at most 4 MiB pinned in "
        "order, the head in a loop: the CPU's), fused (one dequantize-then-dot XLA fuses)",
        choices=DEQUANT_FORMS)
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
    xla_cpu_nice: int = setting(
        10, "CPU backend only: how much lower XLA's compute threads run than the engine's own "
        "thread, so the host loop keeps a core while the next step computes (0: as they are)",
        unit="nice levels")
    cpu_kernels: str = setting(
        "auto", "jaxserve's C++ kernels for XLA on the CPU (int8 matmul, decode attention): "
        "auto (built on first use, then used in a one-device CPU process on x86-64 with AVX2 "
        "and FMA when a compiler is found and the cache passes its ownership checks; else "
        "XLA's ops, logged), off (XLA's ops)", choices=CPU_KERNEL_MODES)
    cpu_kernel_cache_dir: str | None = setting(
        None, "where the CPU kernels are built and cached, created owner-only (0700); a "
        "directory or library not owned by this user, or writable by its group or others, is "
        "refused (XLA's ops run); unset: ~/.cache/jaxserve/kernels", unit="directory")
    cpu_kernel_compiler: str | None = setting(
        None, "the C++ compiler that builds the CPU kernels (a name on PATH or a path); unset: "
        "c++, else g++, from PATH", unit="command")

    def validate(self) -> None:
        need(self.layer_loop in LAYER_LOOPS, "layer_loop", self.layer_loop,
             f"one of {LAYER_LOOPS}")
        need(self.int8_activations in INT8_ACTIVATION_MODES, "int8_activations",
             self.int8_activations, f"one of {INT8_ACTIVATION_MODES}")
        need(self.dequant_form in DEQUANT_FORMS, "dequant_form", self.dequant_form,
             f"one of {DEQUANT_FORMS}")
        need(self.cpu_kernels in CPU_KERNEL_MODES, "cpu_kernels", self.cpu_kernels,
             f"one of {CPU_KERNEL_MODES}")
        for name in ("cpu_kernel_cache_dir", "cpu_kernel_compiler"):
            value = getattr(self, name)
            need(value is None or (isinstance(value, str) and value.strip() != ""), name, value,
                 "unset or a non-empty string")
        need(0 <= self.xla_cpu_nice <= 19, "xla_cpu_nice", self.xla_cpu_nice, "in [0, 19]")
        for name in ("token_buckets", "seq_buckets"):
            buckets = getattr(self, name)
            need(buckets is None or (len(buckets) > 0 and all(b >= 1 for b in buckets)), name,
                 buckets, "a non-empty list of positive sizes")
