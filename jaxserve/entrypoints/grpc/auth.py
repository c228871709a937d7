"""The gRPC server's API-key check (a server interceptor in front of every service) and its TLS
credentials.

A call whose `authorization` metadata is not 'Bearer KEY' with one of the keys (ApiKeys, in
constant time) ends UNAUTHENTICATED with one fixed message, the same for a missing and a wrong
key, before its request is decoded or any handler runs. The health and reflection services pass
unchecked only when the server was told so (`--grpc-open-health`). No keys configured: no
interceptor at all. TLS: the certificate and key of entrypoints/security.py's TlsFiles, and
with client CAs a client certificate signed by one of them is required (mutual TLS). It does
nothing else: no engine calls, no logging of metadata.
"""

from __future__ import annotations

import grpc
from grpc_health.v1 import health
from grpc_reflection.v1alpha import reflection

from jaxserve.entrypoints.security import UNAUTHENTICATED_MESSAGE, ApiKeys, TlsFiles

# Services a probe or a tool asks about the server itself (--grpc-open-health opens them).
_PROBE_PREFIXES = tuple(f"/{name}/" for name in (health.SERVICE_NAME, reflection.SERVICE_NAME))
_MESSAGE = (f"{UNAUTHENTICATED_MESSAGE}: send the metadata 'authorization: Bearer <key>'")


async def _refuse(request, context):
    await context.abort(grpc.StatusCode.UNAUTHENTICATED, _MESSAGE)


def _refusing(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """A handler of the same kind as handler that ends the call UNAUTHENTICATED; the request
    is never decoded (no deserializer), so an unauthenticated caller costs no parsing."""
    kind = (handler.request_streaming, handler.response_streaming)
    make = {(False, False): grpc.unary_unary_rpc_method_handler,
            (False, True): grpc.unary_stream_rpc_method_handler,
            (True, False): grpc.stream_unary_rpc_method_handler,
            (True, True): grpc.stream_stream_rpc_method_handler}[kind]
    return make(_refuse)


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, keys: ApiKeys, open_probes: bool):
        self.keys, self.open_probes = keys, open_probes

    async def intercept_service(self, continuation, details: grpc.HandlerCallDetails):
        handler = await continuation(details)
        if handler is None:  # no such method: grpc answers UNIMPLEMENTED
            return None
        if self.open_probes and details.method.startswith(_PROBE_PREFIXES):
            return handler
        given = [value for key, value in details.invocation_metadata or ()
                 if key == "authorization"]
        if len(given) == 1 and self.keys.allows(given[0]):
            return handler
        return _refusing(handler)


def interceptors(keys: ApiKeys, open_probes: bool) -> list[grpc.aio.ServerInterceptor]:
    """The server's interceptors: the key check when there are keys, else none."""
    return [ApiKeyInterceptor(keys, open_probes)] if len(keys) else []


def server_credentials(tls: TlsFiles) -> grpc.ServerCredentials:
    return grpc.ssl_server_credentials([(tls.private_key, tls.cert_chain)],
                                       root_certificates=tls.ca,
                                       require_client_auth=tls.require_client_cert)
