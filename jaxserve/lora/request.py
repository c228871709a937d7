"""LoRARequest: which adapter a request runs under, with vLLM's fields and meaning.

Plain data, no jax: the engine resolves it (lora/registry.py) into the adapter id a core
Request carries. lora_int_id identifies the adapter (>= 1; 0 is the base model everywhere
else); lora_name is the name clients use for it; lora_path is its PEFT directory.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    lora_name: str
    lora_int_id: int
    lora_path: str = ""

    def __post_init__(self):
        if not isinstance(self.lora_name, str) or not self.lora_name.strip():
            raise ValueError(f"LoRARequest lora_name={self.lora_name!r} is invalid: must be a "
                             "non-empty string")
        if (not isinstance(self.lora_int_id, int) or isinstance(self.lora_int_id, bool)
                or self.lora_int_id < 1):
            raise ValueError(f"LoRARequest lora_int_id={self.lora_int_id!r} is invalid: must "
                             "be an integer >= 1 (0 stands for the base model)")
        if not isinstance(self.lora_path, str):
            raise ValueError(f"LoRARequest lora_path={self.lora_path!r} is invalid: must be a "
                             "string (the adapter's directory)")
