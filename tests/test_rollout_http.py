"""The rollout control endpoints over HTTP: one `run_server` process (tests/http_server_main.py)
started with --enable-rollout-endpoints, and an in-process app without the flag (every path a
404)."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import httpx
import pytest

from http_server_main import tiny_bpe_loaded
from jaxserve.model.loaders.safetensors_loader import save_hf_directory

PROMPT = [5, 6, 7, 8, 9, 10]
N = 8
PATHS = [("post", "/sleep"), ("post", "/wake_up"), ("get", "/is_sleeping"), ("post", "/pause"),
         ("post", "/resume"), ("get", "/is_paused"), ("post", "/update_weights_from_disk")]


@pytest.fixture(scope="module")
def server():
    from http_server_main import drained_server

    gen = drained_server("--enable-rollout-endpoints")
    yield next(gen)
    next(gen, None)


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    """HF directories of the served model's weights (seed 0) and of other weights (seed 1)."""
    dirs = {}
    for seed in (0, 1):
        loaded = tiny_bpe_loaded(seed)
        dirs[seed] = tmp_path_factory.mktemp(f"seed{seed}")
        save_hf_directory(dirs[seed], loaded.config, loaded.params, loaded.tokenizer)
    return dirs


def tokens(server) -> list[int]:
    body = dict(model=httpx.get(server.url + "/v1/models").json()["data"][0]["id"],
                prompt=PROMPT, max_tokens=N, temperature=0.0, ignore_eos=True,
                return_token_ids=True)
    response = httpx.post(server.url + "/v1/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["token_ids"]


def call(server, method: str, path: str, **kwargs):
    return getattr(httpx, method)(server.url + path, timeout=120, **kwargs)


def test_sleep_and_wake_up_give_back_the_same_tokens(server):
    want = tokens(server)
    assert call(server, "get", "/is_sleeping").json() == {"is_sleeping": False}
    answer = call(server, "post", "/sleep", params={"level": 1})
    assert answer.status_code == 200 and answer.json()["level"] == 1
    assert call(server, "get", "/is_sleeping").json() == {"is_sleeping": True}
    answer = call(server, "post", "/wake_up")
    assert answer.json() == {"status": "awake", "is_sleeping": False}
    assert tokens(server) == want


def test_pause_holds_new_requests_until_resume(server):
    want = tokens(server)
    assert call(server, "post", "/pause", params={"mode": "keep"}).json()["status"] == "paused"
    assert call(server, "get", "/is_paused").json() == {"is_paused": True}
    got = []
    waiter = threading.Thread(target=lambda: got.append(tokens(server)))
    waiter.start()
    waiter.join(timeout=1.0)
    assert not got, "a request ran while generation was paused"
    assert call(server, "post", "/resume").json() == {"status": "resumed"}
    waiter.join(timeout=120)
    assert got == [want]


def test_bad_arguments_are_400s_naming_the_field_and_the_server_keeps_serving(server):
    want = tokens(server)
    for path, params, field in [("/pause", {"mode": "later"}, "mode"),
                                ("/sleep", {"level": 3}, "level"),
                                ("/wake_up", {"tags": "everything"}, "tags")]:
        answer = call(server, "post", path, params=params)
        assert answer.status_code == 400, (path, answer.text)
        assert answer.json()["error"]["param"] == field
    answer = call(server, "post", "/update_weights_from_disk", json={"path": "/nonexistent"})
    assert answer.status_code == 400 and answer.json()["error"]["param"] == "path"
    answer = call(server, "post", "/update_weights_from_disk", json={})  # the default model:
    assert answer.status_code == 400 and "different model" in answer.text  # other shapes
    assert tokens(server) == want


def test_update_weights_from_disk_swaps_the_weights_and_counts_versions(server, model_dirs):
    want = tokens(server)
    first = call(server, "post", "/update_weights_from_disk", json={"path": str(model_dirs[1])})
    assert first.status_code == 200, first.text
    assert tokens(server) != want
    second = call(server, "post", "/update_weights_from_disk", json={"path": str(model_dirs[0])})
    assert second.json()["weight_version"] == first.json()["weight_version"] + 1
    assert tokens(server) == want


def test_without_the_flag_every_rollout_path_is_404(monkeypatch):
    from fastapi.testclient import TestClient

    from jaxserve.entrypoints.openai.http_gate import GateState
    from jaxserve.entrypoints.openai.http_server import HttpSettings, build_app
    from jaxserve.entrypoints.openai.rollout_routes import (DEV_MODE_ENV,
                                                            rollout_endpoints_enabled)

    monkeypatch.delenv(DEV_MODE_ENV, raising=False)
    state = GateState()  # past the gate's readiness check: an engine that has not failed
    state.serving = SimpleNamespace(async_engine=SimpleNamespace(error=None))
    client = TestClient(build_app(HttpSettings(port=0), state))
    for method, path in PATHS:
        answer = getattr(client, method)(path, **({"json": {}} if path.startswith("/update")
                                                  else {}))
        assert answer.status_code == 404, (path, answer.status_code)
        assert "--enable-rollout-endpoints" in answer.json()["error"]["message"]
    assert rollout_endpoints_enabled(False, {DEV_MODE_ENV: "1"})
    assert not rollout_endpoints_enabled(False, {DEV_MODE_ENV: "0"})
