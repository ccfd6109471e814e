#!/usr/bin/env python3
"""What the UI thread's screen updates cost while `paged-chat --demo 8` runs in tmux at 160x50:
updates a second, how many re-laid the screen out, the UI thread's CPU time in them (its
own, not the wall clock's: beside the engine's threads an update's wall time swings 2x),
which widgets were dirty in them (an update's "signature"; `L` marks one with a layout), and
the CPU of the UI thread and of the app's process in all (the engine's process not counted).

Each screen update is a pass over its dirty widgets and escape sequences for the terminal,
on the cores the engine needs; one with a layout re-renders every widget that moved, often
the whole screen. The probe counts them from inside the app: a `sitecustomize` on the app's
PYTHONPATH wraps Textual's `Screen._on_timer_update` (textual 8.2.8), starts counting once
the demo has run WARM_S and writes its counts after WINDOW_S.

What the shown tab streams decides most of the cost (a list or a code block re-lays its
reply out line by line), and the demo draws its tabs' prompts from the clock; so the hook
also gives the demo one seed (--seed) for every tree and round, as demo_panel_probe's does.

    python -m benchmarks.screen_update_probe TREE [TREE ...] [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.demo_panel_probe import SEEDED, tmux

WARM_S = 20.0
WINDOW_S = 30.0
BOUND_S = 180.0

COUNTER = """
import collections, json, os, sys, threading, time

def _cpu_s(stat):  # user + system CPU seconds of the thread or process of a /proc stat file
    with open(stat) as file:
        fields = file.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

def _count(out, warm_s, window_s):
    while "textual.screen" not in sys.modules:
        time.sleep(0.05)
    from textual.screen import Screen
    counts, signatures, started = collections.Counter(), collections.Counter(), [None]
    seconds_of = collections.Counter()
    update = Screen._on_timer_update

    def counted(screen):
        if started[0] is None or not screen.is_current:
            return update(screen)
        layout = screen._layout_required
        names = sorted({type(widget).__name__ for widget in screen._dirty_widgets})
        began = time.thread_time()
        update(screen)
        took = time.thread_time() - began
        signature = ("L " if layout else "") + ",".join(names)
        counts["seconds"] += took
        counts["updates"] += 1
        counts["layouts"] += layout
        signatures[signature] += 1
        seconds_of[signature] += took

    Screen._on_timer_update = counted
    time.sleep(warm_s)
    main_thread = f"/proc/self/task/{os.getpid()}/stat"
    ui_thread, process = _cpu_s(main_thread), _cpu_s("/proc/self/stat")
    started[0] = time.monotonic()
    time.sleep(window_s)
    counts["ui_thread_s"] = _cpu_s(main_thread) - ui_thread
    counts["process_s"] = _cpu_s("/proc/self/stat") - process
    with open(out, "w") as file:
        json.dump({"window_s": time.monotonic() - started[0], "counts": counts,
                   "signatures": [(signature, number, seconds_of[signature])
                                  for signature, number in signatures.most_common(12)]}, file)

if os.environ.get("SCREEN_UPDATE_PROBE") and "--demo" in sys.argv:
    threading.Thread(target=_count, daemon=True, args=(
        os.environ["SCREEN_UPDATE_PROBE"], float(os.environ["SCREEN_UPDATE_WARM_S"]),
        float(os.environ["SCREEN_UPDATE_WINDOW_S"]))).start()
"""


def count_updates(tree: Path, venv: Path, scratch: Path, seed: int) -> dict:
    """The counts of one `--demo 8` run of `tree`."""
    hook = scratch / "hook"
    hook.mkdir(exist_ok=True)
    (hook / "sitecustomize.py").write_text(SEEDED + COUNTER)
    out, data = scratch / "counts.json", Path(tempfile.mkdtemp(dir=scratch))
    out.unlink(missing_ok=True)
    (data / "config.toml").touch()
    env = {"PYTHONPATH": f"{tree}:{hook}", "HF_HUB_OFFLINE": "1", "TERM": "xterm-256color",
           "PAGED_CHAT_DATA_DIR": str(data), "PAGED_CHAT_CONFIG": str(data / "config.toml"),
           "SCREEN_UPDATE_PROBE": str(out), "SCREEN_UPDATE_WARM_S": str(WARM_S),
           "SCREEN_UPDATE_WINDOW_S": str(WINDOW_S), "DEMO_PANEL_SEED": str(seed)}
    socket = f"screen-update-probe-{os.getpid()}"
    launched = tmux(socket, "new-session", "-d", "-s", "probe", "-x", "160", "-y", "50",
                    *[arg for key, value in env.items() for arg in ("-e", f"{key}={value}")],
                    f"cd {tree} && {venv / 'bin' / 'paged-chat'} --demo 8")
    assert launched.returncode == 0, launched.stderr
    started = time.monotonic()
    try:
        while not out.exists():
            if time.monotonic() - started > BOUND_S + WARM_S + WINDOW_S:
                raise SystemExit(f"{tree}: no counts after {time.monotonic() - started:.0f} s")
            time.sleep(1)
        time.sleep(0.5)   # written whole
        return json.loads(out.read_text())
    finally:
        tmux(socket, "send-keys", "C-q")
        time.sleep(2)
        tmux(socket, "kill-server")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("trees", nargs="+", type=Path, help="source trees (A B ...)")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0, help="the demo's seed")
    parser.add_argument("--venv", type=Path, default=Path(sys.prefix))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="screen-update-probe-") as scratch:
        for round_ in range(args.rounds):
            for tree in (tree.resolve() for tree in args.trees):
                found = count_updates(tree, args.venv, Path(scratch), args.seed)
                counts, window = found["counts"], found["window_s"]
                print(f"round {round_ + 1} {tree}: {counts['updates'] / window:.1f} screen updates "
                      f"a second, {counts['layouts'] / window:.1f} with a layout; the UI thread's "
                      f"CPU in them {counts['seconds'] / window:.3f} s a second, in all "
                      f"{counts['ui_thread_s'] / window:.3f}; the app's process "
                      f"{counts['process_s'] / window:.3f}", flush=True)
                for signature, number, seconds in found["signatures"]:
                    print(f"  {number / window:5.1f}/s {1000 * seconds / number:5.1f} ms  {signature}")


if __name__ == "__main__":
    main()
