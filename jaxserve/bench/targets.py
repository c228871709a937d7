"""What `jaxserve bench serve` asks a server before loading it, over gRPC or the OpenAI HTTP API.

Readiness (gRPC health SERVING, or GET /health 200), the model's facts (ModelInfo, or
GET /v1/models) and a chat request's prompt token ids (Tokenize, or POST /tokenize), behind
one small interface, so the benchmark fits prompts to max_model_len the same way whichever
front end it measures. Synchronous, short calls only; the load itself is load.py / load_http.py.
"""

from __future__ import annotations

import time
from dataclasses import dataclass


@dataclass(frozen=True)
class ServerFacts:
    model_name: str
    max_model_len: int
    vocab_size: int


def wait_until_serving(client, seconds: float) -> None:
    """Poll health until SERVING; after `seconds`, let the next call fail with its reason."""
    from jaxserve.entrypoints.grpc.client import JaxServeError

    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            if client.health() == "SERVING":
                return
        except JaxServeError:
            pass  # not listening yet
        time.sleep(1.0)


class GrpcFacts:
    """What the benchmark asks a gRPC server before loading it."""

    def __init__(self, client):
        self.client = client

    def __enter__(self):
        self.client.__enter__()
        return self

    def __exit__(self, *exc):
        self.client.__exit__(*exc)

    def wait_ready(self, seconds: float) -> None:
        wait_until_serving(self.client, seconds)

    def facts(self) -> ServerFacts:
        info = self.client.model_info()
        return ServerFacts(info.model_name, info.max_model_len, info.vocab_size)

    def chat_ids(self, messages: list[dict]) -> list[int]:
        return list(self.client.tokenize(messages=messages))


class HttpFacts:
    """The same over the OpenAI HTTP API: /health, /v1/models, /tokenize."""

    def __init__(self, base_url: str, api_key: str | None):
        import httpx
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = httpx.Client(base_url=base_url, headers=headers, timeout=30.0)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.http.close()

    def wait_ready(self, seconds: float) -> None:
        import httpx
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            try:
                if self.http.get("/health").status_code == 200:
                    return
            except httpx.TransportError:
                pass  # not listening yet
            time.sleep(1.0)

    def facts(self) -> ServerFacts:
        card = self._ok(self.http.get("/v1/models"))["data"][0]
        return ServerFacts(card["id"], card["max_model_len"], card["vocab_size"])

    def chat_ids(self, messages: list[dict]) -> list[int]:
        return self._ok(self.http.post("/tokenize", json={"messages": messages}))["tokens"]

    @staticmethod
    def _ok(response) -> dict:
        if response.status_code != 200:
            raise ValueError(f"{response.request.url.path}: HTTP {response.status_code}: "
                             f"{response.text[:300]}")
        return response.json()
