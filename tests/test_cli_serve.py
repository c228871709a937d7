"""The CLI end to end with a tiny model: `generate --wait-ready` started with `serve` gets its
answer; `jaxserve chat` keeps the conversation and its commands."""

from __future__ import annotations

import io
import subprocess
import sys
import time

from conftest import SMALL_ENGINE
from scale_out_fixtures import engine_flags, free_port, save_tiny_checkpoint

import pytest

from jaxserve.core.intake import RequestLimits
from jaxserve.entrypoints.chat_cli import ContextFull, _room, run_chat


def test_generate_wait_ready_started_with_serve_prints_the_answer(tmp_path):
    from jaxserve import LLM, SamplingParams

    checkpoint = save_tiny_checkpoint(tmp_path / "tiny")
    address = f"127.0.0.1:{free_port()}"
    cli = [sys.executable, "-m", "jaxserve.entrypoints.cli"]
    sampling = ["--max-tokens", "6", "--temperature", "0", "--ignore-eos"]
    server_log_path = tmp_path / "server.log"
    with open(server_log_path, "w") as server_log_file:
        server = subprocess.Popen(
            [*cli, "serve", str(checkpoint), "--port", address.split(":")[1], "--http-port",
             "0", *engine_flags(SMALL_ENGINE)], stderr=server_log_file, text=True)
        client = subprocess.Popen([*cli, "generate", "--address", address, "--wait-ready",
                                   "600", *sampling, "hello there"],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            while client.poll() is None and server.poll() is None:
                time.sleep(0.2)  # a server that dies must fail the test, not wait 600 s
            if client.poll() is None:  # the server died first
                client.kill()
            stdout, stderr = client.communicate(timeout=600)
        finally:
            client.kill()
            server.terminate()
            server.wait(timeout=120)
    server_log = server_log_path.read_text()
    assert client.returncode == 0, f"{stderr[-2000:]}\nserver:\n{server_log[-3000:]}"
    with LLM(str(checkpoint), progress=False, **SMALL_ENGINE) as llm:
        want = llm.generate("hello there", SamplingParams(max_tokens=6, temperature=0.0,
                                                          ignore_eos=True), use_tqdm=False)[0]
    assert want.text and stdout == want.text + "\n", (stdout, want.text)
    assert "health SERVING" in server_log and "engine ready in" in server_log, server_log[-3000:]


def test_chat_against_a_server_runs_turns_through_its_template(tmp_path):
    checkpoint = save_tiny_checkpoint(tmp_path / "tiny")
    address = f"127.0.0.1:{free_port()}"
    cli = [sys.executable, "-m", "jaxserve.entrypoints.cli"]
    with open(tmp_path / "server.log", "w") as server_log_file:
        server = subprocess.Popen(
            [*cli, "serve", str(checkpoint), "--port", address.split(":")[1], "--http-port",
             "0", *engine_flags(SMALL_ENGINE)], stderr=server_log_file, text=True)
        try:  # no --max-tokens: each reply may run to the end of the context, as in chat
            chat = subprocess.run([*cli, "chat", "--address", address, "--wait-ready", "600",
                                   "--temperature", "0", "--system", "be brief"],
                                  input="hello\nand again\n/exit\n", capture_output=True,
                                  text=True, timeout=600)
        finally:
            server.terminate()
            server.wait(timeout=120)
    log = (tmp_path / "server.log").read_text()
    assert chat.returncode == 0, f"{chat.stderr[-2000:]}\nserver:\n{log[-3000:]}"
    assert len(chat.stdout.splitlines()) >= 2, f"expected two replies: {chat.stdout!r}"


def _chat(lines: str, system=None):
    seen = []

    def backend(messages):
        seen.append([dict(m) for m in messages])
        yield f"reply{len(seen)}"

    out = io.StringIO()
    assert run_chat(backend, system=system, stdin=io.StringIO(lines), stdout=out) == 0
    return seen, out.getvalue()


def test_chat_sends_the_whole_conversation_each_turn():
    seen, out = _chat("hi\nand then?\n", system="be brief")
    assert seen[1] == [{"role": "system", "content": "be brief"},
                       {"role": "user", "content": "hi"},
                       {"role": "assistant", "content": "reply1"},
                       {"role": "user", "content": "and then?"}]
    assert out == "reply1\nreply2\n"


def test_chat_reset_forgets_and_exit_stops():
    seen, _ = _chat("hi\n/reset\nagain\n/exit\nnever sent\n")
    assert seen == [[{"role": "user", "content": "hi"}], [{"role": "user", "content": "again"}]]


def test_chat_system_command_replaces_the_system_message():
    seen, _ = _chat("/system terse\nhi\n", system="verbose")
    assert seen == [[{"role": "system", "content": "terse"}, {"role": "user", "content": "hi"}]]


def test_chat_drops_the_oldest_turns_when_the_conversation_outgrows_the_context():
    seen, notes = [], io.StringIO()

    def backend(messages):  # room for the system message and three more
        if len(messages) > 4:
            raise ContextFull("too long")
        seen.append([m["content"] for m in messages])
        yield "ok"

    out = io.StringIO()
    run_chat(backend, system="sys", stdin=io.StringIO("a\nb\nc\n"), stdout=out, notes=notes)
    assert seen == [["sys", "a"], ["sys", "a", "ok", "b"], ["sys", "b", "ok", "c"]]
    assert "oldest turn was dropped" in notes.getvalue()


def test_chat_room_is_the_servers_intake_limit_kv_pool_included():
    # max_model_len 512, but the pool holds 4 pages of 16 tokens: 64 tokens in all.
    limits = RequestLimits(max_model_len=512, vocab_size=100, page_size=16, num_pages=5)
    assert _room(limits, 60, None) == 4, "room left by a 60-token conversation in a 64-token pool"
    with pytest.raises(ContextFull, match="KV page pool"):
        _room(limits, 60, 10)
    with pytest.raises(ContextFull, match="conversation has 64 tokens"):
        _room(limits, 64, None)
