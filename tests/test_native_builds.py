"""engine/native: every C source is built into one library, once per machine, in a folder
only this user can write, keyed by the sources, headers, compiler, flags and CPU; each start
says whether it compiled; the Python mirror of each C struct is checked at load."""

from __future__ import annotations

import ctypes
import logging
import os
import re
import shutil
import stat
from pathlib import Path

import pytest

from paged_chat.engine.native import bindings, build
from paged_chat.engine.native.build import compile_library

pytestmark = pytest.mark.skipif(not (os.environ.get("CC") or shutil.which("cc")
                                     or shutil.which("gcc")), reason="no C compiler")
LOGGER = "paged_chat.engine.native.build"


@pytest.fixture
def cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fresh cache dir for the builds of one test."""
    monkeypatch.setattr(build, "_cache_dir", tmp_path / "cache")
    return tmp_path / "cache"


def probe_source(folder: Path, answer: int = 42) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    source = folder / "probe_kernel.c"
    source.write_text(f"int probe_answer(void) {{ return {answer}; }}\n")
    return source


def test_a_build_is_logged_with_its_time_and_a_second_start_compiles_nothing(
        tmp_path, cache_dir, caplog):
    source = probe_source(tmp_path / "src")
    with caplog.at_level(logging.DEBUG, logger=LOGGER):
        assert compile_library("probe", [source]).probe_answer() == 42
        assert "probe: compiled for this machine in" in caplog.text
        caplog.clear()
        assert compile_library("probe", [source]).probe_answer() == 42
    assert "probe: built for this machine before, nothing compiled" in caplog.text
    assert "compiled for this machine in" not in caplog.text


def test_the_build_folder_is_the_cache_dirs_kernels_folder_made_private(tmp_path, cache_dir):
    compile_library("probe", [probe_source(tmp_path / "src")])
    folder = cache_dir / "kernels"
    assert build.build_folder() == folder
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    [built] = folder.glob("probe-*.so")
    assert built.stat().st_uid == os.getuid()


def test_the_default_build_folder_is_the_users_cache_dir_not_the_temp_dir(monkeypatch):
    import platformdirs

    monkeypatch.setattr(build, "_cache_dir", None)
    assert build.build_folder() == platformdirs.user_cache_path("paged-chat") / "kernels"


@pytest.mark.parametrize("mode", [0o720, 0o702, 0o777])
def test_a_build_folder_others_can_write_is_refused(tmp_path, cache_dir, caplog, mode):
    (cache_dir / "kernels").mkdir(parents=True)
    (cache_dir / "kernels").chmod(mode)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert compile_library("probe", [probe_source(tmp_path / "src")]) is None
    assert "can be written by other users" in caplog.text
    assert "the torch paths run" in caplog.text
    assert not list((cache_dir / "kernels").glob("*.so"))


@pytest.mark.skipif(os.getuid() != 0, reason="only root can give a folder to another user")
def test_a_build_folder_or_file_another_user_owns_is_refused(tmp_path, cache_dir, caplog):
    source = probe_source(tmp_path / "src")
    assert compile_library("probe", [source]) is not None
    [built] = (cache_dir / "kernels").glob("probe-*.so")
    os.chown(built, 12345, -1)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert compile_library("probe", [source]) is None
    assert f"{built} is owned by another user (uid 12345" in caplog.text
    os.chown(built, os.getuid(), -1)
    os.chown(cache_dir / "kernels", 12345, -1)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert compile_library("probe", [source]) is None
    assert "kernels is owned by another user (uid 12345" in caplog.text


def test_a_built_file_others_can_write_is_refused(tmp_path, cache_dir, caplog):
    source = probe_source(tmp_path / "src")
    assert compile_library("probe", [source]) is not None
    [built] = (cache_dir / "kernels").glob("probe-*.so")
    built.chmod(0o757)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert compile_library("probe", [source]) is None
    assert f"{built} can be written by other users (mode 0757)" in caplog.text


def test_a_symbolic_link_in_place_of_a_build_is_refused(tmp_path, cache_dir, caplog):
    source = probe_source(tmp_path / "src")
    assert compile_library("probe", [source]) is not None
    [built] = (cache_dir / "kernels").glob("probe-*.so")
    planted = tmp_path / "planted.so"
    shutil.move(built, planted)
    built.symlink_to(planted)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert compile_library("probe", [source]) is None
    assert "is not a plain file" in caplog.text


def test_the_cpu_is_in_the_build_key(tmp_path, cache_dir, monkeypatch):
    source = probe_source(tmp_path / "src")
    compile_library("probe", [source])
    first = {path.name for path in (cache_dir / "kernels").glob("probe-*.so")}
    monkeypatch.setattr(build, "cpu_description", lambda: "x86_64 | AuthenticAMD | another CPU")
    compile_library("probe", [source])
    both = {path.name for path in (cache_dir / "kernels").glob("probe-*.so")}
    assert len(first) == 1 and len(both) == 2


def test_the_cpu_description_names_its_model_and_flags():
    description = build.cpu_description()
    if Path("/proc/cpuinfo").is_file() and "flags" in Path("/proc/cpuinfo").read_text():
        assert re.search(r"\bsse2\b", description), description


def test_a_missing_source_is_a_warning_and_the_torch_paths(tmp_path, cache_dir, caplog):
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert compile_library("probe", [tmp_path / "gone.c"]) is None
    assert "a source is missing" in caplog.text and "gone.c" in caplog.text


def test_a_change_to_a_header_is_a_new_build(tmp_path, cache_dir, caplog):
    """Headers are compiled into every source that includes them: editing one must not
    load the library built from the old text."""
    header = tmp_path / "src" / "answer.h"
    header.parent.mkdir()
    header.write_text("#define ANSWER 1\n")
    source = tmp_path / "src" / "outer.c"
    source.write_text('#include "answer.h"\nint answer(void) { return ANSWER; }\n')
    assert compile_library("outer", [source]).answer() == 1
    header.write_text("#define ANSWER 2\n")
    with caplog.at_level(logging.DEBUG, logger=LOGGER):
        assert compile_library("outer", [source]).answer() == 2
    assert "outer: compiled for this machine in" in caplog.text


def test_every_c_source_is_in_the_one_library_and_none_includes_another():
    assert set(bindings.SOURCES) == set(bindings.CSRC.glob("*.c"))
    for source in bindings.CSRC.glob("*.[ch]"):
        assert not re.search(r'#include\s+"[^"]+\.c"', source.read_text()), source


def test_the_library_holds_every_kernel_family_and_its_structs_match_c():
    lib = bindings.library()
    assert lib is not None
    for name in ("pa_attention", "fo_add_rms_norm", "fo_rope", "fo_silu_and_mul", "pc_matmul",
                 "pc_dequantize"):
        assert hasattr(lib, name), name
    bindings.check_struct_sizes(lib)


def test_a_struct_whose_mirror_drifted_is_a_precise_error():
    class ShortProblem(ctypes.Structure):
        _fields_ = bindings.PagedAttentionProblem._fields_[:-1]

    with pytest.raises(bindings.StructLayoutError, match=r"ShortProblem is \d+ bytes in "
                       r"bindings.py but \d+ in C \(pa_problem_size\)"):
        bindings.check_struct_sizes(bindings.library(), [(ShortProblem, "pa_problem_size")])


def test_debug_sends_the_packages_log_lines_to_stderr_for_its_command_only(capsys):
    from paged_chat.cli.main import _log_to_stderr

    native_logger = logging.getLogger(LOGGER)
    undo = _log_to_stderr()
    try:
        native_logger.info("a kernel line")
        assert capsys.readouterr().err == "paged_chat.engine.native.build: a kernel line\n"
    finally:
        undo()
    native_logger.info("after the command")  # a later command in this process: no line
    assert capsys.readouterr().err == ""


def test_a_debug_command_leaves_no_handler_behind(cli, tmp_path):
    package = logging.getLogger("paged_chat")
    before = list(package.handlers), package.level
    cli("--debug", "ask", "--model", str(tmp_path / "nope.gguf"), "Hello")
    assert (list(package.handlers), package.level) == before
