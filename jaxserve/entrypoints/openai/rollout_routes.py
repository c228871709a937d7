"""The rollout control endpoints over HTTP, with vLLM's development-mode names and shapes.

    POST /sleep?level=1|2                 {"status": "sleeping", "level"}
    POST /wake_up[?tags=weights&tags=kv_cache]   {"status": ..., "is_sleeping"}
    GET  /is_sleeping                     {"is_sleeping"}
    POST /pause?mode=abort|wait|keep      {"status": "paused", "mode", "num_aborted"}
    POST /resume                          {"status": "resumed"}
    GET  /is_paused                       {"is_paused"}
    POST /update_weights_from_disk        body {"path": DIR (default: the served model)}
                                          -> {"weight_version"}

They are off unless the server starts with --enable-rollout-endpoints (or, as vLLM's, with
VLLM_SERVER_DEV_MODE=1 in the environment): off, every one is a 404, as an unknown path. A
refused call (requests running and not paused, a bad level / mode / tag, a model of other
shapes, a missing path, a server with data parallelism) is a 400 naming the field; the
server keeps serving. Weights are read
on the text pool, never on the event loop; the verbs run on the engine thread between steps
(AsyncEngine.control). Only routing and translation: the verbs are engine/rollout.py's.
"""

from __future__ import annotations

import os
from typing import Callable

from fastapi import FastAPI, Query
from pydantic import BaseModel, ConfigDict

from jaxserve.entrypoints.openai.errors import OpenAIError, bad_request

DEV_MODE_ENV = "VLLM_SERVER_DEV_MODE"


def rollout_endpoints_enabled(flag: bool, environ=os.environ) -> bool:
    return flag or environ.get(DEV_MODE_ENV, "").strip().lower() in ("1", "true")


class UpdateWeightsFromDiskRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    path: str | None = None


def add_rollout_routes(app: FastAPI, serving: Callable, responses: dict,
                       enabled: bool) -> None:
    """The endpoints on `app`; serving() gives the OpenAIServing (or raises 503)."""

    def engine_or_404(path: str):
        if not rollout_endpoints_enabled(enabled):
            raise OpenAIError(404, f"no route {path}: the rollout endpoints are off (start the "
                                   f"server with --enable-rollout-endpoints)", None,
                              "not_found_error")
        async_engine = serving().async_engine
        if async_engine.data_parallel_size > 1:  # (VLLM_SERVER_DEV_MODE; the flag is refused)
            raise bad_request(f"{path} is not supported with data_parallel_size="
                              f"{async_engine.data_parallel_size}: the rollout verbs run on "
                              "one engine", "data_parallel_size")
        return async_engine

    async def run(async_engine, fn, field: str):
        try:
            return await async_engine.control(fn)
        except (ValueError, RuntimeError, NotImplementedError, FileNotFoundError) as exc:
            raise bad_request(str(exc), field) from None

    @app.post("/sleep", responses=responses)
    async def sleep(level: int = Query(1)):
        a = engine_or_404("POST /sleep")
        await run(a, lambda: (a.engine.rollout.sleep(level), []), "level")
        return {"status": "sleeping", "level": level}

    @app.post("/wake_up", responses=responses)
    async def wake_up(tags: list[str] | None = Query(None)):
        a = engine_or_404("POST /wake_up")
        await run(a, lambda: (a.engine.rollout.wake_up(tags), []), "tags")
        asleep = a.engine.rollout.is_sleeping
        return {"status": "sleeping" if asleep else "awake", "is_sleeping": asleep}

    @app.get("/is_sleeping", responses=responses)
    async def is_sleeping():
        return {"is_sleeping": engine_or_404("GET /is_sleeping").engine.rollout.is_sleeping}

    @app.post("/pause", responses=responses)
    async def pause(mode: str = Query("abort")):
        a = engine_or_404("POST /pause")

        def call():
            outputs = a.engine.rollout.pause(mode)
            return sum(o.finished and o.finish_reason == "abort" for o in outputs), outputs

        num_aborted = await run(a, call, "mode")
        return {"status": "paused", "mode": mode, "num_aborted": num_aborted}

    @app.post("/resume", responses=responses)
    async def resume():
        a = engine_or_404("POST /resume")
        await run(a, lambda: (a.engine.rollout.resume(), []), "body")
        return {"status": "resumed"}

    @app.get("/is_paused", responses=responses)
    async def is_paused():
        return {"is_paused": engine_or_404("GET /is_paused").engine.rollout.paused}

    @app.post("/update_weights_from_disk", responses=responses)
    async def update_weights_from_disk(request: UpdateWeightsFromDiskRequest):
        from jaxserve.engine.rollout import read_weights

        a = engine_or_404("POST /update_weights_from_disk")
        try:
            params = await a.text_pool.run(read_weights, a.engine, request.path)
        except (ValueError, FileNotFoundError) as exc:
            raise bad_request(str(exc), "path") from None
        version = await run(a, lambda: (a.engine.rollout.update_weights(params), []), "path")
        return {"weight_version": version}
