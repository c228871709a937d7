"""`jaxserve chat`: an interactive chat in the terminal, through the model's chat template.

Each turn sends the whole conversation (system message, earlier turns, the new user line) and
streams the reply. Remote (the default): a running server over gRPC applies the template;
`--offline`: an in-process Engine applies it. As on the OpenAI chat endpoint, a reply without
--max-tokens may run to EOS or the end of the context. Lines starting with '/' are commands:
/exit (or end of input), /reset (forget the conversation), /system TEXT. This module only
drives turns; it does no tokenizing or sampling of its own.
"""

from __future__ import annotations

import sys
from typing import Callable, Iterator

Messages = list[dict]
Backend = Callable[[Messages], Iterator[str]]
HELP = "commands: /exit, /reset (forget the conversation), /system TEXT"


def run_chat(backend: Backend, system: str | None = None, stdin=None, stdout=None,
             prompt: str = ">>> ") -> int:
    """Read user lines until /exit or end of input; stream each reply to stdout."""
    stdin, stdout = stdin or sys.stdin, stdout or sys.stdout
    interactive = hasattr(stdin, "isatty") and stdin.isatty()
    head = [{"role": "system", "content": system}] if system else []
    turns: Messages = []
    if interactive:
        stdout.write(HELP + "\n")
    while True:
        if interactive:
            stdout.write(prompt)
            stdout.flush()
        line = stdin.readline()
        if not line or line.strip() == "/exit":
            break
        text = line.rstrip("\n")
        if not text.strip():
            continue
        if text.startswith("/reset"):
            turns = []
            continue
        if text.startswith("/system"):
            content = text[len("/system"):].strip()
            head = [{"role": "system", "content": content}] if content else []
            continue
        if text.startswith("/"):
            stdout.write(f"unknown command {text.split()[0]!r}; {HELP}\n")
            continue
        user = {"role": "user", "content": text}
        reply = []
        for delta in backend(head + turns + [user]):
            reply.append(delta)
            stdout.write(delta)
            stdout.flush()
        stdout.write("\n")
        turns += [user, {"role": "assistant", "content": "".join(reply)}]
    return 0


def remote_backend(address: str, overrides: dict) -> Backend:
    """Turns sent to the gRPC server at address; max_tokens unset: the rest of the context."""
    import grpc

    from jaxserve.generation_defaults import sampling_params
    from jaxserve.server.client import JaxServeClient, JaxServeError

    client = JaxServeClient(address)
    max_model_len = client.model_info().max_model_len

    def backend(messages: Messages) -> Iterator[str]:
        given = dict(overrides)
        if "max_tokens" not in given:
            given["max_tokens"] = max(1, max_model_len - len(client.tokenize(messages=messages)))
        call = client.generate(messages=messages, params=sampling_params(given))
        try:
            for response in call:
                if response.text:
                    yield response.text
        except grpc.RpcError as exc:
            raise JaxServeError(exc.code(), exc.details() or "") from None
        finally:
            call.cancel()
    return backend


def offline_backend(engine, overrides: dict, model_defaults: dict) -> Backend:
    """Turns run on an in-process Engine with the model's template and sampling defaults."""
    from jaxserve.generation_defaults import sampling_params

    def backend(messages: Messages) -> Iterator[str]:
        text = engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        ids = engine.tokenizer.encode(text, add_special_tokens=False)
        given = dict(overrides)
        if "max_tokens" not in given and "max_tokens" not in model_defaults:
            given["max_tokens"] = max(1, engine.max_model_len - len(ids))
        engine.add_request(ids, sampling_params(given, model_defaults))
        while engine.has_unfinished():
            for out in engine.step():
                if out.error:
                    raise RuntimeError(out.error)
                yield out.new_text
    return backend
