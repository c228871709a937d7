"""API keys and TLS on both front ends (docs/security.md).

One in-process tiny engine is served by three pairs of front ends (gRPC + HTTP on one event
loop thread): `plain` (two keys, no TLS, health closed), `tls` (TLS, two keys, health open with
--grpc-open-health) and `mtls` (TLS with client CAs, one key). One `run_server` process
(tests/http_server_main.py, `jaxserve serve`'s security flags) checks the wiring end to end:
keys from $JAXSERVE_API_KEY, mutual TLS on both ports from one set of files, a clean SIGTERM.
The TLS files are a throwaway CA and certificates (tests/tls_fixtures.py). Settings that cannot
work are refused before anything listens, naming the flag.
"""

from __future__ import annotations

import socket
import ssl
from types import SimpleNamespace

import grpc
import httpx
import pytest

from jaxserve.config import SecurityConfig
from jaxserve.entrypoints.cli import build_parser, main
from jaxserve.entrypoints.cli_flags import security_config_from_args
from jaxserve.entrypoints.grpc.client import JaxServeClient, JaxServeError
from jaxserve.entrypoints.security import ApiKeys, Security

openai = pytest.importorskip("openai")
pytest.importorskip("cryptography")

KEYS = ("sk-one", "sk-two")
NO_KEY, WRONG_KEY = None, "sk-wrong"
GRPC_REFUSAL = "missing or invalid API key: send the metadata 'authorization: Bearer <key>'"
HTTP_REFUSAL = "missing or invalid API key: send the header 'Authorization: Bearer <key>'"


@pytest.fixture(scope="module")
def tls_files(tmp_path_factory):
    from tls_fixtures import make_tls_files
    return make_tls_files(tmp_path_factory.mktemp("tls"))


@pytest.fixture(scope="module")
def async_engine():
    from conftest import SMALL_ENGINE
    from http_server_main import tiny_bpe_loaded

    from jaxserve.config import EngineConfig
    from jaxserve.engine.async_engine import AsyncEngine
    from jaxserve.engine.engine import Engine

    engine = AsyncEngine(Engine(EngineConfig.from_kwargs(**SMALL_ENGINE),
                                loaded=tiny_bpe_loaded(), progress=False))
    engine.start()
    yield engine
    engine.stop(timeout=10.0)


def _fronts(async_engine, config: SecurityConfig):
    """gRPC and HTTP front ends over async_engine with config's keys and TLS, on one loop."""
    from jaxserve.entrypoints.grpc.background import ServerThread
    from jaxserve.entrypoints.openai.http_server import HttpServer, HttpSettings

    security = Security.load(config)
    grpc_server = ServerThread(async_engine, security=security)
    http = grpc_server.call(HttpServer.start("127.0.0.1", HttpSettings(port=0), security), 60)
    http.attach(async_engine)
    yield SimpleNamespace(address=grpc_server.address, url=http.url, http=http)
    grpc_server.call(http.shutdown(timeout=1), 60)
    grpc_server.stop(timeout=1.0)


@pytest.fixture(scope="module")
def plain(async_engine):
    yield from _fronts(async_engine, SecurityConfig(api_keys=KEYS))


@pytest.fixture(scope="module")
def tls(async_engine, tls_files):
    yield from _fronts(async_engine, SecurityConfig(
        api_keys=KEYS, grpc_open_health=True, ssl_certfile=tls_files.server_cert,
        ssl_keyfile=tls_files.server_key))


@pytest.fixture(scope="module")
def mtls(async_engine, tls_files):
    yield from _fronts(async_engine, SecurityConfig(
        api_keys=KEYS[:1], ssl_certfile=tls_files.server_cert, ssl_keyfile=tls_files.server_key,
        ssl_ca_certs=tls_files.ca))


def _trust(tls_files, fronts, client_cert: bool = False) -> dict:
    """JaxServeClient's TLS keywords for fronts (none for a plain one)."""
    if not fronts.url.startswith("https"):
        return {}
    given = dict(ssl_ca_certs=tls_files.ca)
    if client_cert:
        given.update(ssl_certfile=tls_files.client_cert, ssl_keyfile=tls_files.client_key)
    return given


