"""LoRAConfig: the engine's multi-LoRA settings, with vLLM's names (--enable-lora,
--lora-modules, --max-loras, --max-cpu-loras, --max-lora-rank).

One settings group of EngineConfig (config/engine.py), like groups.py's: frozen plain data
plus validate() for the checks that concern it alone. No jax, no adapter reading (that is
jaxserve/lora/'s, at engine start for lora_modules).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from jaxserve.config.settings import need, setting


@dataclass(frozen=True)
class LoRAConfig:
    """LoRA adapters on the base model, batched together in every step (jaxserve/lora/)."""
    enable_lora: bool = setting(
        False, "serve LoRA adapters (PEFT format) on the base model, several in one batch",
        vllm="=")
    lora_modules: tuple[str, ...] | None = setting(
        None, "adapters read at start, each name=path (a PEFT adapter directory) or vLLM's "
        "JSON form {\"name\": ..., \"path\": ...}; their ids are 1, 2, ... in order; needs "
        "enable_lora", unit="name=path", vllm="=")
    max_loras: int = setting(
        1, "adapters resident on the device at once, each in a slot of the step; a request "
        "under another adapter waits until a slot's adapter is idle", unit="adapters",
        vllm="=")
    max_cpu_loras: int | None = setting(
        None, "adapters held in host memory, least recently used dropped for another (read "
        "again when named; refused only while all are in use); unset: max_loras",
        unit="adapters", vllm="=")
    max_lora_rank: int = setting(
        16, "highest adapter rank served: every slot is this wide (smaller ranks are "
        "zero-padded, exactly)", unit="rank", vllm="=")

    def __post_init__(self):
        modules = self.lora_modules
        if isinstance(modules, dict):  # LLM(lora_modules={"name": "path"})
            modules = [f"{name}={path}" for name, path in modules.items()]
        elif isinstance(modules, str):
            modules = [modules]
        if modules is not None:
            object.__setattr__(self, "lora_modules", tuple(modules))

    @property
    def num_cpu_loras(self) -> int:
        return self.max_loras if self.max_cpu_loras is None else self.max_cpu_loras

    def modules(self) -> list[tuple[str, str]]:
        """lora_modules as (name, path) pairs; ValueError naming a malformed entry."""
        pairs = []
        for entry in self.lora_modules or ():
            name = path = ""
            if isinstance(entry, str) and entry.lstrip().startswith("{"):
                try:
                    spec = json.loads(entry)
                except json.JSONDecodeError:
                    spec = None
                if isinstance(spec, dict):
                    name, path = str(spec.get("name", "")), str(spec.get("path", ""))
            elif isinstance(entry, str):
                name, _, path = entry.partition("=")
            need(bool(name.strip() and path.strip()), "lora_modules", entry,
                 "name=path (or {\"name\": ..., \"path\": ...}) with a non-empty name and path")
            pairs.append((name.strip(), path.strip()))
        return pairs

    def validate(self) -> None:
        need(self.max_loras >= 1, "max_loras", self.max_loras, ">= 1")
        need(self.max_lora_rank >= 1, "max_lora_rank", self.max_lora_rank, ">= 1")
        need(self.max_cpu_loras is None or self.max_cpu_loras >= self.max_loras,
             "max_cpu_loras", self.max_cpu_loras, f">= max_loras ({self.max_loras}) or unset")
        pairs = self.modules()
        need(not pairs or self.enable_lora, "lora_modules", self.lora_modules,
             "unset unless enable_lora is on")
        names = [name for name, _ in pairs]
        need(len(set(names)) == len(names), "lora_modules", self.lora_modules,
             "one entry per adapter name")
