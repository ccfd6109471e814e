#!/usr/bin/env python3
"""`paged-chat --demo 8` in tmux at 160x50, read as issue 32 read it: the engine panel's
`gen` tokens/s, READINGS readouts EVERY_S apart once the demo has run WARM_S, their median
against the engine alone on the same 8 demo chats (`bench.tui.run_engine_alone`: their
first turns, greedy, 96 tokens each, as `python -m paged_chat.bench.tui_terminal` runs it).

The demo is not that workload: its tabs sample (the model's temperature and top-p), stop at
EOS, carry each chat on for three turns (longer contexts) and pause 0.3-2 s between turns,
so its batch is often under 8. So each tree also runs the demo without its UI: the same
autopilots, sampling and engine process as the app's, their turns through the engine client
(`headless_demo` below), read off `stats()` at the same times. The app against that is what
the UI costs the demo.

Each tree given runs in turn, round by round (A B A B ...), as the user runs it: the
console script `paged-chat` of one venv, under the tree's PYTHONPATH, with the user's cache
dir (warm), an empty config (or --config) and a throwaway data dir. The engine alone runs in
a process of its own under the same tree, after each demo.

    python scripts/demo_panel_probe.py /tmp/base /work/main [--rounds 2] [--config F]
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

READY = re.compile(r"● \S+ · cpu · (\w+) · [\d,]+ blocks")
GEN = re.compile(r"gen ([\d,]+)")
BATCH = re.compile(r"batch\s+(\d+) seqs")
WARM_S = 15.0
READINGS = 5
EVERY_S = 4.0
BOUND_S = 180.0
ALONE = ("import json; from paged_chat.bench.own_thread import on_own_thread; "
         "from paged_chat.bench.tui import TuiBenchOptions, demo_chats, engine_config, "
         "run_engine_alone, warmed_up; from paged_chat.engine import Engine, SamplingParams; "
         "options = TuiBenchOptions(dtype={dtype!r}); "
         "engine = on_own_thread(lambda: warmed_up(Engine(engine_config(options)))); "
         "params = SamplingParams(temperature=0, max_tokens=options.max_tokens, ignore_eos=True); "
         "print(json.dumps(on_own_thread(lambda: run_engine_alone(engine, demo_chats(8, 0), params))))")


HEADLESS_DEMO = """
import asyncio, json, sys, time
from paged_chat.conversation import Conversation
from paged_chat.settings import Settings
from paged_chat.tui.demo import demo_tabs
from paged_chat.tui.start import app_engine_config, start_engine
from paged_chat.tui.tabs import DEMO_SAMPLING

async def chat(client, system, autopilot, params):
    info = client.info
    conversation = Conversation(info.tokenizer, info.chat_template, system)
    prompt = autopilot.first_prompt()
    while True:
        ids = conversation.next_prompt_ids(prompt)
        reply, text = [], ""
        async for out in client.stream(ids, params):
            reply += out.new_token_ids
            text += out.new_text
        conversation.add_reply(ids, reply, text)
        autopilot.turns += 1
        await asyncio.sleep(autopilot.pause_s())
        if autopilot.turns >= autopilot.turns_per_chat:
            autopilot.turns = 0
            conversation = Conversation(info.tokenizer, info.chat_template, system)
        prompt = autopilot.next_prompt()

async def main(warm_s, readings, every_s):
    settings = Settings()
    client = start_engine(app_engine_config(settings, 8)).result()
    params = settings.sampling_params(settings.model_sampling(client.info.generation_defaults),
                                      **DEMO_SAMPLING)
    tasks = [asyncio.create_task(chat(client, system, autopilot, params))
             for _, system, autopilot in demo_tabs(8, seed=int(time.time()))]
    await asyncio.sleep(warm_s)
    gens = []
    for _ in range(int(readings)):
        gens.append(round(client.stats().generation_tokens_per_s))
        await asyncio.sleep(every_s)
    for task in tasks:
        task.cancel()
    client.shutdown()
    print(json.dumps(gens))

if __name__ == "__main__":
    asyncio.run(main(*map(float, sys.argv[1:4])))