def _ssl_context(tls_files, client_cert: bool = False, cert: str = "client"):
    context = ssl.create_default_context(cafile=tls_files.ca)
    if client_cert:
        context.load_cert_chain(getattr(tls_files, f"{cert}_cert"),
                                getattr(tls_files, f"{cert}_key"))
    return context


def _grpc_outcome(address: str, api_key, **tls) -> str:
    """The status name of a short Generate call ("OK" when it produced tokens)."""
    with JaxServeClient(address, timeout=60, api_key=api_key, **tls) as client:
        try:
            result = client.generate_text("the cat", _greedy(3))
        except JaxServeError as exc:
            return f"{exc.code.name}: {exc.details}"
    assert len(result.token_ids) == 3, result
    return "OK"


def _greedy(max_tokens: int):
    from jaxserve import SamplingParams
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


@pytest.mark.parametrize("which", ["plain", "tls"])
def test_grpc_without_a_key_or_with_a_wrong_one_is_unauthenticated_with_one_right(
        which, request, tls_files):
    fronts = request.getfixturevalue(which)
    trust = _trust(tls_files, fronts)
    got = [_grpc_outcome(fronts.address, key, **trust) for key in (NO_KEY, WRONG_KEY, *KEYS)]
    refused = f"UNAUTHENTICATED: {GRPC_REFUSAL}"
    assert got == [refused, refused, "OK", "OK"], got
    with JaxServeClient(fronts.address, timeout=60, api_key=WRONG_KEY, **trust) as client, \
            pytest.raises(JaxServeError) as info:
        client.tokenize("hello")
    assert info.value.code == grpc.StatusCode.UNAUTHENTICATED


@pytest.mark.parametrize("which", ["plain", "tls"])
def test_http_without_a_key_or_with_a_wrong_one_is_401_with_one_right_200(
        which, request, tls_files):
    fronts = request.getfixturevalue(which)
    verify = _ssl_context(tls_files) if fronts.url.startswith("https") else True
    body = {"model": fronts.http.state.serving.model_name, "prompt": "the cat", "max_tokens": 2}
    with httpx.Client(base_url=fronts.url, verify=verify, timeout=60) as http:
        missing = http.post("/v1/completions", json=body)
        wrong = http.post("/v1/completions", json=body,
                          headers={"Authorization": f"Bearer {WRONG_KEY}"})
        not_bearer = http.post("/v1/completions", json=body,
                               headers={"Authorization": f"Basic {KEYS[0]}"})
    for refused in (missing, wrong, not_bearer):
        assert refused.status_code == 401, refused.text
        assert refused.json()["error"]["message"] == HTTP_REFUSAL, refused.text
        assert refused.headers["WWW-Authenticate"] == "Bearer"
    for key in KEYS:  # the official client, each key
        with httpx.Client(verify=verify) as http_client:
            client = openai.OpenAI(base_url=fronts.url + "/v1", api_key=key, max_retries=0,
                                   http_client=http_client)
            out = client.completions.create(model=body["model"], prompt="the cat",
                                            max_tokens=2, temperature=0.0)
        assert out.usage.completion_tokens == 2
    with httpx.Client(verify=verify) as http_client:
        client = openai.OpenAI(base_url=fronts.url + "/v1", api_key=WRONG_KEY, max_retries=0,
                               http_client=http_client)
        with pytest.raises(openai.AuthenticationError):
            client.models.list()


def _reflected_services(address: str, api_key, **tls) -> list[str]:
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    from jaxserve.entrypoints.grpc.client import auth_metadata, open_channel
    with open_channel(address, **tls) as channel:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        answers = stub.ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=30,
            metadata=auth_metadata(api_key))
        return [s.name for a in answers for s in a.list_services_response.service]


