"""`jaxserve bench serve --backend grpc|openai|openai-chat`: one load generator drives either
front end of one `run_server` process (tests/http_server_main.py, the tiny model), the same
workload gives the same tokens whichever way it goes, and `python -m jaxserve.bench.front_ends`
runs the side-by-side comparison end to end.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("httpx")

from jaxserve.bench.datasets import build_requests  # noqa: E402
from jaxserve.bench.serve import benchmark, fit_to_model  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
MODEL = "tiny-llama"


@pytest.fixture(scope="module")
def server():
    from http_server_main import server_process

    with server_process() as process:
        yield process


@pytest.fixture(scope="module")
def workload(server):
    from jaxserve.bench.targets import HttpFacts

    with HttpFacts(server.url, None) as facts:
        info = facts.facts()
        requests = build_requests("chat", 6, info.vocab_size, 0, output_len=8)
        prompt_ids = [facts.chat_ids(list(r.messages)) for r in requests]
    return fit_to_model(requests, [len(p) for p in prompt_ids], info.max_model_len), prompt_ids


def test_every_backend_serves_the_same_workload_with_the_same_token_counts(server, workload):
    requests, prompt_ids = workload
    results = {}
    for backend in ("grpc", "openai", "openai-chat"):
        address = server.grpc_address if backend == "grpc" else server.url
        results[backend] = benchmark(address, requests, max_concurrency=3, backend=backend,
                                     model=MODEL, prompt_ids=prompt_ids, timeout=120.0)
    for backend, r in results.items():
        assert (r["completed"], r["failed"]) == (6, 0), (backend, r["errors"])
        assert r["total_output_tokens"] == 6 * 8, backend
        assert r["total_input_tokens"] == sum(map(len, prompt_ids)), backend
        assert len(r["raw"]["itl_s"]) == 6 * 7, f"{backend}: one time per token, not per event"
    # Same prompts each time: after the first run every prompt's full pages are cached.
    assert results["openai-chat"]["cached_prompt_tokens"] > 0


def test_the_cli_drives_the_http_front_end_and_refuses_chat_backend_without_messages(
        server, capsys):
    from jaxserve.entrypoints.cli import main

    common = ["bench", "serve", "--base-url", server.url, "--num-prompts", "3",
              "--output-len", "4", "--max-concurrency", "3", "--quiet"]
    assert main(common + ["--backend", "openai-chat", "--dataset", "chat"]) == 0
    out = capsys.readouterr().out
    assert "Serving Benchmark Result (openai-chat)" in out and "Successful requests:" in out
    assert main(common + ["--backend", "openai-chat", "--dataset", "random"]) == 1
    assert "use --dataset chat" in capsys.readouterr().err


def test_front_ends_compares_grpc_and_http_on_one_server(tmp_path):
    from jaxserve.bench import front_ends

    out = tmp_path / "front_ends.json"
    code = front_ends.main(["--server-script", str(ROOT / "tests" / "http_server_main.py"),
                            "--num-prompts", "4", "--output-len", "6", "--rounds", "1",
                            "--max-concurrency", "4", "--json", str(out)])
    report = json.loads(out.read_text())
    assert code == 0, report
    assert [(r["backend"], r["round"]) for r in report["runs"]] == \
        [("openai-chat", 0), ("grpc", 0), ("grpc", 1), ("openai-chat", 1)]
    assert report["summary"]["openai-chat"]["mean_ratio"] > 0
    assert report["server_exit_code"] == 0
