"""LoRASlots: which LoRA adapter each device slot holds, and which running requests use it.

The runner keeps max_loras adapters resident in device slots 1..max_loras (slot 0: no adapter,
all zeros). A request under an adapter takes the adapter's slot when it starts running (from
the waiting queue or back from swap) and gives it back when it stops (finished, preempted):
`acquire` / `release`, the same moments as its batch slot. An adapter not resident goes into
a free slot, else into the slot of the least recently used adapter no running request uses
(it stays resident while idle, so a later request finds it there); the move is a load the next
plan carries (StepPlan.lora_loads: [(slot, adapter id)]), done by the runner before that step.
When every slot's adapter is in use, `can_acquire` is False and the request waits: a slot in
use is never taken, so no running request's adapter changes under it.

This is the seam for what comes later (runtime loading and unloading, load and eviction
metrics): the scheduler asks only can_acquire / acquire / release / take_loads. Plain Python:
no jax, no adapter weights (the runner reads those by id).
"""

from __future__ import annotations

from collections import OrderedDict

from jaxserve.core.request import Request


class LoRASlots:
    def __init__(self, max_loras: int):
        """max_loras: device slots for adapters (0: the engine serves none)."""
        self.max_loras = max_loras
        self._slot_of: dict[int, int] = {}       # resident adapter id -> its slot
        self._users: dict[int, int] = {}         # slot -> running requests using it
        # resident adapters no running request uses, least recently used first: slot -> id
        self._idle: OrderedDict[int, int] = OrderedDict()
        self._free = list(range(max_loras, 0, -1))
        self._loads: list[tuple[int, int]] = []  # this step's (slot, adapter id)
        self.num_loads = 0
        self.num_evictions = 0

    @property
    def resident(self) -> dict[int, int]:
        """Adapter id -> its device slot, for every resident adapter."""
        return dict(self._slot_of)

    def can_acquire(self, request: Request) -> bool:
        """Whether the request's adapter has, or can get, a slot now."""
        return (request.lora_id == 0 or request.lora_id in self._slot_of
                or bool(self._free) or bool(self._idle))

    def acquire(self, request: Request) -> None:
        """The request starts running: request.lora_slot is its adapter's slot (0: none).
        Call only when can_acquire(request)."""
        lora_id = request.lora_id
        if lora_id == 0:
            request.lora_slot = 0
            return
        slot = self._slot_of.get(lora_id)
        if slot is None:
            if self._free:
                slot = self._free.pop()
            else:
                slot, evicted = self._idle.popitem(last=False)
                del self._slot_of[evicted]
                self.num_evictions += 1
            self._slot_of[lora_id] = slot
            self._loads = [(s, i) for s, i in self._loads if s != slot] + [(slot, lora_id)]
            self.num_loads += 1
        self._idle.pop(slot, None)
        self._users[slot] = self._users.get(slot, 0) + 1
        request.lora_slot = slot

    def release(self, request: Request) -> None:
        """The request stopped running: its slot is idle once no other running request uses
        it (kept resident, most recently used)."""
        slot = request.lora_slot
        if slot == 0:
            return
        request.lora_slot = 0
        self._users[slot] -= 1
        if self._users[slot] == 0:
            del self._users[slot]
            lora_id = next(i for i, s in self._slot_of.items() if s == slot)
            self._idle[slot] = lora_id

    def take_loads(self) -> list[tuple[int, int]]:
        """The loads since the last call, for this step's plan: [(slot, adapter id)]."""
        loads, self._loads = self._loads, []
        return loads