def test_health_and_reflection_need_the_key_unless_grpc_open_health(plain, tls, tls_files):
    with JaxServeClient(plain.address, timeout=30) as client, \
            pytest.raises(JaxServeError) as info:
        client.health()
    assert info.value.code == grpc.StatusCode.UNAUTHENTICATED, info.value
    with pytest.raises(grpc.RpcError) as reflected:
        _reflected_services(plain.address, NO_KEY)
    assert reflected.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with JaxServeClient(plain.address, timeout=30, api_key=KEYS[1]) as client:
        assert client.health() == "SERVING"
    assert "jaxserve.v1.JaxServe" in _reflected_services(plain.address, KEYS[0])

    trust = _trust(tls_files, tls)
    with JaxServeClient(tls.address, timeout=30, **trust) as client:  # --grpc-open-health
        assert client.health() == "SERVING"
        assert client.health("jaxserve.v1.JaxServe") == "SERVING"
        with pytest.raises(JaxServeError) as info:
            client.model_info()  # the API itself still needs the key
        assert info.value.code == grpc.StatusCode.UNAUTHENTICATED
    assert "jaxserve.v1.JaxServe" in _reflected_services(tls.address, NO_KEY, **trust)


def _plaintext_http_answer(url: str) -> bytes:
    """What a plain-text HTTP request to url's port gets back (b"" when the server hangs up)."""
    host, port = url.rsplit("//", 1)[1].rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        try:
            return sock.recv(4096)
        except ConnectionResetError:
            return b""


def test_plaintext_to_a_tls_port_fails_cleanly_and_the_next_tls_request_is_served(
        tls, tls_files):
    assert not _plaintext_http_answer(tls.url).startswith(b"HTTP/"), "served without TLS"
    with pytest.raises(httpx.TransportError):
        httpx.get(tls.url.replace("https://", "http://") + "/health", timeout=30)
    with JaxServeClient(tls.address, timeout=10) as client, \
            pytest.raises(JaxServeError) as info:
        client.health()  # a plain-text channel to the TLS port
    assert info.value.code == grpc.StatusCode.UNAVAILABLE, info.value
    assert httpx.get(tls.url + "/health", verify=_ssl_context(tls_files)).status_code == 200
    assert _grpc_outcome(tls.address, KEYS[0], **_trust(tls_files, tls)) == "OK"


def test_tls_clients_must_trust_the_servers_ca(tls, tls_files):
    with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
        httpx.get(tls.url + "/health", timeout=30)  # the system's CAs only
    with JaxServeClient(tls.address, timeout=10, tls=True) as client, \
            pytest.raises(JaxServeError) as info:
        client.health()
    assert info.value.code == grpc.StatusCode.UNAVAILABLE, info.value


def test_mutual_tls_refuses_clients_without_a_trusted_certificate_and_serves_those_with_one(
        mtls, tls_files):
    for context in (_ssl_context(tls_files), _ssl_context(tls_files, True, "other_client")):
        with pytest.raises(httpx.TransportError):
            httpx.get(mtls.url + "/health", verify=context, timeout=30)
    for trust in (dict(ssl_ca_certs=tls_files.ca),
                  dict(ssl_ca_certs=tls_files.ca, ssl_certfile=tls_files.other_client_cert,
                       ssl_keyfile=tls_files.other_client_key)):
        assert _grpc_outcome(mtls.address, KEYS[0], **trust).startswith("UNAVAILABLE")
    with_cert = _ssl_context(tls_files, client_cert=True)
    assert httpx.get(mtls.url + "/health", verify=with_cert).status_code == 200
    assert httpx.get(mtls.url + "/v1/models", verify=with_cert).status_code == 401
    assert httpx.get(mtls.url + "/v1/models", verify=with_cert,
                     headers={"Authorization": f"Bearer {KEYS[0]}"}).status_code == 200
    trust = _trust(tls_files, mtls, client_cert=True)
    assert _grpc_outcome(mtls.address, KEYS[0], **trust) == "OK"
    assert _grpc_outcome(mtls.address, KEYS[1], **trust).startswith("UNAUTHENTICATED")


