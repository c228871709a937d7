"""Run `run_server` (gRPC + OpenAI HTTP) with a tiny model that has a real tokenizer, for tests.

    python tests/http_server_main.py [--api-key KEY] [--max-queued-requests N]
        [--step-delay-ms MS] [--model tiny-bpe|fixtures] [--chat-template FILE]
        [--enable-rollout-endpoints]
        [engine overrides] [--model-dir DIR] [--lora-modules name=path ...] [--max-loras N]
        [--max-cpu-loras N]
        [security flags: --ssl-certfile FILE --ssl-keyfile FILE --ssl-ca-certs FILE ...]

The model is the tiny random Llama with the tiny byte-level BPE vocabulary and ChatML template
of model_fixtures (so chat templates, special tokens and --chat-template behave as with a real
model); `--model fixtures` serves model_fixtures.random_model() over the same vocabulary instead
(the model test_structured_engine constrains offline); engine shapes are conftest.SMALL_ENGINE's.
Both ports are free ones, logged on stderr as "gRPC server listening on HOST:PORT" and "HTTP
(OpenAI API) server listening on http(s)://..."; the security flags are `jaxserve serve`'s own
(cli_flags.add_security_flags, with $JAXSERVE_API_KEY). Exits with run_server's return code. It serves
nothing but a tiny random model.
`server_process(*args)` runs it for a test module: started, serving, its stderr kept read;
`drained_server` / `drained_server_url` also check on teardown that SIGTERM drains it.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import re
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from conftest import SMALL_ENGINE  # noqa: E402  (needs the path set above)
from model_fixtures import random_model, tiny_tokenizer  # noqa: E402
from tiny_models import TinyLoaded, tiny_model  # noqa: E402

from jaxserve.config import EngineConfig  # noqa: E402
from jaxserve.entrypoints.cli_flags import (add_security_flags,  # noqa: E402
                                            security_config_from_args)
from jaxserve.entrypoints.serve import run_server  # noqa: E402
from jaxserve.entrypoints.openai.http_server import HttpSettings  # noqa: E402


def tiny_bpe_loaded(seed: int = 0) -> TinyLoaded:
    """The tiny Llama over the tiny BPE vocabulary (the offline oracle builds the same one)."""
    tokenizer = tiny_tokenizer()
    return TinyLoaded(*tiny_model(seed, vocab_size=tokenizer.vocab_size), tokenizer=tokenizer)


def fixtures_loaded(seed: int = 0) -> TinyLoaded:
    """model_fixtures.random_model over the tiny BPE vocabulary (`--model fixtures`)."""
    config, params = random_model(seed=seed)
    return TinyLoaded(config, params, tokenizer=tiny_tokenizer())


@dataclass
class ServerProcess:
    proc: subprocess.Popen
    url: str                      # http://127.0.0.1:PORT
    grpc_address: str             # 127.0.0.1:PORT
    lines: list[str] = field(default_factory=list)  # its stderr so far
    health_seen: list[int] = field(default_factory=list)  # /health statuses while starting

    @property
    def log(self) -> str:
        return "".join(self.lines)


def _record_health(url: str, seen: list[int]) -> None:
    """Append each new /health status until it is 200 (the engine is attached)."""
    import urllib.error
    import urllib.request

    while not seen or seen[-1] != 200:
        try:
            with urllib.request.urlopen(url + "/health", timeout=5) as response:
                status = response.status
        except urllib.error.HTTPError as exc:
            status = exc.code
        except OSError:
            status = None  # not accepting yet
        if status is not None and (not seen or seen[-1] != status):
            seen.append(status)
        time.sleep(0.01)


@contextlib.contextmanager
def server_process(*args: str):
    """This script as a subprocess, once its health is SERVING; killed on exit if still up.
    Its stderr is read all along on a thread (a full pipe would block the server)."""
    proc = subprocess.Popen([sys.executable, __file__, *args], stderr=subprocess.PIPE,
                            text=True, cwd=Path(__file__).resolve().parent.parent)
    lines, url, address, health_seen, poller = [], None, None, [], None
    for line in proc.stderr:
        lines.append(line)
        if m := re.search(r"HTTP \(OpenAI API\) server listening on (https?://\S+)", line):
            url = m.group(1)
            if url.startswith("http://"):  # a TLS server's health is the test's to read
                poller = threading.Thread(target=_record_health, args=(url, health_seen),
                                          daemon=True)
                poller.start()
        if m := re.search(r"gRPC server listening on (\S+:\d+)", line):
            address = m.group(1)
        if "health SERVING" in line:
            break
    else:
        proc.wait()
        raise RuntimeError(f"the server exited before serving:\n{''.join(lines)}")
    reader = threading.Thread(target=lambda: lines.extend(proc.stderr), daemon=True)
    reader.start()
    if poller is not None:
        poller.join(timeout=30)
    try:
        yield ServerProcess(proc, url, address, lines, health_seen)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        reader.join(timeout=5)


def drained_server(*args: str):
    """A module fixture's body: a server_process (its URL and its log so far), and on teardown
    the check that SIGTERM drains it to exit 0 with no traceback in its log."""
    with server_process(*args) as process:
        yield process
        process.proc.terminate()
        assert process.proc.wait(timeout=60) == 0, "SIGTERM must drain and exit 0"
        assert "Traceback" not in process.log, process.log[-3000:]


def drained_server_url(*args: str):
    """drained_server, yielding only the URL."""
    for process in drained_server(*args):
        yield process.url


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shutdown-timeout", type=float, default=30.0)
    parser.add_argument("--served-model-name", default=None)
    parser.add_argument("--max-body-bytes", type=int, default=1 << 20)
    parser.add_argument("--max-queued-requests", type=int, default=None)
    parser.add_argument("--max-num-seqs", type=int, default=None)
    parser.add_argument("--seq-buckets", type=int, nargs="+", default=None)
    parser.add_argument("--model", choices=("tiny-bpe", "fixtures"), default="tiny-bpe")
    parser.add_argument("--enable-rollout-endpoints", action="store_true")
    parser.add_argument("--chat-template", default=None, metavar="FILE",
                        help="a chat template file overriding the model's (as jaxserve serve)")
    parser.add_argument("--step-delay-ms", type=float, default=0.0,
                        help="sleep before every engine step (keeps requests in flight long "
                             "enough for drain and disconnect tests)")
    parser.add_argument("--model-dir", default=None,
                        help="serve this checkpoint directory instead of --model")
    parser.add_argument("--lora-modules", nargs="+", default=None)
    parser.add_argument("--max-loras", type=int, default=None)
    parser.add_argument("--max-cpu-loras", type=int, default=None)
    add_security_flags(parser)
    args = parser.parse_args()
    if args.step_delay_ms:
        from jaxserve.engine.engine import Engine
        step = Engine.step
        Engine.step = lambda self: (time.sleep(args.step_delay_ms / 1e3), step(self))[1]
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(levelname)s %(name)s: %(message)s")
    overrides = {k: v for k, v in (("max_queued_requests", args.max_queued_requests),
                                   ("max_num_seqs", args.max_num_seqs),
                                   ("seq_buckets", args.seq_buckets),
                                   ("max_loras", args.max_loras),
                                   ("max_cpu_loras", args.max_cpu_loras),
                                   ("lora_modules", args.lora_modules)) if v is not None}
    if args.lora_modules is not None or args.max_loras is not None:
        overrides.update(enable_lora=True, max_lora_rank=16)
    loaded = fixtures_loaded() if args.model == "fixtures" else tiny_bpe_loaded()
    if args.model_dir:
        from jaxserve.model.loaders.loader import load_model
        loaded = load_model(args.model_dir, progress=False)
    config = EngineConfig.from_kwargs(**{**SMALL_ENGINE, **overrides})
    template = Path(args.chat_template).read_text() if args.chat_template else None
    http = HttpSettings(port=0, served_model_name=args.served_model_name,
                        max_body_bytes=args.max_body_bytes, chat_template=template,
                        enable_rollout_endpoints=args.enable_rollout_endpoints)
    return run_server(config, host="127.0.0.1", port=0, shutdown_timeout=args.shutdown_timeout,
                      loaded=loaded,
                      http=http, security=security_config_from_args(args))


if __name__ == "__main__":
    sys.exit(main())
