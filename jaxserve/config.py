"""EngineConfig: every engine setting, with the same name as its CLI flag and LLM(...) keyword.

Frozen plain data plus validate(); no jax import, no defaults that depend on the device (those
are resolved by the runner, e.g. dtype="auto").
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

PREEMPTION_MODES = ("recompute", "swap")
BATCHING_MODES = ("continuous", "static")
DTYPES = ("auto", "float32", "bfloat16", "float16")
LAYER_LOOPS = ("auto", "scan", "unroll")
SPECULATIVE_METHODS = ("ngram", "draft")


@dataclass(frozen=True)
class EngineConfig:
    model: str = "default"
    dtype: str = "auto"                       # float32 on CPU, bfloat16 on TPU/GPU
    max_num_seqs: int = 16
    max_num_batched_tokens: int = 256
    max_model_len: int | None = None          # default: min(model's, 2048)
    page_size: int = 16
    num_pages: int | None = None              # given directly ...
    kv_cache_memory: int | None = None        # ... or derived from a KV budget in bytes
    swap_space: int = 256 * 2**20             # host bytes for swapped-out KV pages
    preemption_mode: str = "recompute"
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    batching: str = "continuous"
    attention_impl: str = "auto"
    layer_loop: str = "auto"                  # unroll on CPU, scan elsewhere
    max_queued_requests: int | None = None
    seed: int = 0
    token_buckets: tuple[int, ...] | None = None  # default: 1, 4, then powers of two from 16
    seq_buckets: tuple[int, ...] | None = None    # default: powers of two from 1
    compile_cache_dir: str | None = None      # default ~/.cache/jaxserve/xla; "" disables
    tensor_parallel_size: int = 1
    speculative_method: str | None = None     # ngram | draft (see jaxserve/spec)
    num_speculative_tokens: int = 0           # k: drafts verified per request and step
    speculative_draft: str | None = None      # draft: "layers:N" of the target, or a model spec
    speculative_ngram_min: int = 1            # ngram: shortest suffix looked up
    speculative_ngram_max: int = 4            # ngram: longest suffix looked up
    speculative_disable_by_batch_size: int | None = None  # default: measured at warm-up

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
        need(self.swap_space >= 0, "swap_space", self.swap_space, ">= 0 bytes")
        need(self.preemption_mode in PREEMPTION_MODES, "preemption_mode", self.preemption_mode,
             f"one of {PREEMPTION_MODES}")
        need(self.batching in BATCHING_MODES, "batching", self.batching,
             f"one of {BATCHING_MODES}")
        need(self.dtype in DTYPES, "dtype", self.dtype, f"one of {DTYPES}")
        need(self.layer_loop in LAYER_LOOPS, "layer_loop", self.layer_loop,
             f"one of {LAYER_LOOPS}")
        need(self.max_model_len is None or self.max_model_len >= 1, "max_model_len",
             self.max_model_len, ">= 1")
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
        for name in ("token_buckets", "seq_buckets"):
            if kwargs.get(name) is not None:
                kwargs[name] = tuple(sorted(set(int(b) for b in kwargs[name])))
        return cls(**kwargs).validate()
