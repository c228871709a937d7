"""Weights quantized at load, kept on disk so that the next start reads them instead of
quantizing again (dequantizing a GGUF's blocks and requantizing them, or quantizing a float
checkpoint, costs seconds to minutes a start; reading the result back is a file read).

An entry is a jaxserve checkpoint (model/loaders/checkpoint.py: config, tokenizer, the quantized
arrays
as stored) in `<cache dir>/<key>/`, key = sha256 of the source files' resolved paths, sizes
and modification times (not their contents: hashing a large model would cost what the cache
saves), the quantized form and CACHE_VERSION (raised whenever a quantizer's output changes). A
new entry is written into a temporary directory and renamed into place, so a crash leaves no
half entry and two servers writing the same one at once both end with a whole one. The
MAX_ENTRIES most recently used entries are kept, older ones removed. The cache directory is
created owner-only (0700); one owned by another user or writable by its group or others is not
used (warned): whoever can write there chooses the weights the server runs. An entry that fails
to restore is removed and rebuilt. This module does not decide what to quantize or how.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import stat
import tempfile
import time
from pathlib import Path
from typing import Callable

from jaxserve.model.loaders import checkpoint
from jaxserve.model.loaders.weights import LoadedModel

log = logging.getLogger(__name__)
CACHE_VERSION = 1
MAX_ENTRIES = 4
SUBDIR = "jaxserve-quantized"  # inside the compile cache directory (model_runner)


def key(files: list[Path], form: str) -> str:
    """The entry name for `files` loaded in `form`."""
    described = []
    for f in files:
        st = f.stat()
        described.append([str(f.resolve()), st.st_size, st.st_mtime_ns])
    text = json.dumps({"files": described, "form": form, "version": CACHE_VERSION})
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def usable(root: Path) -> str | None:
    """None if `root` may hold the cache (created owner-only here), else why not (also the
    check for the int8 forms kept beside it: model/quant/bucket_forms.py)."""
    try:
        root.mkdir(mode=0o700, parents=True, exist_ok=True)
        st = os.stat(root, follow_symlinks=False)
    except OSError as exc:
        return f"cannot create {root}: {exc}"
    if not stat.S_ISDIR(st.st_mode):
        return f"{root} is not a directory"
    if st.st_uid != os.getuid():
        return f"{root} belongs to another user (uid {st.st_uid})"
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"{root} is writable by its group or others"
    return None


def _evict(root: Path, keep: Path) -> None:
    """Remove all but the MAX_ENTRIES most recently used entries (never `keep`)."""
    entries = [p for p in root.iterdir() if p.is_dir() and not p.name.startswith(".tmp")]
    entries.sort(key=lambda p: p.stat().st_mtime, reverse=True)
    for old in entries[MAX_ENTRIES:]:
        if old != keep:
            shutil.rmtree(old, ignore_errors=True)


def _restore(entry: Path) -> LoadedModel:
    model = checkpoint.load_checkpoint(entry)
    marker = json.loads((entry / checkpoint.MARKER).read_text())
    model.source = f"{marker.get('source')} (quantized weights read from {entry})"
    return model


def load_or_build(cache_dir: str | Path, files: list[Path], form: str,
                  build: Callable[[], LoadedModel]) -> LoadedModel:
    """The cached entry of `files` in `form`, or build() written to the cache first."""
    root = Path(cache_dir)
    problem = usable(root)
    if problem is not None:
        log.warning("quantized weights are not cached: %s", problem)
        return build()
    entry = root / key(files, form)
    if checkpoint.is_checkpoint(entry):
        start = time.perf_counter()
        try:
            model = _restore(entry)
        except Exception as exc:  # a damaged entry: rebuilt below
            log.warning("the cached quantized weights in %s could not be read (%s); "
                        "quantizing again", entry, exc)
            shutil.rmtree(entry, ignore_errors=True)
        else:
            os.utime(entry)  # most recently used
            log.info("quantized weights (%s) read from the cache in %.1f s: %s", form,
                     time.perf_counter() - start, entry)
            return model
    model = build()
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=root))
    try:
        checkpoint.save_checkpoint(tmp / "entry", model)
        os.rename(tmp / "entry", entry)
        log.info("quantized weights (%s) cached for the next start: %s", form, entry)
    except Exception as exc:  # caching is best effort: the model is loaded either way
        if not checkpoint.is_checkpoint(entry):  # else another process wrote it first
            log.warning("quantized weights could not be cached in %s: %s", root, exc)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    _evict(root, entry)
    return model
