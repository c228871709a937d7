"""`jaxserve chat`: an interactive chat in the terminal, through the model's chat template.

Each turn sends the whole conversation (system message, earlier turns, the new user line) and
streams the reply. Remote (the default): a running server over gRPC applies the template;
`--offline`: an in-process Engine applies it. As on the OpenAI chat endpoint, a reply without
--max-tokens may run to EOS or the end of the context. Lines starting with '/' are commands:
/exit (or end of input), /reset (forget the conversation), /system TEXT. A conversation that
outgrows the context loses its oldest turns (the system message stays). This module only
drives turns; it does no tokenizing or sampling of its own.
"""

from __future__ import annotations

import sys
from typing import Callable, Iterator

from jaxserve.core import intake

Messages = list[dict]
Backend = Callable[[Messages], Iterator[str]]
HELP = "commands: /exit, /reset (forget the conversation), /system TEXT"


class ContextFull(ValueError):
    """The conversation no longer fits the model's context (raised before any text)."""


def _room(limits, prompt_len: int, max_tokens: int | None) -> int:
    """The output room the conversation leaves (intake's words, the server's limits: context
    and KV pool); ContextFull when it leaves none or less than max_tokens."""
    try:
        if max_tokens is not None:
            intake.check_length(limits, prompt_len, max_tokens, prompt_field="conversation")
        return intake.output_room(limits, prompt_len, "conversation")
    except intake.RequestError as exc:
        raise ContextFull(str(exc)) from None


def run_chat(backend: Backend, system: str | None = None, stdin=None, stdout=None,
             prompt: str = ">>> ", notes=None) -> int:
    """Read user lines until /exit or end of input; stream each reply to stdout. When the
    conversation outgrows the context, the oldest turns are dropped (said on `notes`)."""
    stdin, stdout, notes = stdin or sys.stdin, stdout or sys.stdout, notes or sys.stderr
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
        reply = _reply(backend, head, turns, user, stdout, notes)
        if reply is not None:
            turns += [user, {"role": "assistant", "content": reply}]
    return 0


def _reply(backend: Backend, head: Messages, turns: Messages, user: dict, stdout,
           notes) -> str | None:
    """Stream one reply; drop the oldest turns (in place) while the conversation is too long."""
    while True:
        try:
            reply = []
            for delta in backend(head + turns + [user]):
                reply.append(delta)
                stdout.write(delta)
                stdout.flush()
            stdout.write("\n")
            return "".join(reply)
        except ContextFull as exc:
            if not turns:
                notes.write(f"({exc}: this message alone does not fit; not sent)\n")
                return None
            del turns[:2]
            notes.write("(the oldest turn was dropped to fit the context)\n")


def remote_backend(address: str, overrides: dict, **connect) -> Backend:
    """Turns sent to the gRPC server at address (connect: JaxServeClient's api_key and TLS
    keywords); max_tokens unset: the rest of the context."""
    import grpc

    from jaxserve.engine.generation_defaults import sampling_params
    from jaxserve.entrypoints.grpc.client import JaxServeClient, JaxServeError

    client = JaxServeClient(address, **connect)
    limits = client.model_info()  # (its max_model_len, vocab_size, page_size, num_pages)

    def backend(messages: Messages) -> Iterator[str]:
        given = dict(overrides)
        room = _room(limits, len(client.tokenize(messages=messages)), given.get("max_tokens"))
        given.setdefault("max_tokens", room)
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
    from jaxserve.engine.generation_defaults import sampling_params

    def backend(messages: Messages) -> Iterator[str]:
        text = engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        ids = engine.tokenizer.encode(text, add_special_tokens=False)
        given = dict(overrides)
        room = _room(engine.info, len(ids),
                     given.get("max_tokens", model_defaults.get("max_tokens")))
        if "max_tokens" not in given and "max_tokens" not in model_defaults:
            given["max_tokens"] = room
        engine.add_request(ids, sampling_params(given, model_defaults))
        while engine.has_unfinished():
            for out in engine.step():
                if out.error:
                    raise RuntimeError(out.error)
                yield out.new_text
    return backend
