"""engine/native/build.py: a C source is compiled once per machine, and each start says which
happened (the build logged with its time, a later load logged as nothing compiled)."""

from __future__ import annotations

import logging
import os
import shutil
import tempfile

import pytest

from paged_chat.engine.native.build import compile_library

pytestmark = pytest.mark.skipif(not (os.environ.get("CC") or shutil.which("cc")
                                     or shutil.which("gcc")), reason="no C compiler")


def test_a_build_is_logged_with_its_time_and_a_second_start_compiles_nothing(
        tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    source = tmp_path / "probe_kernel.c"
    source.write_text("int probe_answer(void) { return 42; }\n")
    with caplog.at_level(logging.DEBUG, logger="paged_chat.engine.native.build"):
        assert compile_library(source).probe_answer() == 42
        assert "probe_kernel.c: compiled for this machine in" in caplog.text
        caplog.clear()
        assert compile_library(source).probe_answer() == 42
    assert "probe_kernel.c: built for this machine before, nothing compiled" in caplog.text
    assert "compiled for this machine in" not in caplog.text


def test_debug_sends_the_packages_log_lines_to_stderr_for_its_command_only(capsys):
    from paged_chat.cli.main import _log_to_stderr

    native_logger = logging.getLogger("paged_chat.engine.native.build")
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


def test_a_change_to_an_included_c_file_is_a_new_build(tmp_path, monkeypatch, caplog):
    """decode_layer.c builds kernels.c and others into one library: editing one of them
    must not load the library built from the old text."""
    from paged_chat.engine.native import build as native

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setattr(native, "_HEADERS", tmp_path)
    (tmp_path / "parts").mkdir()
    inner = tmp_path / "parts" / "inner.c"
    outer = tmp_path / "outer.c"
    inner.write_text("static int inner_answer(void) { return 1; }\n")
    outer.write_text('#include "parts/inner.c"\nint answer(void) { return inner_answer(); }\n')
    assert compile_library(outer).answer() == 1
    inner.write_text("static int inner_answer(void) { return 2; }\n")
    with caplog.at_level(logging.DEBUG, logger="paged_chat.engine.native.build"):
        assert compile_library(outer).answer() == 2
    assert "outer.c: compiled for this machine in" in caplog.text
