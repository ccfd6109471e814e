"""The TUI in a real terminal (benchmarks/tui_terminal.py) on the tiny chat model: the app
as it ships, run in a child process on a drained pty and in tmux, streams the same tokens as
the engine alone, and writes escape sequences to those terminals."""

from __future__ import annotations

import shutil

import pytest

from benchmarks.tui_headless import TuiBenchOptions
from benchmarks.tui_terminal import format_terminal_report, run_terminal_bench

pytestmark = pytest.mark.perf


def test_the_app_in_a_real_terminal_against_the_engine_alone(chat_model_dir):
    # Not "headless": tests/test_bench_tui.py runs that path, and it is a model load more.
    terminals = ("pty", "tmux") if shutil.which("tmux") else ("pty",)
    options = TuiBenchOptions(model=str(chat_model_dir), tabs=2, max_tokens=12, dtype="float32")
    report = run_terminal_bench(options, terminals, rounds=1, log=lambda line: None)
    best = report["best"]
    assert [best[name]["output_tokens"] for name in ("engine_alone", *terminals)] == \
        [2 * 12] * (1 + len(terminals))
    assert all(best[name]["engine"].startswith("in a child process") for name in terminals)
    for name in terminals:
        assert best[name]["terminal_chars_per_s"] > 0 and best[name]["terminal_bytes"] > 0
        assert 0 < best[name]["ui_cpu_per_s"] <= best[name]["app_cpu_per_s"]
    if "tmux" in terminals:
        assert best["tmux"]["tmux_server_cpu_per_s"] >= 0
    assert report["vs_engine"]["pty"] == (best["pty"]["output_tokens_per_s"]
                                          / best["engine_alone"]["output_tokens_per_s"])
    text = format_terminal_report(report)
    assert "engine alone" in text and "app pty" in text and "chars/s" in text
