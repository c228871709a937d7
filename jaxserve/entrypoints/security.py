"""What both front ends check before serving a call: the API keys, and the TLS files.

`Security.load(SecurityConfig)` runs once at start-up, before any port opens: it reads every
TLS file and checks that it holds what its flag says (a bad one is refused with a message
naming the flag). The gRPC server (grpc/auth.py's interceptor, grpc.ssl_server_credentials) and
the HTTP server (http_gate.py, uvicorn's ssl_* options) then take what it holds. ApiKeys compares
a presented key with every configured key in constant time, with no early exit, so neither the
timing nor the answer tells which key came close; a missing and a wrong key get the same
answer. It listens on nothing, never logs a key, and does not import jax or grpc.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import ssl
from dataclasses import dataclass

from jaxserve.config.security import SecurityConfig

# The one answer to a call without a valid key, whatever was wrong with it.
UNAUTHENTICATED_MESSAGE = "missing or invalid API key"
_PEM_CERT = b"-----BEGIN CERTIFICATE-----"


class ApiKeys:
    """The configured keys, kept as SHA-256 digests: comparing digests of equal length keeps
    the comparison's time independent of a key's length as well as its content."""

    def __init__(self, keys=()):
        self._digests = tuple(hashlib.sha256(key.encode()).digest() for key in keys)

    def __len__(self) -> int:
        return len(self._digests)

    def allows(self, authorization: str | bytes | None) -> bool:
        """Whether an `Authorization` value ('Bearer KEY', an HTTP header's or gRPC
        metadata's) holds one of the keys; always True when no key is configured."""
        if not self._digests:
            return True
        value = authorization.encode("latin-1") if isinstance(authorization, str) else (
            authorization or b"")
        scheme, _, token = value.strip().partition(b" ")
        given = hashlib.sha256(token.strip()).digest()
        match = False
        for digest in self._digests:  # every key, always: no early exit
            match |= hmac.compare_digest(given, digest)
        return match and scheme.lower() == b"bearer"


@dataclass(frozen=True)
class TlsFiles:
    """The certificate chain, its private key and the client CAs (None: no client
    certificates asked for), as read and checked at start-up. Paths are kept for uvicorn."""
    certfile: str
    keyfile: str
    ca_certs: str | None
    cert_chain: bytes   # PEM
    private_key: bytes  # PEM
    ca: bytes | None    # PEM

    @property
    def require_client_cert(self) -> bool:
        return self.ca is not None


def _read(path: str, flag: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as exc:
        raise ValueError(f"{flag} {path!r} cannot be read: {exc.strerror or exc}") from None


def load_tls(config: SecurityConfig) -> TlsFiles | None:
    """The TLS files, read and checked (None when TLS is off): each error names its flag."""
    if not config.tls:
        return None
    cert = _read(config.ssl_certfile, "--ssl-certfile")
    key = _read(config.ssl_keyfile, "--ssl-keyfile")
    ca = None if config.ssl_ca_certs is None else _read(config.ssl_ca_certs, "--ssl-ca-certs")
    if _PEM_CERT not in cert:
        raise ValueError(f"--ssl-certfile {config.ssl_certfile!r} holds no PEM certificate "
                         f"('{_PEM_CERT.decode()}')")
    if b"PRIVATE KEY-----" not in key:
        raise ValueError(f"--ssl-keyfile {config.ssl_keyfile!r} holds no PEM private key")
    if b"ENCRYPTED" in key:
        raise ValueError(f"--ssl-keyfile {config.ssl_keyfile!r} is encrypted: both servers "
                         "need the private key unencrypted (protect the file instead)")
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        context.load_cert_chain(config.ssl_certfile, config.ssl_keyfile, password=b"")
    except ssl.SSLError as exc:
        raise ValueError(f"--ssl-certfile {config.ssl_certfile!r} and --ssl-keyfile "
                         f"{config.ssl_keyfile!r} are not a certificate and its private key "
                         f"({exc.reason or exc})") from None
    if ca is not None:
        try:
            if _PEM_CERT not in ca:
                raise ssl.SSLError("no PEM certificate in it")
            context.load_verify_locations(cadata=ca.decode("ascii"))
        except (ssl.SSLError, UnicodeDecodeError) as exc:
            raise ValueError(f"--ssl-ca-certs {config.ssl_ca_certs!r} is not a PEM file of CA "
                             f"certificates ({getattr(exc, 'reason', None) or exc})") from None
    return TlsFiles(config.ssl_certfile, config.ssl_keyfile, config.ssl_ca_certs, cert, key, ca)


@dataclass(frozen=True)
class Security:
    """What the two front ends enforce, loaded once from a SecurityConfig."""
    keys: ApiKeys
    tls: TlsFiles | None = None
    grpc_open_health: bool = False

    @classmethod
    def load(cls, config: SecurityConfig | None = None) -> "Security":
        """Validate the config and read its files (ValueError naming the flag on failure).
        None: no keys, no TLS."""
        config = (config or SecurityConfig()).validate()
        return cls(ApiKeys(config.api_keys), load_tls(config), config.grpc_open_health)

    def describe(self) -> str:
        """For the start-up log: 'TLS, 2 API key(s)' (never the keys)."""
        tls = ("no TLS" if self.tls is None else
               "mutual TLS" if self.tls.require_client_cert else "TLS")
        return f"{tls}, {len(self.keys) or 'no'} API key(s)"

    def exposure_warning(self, host: str) -> str | None:
        """A warning for the start-up log when host is reachable from other machines and a
        protection is missing (None when nothing is missing, or on a loopback address)."""
        try:
            loopback = ipaddress.ip_address(host).is_loopback
        except ValueError:  # a name
            loopback = host == "localhost"
        missing = [what for what, absent in (("no API key", not len(self.keys)),
                                             ("no TLS", self.tls is None)) if absent]
        if loopback or not missing:
            return None
        return (f"listening on {host} with {' and '.join(missing)}: whoever reaches the ports "
                "can use the model (and read traffic in the clear); see docs/security.md")
