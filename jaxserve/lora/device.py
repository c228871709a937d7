"""DeviceLoRA: the resident adapters' weights on the device, stacked by slot, per target.

For every projection a LoRA adapter may target on this base model ("wq", "wk", "wv", "wo", and
on a dense MLP "w_gate", "w_up", "w_down"), A [S, L, in, R] and B [S, L, R, out] in the compute
dtype: S = max_loras + 1 slots (slot 0 stays zeros: rows of the base model), R = max_lora_rank.
An adapter of a smaller rank is zero-padded to R (the extra products are exact zeros) and a
target it lacks is zeros, so every adapter fills a slot with arrays of one shape and dtype:
writing one (`write`, a jitted, donated dynamic_update_slice compiled at warm-up) replaces the
arrays in place and never recompiles the step, which takes `arrays` as one of its donated
caches and hands them back unchanged (model/lora.py reads them).

The runner calls `apply_loads(plan.lora_loads, registry)` before each step, on the thread that
launches steps, so writes and steps keep their order. Which adapter goes into which slot is
the scheduler's (core/lora_slots.py); reading adapters is lora/peft.py's.
"""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.lora.peft import TARGETS, LoRAAdapter

log = logging.getLogger(__name__)


def lora_targets(model_config) -> dict[str, tuple[int, int]]:
    """Our parameter name -> (in, out) of every projection an adapter may target."""
    shapes = model_config.param_shapes()
    return {name: shapes[f"layers.{name}"][1:] for name in TARGETS.values()
            if f"layers.{name}" in shapes}


def _write_slot(stacks, slot, new):
    """stacks: name -> (A [S, L, in, R], B [S, L, R, out]); new: name -> (A [L, in, R],
    B [L, R, out]) written at `slot`."""
    return jax.tree.map(
        lambda s, n: jax.lax.dynamic_update_index_in_dim(s, n.astype(s.dtype), slot, 0),
        stacks, new)


class DeviceLoRA:
    def __init__(self, model_config, max_loras: int, max_lora_rank: int, dtype=jnp.float32,
                 sharding=None):
        """sharding: where the stacks live (None: the default device; tensor parallel:
        replicated)."""
        self.num_layers = model_config.num_layers
        self.num_slots = max_loras + 1
        self.max_lora_rank = max_lora_rank
        self.targets = lora_targets(model_config)
        s, n, r = self.num_slots, self.num_layers, max_lora_rank
        zeros = lambda shape: jax.device_put(jnp.zeros(shape, dtype), sharding)
        self.arrays = {name: (zeros((s, n, d_in, r)), zeros((s, n, r, d_out)))
                       for name, (d_in, d_out) in self.targets.items()}
        itemsize = jnp.dtype(dtype).itemsize
        self.nbytes = sum(a.size + b.size for a, b in self.arrays.values()) * itemsize
        log.info("LoRA: %d slots x rank %d on %s, %.1f MiB", max_loras, r,
                 ", ".join(self.targets), self.nbytes / 2**20)
        shardings = {} if sharding is None else {"out_shardings": sharding}
        self._write = jax.jit(_write_slot, donate_argnums=(0,), **shardings)

    def warmup(self) -> None:
        """Compile the slot write (zeros into slot 0, which stays zeros)."""
        self.write(0, None)

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
        if not 0 <= slot < self.num_slots:
            raise ValueError(f"LoRA slot {slot} is outside [0, {self.num_slots})")
        self.arrays = self._write(self.arrays, np.int32(slot), self.padded(adapter))

    def apply_loads(self, loads: list[tuple[int, int]], registry) -> None:
        """A plan's [(slot, adapter id)], each adapter's weights read from `registry` (a
        lora/registry.py LoRARegistry)."""
        for slot, lora_id in loads:
            self.write(slot, registry.get(lora_id))