def test_the_server_process_takes_keys_from_the_environment_and_mutual_tls_on_both_ports(
        tls_files, monkeypatch):
    from http_server_main import server_process

    monkeypatch.setenv("JAXSERVE_API_KEY", "sk-env-1, sk-env-2")
    flags = ["--ssl-certfile", tls_files.server_cert, "--ssl-keyfile", tls_files.server_key,
             "--ssl-ca-certs", tls_files.ca, "--grpc-open-health"]
    with server_process(*flags) as process:
        assert process.url.startswith("https://"), process.url
        assert "mutual TLS, 2 API key(s)" in process.log, process.log[-3000:]
        trust = _trust(tls_files, process, client_cert=True)
        got = [_grpc_outcome(process.grpc_address, key, **trust)
               for key in (NO_KEY, "sk-env-1,sk-env-2", "sk-env-1", "sk-env-2")]
        assert [g.split(":")[0] for g in got] == ["UNAUTHENTICATED"] * 2 + ["OK"] * 2, got
        with JaxServeClient(process.grpc_address, timeout=30, **trust) as client:
            assert client.health() == "SERVING"  # --grpc-open-health
        with httpx.Client(verify=_ssl_context(tls_files, True)) as http_client:
            client = openai.OpenAI(base_url=process.url + "/v1", api_key="sk-env-2",
                                   max_retries=0, http_client=http_client)
            assert client.models.list().data
            assert not _plaintext_http_answer(process.url).startswith(b"HTTP/")
            assert client.models.list().data, "a plain-text connection stopped the server"
        process.proc.terminate()
        assert process.proc.wait(timeout=60) == 0, "SIGTERM must drain and exit 0"
    assert "Traceback" not in process.log, process.log[-3000:]
    assert "sk-env" not in process.log, "a key was logged"


# ---- settings refused before anything listens -------------------------------------------------
def _security_args(*argv: str, environ: dict | None = None) -> SecurityConfig:
    args = build_parser().parse_args(["serve", *argv])
    return security_config_from_args(args, environ=environ or {})


def test_several_keys_by_repeating_the_flag_or_with_commas_and_from_the_environment():
    assert _security_args("--api-key", "a", "--api-key", "b,c").api_keys == ("a", "b", "c")
    assert _security_args(environ={"JAXSERVE_API_KEY": "x, y"}).api_keys == ("x", "y")
    assert _security_args("--api-key", "a",
                          environ={"JAXSERVE_API_KEY": "x"}).api_keys == ("a",), "flag wins"
    assert _security_args(environ={"JAXSERVE_API_KEY": ""}).api_keys == ()
    assert _security_args().api_keys == ()
    assert not _security_args().grpc_open_health
    for argv, env in ((("--api-key", "a,"), None), (("--api-key", "a,,b"), None),
                      ((), {"JAXSERVE_API_KEY": "x,"})):
        with pytest.raises(ValueError, match="empty key"):
            _security_args(*argv, environ=env)
    with pytest.raises(ValueError, match="--api-key: key 1 of 1") as info:
        _security_args("--api-key", "has\x7fcontrol-secret")
    assert "secret" not in str(info.value), "an error message must not show the key"


@pytest.mark.parametrize("argv, flag", [
    (("--ssl-keyfile", "k.pem"), "--ssl-keyfile is given without --ssl-certfile"),
    (("--ssl-certfile", "c.pem"), "--ssl-certfile is given without --ssl-keyfile"),
    (("--ssl-ca-certs", "ca.pem"), "--ssl-ca-certs is given without --ssl-certfile"),
])
def test_a_tls_flag_without_its_partner_is_refused_naming_it(argv, flag):
    with pytest.raises(ValueError, match=flag):
        _security_args(*argv)


