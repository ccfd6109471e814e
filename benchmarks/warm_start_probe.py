#!/usr/bin/env python3
"""The TUI's warm start, timed as a user restarting it sees it: `paged-chat` (the default
model, its converted tokenizer and weights already cached) in a tmux pane at 160x50, from
launch until the status line reads `● smollm2-135m · cpu · float32 · N blocks × 16`, then
Ctrl+Q until the process has exited.

Each tree given is run in turn, round by round (A B A B ...), so that the machine's load
hits them alike; per tree it prints every run, the medians of "ready" and "quit", and the
load average before each run. Every tree runs as the user runs it, the console script
`paged-chat` of one venv (--venv), under its own PYTHONPATH, with the user's cache dir (the
warm caches) and, per tree, an empty config and a throwaway chat store that its runs share
(a restart finds the session the last run left).

    python -m benchmarks.warm_start_probe /work/main /work/wt/warmstart2 [--rounds 3] [--venv V]

Untimed runs per tree come first (--warmup, default 1): a first-ever start converts the
model's tokenizer and weights into the cache, and any start warms the page cache.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

READY = re.compile(r"● smollm2-135m · cpu · float32 · [\d,]+ blocks × 16")
FAILED = re.compile(r"✖ [^\n]*")
POLL_S = 0.1   # each poll runs a tmux client: faster polling would take CPU from the app
BOUND_S = 180.0   # generous: a busy 2-core machine; nothing here waits a fixed time


def load() -> str:
    """The 1, 5 and 15 minute load averages."""
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def tmux(socket: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["tmux", "-L", socket, *args], capture_output=True, text=True)


def run_once(tree: Path, venv: Path, data_dir: Path, config: Path) -> tuple[float, float, float]:
    """(seconds from launch to the ready line, seconds from Ctrl+Q to the process's exit,
    CPU seconds the app and its engine child used in all, as bash's `time` counts them)."""
    socket = f"warm-start-probe-{os.getpid()}"
    env = {"PYTHONPATH": str(tree), "HF_HUB_OFFLINE": "1", "PAGED_CHAT_DATA_DIR": str(data_dir),
           "PAGED_CHAT_CONFIG": str(config), "TERM": "xterm-256color"}
    cpu = data_dir / "cpu-seconds"
    # `time`'s line goes to the file; the app's stderr (Textual draws there) stays the pane's.
    command = (f"cd {tree} && TIMEFORMAT='%U %S' && "
               f"{{ time {venv / 'bin' / 'paged-chat'} 2>&4 ; }} 4>&2 2>{cpu}")
    started = time.monotonic()
    launched = tmux(socket, "new-session", "-d", "-s", "probe", "-x", "160", "-y", "50",
                    *[arg for key, value in env.items() for arg in ("-e", f"{key}={value}")],
                    command)
    assert launched.returncode == 0, launched.stderr
    try:
        while True:
            screen = tmux(socket, "capture-pane", "-p", "-t", "probe").stdout
            if READY.search(screen):
                ready = time.monotonic() - started
                break
            if failed := FAILED.search(screen):
                raise SystemExit(f"{tree}: {failed.group(0)}")
            if time.monotonic() - started > BOUND_S:
                raise SystemExit(f"{tree}: not ready after {BOUND_S:.0f} s:\n{screen}")
            time.sleep(POLL_S)
        tmux(socket, "send-keys", "-t", "probe", "C-q")
        asked = time.monotonic()
        while tmux(socket, "has-session", "-t", "probe").returncode == 0:
            if time.monotonic() - asked > BOUND_S:
                raise SystemExit(f"{tree}: still running {BOUND_S:.0f} s after Ctrl+Q")
            time.sleep(POLL_S)
        user, system = cpu.read_text().split()
        return ready, time.monotonic() - asked, float(user) + float(system)
    finally:
        tmux(socket, "kill-server")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("trees", nargs="+", type=Path, help="source trees to time (A B ...)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1, help="untimed runs per tree first")
    parser.add_argument("--venv", type=Path, default=Path(sys.prefix),
                        help="the venv whose `paged-chat` every tree runs with (this one)")
    args = parser.parse_args()
    trees = [tree.resolve() for tree in args.trees]
    runs: dict[Path, list[tuple[float, float, float, str]]] = {tree: [] for tree in trees}
    with tempfile.TemporaryDirectory(prefix="warm-start-probe-") as scratch:
        homes = {}
        for index, tree in enumerate(trees):
            home = Path(scratch) / str(index)
            (home / "data").mkdir(parents=True)
            (home / "config.toml").write_text("")
            homes[tree] = (home / "data", home / "config.toml")
        for _ in range(args.warmup):
            for tree in trees:
                run_once(tree, args.venv, *homes[tree])
        for round_ in range(args.rounds):
            for tree in trees:
                before = load()
                ready, quit_, cpu = run_once(tree, args.venv, *homes[tree])
                runs[tree].append((ready, quit_, cpu, before))
                print(f"round {round_ + 1} {tree}: ready {ready:.2f} s, quit {quit_:.2f} s, "
                      f"cpu {cpu:.2f} s, load before {before}", flush=True)
    for tree, measured in runs.items():
        ready, quit_, cpu, loads = zip(*measured)
        print(f"{tree}: median ready {statistics.median(ready):.2f} s, median quit "
              f"{statistics.median(quit_):.2f} s, median cpu {statistics.median(cpu):.2f} s over "
              f"{len(measured)} runs (loads before: {', '.join(loads)})")
    print("uptime:", subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip())


if __name__ == "__main__":
    main()
