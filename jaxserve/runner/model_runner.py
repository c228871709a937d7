"""ModelRunner: owns every device array of a plain step (weights, KV pages, host swap copies).

It turns a StepPlan into StepInputs (runner/batch.py) and one call of its CompiledStep
(forward -> sample, KV donated), and returns plain numpy results. Every (tokens, requests)
bucket is compiled ahead of time; a shape outside the table raises instead of compiling. It
never decides what runs: that is the scheduler's job. runner/protocol.py declares what every
runner (plain, speculative, multi-host leader / follower) offers the engine.
"""

from __future__ import annotations

import functools
import logging
import os

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxserve.model.config import ModelConfig
from jaxserve.plan import StepPlan
from jaxserve.runner.batch import build_step_inputs
from jaxserve.runner.buckets import BucketTable
from jaxserve.runner.compiled_step import CompiledStep
from jaxserve.runner.kv_cache import DeviceKV
from jaxserve.runner.protocol import StepResult
from jaxserve.runner.sampler import sample
from jaxserve.runner.tensor_parallel import Placement
from jaxserve.step_inputs import StepInputs

log = logging.getLogger(__name__)


def resolve_dtype(dtype: str, backend: str):
    if dtype == "auto":
        return jnp.float32 if backend == "cpu" else jnp.bfloat16
    return {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}[dtype]


def resolve_layer_loop(layer_loop: str, backend: str) -> str:
    # Measured on the 2-core CPU: unrolled layers beat scan's per-layer weight slices.
    if layer_loop == "auto":
        return "unroll" if backend == "cpu" else "scan"
    return layer_loop


def enable_compile_cache(cache_dir: str | None) -> None:
    if cache_dir == "":
        return
    if jax.config.jax_compilation_cache_dir:
        return  # someone (a test, the user) already chose one
    cache_dir = cache_dir or os.path.join(os.path.expanduser("~"), ".cache", "jaxserve", "xla")
    os.makedirs(cache_dir, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", cache_dir)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)


def pack(tokens, logprobs):
    """One packed i32 array -> one device-to-host copy per step. [2, ...]"""
    return jnp.stack([tokens, jax.lax.bitcast_convert_type(logprobs, jnp.int32)])


def unpack(packed: np.ndarray, num_chunks: int) -> StepResult:
    return StepResult(packed[0, :num_chunks].copy(),
                      packed[1, :num_chunks].view(np.float32).copy())


def plain_step(graphdef, attention, state, kv, inputs: StepInputs):
    """forward -> sample. Returns (packed [2, S] i32, kv)."""
    model = nnx.merge(graphdef, state)
    logits, kv = model(inputs.model, inputs.attention, kv, attention)
    tokens, logprobs = sample(logits, inputs.sampling)
    return pack(tokens, logprobs), kv


class ModelRunner:
    def __init__(self, model_config: ModelConfig, params: dict[str, np.ndarray], *,
                 num_pages: int, page_size: int, max_model_len: int, max_num_seqs: int,
                 max_num_batched_tokens: int, dtype: str = "auto",
                 attention_impl: str = "auto", layer_loop: str = "auto",
                 token_buckets=None, seq_buckets=None, compile_cache_dir: str | None = None,
                 mesh=None):
        """mesh: a ("tp",) jax Mesh to shard weights, KV pages and the step over (None: one
        device); see runner/tensor_parallel.py."""
        backend = jax.default_backend()
        enable_compile_cache(compile_cache_dir)
        self.model_config = model_config
        self.dtype = resolve_dtype(dtype, backend)
        self.layer_loop = resolve_layer_loop(layer_loop, backend)
        self.attention_impl = attention_impl
        self.page_size = page_size
        self.num_pages = num_pages
        self.mesh = mesh
        self.buckets = BucketTable.build(max_num_batched_tokens, max_num_seqs, max_model_len,
                                         page_size, token_buckets, seq_buckets)
        self.placement = Placement(mesh, model_config)
        self.graphdef, state = self.placement.model(params, self.dtype, self.layer_loop)
        self.cache = self.new_cache(self.placement)
        self.attention = self.placement.attention(attention_impl, page_size)
        step = functools.partial(plain_step, self.graphdef, self.attention)
        p = self.buckets.max_pages_per_request
        self.step = CompiledStep("step", step, state, (self.cache,), self.buckets,
                                 lambda shape: StepInputs.empty(*shape, p),
                                 **self.placement.jit_shardings())

    def new_cache(self, placement: Placement) -> DeviceKV:
        """A zeroed KV cache for placement's model over this runner's page pool."""
        arrays = placement.kv_cache(self.num_pages, self.page_size, self.dtype)
        return DeviceKV(arrays, self.buckets.max_pages_per_request)

    @property
    def state(self):
        return self.step.state

    @property
    def kv(self):
        return self.cache.arrays

    @property
    def num_host_swapped(self) -> int:
        return self.cache.num_host_swapped

    def warmup(self, progress: bool = True) -> None:
        self.step.warmup(progress)
        self.cache.warmup()

    def wait(self) -> None:
        jax.block_until_ready((self.state, self.kv))

    def close(self) -> None:
        pass

    def execute(self, plan: StepPlan) -> StepResult:
        self.cache.apply_swaps(plan)
        if not plan.chunks:
            return StepResult(np.zeros(0, np.int32), np.zeros(0, np.float32))
        inputs = build_step_inputs(plan, self.buckets, self.page_size)
        return unpack(np.asarray(self.step.run(inputs)), len(plan.chunks))
