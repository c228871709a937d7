"""LoRASlots: the scheduler's one object for LoRA adapters: which requests use each adapter,
which adapter each device slot holds, and which slot each running request's rows read.

The scheduler calls one method per request event and never looks at a request's adapter
itself: `add` when a request is queued (its adapter counts as in use until `finish`; an
adapter named while the engine serves none is the request's error), `can_acquire` / `acquire`
when it starts running (from the waiting queue or back from swap), `release` when it stops
(finished, preempted), `finish` when it ends, `take_loads` once per plan. A base-model
request (lora_id 0) passes through every one of them unchanged.

The runner keeps max_loras adapters resident in device slots 1..max_loras (slot 0: no adapter,
all zeros). An adapter not resident goes into a free slot, else into the slot of the least
recently used adapter no running request uses (it stays resident while idle, so a later
request finds it there); the move is a load the next plan carries (StepPlan.lora_loads:
[(slot, adapter id)]), done by the runner before that step. When every slot's adapter is in
use, `can_acquire` is False and the request waits: a slot in use is never taken, so no
running request's adapter changes under it. Plain Python: no jax, no adapter weights (the
runner reads those by id).
"""

from __future__ import annotations

from collections import Counter, OrderedDict

from jaxserve.core.request import Request


class LoRASlots:
    def __init__(self, max_loras: int):
        """max_loras: device slots for adapters (0: the engine serves none)."""
        self.max_loras = max_loras
        self._refs: Counter = Counter()          # adapter id -> unfinished requests under it
        self._slot_of: dict[int, int] = {}       # resident adapter id -> its slot
        self._users: dict[int, int] = {}         # slot -> running requests using it
        self._held: dict[str, int] = {}          # running request id -> its adapter's slot
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

    @property
    def in_use(self) -> frozenset[int]:
        """The adapters some unfinished request (queued, running or swapped out) names."""
        return frozenset(self._refs)

    def add(self, request: Request) -> str | None:
        """The request is queued: its adapter is in use until finish(request). Returns the
        request's error when it names an adapter and the engine serves none, else None."""
        if not request.lora_id:
            return None
        self._refs[request.lora_id] += 1
        if self.max_loras:
            return None
        return (f"request names LoRA adapter {request.lora_id}, but this engine serves no "
                "adapters (enable_lora is off)")

    def finish(self, request: Request) -> None:
        """The request ended (after release, if it ran): its use of its adapter ends."""
        lora_id = request.lora_id
        if not lora_id:
            return
        self._refs[lora_id] -= 1
        if not self._refs[lora_id]:
            del self._refs[lora_id]

    def slot_of(self, request_id: str) -> int:
        """The device slot a running request's rows read (0: the base model)."""
        return self._held.get(request_id, 0)

    def can_acquire(self, request: Request) -> bool:
        """Whether the request's adapter has, or can get, a slot now."""
        return (request.lora_id == 0 or request.lora_id in self._slot_of
                or bool(self._free) or bool(self._idle))

    def acquire(self, request: Request) -> None:
        """The request starts running: slot_of(its id) is its adapter's slot from now on.
        Call only when can_acquire(request)."""
        lora_id = request.lora_id
        if lora_id == 0:
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
        self._held[request.request_id] = slot

    def release(self, request: Request) -> None:
        """The request stopped running: its slot is idle once no other running request uses
        it (kept resident, most recently used)."""
        slot = self._held.pop(request.request_id, 0)
        if slot == 0:
            return
        self._users[slot] -= 1
        if self._users[slot] == 0:
            del self._users[slot]
            self._idle[slot] = next(i for i, s in self._slot_of.items() if s == slot)

    def take_loads(self) -> list[tuple[int, int]]:
        """The loads since the last call, for this step's plan: [(slot, adapter id)]."""
        loads, self._loads = self._loads, []
        return loads
