"""Hugging Face hub ids (`org/name[@revision][/file.gguf]`): found in the local hub cache, or
downloaded into it.

`--model org/name` finds the snapshot directory that `hf download org/name` (or any
transformers `from_pretrained`) left in the hub cache (`$HF_HUB_CACHE`, else `$HF_HOME/hub`, else
huggingface_hub's default), through huggingface_hub's own snapshot lookup. A model not in the
cache is downloaded there with huggingface_hub (a progress bar per file, the revision asked for,
`HF_TOKEN` for gated models; safetensors weights with their JSON files and tokenizer, or the one
`.gguf` named), as `vllm serve org/name` does, unless `HF_HUB_OFFLINE=1` (`jaxserve serve
--offline` sets it): then nothing reaches the network and a missing model is an error saying
how to fetch it. Readers that only look (generation defaults) never download. It must not
import jax and knows nothing about weight formats (loader.py decides what the snapshot holds).
"""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path

log = logging.getLogger(__name__)
# what a download fetches of a repository: config, safetensors weights, tokenizer, templates
DOWNLOAD_PATTERNS = ("*.json", "*.safetensors", "*.jinja", "tokenizer.model", "*.tiktoken")

# one '/' between two hub-name parts, an optional @revision (branch, tag or commit hash), an
# optional .gguf file inside the repository
_HUB_ID = re.compile(r"^(?P<repo>[A-Za-z0-9][\w.-]*/[\w.-]+)(?:@(?P<revision>[\w.-]+))?"
                     r"(?:/(?P<file>[\w./-]+\.gguf))?$")


def looks_like_hub_id(spec: str) -> bool:
    """True for `org/name`, `org/name@revision`, `org/name[@revision]/file.gguf` (never a path
    starting with '.', '/' or '~')."""
    return _HUB_ID.match(spec) is not None and ".." not in spec


def hub_repo_id(spec: str) -> str:
    """`org/name` of a hub id (the served model name)."""
    return _HUB_ID.match(spec)["repo"]


def offline() -> bool:
    """HF_HUB_OFFLINE set (read now, not at import as huggingface_hub does): never download."""
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def with_revision(spec: str, revision: str | None) -> str:
    """spec with `revision` (the `revision` setting) as its `@revision`; ValueError when spec
    is not a hub id or names another revision."""
    if revision is None:
        return spec
    match = _HUB_ID.match(spec)
    if match is None or ".." in spec:
        raise ValueError(f"revision={revision!r} is only for a Hugging Face hub id "
                         f"(org/name), not model={spec!r}")
    if match["revision"] not in (None, revision):
        raise ValueError(f"revision={revision!r} differs from the revision in "
                         f"model={spec!r}: give one")
    file = f"/{match['file']}" if match["file"] else ""
    return f"{match['repo']}@{revision}{file}"


def hub_cache_dir() -> Path:
    """The hub cache directory, read from the environment now (huggingface_hub.constants reads
    it once at import, which would ignore a later HF_HOME / HF_HUB_CACHE)."""
    from huggingface_hub import constants

    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    return Path(constants.HF_HUB_CACHE).expanduser()


def resolve_hub_id(spec: str, download: bool = False) -> Path:
    """The cached snapshot directory (or `.gguf` file) of hub id `spec`. Not in the cache:
    downloaded when `download` and not offline(), else FileNotFoundError naming the id, the
    cache directory and how to fetch the model."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    match = _HUB_ID.match(spec)
    if match is None:
        raise ValueError(f"{spec!r} is not a Hugging Face hub id (org/name[@revision])")
    repo_id, revision, filename = match["repo"], match["revision"], match["file"]
    cache_dir = hub_cache_dir()
    try:
        snapshot = Path(snapshot_download(repo_id, revision=revision, cache_dir=cache_dir,
                                          local_files_only=True))
    except (LocalEntryNotFoundError, HFValidationError, OSError) as err:
        if not download or offline():
            raise _not_cached(spec, repo_id, revision, cache_dir, err, download) from None
        return _download(repo_id, revision, filename, cache_dir)
    if filename is None:
        return snapshot
    path = snapshot / filename
    if path.is_file():
        return path
    if download and not offline():
        return _download(repo_id, revision, filename, cache_dir)
    present = sorted(str(p.relative_to(snapshot)) for p in snapshot.rglob("*.gguf"))
    raise FileNotFoundError(
        f"{filename!r} is not in the cached snapshot {snapshot} of {repo_id} (it holds "
        f"{', '.join(present) or 'no .gguf file'}); unset HF_HUB_OFFLINE to download it, or "
        f"run `hf download {repo_id} {filename}` on a machine with internet and copy its cache "
        f"here")


def _not_cached(spec, repo_id, revision, cache_dir, err, download: bool) -> FileNotFoundError:
    at = f" at revision {revision!r}" if revision else ""
    rev_flag = f" --revision {revision}" if revision else ""
    why = ("offline (HF_HUB_OFFLINE=1 or `jaxserve serve --offline`): nothing is downloaded; "
           "unset it to download, or" if download else "not downloaded here:")
    return FileNotFoundError(
        f"model {spec!r} is neither a local path nor a Hugging Face model{at} in the local "
        f"cache {cache_dir} (looked for {cache_dir / ('models--' + repo_id.replace('/', '--'))}"
        f"). {why} run `hf download {repo_id}{rev_flag}` on a machine with internet and copy "
        f"its cache here, or point HF_HOME / HF_HUB_CACHE at a cache that holds it "
        f"({type(err).__name__}: {err})")


def _download(repo_id: str, revision: str | None, filename: str | None,
              cache_dir: Path) -> Path:
    """The repository's snapshot (or its one `.gguf` file) fetched into the hub cache."""
    from huggingface_hub import hf_hub_download, snapshot_download

    token = os.environ.get("HF_TOKEN") or None  # None: huggingface_hub's stored login, if any
    what = f"{repo_id}{'@' + revision if revision else ''}{'/' + filename if filename else ''}"
    log.info("downloading %s from the Hugging Face hub into %s (HF_HUB_OFFLINE=1 or "
             "--offline to forbid)", what, cache_dir)
    try:
        if filename is not None:
            return Path(hf_hub_download(repo_id, filename, revision=revision,
                                        cache_dir=cache_dir, token=token))
        return Path(snapshot_download(repo_id, revision=revision, cache_dir=cache_dir,
                                      allow_patterns=list(DOWNLOAD_PATTERNS), token=token))
    except Exception as err:  # network, authentication, unknown repository or revision
        gated = "; a gated or private model needs HF_TOKEN" if token is None else ""
        raise FileNotFoundError(f"could not download {what} from the Hugging Face hub into "
                                f"{cache_dir}{gated} ({type(err).__name__}: {err})") from err
