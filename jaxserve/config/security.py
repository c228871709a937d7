"""SecurityConfig: who may call the two front ends (API keys) and how they are reached (TLS).

One setting serves both ports: the keys guard the gRPC API and the OpenAI HTTP API alike, and
one certificate, key and CA file serve both listeners. Each field documents its flag (made by
entrypoints/cli_flags.py, with vLLM's names). validate() checks the combinations only; the
files themselves are read and checked when a server starts (entrypoints/security.py). Plain
data, no I/O, no jax, and no key ever appears in an error message.
"""

from __future__ import annotations

from dataclasses import dataclass

from jaxserve.config.settings import setting

# What a key may hold: it travels in an HTTP header and in gRPC metadata (printable ASCII),
# after "Bearer "; commas separate keys in one flag value or $JAXSERVE_API_KEY.
_KEY_CHARS = frozenset(chr(c) for c in range(0x21, 0x7F)) - {","}
ENV_API_KEY = "JAXSERVE_API_KEY"


@dataclass(frozen=True)
class SecurityConfig:
    """API keys and TLS files for both front ends (`jaxserve serve`)."""
    api_keys: tuple[str, ...] = setting(
        (), "require 'Authorization: Bearer KEY' (HTTP header, gRPC metadata) with one of "
        "these keys on both APIs; repeat the flag or separate keys with commas; unset: "
        f"${ENV_API_KEY} (same format), else no key", vllm="--api-key")
    grpc_open_health: bool = setting(
        False, "answer the gRPC health and reflection services without a key (load-balancer "
        "probes); off: they need a key like every other call. HTTP /health is always open")
    ssl_certfile: str | None = setting(
        None, "PEM certificate (chain) both ports serve TLS with; needs ssl_keyfile",
        unit="file", vllm="=")
    ssl_keyfile: str | None = setting(
        None, "PEM private key (unencrypted) of ssl_certfile", unit="file", vllm="=")
    ssl_ca_certs: str | None = setting(
        None, "PEM CA certificates: when set, both ports require a client certificate signed "
        "by one of them (mutual TLS); needs ssl_certfile", unit="file", vllm="=")

    def validate(self) -> "SecurityConfig":
        if not isinstance(self.api_keys, tuple):
            raise TypeError("api_keys must be a tuple of strings (parse_api_keys reads flag "
                            "and environment values)")
        for i, key in enumerate(self.api_keys):
            if not key or not set(key) <= _KEY_CHARS:
                raise ValueError(
                    f"--api-key: key {i + 1} of {len(self.api_keys)} is invalid: a key must be "
                    "non-empty printable ASCII without spaces or commas (it is sent as "
                    "'Authorization: Bearer KEY')")
        if self.ssl_keyfile is not None and self.ssl_certfile is None:
            raise ValueError("--ssl-keyfile is given without --ssl-certfile: TLS needs both")
        if self.ssl_certfile is not None and self.ssl_keyfile is None:
            raise ValueError("--ssl-certfile is given without --ssl-keyfile: TLS needs both "
                             "(the private key in its own PEM file)")
        if self.ssl_ca_certs is not None and self.ssl_certfile is None:
            raise ValueError("--ssl-ca-certs is given without --ssl-certfile and "
                             "--ssl-keyfile: client certificates are checked only over TLS")
        return self

    @property
    def tls(self) -> bool:
        return self.ssl_certfile is not None


def parse_api_keys(values) -> tuple[str, ...]:
    """Keys from flag values or the environment variable: each value is one key or several
    separated by commas (spaces around them dropped). An empty item is an error: a stray comma
    must not pass as a key."""
    keys: list[str] = []
    for value in values:
        items = [item.strip() for item in value.split(",")]
        if any(not item for item in items):
            raise ValueError("--api-key / $JAXSERVE_API_KEY: an empty key (a stray comma, or "
                             "an empty value); separate keys with single commas")
        keys.extend(items)
    return tuple(dict.fromkeys(keys))
