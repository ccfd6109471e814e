"""`bench --contention N`: every system again beside N busy processes of the bench's own.

Users run chats on machines that are doing other things (a browser, a build). The busy
processes make that load reproducible: each spins a pure-Python loop (one core's worth of
work, no memory traffic to speak of) and stops by itself when its time bound runs out or
its parent is gone, so none outlives the bench even after a `kill -9`. `busy_processes`
kills them on the way out, Ctrl+C included.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

# Spins until the deadline or until its parent exits (it is then re-parented).
_BUSY_LOOP = """
import os, sys, time
parent, deadline = int(sys.argv[1]), time.monotonic() + float(sys.argv[2])
while time.monotonic() < deadline and os.getppid() == parent:
    for _ in range(200_000):
        pass
"""


@contextmanager
def busy_processes(count: int, bound_s: float, settle_s: float = 1.0
                   ) -> Iterator[list[subprocess.Popen]]:
    """Run `count` CPU-bound processes for at most `bound_s` seconds; kill them on exit.

    They run `settle_s` before the caller goes on: a user's build or browser is busy before
    the chat starts, not from the same instant. (Started together with a run, the load came
    after an engine that had just measured a quiet machine chose its first step's threads:
    the quick workload's whole prefill then ran on both cores beside them, 3.5 s against
    1.2 s quiet.)"""
    processes: list[subprocess.Popen] = []
    try:
        for _ in range(count):
            processes.append(subprocess.Popen(
                [sys.executable, "-c", _BUSY_LOOP, str(os.getpid()), str(bound_s)],
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        if processes:
            time.sleep(settle_s)
        yield processes
    finally:
        for process in processes:
            process.kill()
        for process in processes:
            process.wait()


def contention_table(systems: list[dict], busy: int) -> list[dict]:
    """Quiet vs contended output tokens/s per system, from the summaries of one run.

    A contended summary's system is named `"<name> +<busy> busy"` after its quiet twin.
    """
    by_name = {summary["system"]: summary for summary in systems}
    rows = []
    for summary in systems:
        contended = by_name.get(f"{summary['system']} +{busy} busy")
        if contended is None:
            continue
        quiet_rate, busy_rate = summary["output_tokens_per_s"], contended["output_tokens_per_s"]
        rows.append({"system": summary["system"], "quiet_tokens_per_s": quiet_rate,
                     "contended_tokens_per_s": busy_rate, "kept": busy_rate / quiet_rate,
                     "busy_processes": busy})
    return rows


def format_contention(rows: list[dict]) -> str:
    lines = [f"beside {rows[0]['busy_processes']} busy processes (output tokens/s, quiet -> "
             "contended, kept):"] if rows else []
    lines += [f"  {row['system']}: {row['quiet_tokens_per_s']:.1f} -> "
              f"{row['contended_tokens_per_s']:.1f} ({100 * row['kept']:.0f}%)" for row in rows]
    rates = {row["system"]: row["contended_tokens_per_s"] for row in rows}
    if "paged-chat" in rates and rates.get("hf-cb"):
        lines.append(f"  contended paged-chat / hf-cb: {rates['paged-chat'] / rates['hf-cb']:.2f}x")
    return "\n".join(lines)
