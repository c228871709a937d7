"""RunnerMemory: what the rollout API does to a plain runner's device arrays: swap in new
weights, give the weights and the KV pool back to the device allocator, and make them again.

The compiled step takes its weights as one flat tuple of leaves (runner/compiled_step.py), so new
weights with the same shapes, dtypes and shardings are swapped in by replacing that tuple: the
executables stay and nothing compiles. Sleeping deletes device buffers (`jax.Array.delete`,
which frees them whoever else holds a reference): the KV pages with the swapped-out pages and
the host prefix tier's copies in flight (their contents belong to the pool), and the weights;
at level 1 the weights go to host memory first (pinned host memory where the backend has it,
so waking is a DMA; a numpy copy where it has none). Waking puts them back in the same
shardings and makes a zeroed KV pool with the executable that made the first one.

Nothing here decides when: the engine (engine/rollout.py) calls these between steps, with no
step in flight. The logits processors' state, the batch's page tables and the LoRA stacks stay
(they are small, and hold no KV).
"""

from __future__ import annotations

import jax
import numpy as np

from jaxserve.runner.weight_update import build_leaves, weight_paths

ON_DEVICE, ON_HOST, DISCARDED = "device", "host", "discarded"


class RunnerMemory:
    def __init__(self, runner):
        """runner: a ModelRunner (runner/model_runner.py), whose rollout_memory() makes this."""
        self.runner = runner
        step = runner.step
        self.paths = weight_paths(step.state, runner.model_config)
        self.targets = [jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=leaf.sharding)
                        for leaf in step.leaves]
        self.weights = ON_DEVICE
        self.kv_on_device = True
        self._host: list | None = None  # the weights' host copies (level 1 sleep)

    # ---- weights ---------------------------------------------------------------------
    def build(self, params) -> list:
        """New weight leaves placed on the device (runner/weight_update.py); nothing swapped."""
        return build_leaves(params, self.runner.step.state, self.targets,
                            self.runner.model_config)

    def swap_in(self, new: list) -> None:
        """Make `new` (from build) the step's weights; the old device buffers are freed."""
        self.runner.wait()
        step = self.runner.step
        old = step.leaves
        leaves = tuple(o if n is None else n for o, n in zip(old, new))
        self._set(leaves)
        if self.weights == ON_DEVICE:
            for o, n in zip(old, new):
                if n is not None:
                    o.delete()
        self.weights, self._host = ON_DEVICE, None

    def get(self) -> object:
        """A copy of the weights on the device, in the step's state pytree (the layout build
        takes back)."""
        if self.weights != ON_DEVICE:
            raise RuntimeError(f"the weights are not on the device ({self.weights}): wake_up "
                               f"or update the weights first")
        self.runner.wait()
        state = self.runner.step.state
        return jax.tree.map(lambda a: jax.device_put(a, a.sharding, may_alias=False), state)

    def offload_weights(self) -> None:
        """Level 1 sleep: the weights to host memory, their device buffers freed."""
        if self.weights != ON_DEVICE:
            return
        self.runner.wait()
        self._host = [None if where is None else _to_host(leaf)
                      for leaf, where in zip(self.runner.step.leaves, self.paths)]
        self._delete_weights()
        self.weights = ON_HOST

    def discard_weights(self) -> None:
        """Level 2 sleep: the weights' device buffers (and any host copy) freed."""
        if self.weights == ON_DEVICE:
            self.runner.wait()
            self._delete_weights()
        self.weights, self._host = DISCARDED, None

    def restore_weights(self) -> bool:
        """The host copies back on the device; False when there are none (discarded)."""
        if self.weights == ON_HOST:
            leaves = tuple(leaf if host is None else jax.device_put(host, target.sharding)
                           for leaf, host, target in zip(self.runner.step.leaves, self._host,
                                                         self.targets))
            self._set(leaves)
            self.weights, self._host = ON_DEVICE, None
        return self.weights == ON_DEVICE

    def _delete_weights(self) -> None:
        for leaf, where in zip(self.runner.step.leaves, self.paths):
            if where is not None:  # (RoPE frequencies stay: a few bytes, from the config)
                leaf.delete()

    def _set(self, leaves: tuple) -> None:
        self.runner.step.replace_leaves(leaves)

    # ---- KV ---------------------------------------------------------------------------
    def free_kv(self) -> None:
        """Delete the KV pages, the swapped-out pages' copies and the host tier's stores in
        flight (the page manager forgets what they held: engine/rollout.py)."""
        if not self.kv_on_device:
            return
        self.runner.wait()
        self.runner.cache.release()
        self.kv_on_device = False

    def restore_kv(self) -> None:
        """A zeroed KV pool in the same shardings (the allocation compiled at start-up)."""
        if self.kv_on_device:
            return
        runner = self.runner
        runner.cache.restore(runner.placement.kv_cache(runner.num_pages, runner.page_size,
                                                       runner.kv_dtype))
        self.kv_on_device = True


def _to_host(leaf: jax.Array):
    kinds = {m.kind for d in leaf.sharding.device_set for m in d.addressable_memories()}
    if "pinned_host" in kinds:
        return jax.device_put(leaf, leaf.sharding.with_memory_kind("pinned_host"))
    return np.array(leaf)  # (a copy: a view of a CPU buffer would keep it alive)


def device_bytes() -> int:
    """Bytes of every live jax array in device memory (pinned host copies left out)."""
    total = 0
    for array in jax.live_arrays():
        if array.is_deleted() or getattr(array.sharding, "memory_kind", None) == "pinned_host":
            continue
        total += array.nbytes
    return total
