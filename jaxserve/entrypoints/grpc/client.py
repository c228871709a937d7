"""A small synchronous client for the JaxServe gRPC API (the CLI's `generate --address`, tests).

JaxServeClient wraps one channel, plain or TLS (with a client certificate for a server that
requires one), and sends an API key with every call when given one: generate (the raw response
stream, cancellable), generate_text (collected), tokenize, model_info, health. stream_generate
yields text deltas.
Failures raise JaxServeError carrying the gRPC status code (InvalidRequestError, also a
ValueError, for INVALID_ARGUMENT). It holds no engine code and imports no jax.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from jaxserve.core.request import SamplingParams
from jaxserve.entrypoints.grpc import convert
from jaxserve.entrypoints.grpc.pb import jaxserve_pb2 as pb
from jaxserve.entrypoints.grpc.pb import jaxserve_pb2_grpc as pb_grpc


class JaxServeError(RuntimeError):
    """A call failed; `code` is its grpc.StatusCode, `details` the server's message,
    `retry_after` the server's retry hint in seconds (a load refusal's), else None."""

    def __init__(self, code: grpc.StatusCode, details: str, retry_after: float | None = None):
        super().__init__(f"{code.name}: {details}")
        self.code, self.details, self.retry_after = code, details, retry_after


class InvalidRequestError(JaxServeError, ValueError):
    """INVALID_ARGUMENT: the message names the field, the value and the limit."""


def auth_metadata(api_key: str | None) -> tuple[tuple[str, str], ...]:
    """The call metadata that carries api_key (none without one)."""
    return (("authorization", f"Bearer {api_key}"),) if api_key else ()


def retry_after(exc: grpc.RpcError) -> float | None:
    """The `retry-after` trailing metadata of a failed call (seconds), or None."""
    trailing = exc.trailing_metadata() if hasattr(exc, "trailing_metadata") else None
    for key, value in trailing or ():
        if key == "retry-after":
            try:
                return float(value)
            except ValueError:
                return None
    return None


def _error(exc: grpc.RpcError) -> JaxServeError:
    cls = InvalidRequestError if exc.code() == grpc.StatusCode.INVALID_ARGUMENT else JaxServeError
    return cls(exc.code(), exc.details() or "", retry_after(exc))


@dataclass
class GenerateResult:
    request_id: str
    text: str = ""
    reasoning_text: str = ""               # a chat's reasoning (server with a reasoning parser)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[dict[int, float]] = field(default_factory=list)  # logprobs = k > 0
    finish_reason: str | None = None       # "stop" or "length"
    usage: pb.Usage | None = None
    text_deltas: list[str] = field(default_factory=list)
    # prompt_logprobs: per prompt position from the second, {token id: logprob}, own first
    prompt_logprobs: list[dict[int, float]] = field(default_factory=list)
    # n > 1: every sample, by index (samples[0] is this result itself)
    samples: dict[int, "GenerateResult"] = field(default_factory=dict)


def _read(path: str, name: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as exc:
        raise ValueError(f"{name} {path!r} cannot be read: {exc.strerror or exc}") from None


def open_channel(address: str, *, tls: bool | None = None, ssl_ca_certs: str | None = None,
                 ssl_certfile: str | None = None, ssl_keyfile: str | None = None,
                 aio: bool = False):
    """A channel to address: plain, or TLS when tls is True or any ssl_* file is given.
    ssl_ca_certs: PEM CAs to trust (None: the system's); ssl_certfile + ssl_keyfile: this
    client's certificate, for a server that requires one (--ssl-ca-certs there)."""
    module = grpc.aio if aio else grpc
    if (ssl_certfile is None) != (ssl_keyfile is None):
        raise ValueError("ssl_certfile and ssl_keyfile go together: a client certificate "
                         "needs its private key")
    if not (tls or ssl_ca_certs or ssl_certfile):
        return module.insecure_channel(address)
    credentials = grpc.ssl_channel_credentials(
        root_certificates=ssl_ca_certs and _read(ssl_ca_certs, "ssl_ca_certs"),
        private_key=ssl_keyfile and _read(ssl_keyfile, "ssl_keyfile"),
        certificate_chain=ssl_certfile and _read(ssl_certfile, "ssl_certfile"))
    return module.secure_channel(address, credentials)


class JaxServeClient:
    def __init__(self, address: str, timeout: float | None = None, *,
                 api_key: str | None = None, **tls):
        """address: "host:port"; timeout: default per-call deadline in seconds; api_key: sent
        as 'authorization: Bearer KEY' on every call; tls: open_channel's tls, ssl_ca_certs,
        ssl_certfile, ssl_keyfile (TLS when any is given)."""
        self.address, self.timeout = address, timeout
        self.channel = open_channel(address, **tls)
        self.metadata = auth_metadata(api_key)
        self.stub = pb_grpc.JaxServeStub(self.channel)
        self.health_stub = health_pb2_grpc.HealthStub(self.channel)

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> "JaxServeClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def generate(self, prompt: str | list[int] | None = None,
                 params: SamplingParams | None = None, *, messages: list[dict] | None = None,
                 request_id: str = "", priority: int = 0, timeout: float | None = None,
                 chat_template_kwargs: dict | None = None):
        """The raw call: an iterator of GenerateResponse with .cancel(); it raises
        grpc.RpcError on failure. Exactly one of prompt (text or token ids) and messages (with
        their chat_template_kwargs)."""
        request = convert.generate_request(prompt, params, messages=messages,
                                           request_id=request_id, priority=priority,
                                           chat_template_kwargs=chat_template_kwargs)
        return self.stub.Generate(request, timeout=timeout or self.timeout,
                                  metadata=self.metadata)

    def generate_text(self, prompt: str | list[int] | None = None,
                      params: SamplingParams | None = None, **kwargs) -> GenerateResult:
        """Run one request to the end; raises JaxServeError on failure."""
        result = GenerateResult(request_id=kwargs.get("request_id", ""))
        try:
            result.samples[0] = result
            for response in self.generate(prompt, params, **kwargs):
                result.request_id = response.request_id
                sample = result.samples.setdefault(
                    response.index, GenerateResult(response.request_id))
                sample.text += response.text
                sample.reasoning_text += response.reasoning_text
                sample.text_deltas.append(response.text)
                sample.token_ids.extend(response.token_ids)
                sample.logprobs.extend(response.logprobs)
                sample.top_logprobs.extend(dict(zip(top.token_ids, top.logprobs))
                                           for top in response.top_logprobs)
                if response.finish_reason != pb.FINISH_REASON_UNSPECIFIED:
                    sample.finish_reason = convert.FINISH_REASON_NAMES[response.finish_reason]
                result.prompt_logprobs.extend(dict(zip(e.token_ids, e.logprobs))
                                              for e in response.prompt_logprobs)
                if response.HasField("usage"):
                    result.usage = response.usage
        except grpc.RpcError as exc:
            raise _error(exc) from None
        return result

    def tokenize(self, text: str | None = None, *, messages: list[dict] | None = None,
                 add_special_tokens: bool = True) -> list[int]:
        request = pb.TokenizeRequest()
        if messages is not None:
            request.chat.CopyFrom(convert.chat_to_proto(messages))
        else:
            request.text = text
            request.add_special_tokens = add_special_tokens
        try:
            return list(self.stub.Tokenize(request, timeout=self.timeout,
                                           metadata=self.metadata).token_ids)
        except grpc.RpcError as exc:
            raise _error(exc) from None

    def model_info(self) -> pb.ModelInfoResponse:
        try:
            return self.stub.ModelInfo(pb.ModelInfoRequest(), timeout=self.timeout,
                                       metadata=self.metadata)
        except grpc.RpcError as exc:
            raise _error(exc) from None

    def health(self, service: str = "") -> str:
        """"SERVING", "NOT_SERVING", ...; raises JaxServeError (UNAVAILABLE) when unreachable."""
        try:
            response = self.health_stub.Check(health_pb2.HealthCheckRequest(service=service),
                                              timeout=self.timeout or 5.0,
                                              metadata=self.metadata)
        except grpc.RpcError as exc:
            raise _error(exc) from None
        return health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)


def stream_generate(address: str, prompt: str, params: SamplingParams | None = None,
                    chat: bool = False, **connect) -> Iterator[str]:
    """Text deltas of one completion from the server at address; chat wraps the prompt as a
    user message; connect: JaxServeClient's api_key and TLS keywords. Raises JaxServeError
    (InvalidRequestError for bad input) on failure."""
    with JaxServeClient(address, **connect) as client:
        if chat:
            call = client.generate(messages=[{"role": "user", "content": prompt}],
                                   params=params)
        else:
            call = client.generate(prompt, params)
        try:
            for response in call:
                if response.text:
                    yield response.text
        except grpc.RpcError as exc:
            raise _error(exc) from None
        finally:
            call.cancel()  # no-op when finished; aborts the request if the caller stops early
