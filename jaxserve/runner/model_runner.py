"""ModelRunner: owns every device array (weights, KV pages, host swap copies, executables).

It turns a StepPlan into one call of a compiled step (forward -> sample, KV donated) and
returns plain numpy results. Every (tokens, requests) bucket is compiled ahead of time; a
shape outside the table raises instead of compiling. It never decides what runs: that is the
scheduler's job.
"""

from __future__ import annotations

import functools
import logging
import os
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tqdm.auto import tqdm

from jaxserve.model.attention import get_attention_fn
from jaxserve.model.config import ModelConfig
from jaxserve.model.llama import StepInputs
from jaxserve.plan import StepPlan
from jaxserve.runner.batch import HostBatch, build_host_batch, empty_host_batch
from jaxserve.runner.buckets import BucketTable, powers_of_two
from jaxserve.runner.compile_count import num_compilations
from jaxserve.runner.sampler import sample
from jaxserve.runner.swap import KVSwapper
from jaxserve.runner.tensor_parallel import Placement

log = logging.getLogger(__name__)


@dataclass
class StepResult:
    token_ids: np.ndarray  # [num_chunks] i32 (entries of non-sampling chunks are meaningless)
    logprobs: np.ndarray   # [num_chunks] f32


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


def _step(graphdef, attention_fn, state, kv, token_ids, positions, slot_mapping,
          cu_q_lens, kv_lens, page_table, num_seqs, logits_indices, temperature, top_k, top_p,
          min_p, seeds, output_index, any_sampling):
    model = nnx.merge(graphdef, state)
    inputs = StepInputs(token_ids, positions, slot_mapping, cu_q_lens, kv_lens, page_table,
                        num_seqs, logits_indices)
    logits, kv = model(inputs, kv, attention_fn)
    tokens, logprobs = sample(logits, temperature, top_k, top_p, min_p, seeds, output_index,
                              any_sampling)
    # One packed array -> one device-to-host copy per step.
    packed = jnp.stack([tokens, jax.lax.bitcast_convert_type(logprobs, jnp.int32)])  # [2, S]
    return packed, kv


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
        self.page_size = page_size
        self.num_pages = num_pages
        self.buckets = BucketTable.build(max_num_batched_tokens, max_num_seqs, max_model_len,
                                         page_size, token_buckets, seq_buckets)
        placement = Placement(mesh, model_config)
        self.mesh = mesh
        self.graphdef, self.state = placement.model(params, self.dtype, self.layer_loop)
        self.kv = placement.kv_cache(num_pages, page_size, self.dtype)
        self.swapper = KVSwapper(powers_of_two(1, self.buckets.max_pages_per_request))
        self._host_pages = {}
        step = functools.partial(_step, self.graphdef,
                                 placement.attention(get_attention_fn(attention_impl)))
        self._jitted = jax.jit(step, donate_argnums=(1,), **placement.jit_shardings())
        self._executables = {}
        self.compilations_after_warmup: int | None = None

    # ---- compilation -----------------------------------------------------------------
    def warmup(self, progress: bool = True) -> None:
        """Compile every bucket (and the swap copies) ahead of time, then run each once.

        Tracing is serial (Python); XLA compiles run on a small thread pool, since the
        compiler releases the GIL and start-up time is mostly compile time.
        """
        shapes = self.buckets.shapes()
        batches = {shape: empty_host_batch(*shape, self.buckets.max_pages_per_request)
                   for shape in shapes}
        lowered = {shape: self._jitted.lower(self.state, self.kv, *b.model_inputs(),
                                             *b.sampling_inputs())
                   for shape, b in batches.items()}
        workers = max(1, min(len(shapes), os.cpu_count() or 1, 4))
        with ThreadPoolExecutor(workers) as pool, tqdm(
                total=len(shapes), desc="compiling step buckets", disable=not progress) as bar:
            futures = {pool.submit(low.compile): shape for shape, low in lowered.items()}
            for future in as_completed(futures):
                self._executables[futures[future]] = future.result()
                bar.set_postfix_str("T={} S={}".format(*futures[future]))
                bar.update(1)
        for batch in batches.values():
            self._run(batch)  # first run of an executable can allocate; do it now
        self.swapper.warmup(self.kv)
        self.compilations_after_warmup = num_compilations()

    def _run(self, batch: HostBatch) -> np.ndarray:
        exe = self._executables.get(batch.shape)
        if exe is None:
            raise RuntimeError(f"no compiled step for bucket (T, S)={batch.shape}; compiled: "
                               f"{sorted(self._executables)} (warmup() compiles them all)")
        packed, self.kv = exe(self.state, self.kv, *batch.model_inputs(),
                              *batch.sampling_inputs())
        packed.copy_to_host_async()
        return packed

    # ---- one step --------------------------------------------------------------------
    def execute(self, plan: StepPlan) -> StepResult:
        for request_id in plan.dropped_swaps:
            self._host_pages.pop(request_id, None)
        for op in plan.swap_out:
            self._host_pages[op.request_id] = self.swapper.swap_out(self.kv, op.page_ids)
        for op in plan.swap_in:
            self.kv = self.swapper.swap_in(self.kv, self._host_pages.pop(op.request_id),
                                           op.page_ids)
        if not plan.chunks:
            return StepResult(np.zeros(0, np.int32), np.zeros(0, np.float32))
        batch = build_host_batch(plan, self.buckets, self.page_size)
        packed = np.asarray(self._run(batch))
        n = len(plan.chunks)
        return StepResult(packed[0, :n].copy(), packed[1, :n].view(np.float32).copy())

    @property
    def num_host_swapped(self) -> int:
        return len(self._host_pages)
