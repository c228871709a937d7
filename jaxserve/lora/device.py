"""DeviceLoRA: the resident adapters' weights on the device, side by side by slot, per target.

For every projection a LoRA adapter may target on this base model ("wq", "wk", "wv", "wo", and
on a dense MLP "w_gate", "w_up", "w_down"), per layer A [in, N * R] and B [N * R, out] in the
compute dtype (model/decoder/lora.py's layout: slot s's A is columns (s - 1) * R .. s * R - 1, its B
the same rows): slots 1 .. N = max_loras hold adapters; slot 0, the base model's rows, has no
block (its delta is zero by construction, not by stored zeros). R = max_lora_rank. Held as L
arrays per target for the unrolled layer loop, or stacked [L, ...] for the scan
(`per_layer`), as the base weights are. An adapter of a smaller rank is
zero-padded to R (the extra products are exact zeros) and a target it lacks is zeros, so
writing one into a slot (`write`: a jitted, donated dynamic_update_slice per array, compiled
at warm-up) replaces arrays of the same shape and dtype and never recompiles the step, which
takes `arrays` (a model/decoder/lora.py LoRAStacks) as one of its donated caches and hands them back
unchanged. Under tensor parallelism the stacks are sharded like the base weights they adapt
(model/decoder/sharding.py's lora_specs: A on the base's input axis, B on its output axis).

The runner calls `apply_loads(plan.lora_loads, registry)` before each step, on the thread that
launches steps, so writes and steps keep their order. An engine that serves no adapters holds
`NoAdapters` in their place: its stacks are None, so the step's model input `Adapters` is None
and no delta is compiled. Which adapter goes into which slot is
the scheduler's (core/lora_slots.py); reading adapters is lora/peft.py's.
"""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.lora.peft import TARGETS, LoRAAdapter
from jaxserve.model.decoder.lora import LoRAStacks

log = logging.getLogger(__name__)


def lora_targets(model_config) -> dict[str, tuple[int, int]]:
    """Our parameter name -> (in, out) of every projection an adapter may target."""
    shapes = model_config.param_shapes()
    return {name: shapes[f"layers.{name}"][1:] for name in TARGETS.values()
            if f"layers.{name}" in shapes}


def _write_slot(stacks: LoRAStacks, slot, new) -> LoRAStacks:
    """stacks with new: name -> (A [L, in, R], B [L, R, out]) written into `slot`'s block
    (slot >= 1)."""
    def put(array, block, axis):  # block's rank axis goes to (slot - 1) * R on `axis`
        start = [0] * array.ndim
        start[axis] = (slot - 1) * block.shape[axis]
        return jax.lax.dynamic_update_slice(array, block.astype(array.dtype), start)

    weights = {}
    for name, (a, b) in stacks.weights.items():
        new_a, new_b = new[name]
        if isinstance(a, tuple):  # per layer: [in, N * R] / [N * R, out]
            weights[name] = (tuple(put(x, new_a[i], 1) for i, x in enumerate(a)),
                             tuple(put(x, new_b[i], 0) for i, x in enumerate(b)))
        else:  # stacked: [L, in, N * R] / [L, N * R, out]
            weights[name] = (put(a, new_a, 2), put(b, new_b, 1))
    return LoRAStacks(weights, stacks.max_loras)


