"""The harnesses under benchmarks/: each runs as `python -m benchmarks.NAME` from the
repository root (its imports resolve, its argparse answers -h); the contention harness's busy
processes never outlive it and a contended run reports quiet and contended figures side by
side; the host overhead is the step's time less the sampler's."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from benchmarks.contention import busy_processes, format_contention, run_contention
from paged_chat.bench import BenchOptions

pytestmark = pytest.mark.perf

REPO = Path(__file__).resolve().parents[1]
HARNESSES = sorted(path.stem for path in (REPO / "benchmarks").glob("*.py")
                   if "def main(" in path.read_text())


def gone(pid: int) -> bool:
    """True once `pid` is no process (reaped), or only a zombie nobody will wait for."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split(") ")[1].startswith("Z")
    except FileNotFoundError:
        return True


def live_children() -> set[int]:
    """This process's children that are running (not zombies)."""
    children = set()
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat") as stat:
                fields = stat.read().rsplit(") ", 1)[1].split()
        except (FileNotFoundError, ProcessLookupError):
            continue
        if int(fields[1]) == os.getpid() and fields[0] != "Z":
            children.add(int(entry))
    return children


def test_busy_processes_run_and_are_killed_at_the_end():
    with busy_processes(2, bound_s=600) as processes:
        pids = [process.pid for process in processes]
        assert len(pids) == 2 and all(process.poll() is None for process in processes)
    assert all(gone(pid) for pid in pids)


def test_busy_processes_are_killed_when_interrupted():
    with pytest.raises(KeyboardInterrupt):
        with busy_processes(2, bound_s=600) as processes:
            pids = [process.pid for process in processes]
            raise KeyboardInterrupt
    assert all(gone(pid) for pid in pids)


def test_busy_processes_are_busy_before_the_caller_goes_on():
    """The load is there before the system runs, as a user's other programs are: each
    process has already spent CPU time (started together with the run, the engine chose its
    first step's threads for a quiet machine)."""
    with busy_processes(2, bound_s=600, settle_s=0.5) as processes:
        for process in processes:
            with open(f"/proc/{process.pid}/stat") as stat:
                utime, stime = stat.read().split(") ")[1].split()[11:13]
            assert int(utime) + int(stime) > 0


def test_busy_processes_stop_by_themselves_at_their_bound():
    with busy_processes(1, bound_s=0.5) as processes:
        deadline = time.monotonic() + 60
        while processes[0].poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert processes[0].returncode == 0


def test_contended_run_reports_quiet_and_contended(chat_model_dir):
    options = BenchOptions(model=str(chat_model_dir), num_chats=2, min_output=3, max_output=4,
                           dtype="float32", threads=1, systems=("paged-chat",),
                           scenarios=False)
    before = live_children()
    report = run_contention(options, busy=1, log=lambda line: None)
    names = [summary["system"] for summary in report["systems"]]
    assert names == ["paged-chat", "paged-chat +1 busy"]
    (row,) = report["contention"]
    assert row["quiet_tokens_per_s"] > 0 and row["contended_tokens_per_s"] > 0
    assert "beside 1 busy processes" in format_contention(report["contention"])
    assert live_children() <= before


def test_host_overhead_reports_numbers(chat_model_dir):
    from benchmarks.host_overhead import format_host_overhead, host_overhead
    from paged_chat.engine.models.loader import load_model_source

    rows = host_overhead(load_model_source(str(chat_model_dir)), batch_sizes=(2, 4),
                         context_len=256, shared_len=128, decode_steps=3)
    assert [row["batch_size"] for row in rows] == [2, 4]
    for row in rows:
        assert row["decode_steps"] == 3
        assert row["step_wall_ms"] > 0 and row["sample_ms"] > 0
        assert 0 < row["host_ms"] < row["step_ms"], "the sampler's math is taken away"
        assert row["host_per_token_us"] == pytest.approx(1e3 * row["host_ms"] / row["batch_size"])
    assert "batch 4:" in format_host_overhead(rows)


@pytest.mark.parametrize("name", HARNESSES)
def test_a_harness_answers_help_from_the_repo_root(name):
    env = {**os.environ, "TRITON_INTERPRET": "1"}  # device_check imports triton
    result = subprocess.run([sys.executable, "-m", f"benchmarks.{name}", "-h"], cwd=REPO, env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "usage:" in result.stdout
