"""Where jaxserve's CPU kernels are built and whether a built one may be loaded.

A shared object is code the server runs: whoever can replace it runs code in the server. So a
kernel is built into a cache directory that jaxserve creates owner-only (0700), and a library
is handed out only while it and its directory are owned by this process's user and writable by
no group and no one else; anything else (a shared cache, a volume mounted group-writable, a
directory or file of another user, a symbolic link in the library's place) is `Untrusted`,
naming the path. The library comes back as a descriptor opened after those checks, so the file
that was checked is the file loaded. The compiler is `c++` (else `g++`) from PATH unless the
caller names another; no environment variable chooses it.

This module knows nothing of XLA, of what the kernels compute, or of which CPUs may run them
(cpu_ffi.py decides that); it never loads a library itself.
"""

from __future__ import annotations

import os
import shutil
import stat
import tempfile
from pathlib import Path
from typing import Callable

DIR_MODE = 0o700   # the cache directory jaxserve creates
FILE_MODE = 0o700  # a library it builds
SHARED_BITS = stat.S_IWGRP | stat.S_IWOTH


class Untrusted(Exception):
    """A cache directory or library this process must not load code from."""

    def __init__(self, path: Path | str, problem: str):
        super().__init__(f"{path} is {problem}")
        self.path = str(path)


def default_dir() -> Path:
    return Path.home() / ".cache" / "jaxserve" / "kernels"


def find_compiler(setting: str | None) -> tuple[str | None, str]:
    """(the compiler's path, or None; how it was looked for): `setting` (a name on PATH or a
    path) when given, else c++, else g++ from PATH."""
    if setting:
        found = shutil.which(os.path.expanduser(setting))
        return found, f"cpu_kernel_compiler={setting!r}"
    return shutil.which("c++") or shutil.which("g++"), "c++ or g++ on PATH"


def _problem(st: os.stat_result, kind: str) -> str | None:
    """Why a file of this status is not to be trusted (None: it is)."""
    want = stat.S_ISDIR if kind == "directory" else stat.S_ISREG
    if not want(st.st_mode):
        return f"not a {kind}" + (" (a symbolic link)" if stat.S_ISLNK(st.st_mode) else "")
    if st.st_uid != os.getuid():
        return f"owned by uid {st.st_uid}, not by this process's user (uid {os.getuid()})"
    if st.st_mode & SHARED_BITS:
        who = " and ".join(w for w, bit in (("its group", stat.S_IWGRP),
                                           ("others", stat.S_IWOTH)) if st.st_mode & bit)
        return f"writable by {who} (mode {stat.S_IMODE(st.st_mode):04o})"
    return None


def _check(fd: int, path: Path, kind: str) -> None:
    problem = _problem(os.fstat(fd), kind)
    if problem:
        raise Untrusted(path, problem)


def _open_dir(directory: Path) -> int:
    """A descriptor of the cache directory (created 0700 when missing), checked."""
    directory.parent.mkdir(parents=True, exist_ok=True)
    try:
        directory.mkdir(mode=DIR_MODE)
    except FileExistsError:
        pass
    try:
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:  # ELOOP / ENOTDIR: the last part is a link or a file
        st = os.lstat(directory)
        raise Untrusted(directory, _problem(st, "directory") or str(exc)) from None
    try:
        _check(fd, directory, "directory")
    except Untrusted:
        os.close(fd)
        raise
    return fd


def _open_library(dir_fd: int, path: Path) -> int:
    """A descriptor of the library, checked (FileNotFoundError when there is none)."""
    try:
        fd = os.open(path.name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
    except OSError as exc:
        if isinstance(exc, FileNotFoundError):
            raise
        st = os.lstat(path.name, dir_fd=dir_fd)
        raise Untrusted(path, _problem(st, "regular file") or str(exc)) from None
    try:
        _check(fd, path, "regular file")
    except Untrusted:
        os.close(fd)
        raise
    return fd


def trusted_library(directory: Path, filename: str, build: Callable[[str], None]) -> int:
    """An open descriptor of directory/filename, for loading through /proc/self/fd. When the
    file is missing, build(tmp) writes it to a temporary path in the directory, which is then
    made FILE_MODE and renamed into place (processes building at once each rename a whole file).
    Raises Untrusted (the directory is checked before anything is built in it) or what build
    raises."""
    directory = Path(os.path.abspath(os.path.expanduser(directory)))
    target = directory / filename
    dir_fd = _open_dir(directory)
    try:
        try:
            return _open_library(dir_fd, target)
        except FileNotFoundError:
            pass
        fd, tmp = tempfile.mkstemp(suffix=".so", prefix=f".{target.stem}-", dir=directory)
        os.close(fd)
        try:
            build(tmp)
            os.chmod(tmp, FILE_MODE)  # the linker may have made it with the process's umask
            os.replace(tmp, target)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
        return _open_library(dir_fd, target)
    finally:
        os.close(dir_fd)
