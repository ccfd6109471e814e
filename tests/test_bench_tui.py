"""The TUI headless harness (benchmarks/tui_headless.py) on the tiny chat model: the app
(its engine in a process of its own, as it ships, and on a thread) and the engine alone
produce the same tokens, and the profile sees the app's own work."""

from __future__ import annotations

import pytest

from benchmarks.tui_headless import TuiBenchOptions, format_tui_report, run_tui_bench

pytestmark = pytest.mark.perf


def test_tui_scenario_measures_the_app_against_the_engine_alone(chat_model_dir):
    options = TuiBenchOptions(model=str(chat_model_dir), tabs=2, max_tokens=12, dtype="float32")
    report = run_tui_bench(options, log=lambda line: None)
    rounds = report["rounds"]
    runs = [*rounds["engine_alone"], *rounds["app"], *rounds["app_engine_on_a_thread"],
            report["typing_app"], report["profiled_app"]]
    assert [run["output_tokens"] for run in runs] == [2 * 12] * 8
    # The app as it ships runs its engine in a process of its own (issue 18).
    assert all(run["engine"].startswith("in a child process")
               for run in [*rounds["app"], report["typing_app"], report["profiled_app"]])
    assert {run["engine"] for run in rounds["app_engine_on_a_thread"]} == {"on a thread of this process"}
    assert all(run["output_tokens_per_s"] > 0 for run in runs)
    assert report["app"]["output_tokens_per_s"] == max(
        run["output_tokens_per_s"] for run in report["rounds"]["app"])
    assert 0 < report["app"]["ui_cpu_per_s"] < 2
    typed = report["typing_app"]
    assert typed["keypress_echo_samples"] >= 1   # typed into the shown tab while it streamed
    assert 0 < typed["keypress_echo_median_ms"] <= typed["keypress_echo_p95_ms"]
    assert "keypress_echo_samples" not in report["app"]
    alone = report["engine_alone"]["output_tokens_per_s"]
    assert report["app_vs_engine"] == report["app"]["output_tokens_per_s"] / alone
    assert report["thread_app_vs_engine"] == (
        report["app_engine_on_a_thread"]["output_tokens_per_s"] / alone)
    profile = report["profile"]
    assert profile["areas_per_s"]["markdown"] > 0   # the replies rendered on the UI thread
    assert abs(sum(profile["areas_per_s"].values()) - profile["ui_busy_per_s"]) < 1e-9
    assert len(profile["top"]) == 12
    text = format_tui_report(report)
    assert "% of the engine alone" in text and "markdown" in text and "keypress to echo" in text
    assert "engine on a thread instead of in its own process" in text

