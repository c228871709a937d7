"""`--model org/name` not in the local hub cache: downloaded with huggingface_hub (here a mocked
hub client writing a fake repository into the cache), never when offline (HF_HUB_OFFLINE=1 or
`serve --offline`: any network call fails the test). No test here reaches the real hub."""

from __future__ import annotations

import socket

import huggingface_hub
import numpy as np
import pytest

from jaxserve.entrypoints.cli import main
from jaxserve.model.loaders import hub_cache
from jaxserve.model.loaders.loader import load_model
from model_fixtures import random_model, write_gguf
from test_hub_cache import COMMIT, fake_hub_cache


@pytest.fixture
def no_network(monkeypatch):
    """Every connection or name lookup fails the test loudly (sockets and the hub client)."""
    calls = []

    def refuse(*args, **kwargs):
        calls.append(args)
        raise AssertionError(f"network call attempted: {args[:2]}")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket.socket, "connect_ex", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    monkeypatch.setattr(socket, "getaddrinfo", refuse)
    real_snapshot = huggingface_hub.snapshot_download

    def cache_only(*args, **kwargs):  # the cache lookup is allowed, a download is not
        if not kwargs.get("local_files_only"):
            refuse("snapshot_download", args, kwargs)
        return real_snapshot(*args, **kwargs)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", cache_only)
    monkeypatch.setattr(huggingface_hub, "hf_hub_download",
                        lambda *a, **k: refuse("hf_hub_download", a, k))
    return calls


@pytest.fixture
def hub(tmp_path, monkeypatch):
    cache = tmp_path / "hub"
    cache.mkdir()
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.chdir(tmp_path)
    return cache


def test_offline_mode_attempts_no_network_call(hub, no_network, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(FileNotFoundError) as err:
        load_model("org/not-cached", progress=False)
    assert "offline" in str(err.value) and "HF_HUB_OFFLINE" in str(err.value), err.value
    assert no_network == [], "no connection, lookup or download was tried"
    config, params = random_model()  # what is cached still loads offline
    fake_hub_cache(hub, "org/cached", config, params)
    assert set(load_model("org/cached", progress=False).params) == set(params)
    assert no_network == []


def test_serve_offline_flag_forbids_the_download(hub, no_network, monkeypatch, capsys):
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    status = main(["serve", "org/not-cached", "--offline", "--port", "0", "--http-port", "0"])
    assert status == 2, "refused: the model is not in the cache and downloading is off"
    assert "offline (HF_HUB_OFFLINE=1" in capsys.readouterr().err
    assert no_network == []
    import os
    assert os.environ.get("HF_HUB_OFFLINE") == "1"


class FakeHub:
    """A hub client: the cache lookup is huggingface_hub's own; a download writes the
    repository's files into the cache in huggingface_hub's layout and records its call."""

    def __init__(self, monkeypatch, repos: dict):
        self.repos, self.calls = repos, []
        real = huggingface_hub.snapshot_download

        def snapshot_download(repo_id, *, revision=None, cache_dir=None,
                              local_files_only=False, **kwargs):
            if local_files_only:
                return real(repo_id, revision=revision, cache_dir=cache_dir,
                            local_files_only=True)
            self.calls.append(dict(repo_id=repo_id, revision=revision, **kwargs))
            if (repo_id, revision) not in self.repos:
                raise OSError(f"401 Client Error: {repo_id} is gated")
            config, params = self.repos[repo_id, revision]
            return str(fake_hub_cache(cache_dir, repo_id, config, params,
                                      ref=revision or "main"))

        def hf_hub_download(repo_id, filename, *, revision=None, cache_dir=None, **kwargs):
            self.calls.append(dict(repo_id=repo_id, filename=filename, revision=revision,
                                   **kwargs))
            config, params = self.repos[repo_id, revision]
            snapshot = cache_dir / f"models--{repo_id.replace('/', '--')}" / "snapshots" / COMMIT
            snapshot.mkdir(parents=True, exist_ok=True)
            write_gguf(snapshot / filename, config, params)
            return str(snapshot / filename)

        monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
        monkeypatch.setattr(huggingface_hub, "hf_hub_download", hf_hub_download)


def test_a_model_not_in_the_cache_is_downloaded_with_revision_and_token(hub, monkeypatch):
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setenv("HF_TOKEN", "hf_secret")
    config, params = random_model(seed=3)
    fake = FakeHub(monkeypatch, {("org/remote", "v2"): (config, params)})
    loaded = load_model(hub_cache.with_revision("org/remote", "v2"), progress=False)
    assert loaded.config.name == "org/remote"
    np.testing.assert_array_equal(loaded.params["embed"], params["embed"])
    (call,) = fake.calls
    assert call["revision"] == "v2" and call["token"] == "hf_secret"
    assert "*.safetensors" in call["allow_patterns"] and "*.json" in call["allow_patterns"]
    again = load_model("org/remote@v2", progress=False)  # now cached: no second download
    assert len(fake.calls) == 1
    np.testing.assert_array_equal(again.params["embed"], params["embed"])


def test_one_gguf_file_of_a_repository_is_downloaded_alone(hub, monkeypatch):
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    config, params = random_model(seed=4)
    fake = FakeHub(monkeypatch, {("org/tiny-GGUF", None): (config, params)})
    loaded = load_model("org/tiny-GGUF/tiny-q8.gguf", progress=False)
    np.testing.assert_allclose(loaded.params["embed"], params["embed"], atol=1e-6)
    assert [c["filename"] for c in fake.calls] == ["tiny-q8.gguf"]
    assert fake.calls[0]["token"] is None


def test_a_failed_download_names_the_model_and_the_token(hub, monkeypatch):
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    FakeHub(monkeypatch, {})
    with pytest.raises(FileNotFoundError, match="could not download org/gated.*HF_TOKEN"):
        load_model("org/gated", progress=False)


def test_revision_setting_joins_the_hub_id():
    assert hub_cache.with_revision("org/name", None) == "org/name"
    assert hub_cache.with_revision("org/name", "v1") == "org/name@v1"
    assert hub_cache.with_revision("org/name/f.gguf", "v1") == "org/name@v1/f.gguf"
    assert hub_cache.with_revision("org/name@v1", "v1") == "org/name@v1"
    with pytest.raises(ValueError, match="revision='v2' differs"):
        hub_cache.with_revision("org/name@v1", "v2")
    with pytest.raises(ValueError, match="only for a Hugging Face hub id"):
        hub_cache.with_revision("./local/dir", "v1")


def test_generation_defaults_never_download(hub, no_network, monkeypatch):
    from jaxserve.engine.generation_defaults import read_generation_defaults

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    assert read_generation_defaults("org/not-cached") == {}
    assert no_network == []
