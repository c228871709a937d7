"""LoRARegistry: the adapters the server knows by name and id, and the ones host memory holds.

Two tables. The known adapters (`requests`): LoRARequest by id and name, from lora_modules at
start, from `resolve` (LLM.generate's lora_request: an adapter seen before is checked to be the
same one, an id names one adapter, a name one id) and from `load` (the HTTP runtime endpoint,
which gives each load a fresh id: an id is never reused, so the prefix cache, keyed by id, never
lets a reloaded adapter reuse the old one's KV). The held weights (`get`): at most
max_cpu_loras LoRAAdapters, least recently used first. Holding one more evicts the least
recently used adapter no request uses (`in_use`, the engine's); it stays known and is read
again from its path when next named. `unload` forgets a name at once (new requests naming it
are refused) while requests already made under it keep its weights until they end.

Reading runs on the caller's thread (the HTTP and gRPC front ends call in from theirs), so the
tables are guarded by a lock; `pending` counts requests resolved but not yet queued, so that an
adapter is not evicted between a request's intake and its queueing (the engine calls `queued`).
No jax, no device memory, no scheduling.
"""

from __future__ import annotations

import threading
from collections import Counter, OrderedDict
from pathlib import Path
from typing import Callable

from jaxserve.lora.peft import LoRAAdapter, read_adapter
from jaxserve.lora.request import LoRARequest


class LoRARegistry:
    def __init__(self, model_config, max_lora_rank: int, max_cpu_loras: int,
                 in_use: Callable[[int], bool] | None = None):
        """model_config: the base model's ModelConfig, every adapter is checked against;
        in_use(id): whether a queued or running request uses the adapter (the engine sets it;
        None: none does)."""
        self.model_config = model_config
        self.max_lora_rank = max_lora_rank
        self.max_cpu_loras = max_cpu_loras
        self.in_use = in_use or (lambda lora_id: False)
        self._lock = threading.Lock()
        self._adapters: OrderedDict[int, LoRAAdapter] = OrderedDict()  # LRU first
        self._requests: dict[int, LoRARequest] = {}
        self._ids_by_name: dict[str, int] = {}
        self._names: dict[int, str] = {}   # every id ever known -> its name (metrics labels)
        self._retired: set[int] = set()    # ids of unloaded adapters: never reused
        self._pending: Counter = Counter()
        self._next_id = 1
        self.num_loads = 0       # adapters read into host memory
        self.num_evictions = 0   # adapters dropped from host memory to make room

    def __len__(self) -> int:
        return len(self._adapters)

    def __contains__(self, lora_id: int) -> bool:
        return lora_id in self._adapters

    @property
    def requests(self) -> list[LoRARequest]:
        """The adapters known (servable by name), as the LoRARequests that named them, by id."""
        with self._lock:
            return [self._requests[i] for i in sorted(self._requests)]

    def lookup(self, name: str) -> LoRARequest | None:
        """The known adapter called `name` (None: no such adapter)."""
        with self._lock:
            lora_id = self._ids_by_name.get(name)
            return None if lora_id is None else self._requests[lora_id]

    def name_of(self, lora_id: int) -> str:
        return self._names.get(lora_id, str(lora_id))

    def resolve(self, request: LoRARequest) -> int:
        """The adapter id of `request`, reading the adapter when host memory does not hold it;
        counted as pending until the engine calls `queued`. ValueError when it contradicts an
        adapter known (same id or name, another adapter), names an unloaded id, when host
        memory is full of adapters in use, or when the adapter itself is refused
        (lora/peft.py)."""
        if not isinstance(request, LoRARequest):
            raise ValueError(f"lora_request must be a LoRARequest, not {type(request).__name__}")
        lora_id = request.lora_int_id
        with self._lock:
            held = self._requests.get(lora_id)
            if held is not None:
                if (held.lora_name != request.lora_name or
                        (request.lora_path and _same(held.lora_path) != _same(request.lora_path))):
                    raise ValueError(f"lora_int_id={lora_id} already names adapter "
                                     f"{held.lora_name!r} at {held.lora_path!r}; give this one "
                                     "another id")
                request = held
            else:
                if lora_id in self._retired:
                    raise ValueError(f"lora_int_id={lora_id} named an adapter that was "
                                     "unloaded; give this one another id")
                other = self._ids_by_name.get(request.lora_name)
                if other is not None:
                    raise ValueError(f"lora_name={request.lora_name!r} already names the "
                                     f"adapter with lora_int_id={other}")
                if not request.lora_path:
                    raise ValueError(f"LoRA adapter {request.lora_name!r} is new and has no "
                                     "lora_path to read it from")
            self._hold(request)
            self._pending[lora_id] += 1
            return lora_id

    def load(self, name: str, path: str) -> LoRARequest:
        """A new adapter `name` read from `path` under a fresh id (the runtime endpoint);
        ValueError when the name is taken or the adapter is refused."""
        with self._lock:
            if name in self._ids_by_name:
                raise ValueError(f"lora_name={name!r} is already loaded; unload it first")
            request = LoRARequest(name, self._next_id, path)
            self._hold(request)
            return request

    def unload(self, name: str) -> LoRARequest:
        """Forget adapter `name` (KeyError: not known). Requests made under it keep its
        weights until they end; its id is never reused."""
        with self._lock:
            lora_id = self._ids_by_name.pop(name)
            request = self._requests.pop(lora_id)
            self._retired.add(lora_id)
            self._drop_unused_retired()
            return request

    def queued(self, lora_id: int) -> None:
        """A resolved request is in the engine's queues now (or was dropped before)."""
        with self._lock:
            self._pending[lora_id] -= 1
            if self._pending[lora_id] <= 0:
                del self._pending[lora_id]

    def get(self, lora_id: int) -> LoRAAdapter:
        with self._lock:
            adapter = self._adapters.get(lora_id)
        if adapter is None:
            raise KeyError(f"no LoRA adapter with id {lora_id} is loaded")
        return adapter

    # ---- under the lock ------------------------------------------------------------------
    def _busy(self, lora_id: int) -> bool:
        return lora_id in self._pending or self.in_use(lora_id)

    def _drop_unused_retired(self) -> None:
        for lora_id in [i for i in self._adapters if i in self._retired and not self._busy(i)]:
            del self._adapters[lora_id]

    def _hold(self, request: LoRARequest) -> None:
        """Host memory holds the adapter (most recently used); read it when it does not,
        making room by evicting the least recently used idle one."""
        lora_id = request.lora_int_id
        if lora_id in self._adapters:
            self._adapters.move_to_end(lora_id)
            return
        self._drop_unused_retired()
        adapter = read_adapter(request.lora_path, self.model_config, self.max_lora_rank)
        if len(self._adapters) >= self.max_cpu_loras:
            victim = next((i for i in self._adapters if not self._busy(i)), None)
            if victim is None:
                raise ValueError(f"cannot load LoRA adapter {request.lora_name!r}: host memory "
                                 f"holds max_cpu_loras={self.max_cpu_loras} adapters, all in "
                                 "use by requests")
            del self._adapters[victim]
            self.num_evictions += 1
        self._adapters[lora_id] = adapter
        self._requests[lora_id] = request
        self._ids_by_name[request.lora_name] = lora_id
        self._names[lora_id] = request.lora_name
        self._next_id = max(self._next_id, lora_id + 1)
        self.num_loads += 1


def _same(path: str) -> str:
    return str(Path(path).resolve())