def test_unreadable_or_wrong_tls_files_are_refused_at_start_naming_the_flag(tls_files, tmp_path):
    from cryptography.hazmat.primitives import serialization

    t = tls_files
    encrypted = tmp_path / "encrypted.key"
    with open(t.server_key, "rb") as f:
        key = serialization.load_pem_private_key(f.read(), None)
    encrypted.write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                            serialization.PrivateFormat.PKCS8,
                                            serialization.BestAvailableEncryption(b"pw")))
    cases = [
        (dict(ssl_certfile=str(tmp_path / "missing.crt"), ssl_keyfile=t.server_key),
         "--ssl-certfile .*missing.crt.* cannot be read"),
        (dict(ssl_certfile=t.server_cert, ssl_keyfile=str(tmp_path)),
         "--ssl-keyfile .* cannot be read"),
        (dict(ssl_certfile=t.server_key, ssl_keyfile=t.server_key),
         "--ssl-certfile .* holds no PEM certificate"),
        (dict(ssl_certfile=t.server_cert, ssl_keyfile=t.server_cert),
         "--ssl-keyfile .* holds no PEM private key"),
        (dict(ssl_certfile=t.server_cert, ssl_keyfile=str(encrypted)),
         "--ssl-keyfile .* is encrypted"),
        (dict(ssl_certfile=t.server_cert, ssl_keyfile=t.client_key),
         "--ssl-certfile .* and --ssl-keyfile .* are not a certificate and its private key"),
        (dict(ssl_certfile=t.server_cert, ssl_keyfile=t.server_key, ssl_ca_certs=t.server_key),
         "--ssl-ca-certs .* is not a PEM file of CA certificates"),
    ]
    for given, message in cases:
        with pytest.raises(ValueError, match=message):
            Security.load(SecurityConfig(**given))


def test_serve_refuses_bad_security_flags_before_loading_the_model(capsys, tmp_path):
    assert main(["serve", "--ssl-keyfile", str(tmp_path / "k.pem")]) == 2
    assert "--ssl-keyfile is given without --ssl-certfile" in capsys.readouterr().err
    assert main(["serve", "--ssl-certfile", str(tmp_path / "c.pem"), "--ssl-keyfile",
                 str(tmp_path / "k.pem"), "--http-port", "0", "--port", "0"]) == 2
    assert "--ssl-certfile" in capsys.readouterr().err


def test_api_keys_accept_each_key_only_as_a_bearer_token():
    keys = ApiKeys(KEYS)
    assert all(keys.allows(f"Bearer {k}") for k in KEYS)
    assert keys.allows(f"bearer {KEYS[0]}".encode())  # the scheme is case-insensitive
    for refused in (None, "", "Bearer", "Bearer ", f"Bearer {KEYS[0]}x", f"Basic {KEYS[0]}",
                    KEYS[0], f"Bearer {KEYS[0][:-1]}", f"Bearer {KEYS[0]},{KEYS[1]}"):
        assert not keys.allows(refused), refused
    assert ApiKeys().allows(None), "no keys configured: every caller is let in"


def test_listening_beyond_loopback_without_a_key_or_tls_is_warned_about(tls_files):
    bare, keyed = Security.load(SecurityConfig()), Security.load(SecurityConfig(api_keys=KEYS))
    both = Security.load(SecurityConfig(api_keys=KEYS, ssl_certfile=tls_files.server_cert,
                                        ssl_keyfile=tls_files.server_key))
    for host in ("127.0.0.1", "::1", "localhost"):
        assert bare.exposure_warning(host) is None, host
    assert "no API key and no TLS" in bare.exposure_warning("0.0.0.0")
    assert "with no TLS" in keyed.exposure_warning("::")
    assert both.exposure_warning("0.0.0.0") is None


def test_jaxserve_generate_reaches_a_tls_server_with_its_key_and_ca(tls, tls_files, capsys):
    flags = ["generate", "--address", tls.address, "--ssl-ca-certs", tls_files.ca,
             "--max-tokens", "2", "--temperature", "0", "--ignore-eos", "the cat"]
    assert main([*flags[:1], "--api-key", KEYS[1], *flags[1:]]) == 0, capsys.readouterr().err
    assert capsys.readouterr().out.strip()
    assert main([*flags[:1], "--api-key", WRONG_KEY, *flags[1:]]) == 1
    assert f"UNAUTHENTICATED: {GRPC_REFUSAL}" in capsys.readouterr().err
