"""Throwaway TLS files for tests: a CA, a server certificate for localhost / 127.0.0.1 and a
client certificate, both signed by the CA, plus a second CA that signed nothing the server
trusts. Made with `cryptography` in a directory the test gives; valid for one day. Test data
only: nothing here is used by the server itself.
"""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


@dataclass(frozen=True)
class TlsPaths:
    ca: str                # the CA both sides trust
    server_cert: str
    server_key: str
    client_cert: str       # signed by ca
    client_key: str
    other_client_cert: str  # signed by another CA: a server with ca must refuse it
    other_client_key: str


def _key():
    return ec.generate_private_key(ec.SECP256R1())


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _certificate(subject: str, key, issuer: str, issuer_key, *, ca: bool = False,
                 server: bool = False) -> x509.Certificate:
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (x509.CertificateBuilder().subject_name(_name(subject)).issuer_name(_name(issuer))
               .public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5))
               .not_valid_after(now + datetime.timedelta(days=1))
               .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if ca:
        builder = builder.add_extension(x509.KeyUsage(
            digital_signature=True, key_cert_sign=True, crl_sign=True, content_commitment=False,
            key_encipherment=False, data_encipherment=False, key_agreement=False,
            encipher_only=False, decipher_only=False), critical=True)
    else:
        usage = ExtendedKeyUsageOID.SERVER_AUTH if server else ExtendedKeyUsageOID.CLIENT_AUTH
        builder = builder.add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
    if server:
        builder = builder.add_extension(x509.SubjectAlternativeName([
            x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False)
    return builder.sign(issuer_key, hashes.SHA256())


def _write(directory: Path, name: str, cert: x509.Certificate, key) -> tuple[str, str]:
    cert_path, key_path = directory / f"{name}.crt", directory / f"{name}.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                           serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return str(cert_path), str(key_path)


def make_tls_files(directory: Path) -> TlsPaths:
    """Write the CAs, the server's and the clients' certificates and keys into directory."""
    ca_key, other_ca_key = _key(), _key()
    ca_cert = _certificate("jaxserve test CA", ca_key, "jaxserve test CA", ca_key, ca=True)
    ca_path, _ = _write(directory, "ca", ca_cert, ca_key)
    server_key, client_key, other_key = _key(), _key(), _key()
    server = _write(directory, "server", _certificate("localhost", server_key,
                                                      "jaxserve test CA", ca_key, server=True),
                    server_key)
    client = _write(directory, "client", _certificate("test client", client_key,
                                                      "jaxserve test CA", ca_key), client_key)
    other = _write(directory, "other-client", _certificate(
        "stranger", other_key, "another CA", other_ca_key), other_key)
    return TlsPaths(ca_path, *server, *client, *other)
