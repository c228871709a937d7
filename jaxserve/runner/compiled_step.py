"""CompiledStep: one step function, compiled ahead of time for every bucket, and run.

A step function has the signature `fn(state, kv, inputs) -> (out, kv)`: weights (an NNX state,
or a tuple of them), the KV arrays (donated, so XLA updates them in place) and one inputs
dataclass (step_inputs.py). CompiledStep owns its jit, the bucket table, one executable per
bucket, ahead-of-time warm-up (trace serially, compile on a small thread pool, run each once),
the "no compiled step for this bucket" error (serving never compiles) and the run with its
asynchronous device-to-host copy of `out` (of out[0] when `out` is a tuple: the rest is
fetched only by the steps that need it). Its KV caches (DeviceKV, which apply swaps) may be
shared with other CompiledSteps over the same cache; the runner that owns the caches applies
each plan's swaps once per cache. The model runner and the speculative runner are built from
CompiledSteps; neither decides what runs.

The weights enter every call as one flat tuple of arrays, flattened once here: the executable
is compiled for `fn(unflatten(leaves), kv, inputs)`. Passing the NNX state itself made every
call flatten it in Python, one callback per Variable (0.62-0.66 ms a call for the default model's
273 leaves, 0.02 ms for the same arrays as a tuple: scripts/dispatch_options.py).
"""

from __future__ import annotations

import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from typing import Callable

import jax
from tqdm.auto import tqdm

from jaxserve.runner.buckets import BucketTable
from jaxserve.runner.kv_cache import DeviceKV

log = logging.getLogger(__name__)


class CompiledStep:
    def __init__(self, name: str, fn: Callable, state, caches: tuple[DeviceKV, ...],
                 buckets: BucketTable, empty_inputs: Callable[[tuple[int, int]], object],
                 **jit_kwargs):
        """caches: the KV caches the step reads and writes, passed as `kv` (one: its arrays;
        several: a tuple of them); empty_inputs(shape): all-padding inputs of a bucket."""
        self.name = name
        self.state = state  # as given (readers: the speculative runner, start-up sizes)
        leaves, treedef = jax.tree.flatten(state)
        self._leaves = tuple(leaves)
        self.caches = caches
        self.buckets = buckets
        self.empty_inputs = empty_inputs
        def flat_fn(leaves, kv, inputs):
            return fn(jax.tree.unflatten(treedef, leaves), kv, inputs)

        self._jitted = jax.jit(flat_fn, donate_argnums=(1,), **jit_kwargs)
        self._executables: dict[tuple[int, int], jax.stages.Compiled] = {}

    @property
    def leaves(self) -> tuple:
        """The weights as the executables take them: one flat tuple of arrays."""
        return self._leaves

    def replace_leaves(self, leaves: tuple) -> None:
        """New weights of the same shapes, dtypes and shardings: the executables stay."""
        self._leaves = tuple(leaves)
        self.state = jax.tree.unflatten(jax.tree.structure(self.state), self._leaves)

    @property
    def kv(self):
        arrays = tuple(c.arrays for c in self.caches)
        return arrays[0] if len(arrays) == 1 else arrays

    def _set_kv(self, kv) -> None:
        for cache, arrays in zip(self.caches, (kv,) if len(self.caches) == 1 else kv):
            cache.arrays = arrays

    def warmup(self, progress: bool = True) -> None:
        """Compile every bucket ahead of time, then run each once (a first run can allocate).

        Tracing is serial (Python); each bucket's XLA compile starts on a small thread pool as
        soon as it is traced (the compiler releases the GIL, and start-up is mostly compile
        time), largest bucket first: it takes longest, so the pool finishes together."""
        shapes = sorted(self.buckets.shapes(), reverse=True)
        workers = max(1, min(len(shapes), os.cpu_count() or 1, 4))
        inputs, futures = {}, {}
        start = time.perf_counter()
        with ThreadPoolExecutor(workers) as pool, tqdm(
                total=len(shapes), desc=f"compiling {self.name} buckets",
                disable=not progress) as bar:
            for shape in shapes:
                inputs[shape] = self.empty_inputs(shape)
                lowered = self._jitted.lower(self._leaves, self.kv, inputs[shape])
                futures[pool.submit(lowered.compile)] = shape
            traced = time.perf_counter() - start
            for future in as_completed(futures):
                self._executables[futures[future]] = future.result()
                bar.set_postfix_str("T={} S={}".format(*futures[future]))
                bar.update(1)
        compiled = time.perf_counter() - start
        for x in inputs.values():
            self.run(x)
        jax.block_until_ready(self.kv)
        log.info("%s step: %d buckets (T, S) %s traced in %.1f s, traced + compiled in %.1f s "
                 "(%d compile threads), warm-up runs %.1f s", self.name, len(shapes),
                 sorted(shapes), traced, compiled, workers,
                 time.perf_counter() - start - compiled)

    def compile_only(self, shape: tuple[int, int]) -> jax.stages.Compiled:
        """Bucket `shape` compiled and returned, not kept (start-up reads its memory_analysis()
        before the KV pool is sized: engine/memory_profile.py)."""
        return self._jitted.lower(self._leaves, self.kv, self.empty_inputs(shape)).compile()

    def input_shardings(self, shape: tuple[int, int]):
        """The inputs pytree's shardings the bucket's executable was compiled for (under a
        mesh XLA may shard an input, e.g. a bitmask over the vocabulary axis)."""
        return self._executables[shape].input_shardings[0][2]

    def run(self, inputs):
        """Run the bucket's executable; `out` comes back with its host copy already started."""
        exe = self._executables.get(inputs.shape)
        if exe is None:
            raise RuntimeError(f"no compiled {self.name} step for bucket (T, S)={inputs.shape}; "
                               f"compiled: {sorted(self._executables)} (warmup() compiles them)")
        out, kv = exe(self._leaves, self.kv, inputs)
        self._set_kv(kv)
        if out is not None:  # a tuple: its first array is every step's; the rest on demand
            (out[0] if isinstance(out, tuple) else out).copy_to_host_async()
        return out