"""


def tmux(socket: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["tmux", "-L", socket, *args], capture_output=True, text=True)


def demo_readouts(tree: Path, venv: Path, data_dir: Path, config: Path) -> tuple[str, list[int], list[int]]:
    """(the dtype the status line names, `gen` readouts, `batch` readouts) of one demo run."""
    socket = f"demo-panel-probe-{os.getpid()}"
    env = {"PYTHONPATH": str(tree), "HF_HUB_OFFLINE": "1", "PAGED_CHAT_DATA_DIR": str(data_dir),
           "PAGED_CHAT_CONFIG": str(config), "TERM": "xterm-256color"}
    launched = tmux(socket, "new-session", "-d", "-s", "probe", "-x", "160", "-y", "50",
                    *[arg for key, value in env.items() for arg in ("-e", f"{key}={value}")],
                    f"cd {tree} && {venv / 'bin' / 'paged-chat'} --demo 8")
    assert launched.returncode == 0, launched.stderr
    started = time.monotonic()
    try:
        while not (ready := READY.search(screen := tmux(socket, "capture-pane", "-p").stdout)):
            if time.monotonic() - started > BOUND_S:
                raise SystemExit(f"{tree}: not ready after {BOUND_S:.0f} s:\n{screen}")
            time.sleep(0.5)
        time.sleep(WARM_S)
        gens, batches = [], []
        for _ in range(READINGS):
            screen = tmux(socket, "capture-pane", "-p").stdout
            gens.append(int(GEN.search(screen).group(1).replace(",", "")))
            batches.append(int(BATCH.search(screen).group(1)))
            time.sleep(EVERY_S)
        return ready.group(1), gens, batches
    finally:
        tmux(socket, "send-keys", "C-q")
        time.sleep(2)
        tmux(socket, "kill-server")


def headless_demo(tree: Path, venv: Path, scratch: Path) -> list[int]:
    """`gen` readouts of the demo's chats driven without the UI (HEADLESS_DEMO)."""
    script = scratch / "headless_demo.py"
    script.write_text(HEADLESS_DEMO)
    out = python_in(tree, venv, str(script), str(WARM_S), str(READINGS), str(EVERY_S))
    return [int(gen) for gen in re.findall(r"\d+", out.strip().splitlines()[-1])]


def engine_alone(tree: Path, venv: Path, dtype: str) -> float:
    out = python_in(tree, venv, "-c", ALONE.format(dtype=dtype))
    return float(re.search(r'"output_tokens_per_s": ([\d.]+)', out).group(1))


def python_in(tree: Path, venv: Path, *args: str) -> str:
    """The stdout of the venv's python running `args` on `tree`'s code."""
    return subprocess.run([str(venv / "bin" / "python"), *args], cwd=tree, capture_output=True,
                          text=True, check=True,
                          env=os.environ | {"PYTHONPATH": str(tree), "HF_HUB_OFFLINE": "1"}).stdout


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("trees", nargs="+", type=Path, help="source trees (A B ...)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--config", type=Path, help="a config.toml for every tree (default: empty)")
    parser.add_argument("--venv", type=Path, default=Path(sys.prefix))
    args = parser.parse_args()
    trees = [tree.resolve() for tree in args.trees]
    with tempfile.TemporaryDirectory(prefix="demo-panel-probe-") as scratch:
        config = args.config or Path(scratch) / "config.toml"
        config.touch()
        for round_ in range(args.rounds):
            for index, tree in enumerate(trees):
                data = Path(scratch) / f"{round_}-{index}"
                data.mkdir()
                load = " ".join(Path("/proc/loadavg").read_text().split()[:3])
                dtype, gens, batches = demo_readouts(tree, args.venv, data, config)
                alone = engine_alone(tree, args.venv, dtype)
                headless = headless_demo(tree, args.venv, Path(scratch))
                gen, without_ui = statistics.median(gens), statistics.median(headless)
                print(f"round {round_ + 1} {tree} ({dtype}): panel gen {gens} (median {gen:.0f}), "
                      f"batch {batches}; engine alone {alone:.1f} tok/s: {100 * gen / alone:.0f}%; "
                      f"the demo without its UI {headless} (median {without_ui:.0f}): "
                      f"{100 * gen / without_ui:.0f}% (load before {load})", flush=True)


if __name__ == "__main__":
    main()
