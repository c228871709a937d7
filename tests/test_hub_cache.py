"""`--model org/name`: a Hugging Face hub id resolves through the local hub cache, offline."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from jaxserve.model.loaders.hub_cache import looks_like_hub_id, resolve_hub_id
from jaxserve.model.loaders.loader import load_model, save_hf_directory
from model_fixtures import random_model, tiny_tokenizer, write_gguf

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def fake_hub_cache(cache: Path, repo_id: str, config, params, *, commit: str = COMMIT,
                   ref: str = "main") -> Path:
    """huggingface_hub's cache layout: models--org--name/{refs/<ref>, snapshots/<commit>/}."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / commit
    save_hf_directory(snapshot, config, params, tiny_tokenizer())
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / ref).write_text(commit)
    return snapshot


@pytest.fixture
def hub_cache(tmp_path, monkeypatch) -> Path:
    cache = tmp_path / "hub"
    cache.mkdir()
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)  # relative specs must not find stray directories
    return cache


@pytest.mark.parametrize("spec, is_id", [
    ("org/name", True), ("HuggingFaceTB/SmolLM2-135M-Instruct", True), ("org/name@main", True),
    ("org/name@" + COMMIT, True), ("./org/name", False), ("/abs/path", False),
    ("~/models/x", False), ("name", False), ("a/b/c", False), ("org/../x", False),
    ("model.gguf", False), ("org/name/model-Q4_K_M.gguf", True),
    ("org/name@v1/sub/model.gguf", True), ("org/name/../x.gguf", False)])
def test_hub_id_shape(spec, is_id):
    assert looks_like_hub_id(spec) is is_id, spec


def test_hub_id_loads_the_cached_snapshot(hub_cache):
    config, params = random_model()
    fake_hub_cache(hub_cache, "org/tiny-llama", config, params)
    loaded = load_model("org/tiny-llama", progress=False)
    assert loaded.config.name == "org/tiny-llama", "the served name is the hub id, not the hash"
    assert set(loaded.params) == set(params)
    for name, want in params.items():
        np.testing.assert_array_equal(loaded.params[name], want, err_msg=name)
    assert "org/tiny-llama" in loaded.source and COMMIT in loaded.source


def test_hub_id_with_revision_picks_that_snapshot(hub_cache):
    config, params = random_model(seed=0)
    fake_hub_cache(hub_cache, "org/tiny-llama", config, params)
    other = "fedcba9876543210fedcba9876543210fedcba98"
    _, params_v2 = random_model(seed=1)
    fake_hub_cache(hub_cache, "org/tiny-llama", config, params_v2, commit=other, ref="v2")
    by_ref = load_model("org/tiny-llama@v2", progress=False)
    by_hash = load_model(f"org/tiny-llama@{other}", progress=False)
    main = load_model("org/tiny-llama", progress=False)
    np.testing.assert_array_equal(by_ref.params["embed"], params_v2["embed"])
    np.testing.assert_array_equal(by_hash.params["embed"], params_v2["embed"])
    np.testing.assert_array_equal(main.params["embed"], params["embed"])


def test_hub_cache_found_through_hf_home(tmp_path, monkeypatch):
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    config, params = random_model()
    fake_hub_cache(tmp_path / "hf" / "hub", "org/tiny-llama", config, params)
    assert resolve_hub_id("org/tiny-llama") == (
        tmp_path / "hf" / "hub" / "models--org--tiny-llama" / "snapshots" / COMMIT)


def test_local_directory_wins_over_the_hub_cache(hub_cache, tmp_path):
    config, params = random_model(seed=0)
    fake_hub_cache(hub_cache, "org/tiny-llama", config, params)
    _, local_params = random_model(seed=2)
    save_hf_directory(tmp_path / "org" / "tiny-llama", config, local_params, tiny_tokenizer())
    loaded = load_model("org/tiny-llama", progress=False)
    np.testing.assert_array_equal(loaded.params["embed"], local_params["embed"])
    assert COMMIT not in loaded.source, loaded.source


def test_uncached_hub_id_names_the_id_the_cache_and_the_download_command(hub_cache):
    with pytest.raises(FileNotFoundError) as err:
        load_model("org/not-downloaded", progress=False)
    message = str(err.value)
    assert "org/not-downloaded" in message, message
    assert str(hub_cache) in message, message
    assert "hf download org/not-downloaded" in message, message
    assert "HF_HOME" in message, message


def test_uncached_revision_is_named(hub_cache):
    config, params = random_model()
    fake_hub_cache(hub_cache, "org/tiny-llama", config, params)
    with pytest.raises(FileNotFoundError, match="revision 'nope'"):
        load_model("org/tiny-llama@nope", progress=False)


def test_hub_id_with_a_gguf_file_picks_that_file_of_the_snapshot(hub_cache):
    config, params = random_model(seed=0)
    snapshot = hub_cache / "models--org--tiny-GGUF" / "snapshots" / COMMIT
    snapshot.mkdir(parents=True)
    (hub_cache / "models--org--tiny-GGUF" / "refs").mkdir()
    (hub_cache / "models--org--tiny-GGUF" / "refs" / "main").write_text(COMMIT)
    _, other = random_model(seed=1)
    write_gguf(snapshot / "tiny-a.gguf", config, params)
    write_gguf(snapshot / "tiny-b.gguf", config, other)
    loaded = load_model("org/tiny-GGUF/tiny-b.gguf", progress=False)
    assert loaded.config.name == "org/tiny-GGUF"
    np.testing.assert_array_equal(loaded.params["embed"], other["embed"])
    with pytest.raises(FileNotFoundError, match="holds no model.*2 .gguf files"):
        load_model("org/tiny-GGUF", progress=False)
    with pytest.raises(FileNotFoundError, match=r"'tiny-c.gguf'.*tiny-a.gguf, tiny-b.gguf"):
        load_model("org/tiny-GGUF/tiny-c.gguf", progress=False)
