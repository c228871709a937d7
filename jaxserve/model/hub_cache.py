"""Hugging Face hub ids (`org/name[@revision][/file.gguf]`) resolved in the local hub cache.

`--model org/name` finds the snapshot directory that `hf download org/name` (or any
transformers `from_pretrained`) left in the hub cache (`$HF_HUB_CACHE`, else `$HF_HOME/hub`, else
huggingface_hub's default), through huggingface_hub's own snapshot lookup. It never touches the
network: serving must not depend on the hub being reachable, and a download is the user's
explicit act. It must not import jax and knows nothing about weight formats (loader.py decides
what the snapshot holds; `/file.gguf` picks one file of a repository holding several).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

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


def hub_cache_dir() -> Path:
    """The hub cache directory, read from the environment now (huggingface_hub.constants reads
    it once at import, which would ignore a later HF_HOME / HF_HUB_CACHE)."""
    from huggingface_hub import constants

    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    return Path(constants.HF_HUB_CACHE).expanduser()


def resolve_hub_id(spec: str) -> Path:
    """The cached snapshot directory of hub id `spec`; FileNotFoundError naming the id, the cache
    directory and how to fetch the model when it is not cached."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    match = _HUB_ID.match(spec)
    if match is None:
        raise ValueError(f"{spec!r} is not a Hugging Face hub id (org/name[@revision])")
    repo_id, revision, filename = match["repo"], match["revision"], match["file"]
    cache_dir = hub_cache_dir()
    try:
        snapshot = snapshot_download(repo_id, revision=revision, cache_dir=cache_dir,
                                     local_files_only=True)
    except (LocalEntryNotFoundError, HFValidationError, OSError) as err:
        at = f" at revision {revision!r}" if revision else ""
        rev_flag = f" --revision {revision}" if revision else ""
        raise FileNotFoundError(
            f"model {spec!r} is neither a local path nor a Hugging Face model{at} in the local "
            f"cache {cache_dir} (looked for {cache_dir / ('models--' + repo_id.replace('/', '--'))}"
            f"). jaxserve never downloads: run `hf download {repo_id}{rev_flag}` (older "
            f"huggingface_hub: `huggingface-cli download {repo_id}{rev_flag}`) on a machine with "
            f"internet and copy its cache here, or point HF_HOME / HF_HUB_CACHE at a cache that "
            f"holds it ({type(err).__name__}: {err})") from None
    if filename is None:
        return Path(snapshot)
    path = Path(snapshot) / filename
    if not path.is_file():
        present = sorted(str(p.relative_to(snapshot)) for p in Path(snapshot).rglob("*.gguf"))
        raise FileNotFoundError(
            f"{filename!r} is not in the cached snapshot {snapshot} of {repo_id} (it holds "
            f"{', '.join(present) or 'no .gguf file'}); run `hf download {repo_id} {filename}` "
            f"on a machine with internet and copy its cache here")
    return path
