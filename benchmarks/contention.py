"""`paged-chat bench`'s systems run twice, quiet, then beside N busy processes of its own.

Users run chats on machines that are doing other things (a browser, a build). The busy
processes make that load reproducible: each spins a pure-Python loop (one core's worth of
work, no memory traffic to speak of) and stops by itself when its time bound runs out or
its parent is gone, so none outlives the harness even after a `kill -9`. `busy_processes`
kills them on the way out, Ctrl+C included.

From the repository root (`-h` for the options):

    python -m benchmarks.contention --busy 2 [--model smollm2-135m] [--systems paged-chat,hf-cb]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict

from paged_chat.bench import BenchOptions, prepare_bench, run_systems, systems_report
from paged_chat.bench.report import format_report

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
    the chat starts, not from the same instant. (Started together with a run, the load would
    come after an engine that had just measured a quiet machine chose its first step's
    threads, and the run would measure that choice.)"""
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


def run_contention(options: BenchOptions, busy: int, bound_s: float = 600.0,
                   log: Callable[[str], None] = print) -> dict:
    """`paged-chat bench`'s report of the systems run quiet, then again (named
    `"<name> +<busy> busy"`) beside `busy` busy processes, with the table of both under
    "contention"."""
    setup = prepare_bench(options, log)
    results = run_systems(setup, options, log)
    with busy_processes(busy, bound_s):
        results += run_systems(setup, options, log, suffix=f" +{busy} busy")
    report = {"options": {**asdict(options), "busy_processes": busy}, **systems_report(setup, results)}
    report["contention"] = contention_table(report["systems"], busy)
    return report


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.contention",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--busy", type=int, default=2, help="busy processes (default 2)")
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--systems", default="paged-chat,hf-cb",
                        help="comma-separated, as `paged-chat bench --systems`")
    parser.add_argument("--chats", type=int, default=8)
    parser.add_argument("--min-output", type=int, default=16)
    parser.add_argument("--max-output", type=int, default=48)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", help="write the report here")
    args = parser.parse_args()
    options = BenchOptions(model=args.model, num_chats=args.chats, min_output=args.min_output,
                           max_output=args.max_output, dtype=args.dtype, threads=args.threads,
                           scenarios=False,
                           systems=tuple(name.strip() for name in args.systems.split(",") if name.strip()))
    report = run_contention(options, args.busy, log=lambda line: print(line, file=sys.stderr))
    print(format_report(report))
    print(format_contention(report["contention"]))
    if args.json:
        with open(args.json, "w") as out:
            json.dump(report, out, indent=2)


if __name__ == "__main__":
    main()
