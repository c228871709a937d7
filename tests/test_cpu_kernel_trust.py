"""Which CPU kernel libraries jaxserve loads (model/cpu/ffi.py, model/cpu/kernel_cache.py).

A new cache directory is made owner-only and its library is built once, then loaded from the
cache. A cache directory writable by its group, a library writable by others, one owned by
another user or a symbolic link in its place is refused with its path in the log, and an
engine over such a cache runs XLA's ops: the same greedy tokens as an engine with the kernels
off, and no kernel call in its compiled step. On a CPU that is not x86-64 with AVX2 and FMA
the compiler is never run and the log says once that XLA's ops run. The settings reach the
kernels from LLM(...) keywords (the CLI's flags: tests/test_engine_config.py).
"""

from __future__ import annotations

import logging
import os
import shutil
import stat

import pytest

from conftest import make_llm
from jaxserve.config import EngineConfig
from jaxserve.core.request import SamplingParams
from jaxserve.model.cpu import attention as cpu_attention
from jaxserve.model.cpu import ffi as cpu_ffi
from jaxserve.model.cpu import int8 as cpu_int8
from jaxserve.model.cpu import kernel_cache

LOGGER = "jaxserve.model.cpu.ffi"
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
PROMPTS = [[5, 9, 14, 3, 77], [40, 41, 42], [100] * 9]


@pytest.fixture(autouse=True)
def fresh_decisions(monkeypatch):
    """Every test decides and logs afresh (the process keeps one decision per settings)."""
    monkeypatch.setattr(cpu_ffi, "_reasons", {})
    monkeypatch.setattr(cpu_ffi, "_said", set())


@pytest.fixture
def compiles(monkeypatch):
    """The compiler runs of the test: (compiler, source) each, the build still done."""
    calls, real = [], cpu_ffi._compile

    def counted(compiler, source, out):
        calls.append((compiler, source.name))
        real(compiler, source, out)
    monkeypatch.setattr(cpu_ffi, "_compile", counted)
    return calls


@pytest.fixture(scope="module")
def built_cache(tmp_path_factory):
    """A cache with the int8 kernel's library built by jaxserve (copied by the tests that
    spoil one)."""
    directory = tmp_path_factory.mktemp("built") / "kernels"
    with cpu_ffi.using(cpu_ffi.KernelSettings(cache_dir=str(directory))):
        assert cpu_int8.available(), cpu_ffi.reason(cpu_int8.NAME)
    return directory


def _copy(built, tmp_path):
    directory = tmp_path / "kernels"
    shutil.copytree(built, directory)  # the modes come along
    os.chmod(directory, 0o700)
    return directory, next(directory.glob("int8_matmul-*.so"))


def _int8_ready(directory) -> bool:
    with cpu_ffi.using(cpu_ffi.KernelSettings(cache_dir=str(directory))):
        return cpu_int8.available()


def _refusals(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == LOGGER and r.levelno == logging.WARNING and "refusing" in r.getMessage()]


def test_a_new_cache_is_owner_only_built_once_then_loaded_from_the_cache(tmp_path, compiles):
    directory = tmp_path / "shared" / "kernels"
    assert _int8_ready(directory), cpu_ffi.reason(cpu_int8.NAME)
    assert stat.S_IMODE(directory.stat().st_mode) == 0o700
    (library,) = directory.glob("int8_matmul-*.so")
    assert stat.S_IMODE(library.stat().st_mode) & 0o022 == 0
    assert [name for _, name in compiles] == ["int8_matmul.cc"]
    cpu_ffi._reasons.clear()  # a new process: the cached library, no compiler run
    assert _int8_ready(directory), cpu_ffi.reason(cpu_int8.NAME)
    assert len(compiles) == 1, "the cached library was built again"


def test_a_group_writable_cache_directory_is_refused_and_nothing_is_built(tmp_path, caplog,
                                                                          compiles):
    directory = tmp_path / "kernels"
    directory.mkdir()
    os.chmod(directory, 0o770)
    with caplog.at_level(logging.INFO, logger=LOGGER):
        assert not _int8_ready(directory)
    assert compiles == [] and list(directory.iterdir()) == []
    (line,) = _refusals(caplog)
    assert f"{directory} is writable by its group (mode 0770)" in line, line
    assert "XLA's ops" in line


def test_a_world_writable_library_is_refused(built_cache, tmp_path, caplog, compiles):
    directory, library = _copy(built_cache, tmp_path)
    assert _int8_ready(directory)  # as copied: trusted
    cpu_ffi._reasons.clear()
    os.chmod(library, 0o757)
    with caplog.at_level(logging.INFO, logger=LOGGER):
        assert not _int8_ready(directory)
    (line,) = _refusals(caplog)
    assert f"{library} is writable by others (mode 0757)" in line, line
    assert compiles == []