class DeviceLoRA:
    def __init__(self, model_config, max_loras: int, max_lora_rank: int, dtype=jnp.float32,
                 placement=None, per_layer: bool = True):
        """placement: a runner/tensor_parallel.py Placement whose mesh the stacks are sharded
        over as its lora_shardings say (None, or one without a mesh: the default device);
        per_layer: L arrays per target (the unrolled loop), else stacked."""
        self.num_layers = model_config.num_layers
        self.max_loras = max_loras
        self.max_lora_rank = max_lora_rank
        self.targets = lora_targets(model_config)
        s, n, r = max_loras, self.num_layers, max_lora_rank
        by_target = (None if placement is None
                     else placement.lora_shardings(self.targets, per_layer))
        zeros = lambda shape, sharding: jax.device_put(jnp.zeros(shape, dtype), sharding)  # noqa: E731
        weights, shardings = {}, {}
        for name, (d_in, d_out) in self.targets.items():
            a_sharding, b_sharding = (None, None) if by_target is None else by_target[name]
            if per_layer:
                weights[name] = (tuple(zeros((d_in, s * r), a_sharding) for _ in range(n)),
                                 tuple(zeros((s * r, d_out), b_sharding) for _ in range(n)))
                shardings[name] = ((a_sharding,) * n, (b_sharding,) * n)
            else:
                weights[name] = (zeros((n, d_in, s * r), a_sharding),
                                 zeros((n, s * r, d_out), b_sharding))
                shardings[name] = (a_sharding, b_sharding)
        self.arrays = LoRAStacks(weights, max_loras)
        # The stacks' shardings as a LoRAStacks (a step's jit pins its output to them), or None
        self.shardings = None if by_target is None else LoRAStacks(shardings, max_loras)
        self.nbytes = sum(x.nbytes for x in jax.tree.leaves(self.arrays))
        log.info("LoRA: %d slots x rank %d on %s, %.1f MiB", max_loras, r,
                 ", ".join(self.targets), self.nbytes / 2**20)
        out = {} if self.shardings is None else {"out_shardings": self.shardings}
        self._write = jax.jit(_write_slot, donate_argnums=(0,), **out)

    def warmup(self) -> None:
        """Compile the slot write (zeros into slot 1, which holds zeros until a load)."""
        self.write(1, None)

    def padded(self, adapter: LoRAAdapter | None) -> dict:
        """The adapter as one slot's host arrays: rank padded to max_lora_rank, the targets it
        lacks zeros (None: all zeros)."""
        n, r = self.num_layers, self.max_lora_rank
        if adapter is not None:
            extra = sorted(set(adapter.weights) - set(self.targets))
            if extra:
                raise ValueError(f"LoRA adapter {adapter.path!r} targets {extra}, which this "
                                 f"model has no slot for ({', '.join(self.targets)})")
            if adapter.rank > r:
                raise ValueError(f"LoRA adapter {adapter.path!r} has rank {adapter.rank} > "
                                 f"max_lora_rank={r}")
        out = {}
        for name, (d_in, d_out) in self.targets.items():
            a = np.zeros((n, d_in, r), np.float32)
            b = np.zeros((n, r, d_out), np.float32)
            if adapter is not None and name in adapter.weights:
                a_adapter, b_adapter = adapter.weights[name]
                a[:, :, :adapter.rank], b[:, :adapter.rank] = a_adapter, b_adapter
            out[name] = (a, b)
        return out

    def write(self, slot: int, adapter: LoRAAdapter | None) -> None:
        """The adapter's weights into `slot` (None: zeros), in place."""
        if not 1 <= slot <= self.max_loras:
            raise ValueError(f"LoRA slot {slot} is outside [1, max_loras={self.max_loras}]")
        self.arrays = self._write(self.arrays, np.int32(slot), self.padded(adapter))

    def apply_loads(self, loads: list[tuple[int, int]], registry) -> None:
        """A plan's [(slot, adapter id)], each adapter's weights read from `registry` (a
        lora/registry.py LoRARegistry)."""
        for slot, lora_id in loads:
            self.write(slot, registry.get(lora_id))


class NoAdapters:
    """The runner's adapters when the engine serves none: the steps' adapter entry is None
    (a pytree without leaves: the compiled step is the one without adapters), and no plan
    loads one (core/lora_slots.py refuses requests that name an adapter)."""

    arrays = None
    shardings = None
    max_loras = 0

    def warmup(self) -> None:
        pass

    def apply_loads(self, loads: list[tuple[int, int]], registry) -> None:
        if loads:
            raise RuntimeError(f"a plan loads LoRA adapters {loads}, but this engine serves "
                               "none")
