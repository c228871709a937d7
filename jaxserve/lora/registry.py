"""LoRARegistry: the adapters the host holds, by lora_int_id, at most max_cpu_loras of them.

`resolve(lora_request)` gives the adapter id a request carries (its lora_int_id): an adapter
seen before is checked to be the same one (an id names one adapter, a name one id), a new one is
read from its PEFT directory (lora/peft.py) and kept. The runner reads an adapter's weights by
id (`get`) when the scheduler puts it into a device slot. Reading runs on the caller's thread
(the HTTP and gRPC front ends call in from theirs), so the table is guarded by a lock.

In this version the host keeps every adapter it has read: one past max_cpu_loras is refused
(ValueError), none is ever evicted. No jax, no device memory, no scheduling.
"""

from __future__ import annotations

import threading
from pathlib import Path

from jaxserve.lora.peft import LoRAAdapter, read_adapter
from jaxserve.lora.request import LoRARequest


class LoRARegistry:
    def __init__(self, model_config, max_lora_rank: int, max_cpu_loras: int):
        """model_config: the base model's ModelConfig, every adapter is checked against."""
        self.model_config = model_config
        self.max_lora_rank = max_lora_rank
        self.max_cpu_loras = max_cpu_loras
        self._lock = threading.Lock()
        self._adapters: dict[int, LoRAAdapter] = {}
        self._requests: dict[int, LoRARequest] = {}
        self._ids_by_name: dict[str, int] = {}

    def __len__(self) -> int:
        return len(self._adapters)

    def __contains__(self, lora_id: int) -> bool:
        return lora_id in self._adapters

    @property
    def requests(self) -> list[LoRARequest]:
        """The adapters held, as the LoRARequests that named them, by id."""
        with self._lock:
            return [self._requests[i] for i in sorted(self._requests)]

    def resolve(self, request: LoRARequest) -> int:
        """The adapter id of `request`, reading the adapter the first time; ValueError when it
        contradicts an adapter held (same id or name, another adapter), when the host holds
        max_cpu_loras already, or when the adapter itself is refused (lora/peft.py)."""
        if not isinstance(request, LoRARequest):
            raise ValueError(f"lora_request must be a LoRARequest, not {type(request).__name__}")
        with self._lock:
            held = self._requests.get(request.lora_int_id)
            if held is not None:
                if (held.lora_name != request.lora_name or
                        (request.lora_path and _same(held.lora_path) != _same(request.lora_path))):
                    raise ValueError(f"lora_int_id={request.lora_int_id} already names adapter "
                                     f"{held.lora_name!r} at {held.lora_path!r}; give this one "
                                     "another id")
                return request.lora_int_id
            other = self._ids_by_name.get(request.lora_name)
            if other is not None:
                raise ValueError(f"lora_name={request.lora_name!r} already names the adapter "
                                 f"with lora_int_id={other}")
            if len(self._adapters) >= self.max_cpu_loras:
                raise ValueError(f"cannot load LoRA adapter {request.lora_name!r}: the host "
                                 f"holds max_cpu_loras={self.max_cpu_loras} adapters already")
            if not request.lora_path:
                raise ValueError(f"LoRA adapter {request.lora_name!r} is new and has no "
                                 "lora_path to read it from")
            adapter = read_adapter(request.lora_path, self.model_config, self.max_lora_rank)
            self._adapters[request.lora_int_id] = adapter
            self._requests[request.lora_int_id] = request
            self._ids_by_name[request.lora_name] = request.lora_int_id
            return request.lora_int_id

    def get(self, lora_id: int) -> LoRAAdapter:
        with self._lock:
            adapter = self._adapters.get(lora_id)
        if adapter is None:
            raise KeyError(f"no LoRA adapter with id {lora_id} is loaded")
        return adapter


def _same(path: str) -> str:
    return str(Path(path).resolve())