def test_a_cache_of_another_user_is_refused(built_cache, tmp_path, caplog, monkeypatch):
    directory, _ = _copy(built_cache, tmp_path)
    me = os.getuid()
    monkeypatch.setattr(kernel_cache.os, "getuid", lambda: me + 4242)
    with caplog.at_level(logging.INFO, logger=LOGGER):
        assert not _int8_ready(directory)
    (line,) = _refusals(caplog)
    assert f"{directory} is owned by uid {me}, not by this process's user (uid {me + 4242})" \
        in line, line


@pytest.mark.skipif(os.getuid() != 0, reason="giving a file to another user takes root")
def test_a_library_of_another_user_in_an_own_cache_is_refused(built_cache, tmp_path, caplog):
    directory, library = _copy(built_cache, tmp_path)
    os.chown(library, 4242, 4242)
    with caplog.at_level(logging.INFO, logger=LOGGER):
        assert not _int8_ready(directory)
    (line,) = _refusals(caplog)
    assert f"{library} is owned by uid 4242" in line, line


def test_a_symbolic_link_in_the_librarys_place_is_refused(built_cache, tmp_path, caplog):
    directory, library = _copy(built_cache, tmp_path)
    elsewhere = tmp_path / "elsewhere.so"
    library.rename(elsewhere)
    library.symlink_to(elsewhere)
    with caplog.at_level(logging.INFO, logger=LOGGER):
        assert not _int8_ready(directory)
    (line,) = _refusals(caplog)
    assert f"{library} is not a regular file (a symbolic link)" in line, line


@pytest.mark.parametrize("machine,flags", [("aarch64", None), ("x86_64", {"sse2", "avx"})])
def test_no_build_on_a_cpu_without_avx2_and_one_log_line(machine, flags, tmp_path, caplog,
                                                         compiles, monkeypatch):
    monkeypatch.setattr(cpu_ffi.platform, "machine", lambda: machine)
    if flags is not None:
        monkeypatch.setattr(cpu_ffi, "_cpu_flags", lambda: flags)
    with caplog.at_level(logging.INFO, logger=LOGGER), \
            cpu_ffi.using(cpu_ffi.KernelSettings(cache_dir=str(tmp_path / "kernels"))):
        for _ in range(2):
            assert not cpu_int8.available() and not cpu_attention.available()
        assert "x86-64" in cpu_ffi.reason(cpu_int8.NAME) or "lacks avx2" in \
            cpu_ffi.reason(cpu_int8.NAME)
    assert compiles == [] and not (tmp_path / "kernels").exists()
    lines = [r.getMessage() for r in caplog.records if r.name == LOGGER]
    assert len(lines) == 1 and "XLA's ops run instead" in lines[0], lines


def test_bad_settings_are_errors_naming_the_field():
    with pytest.raises(ValueError, match=r"cpu_kernels='on' is invalid: must be one of"):
        EngineConfig.from_kwargs(cpu_kernels="on")
    for name in ("cpu_kernel_cache_dir", "cpu_kernel_compiler"):
        with pytest.raises(ValueError, match=f"{name}='' is invalid"):
            EngineConfig.from_kwargs(**{name: ""})
    with pytest.raises(ValueError, match="cpu_kernels='on' is invalid"):
        cpu_ffi.KernelSettings(mode="on")


def _tokens(llm) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


def _calls_the_kernel(llm) -> bool:
    exes = llm.engine.runner.step._executables.values()
    return any(cpu_attention.TARGET in exe.as_text() for exe in exes)


def test_an_engine_over_a_refused_cache_runs_xlas_ops_with_the_tokens_of_kernels_off(
        tmp_path, caplog, compiles):
    shared = tmp_path / "kernels"
    shared.mkdir()
    os.chmod(shared, 0o775)
    with caplog.at_level(logging.INFO, logger=LOGGER), \
            make_llm(cpu_kernel_cache_dir=str(shared)) as llm:
        refused = _tokens(llm)
        assert not _calls_the_kernel(llm), "the step calls a kernel from a refused cache"
    (line,) = _refusals(caplog)
    assert f"{shared} is writable by its group" in line and "decode_attention" in line, line
    assert compiles == []
    with make_llm(cpu_kernels="off") as llm:
        assert not _calls_the_kernel(llm)
        assert refused == _tokens(llm)


def test_an_engine_on_another_cpu_never_runs_the_compiler(tmp_path, caplog, compiles,
                                                          monkeypatch):
    monkeypatch.setattr(cpu_ffi.platform, "machine", lambda: "aarch64")
    with caplog.at_level(logging.INFO, logger=LOGGER), \
            make_llm(cpu_kernel_cache_dir=str(tmp_path / "kernels")) as llm:
        assert not _calls_the_kernel(llm)
    assert compiles == []
    lines = [r.getMessage() for r in caplog.records if r.name == LOGGER]
    assert lines == ["jaxserve's CPU kernels are not used: the CPU is aarch64, not x86-64; "
                     "XLA's ops run instead"], lines


def test_an_engine_with_the_defaults_calls_the_kernel(small_llm):
    assert _calls_the_kernel(small_llm), cpu_ffi.reason(cpu_attention.NAME)
