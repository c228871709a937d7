"""LoRA adapters over HTTP: /v1/models' adapter cards and vLLM's runtime loading endpoints.

`POST /v1/load_lora_adapter` {"lora_name", "lora_path"} reads a PEFT adapter directory and
serves it under that name (a fresh adapter id each load: lora/registry.py); `POST
/v1/unload_lora_adapter` {"lora_name"} stops serving it (requests already running under it
finish; new ones naming it get 404). Both answer 404, as vLLM does without its flag, unless the
server serves LoRA (--enable-lora) and runtime updating is allowed by the environment:
VLLM_ALLOW_RUNTIME_LORA_UPDATING or JAXSERVE_ALLOW_RUNTIME_LORA_UPDATING set to 1 / true. A bad
adapter (missing file, rank above --max-lora-rank, unknown target module, shapes not matching
the base model) is a 400 naming the problem; the server keeps serving. Adapter files are read
on the text pool, never on the event loop. Only routing and translation: the adapters
themselves are the registry's.
"""

from __future__ import annotations

import os
from typing import Callable

from fastapi import FastAPI
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, ConfigDict, Field

from jaxserve.entrypoints.openai import protocol as api
from jaxserve.entrypoints.openai.errors import OpenAIError, bad_request

RUNTIME_FLAGS = ("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "JAXSERVE_ALLOW_RUNTIME_LORA_UPDATING")


def runtime_updating_allowed(environ=os.environ) -> bool:
    return any(environ.get(flag, "").strip().lower() in ("1", "true") for flag in RUNTIME_FLAGS)


class LoadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="allow")
    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)


class UnloadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="allow")
    lora_name: str = Field(min_length=1)
    lora_int_id: int | None = None


def adapter_cards(serving, created: int) -> list[api.ModelCard]:
    """One card per adapter served: id its name, root its path, parent the base model."""
    registry = serving.async_engine.engine.lora_registry
    if registry is None:
        return []
    return [api.ModelCard(id=r.lora_name, created=created, root=r.lora_path,
                          parent=serving.model_name, max_model_len=serving.info.max_model_len,
                          vocab_size=serving.info.vocab_size)
            for r in registry.requests]


def add_lora_routes(app: FastAPI, serving: Callable, responses: dict) -> None:
    """The runtime endpoints on `app`; serving() gives the OpenAIServing (or raises 503)."""

    def registry_or_404(path: str):
        registry = serving().async_engine.engine.lora_registry
        if registry is None or not runtime_updating_allowed():
            why = ("the server serves no LoRA adapters (start it with --enable-lora)"
                   if registry is None else "runtime LoRA updating is off (set "
                   f"{RUNTIME_FLAGS[1]}=1 or {RUNTIME_FLAGS[0]}=1 to allow it)")
            raise OpenAIError(404, f"no route POST {path}: {why}", None, "not_found_error")
        return registry

    @app.post("/v1/load_lora_adapter", response_class=PlainTextResponse, responses=responses)
    async def load_lora_adapter(request: LoadLoRAAdapterRequest):
        registry = registry_or_404("/v1/load_lora_adapter")
        s = serving()
        if request.lora_name == s.model_name:
            raise bad_request(f"lora_name={request.lora_name!r} is the base model's name",
                              "lora_name")
        try:
            await s.async_engine.text_pool.run(registry.load, request.lora_name,
                                               request.lora_path)
        except ValueError as exc:
            field = "lora_name" if "already loaded" in str(exc) else "lora_path"
            raise bad_request(str(exc), field) from None
        return PlainTextResponse(
            f"Success: LoRA adapter '{request.lora_name}' added successfully.")

    @app.post("/v1/unload_lora_adapter", response_class=PlainTextResponse, responses=responses)
    async def unload_lora_adapter(request: UnloadLoRAAdapterRequest):
        registry = registry_or_404("/v1/unload_lora_adapter")
        try:
            registry.unload(request.lora_name)
        except KeyError:
            raise OpenAIError(404, f"LoRA adapter {request.lora_name!r} is not loaded",
                              "lora_name", "not_found_error") from None
        return PlainTextResponse(
            f"Success: LoRA adapter '{request.lora_name}' removed successfully.")
