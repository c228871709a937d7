"""The gRPC side's error handling: undecodable requests, and exceptions mapped to status codes.

grpc decodes a request before any handler runs, and a message that fails to decode (truncated
bytes, invalid UTF-8 in a string field) would end the call UNKNOWN. `add_servicer` registers
the JaxServe handlers with a decoder that never raises: it hands the handler an Undecodable,
which is refused with INVALID_ARGUMENT and protobuf's message; a message over the servicer's
max_request_bytes is not decoded at all (RESOURCE_EXHAUSTED naming the limit), so a huge one
costs the event loop nothing. `status_for_exception` is the one
table from engine exceptions to status codes, `status_for_finish` that of an output that
finished with an error; a load refusal (the waiting queue or one client's requests at their
bound) is RESOURCE_EXHAUSTED with a retry hint in the trailing metadata `retry-after` (seconds,
as HTTP's Retry-After). No engine calls, no sampling, no device work.
"""

from __future__ import annotations

import logging

import grpc
from google.protobuf.message import DecodeError

from jaxserve.core.intake import RequestError
from jaxserve.engine.async_engine import DeadlineExceededError, EngineDeadError, EngineFailedError
from jaxserve.core.errors import QueueFullError
from jaxserve.engine.client_limits import RETRY_AFTER_S
from jaxserve.entrypoints.grpc.pb import jaxserve_pb2 as pb

log = logging.getLogger(__name__)
# (code, details) or (code, details, trailing metadata): context.abort(*error) takes either.
StatusError = tuple[grpc.StatusCode, str] | tuple[grpc.StatusCode, str, tuple]
RETRY_AFTER = (("retry-after", str(RETRY_AFTER_S)),)


class Undecodable:
    """What a handler gets instead of a request it must refuse undecoded."""

    def __init__(self, code: grpc.StatusCode, message: str):
        self.code, self.message = code, message


def _decoder(message_class, servicer):
    name = message_class.DESCRIPTOR.full_name

    def decode(data: bytes):
        limit = servicer.max_request_bytes
        if len(data) > limit:
            return Undecodable(grpc.StatusCode.RESOURCE_EXHAUSTED,
                               f"the request is {len(data)} bytes, over the limit of {limit} "
                               f"(max_request_bytes: no prompt that fits max_model_len is "
                               f"longer)")
        try:
            return message_class.FromString(data)
        except (DecodeError, UnicodeDecodeError, ValueError) as exc:
            return Undecodable(grpc.StatusCode.INVALID_ARGUMENT,
                               f"the request is not a valid {name} message: {exc} (truncated "
                               f"or corrupt bytes, or a string field that is not valid UTF-8)")
    return decode


def _refusing_undecodable(handler):
    async def checked(request, context):
        if isinstance(request, Undecodable):
            await context.abort(request.code, request.message)
        return await handler(request, context)
    return checked


def add_servicer(servicer, server: grpc.aio.Server) -> None:
    """pb_grpc.add_JaxServeServicer_to_server, with requests decoded by `_decoder`."""
    service = pb.DESCRIPTOR.services_by_name["JaxServe"]
    handlers = {}
    for method in service.methods:
        make = (grpc.unary_stream_rpc_method_handler if method.server_streaming
                else grpc.unary_unary_rpc_method_handler)
        handlers[method.name] = make(
            _refusing_undecodable(getattr(servicer, method.name)),
            request_deserializer=_decoder(getattr(pb, method.input_type.name), servicer),
            response_serializer=getattr(pb, method.output_type.name).SerializeToString)
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(service.full_name, handlers),))


def status_for_exception(exc: Exception, validating: bool) -> StatusError:
    """validating: the request has produced no output yet, so a ValueError is bad input. A
    RequestError (refused at intake) is bad input always: INVALID_ARGUMENT, also when the KV
    page pool is what it exceeds (no retry can pass: RESOURCE_EXHAUSTED, which clients retry,
    is kept for load that will)."""
    if isinstance(exc, RequestError):
        return grpc.StatusCode.INVALID_ARGUMENT, str(exc)
    if isinstance(exc, EngineDeadError):
        return grpc.StatusCode.UNAVAILABLE, str(exc)
    if isinstance(exc, EngineFailedError):
        return grpc.StatusCode.INTERNAL, str(exc)
    if isinstance(exc, DeadlineExceededError):
        return grpc.StatusCode.DEADLINE_EXCEEDED, str(exc)
    if isinstance(exc, QueueFullError):
        return grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc), RETRY_AFTER
    if validating and isinstance(exc, ValueError):
        return grpc.StatusCode.INVALID_ARGUMENT, str(exc)
    log.error("request failed", exc_info=exc)
    return grpc.StatusCode.INTERNAL, f"internal error: {exc!r}"


def status_for_finish(out) -> StatusError:
    """The status of a request that finished neither by stop nor by length. One refused at
    intake never gets here (make_request raised RequestError), so an error finish is the
    engine's failure, unless the engine found the request at fault while it ran
    (out.error_field: its token bans leave its grammar no token), which is bad input."""
    if out.finish_reason == "abort":
        return grpc.StatusCode.ABORTED, f"request {out.request_id} was aborted by the server"
    if out.error_field is not None:
        return grpc.StatusCode.INVALID_ARGUMENT, out.error or f"{out.error_field} is invalid"
    return grpc.StatusCode.INTERNAL, out.error or "request failed in the engine"
