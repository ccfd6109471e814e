#!/usr/bin/env python3
"""`paged-chat --demo 8` in tmux at 160x50, read as issue 32 read it: the engine panel's
`gen` tokens/s, READINGS readouts (or --readings) EVERY_S apart once the demo has run
WARM_S, their median against the engine alone on the same 8 demo chats
(`benchmarks.tui_headless.run_engine_alone`: their first turns, greedy, 96 tokens each, as
`python -m benchmarks.tui_terminal` runs it).

The demo is not that workload: its tabs sample (the model's temperature and top-p), stop at
EOS, carry each chat on for three turns (longer contexts) and pause 0.3-2 s between turns,
so its batch is often under 8. So each tree also runs the demo without its UI: the same
autopilots, sampling and engine process as the app's, their turns through the engine client
(`headless_demo` below), read off `stats()` at the same times. The app against that is what
the UI costs the demo.

A readout is the panel's tokens/s of the last moment, which swings as tabs pause and
start. So each run also gives its average over the readouts' whole
window, from the engine's count of generated tokens: the app's off its `/metrics` (the demo
runs with `--serve` for it: an idle API server on the app's engine), the headless demo's
off `stats()`.

What the batch does to tokens/s, it does not do to a step's time: a decode step reads the
weights once for all its sequences, so it takes about as long for 5 as for 8. So each run
also reads the last step's milliseconds at each readout, off the panel (`step N ms`) and
off the headless demo's `stats()`, and compares their medians: the UI's cost without the
batch's noise (a readout that falls on a prompt's chunk reads long; the median passes over it).

The demo draws its tabs' prompts and pauses from the clock, so no two runs carry the same
work; `--seed N` gives the app's demo (through a `sitecustomize` on its PYTHONPATH) and the
headless demo that seed instead, in every tree and round. Their replies still differ (they
sample), but not their prompts.

Each tree given runs in turn, round by round (A B A B ...), as the user runs it: the
console script `paged-chat` of one venv, under the tree's PYTHONPATH, with the user's cache
dir (warm), an empty config (or --config) and a throwaway data dir. The engine alone runs in
a process of its own under the same tree, after each demo.

    python -m benchmarks.demo_panel_probe /tmp/base /work/main [--rounds 2] [--readings 5]
        [--seed N] [--config F]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

READY = re.compile(r"● \S+ · cpu · (\w+) · [\d,]+ blocks")
GEN = re.compile(r"gen ([\d,]+)")
BATCH = re.compile(r"batch\s+(\d+) seqs")
STEP = re.compile(r"step ([\d,]+) ms")
GENERATED = re.compile(r"^vllm:generation_tokens_total\{[^}]*\} ([\d.e+]+)$", re.MULTILINE)
WARM_S = 15.0
READINGS = 5
EVERY_S = 4.0
BOUND_S = 180.0
ALONE = ("import json; from paged_chat.bench.own_thread import on_own_thread; "
         "from benchmarks.tui_headless import TuiBenchOptions, demo_chats, engine_config, "
         "run_engine_alone, warmed_up; from paged_chat.engine import Engine, SamplingParams; "
         "options = TuiBenchOptions(dtype={dtype!r}); "
         "engine = on_own_thread(lambda: warmed_up(Engine(engine_config(options)))); "
         "params = SamplingParams(temperature=0, max_tokens=options.max_tokens, ignore_eos=True); "
         "print(json.dumps(on_own_thread(lambda: run_engine_alone(engine, demo_chats(8, 0), params))))")


HEADLESS_DEMO = """
import asyncio, json, sys, time
from paged_chat.app.conversation import Conversation
from paged_chat.app.settings import Settings
from paged_chat.tui.demo import demo_tabs
from paged_chat.tui.engine_start import app_engine_config, start_engine
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

async def main(warm_s, readings, every_s, seed):
    settings = Settings()
    client = start_engine(app_engine_config(settings, 8)).result()
    params = settings.sampling_params(settings.model_sampling(client.info.generation_defaults),
                                      **DEMO_SAMPLING)
    tasks = [asyncio.create_task(chat(client, system, autopilot, params))
             for _, system, autopilot in demo_tabs(8, seed=seed)]
    await asyncio.sleep(warm_s)
    gens, steps, started, generated = [], [], time.monotonic(), client.stats().generation_tokens_total
    for _ in range(int(readings)):
        stats = client.stats()
        gens.append(round(stats.generation_tokens_per_s))
        steps.append(round(stats.step_time_s * 1000))
        await asyncio.sleep(every_s)
    average = (client.stats().generation_tokens_total - generated) / (time.monotonic() - started)
    for task in tasks:
        task.cancel()
    client.shutdown()
    print(json.dumps([gens, steps, average]))

if __name__ == "__main__":
    seed = int(sys.argv[4]) if len(sys.argv) > 4 else int(time.time())
    asyncio.run(main(*map(float, sys.argv[1:4]), seed))
"""

SEEDED = """
import os, sys
if "--demo" in sys.argv:
    import paged_chat.tui.demo as demo
    drawn = demo.demo_tabs
    demo.demo_tabs = lambda count, seed=0: drawn(count, int(os.environ["DEMO_PANEL_SEED"]))
"""


def tmux(socket: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["tmux", "-L", socket, *args], capture_output=True, text=True)


def demo_readouts(tree: Path, venv: Path, data_dir: Path, config: Path, readings: int,
                  seed: int | None) -> tuple[str, list[int], list[int], list[int], float]:
    """(the dtype the status line names, `gen` readouts, `batch` readouts, `step` ms
    readouts, tokens/s over their window) of one demo run."""
    tmux_socket = f"demo-panel-probe-{os.getpid()}"
    port = free_port()
    env = {"PYTHONPATH": str(tree), "HF_HUB_OFFLINE": "1", "PAGED_CHAT_DATA_DIR": str(data_dir),
           "PAGED_CHAT_CONFIG": str(config), "TERM": "xterm-256color"}
    if seed is not None:
        hook = data_dir / "seeded"
        hook.mkdir()
        (hook / "sitecustomize.py").write_text(SEEDED)
        env |= {"PYTHONPATH": f"{tree}:{hook}", "DEMO_PANEL_SEED": str(seed)}
    launched = tmux(tmux_socket, "new-session", "-d", "-s", "probe", "-x", "160", "-y", "50",
                    *[arg for key, value in env.items() for arg in ("-e", f"{key}={value}")],
                    f"cd {tree} && {venv / 'bin' / 'paged-chat'} --demo 8 --serve {port}")
    assert launched.returncode == 0, launched.stderr
    started = time.monotonic()
    try:
        while not (ready := READY.search(screen := tmux(tmux_socket, "capture-pane", "-p").stdout)):
            if time.monotonic() - started > BOUND_S:
                raise SystemExit(f"{tree}: not ready after {BOUND_S:.0f} s:\n{screen}")
            time.sleep(0.5)
        time.sleep(WARM_S)
        gens, batches, steps, started, generated = [], [], [], time.monotonic(), generated_tokens(port)
        for _ in range(readings):
            screen = tmux(tmux_socket, "capture-pane", "-p").stdout
            gens.append(int(GEN.search(screen).group(1).replace(",", "")))
            batches.append(int(BATCH.search(screen).group(1)))
            steps.append(int(STEP.search(screen).group(1).replace(",", "")))
            time.sleep(EVERY_S)
        average = (generated_tokens(port) - generated) / (time.monotonic() - started)
        return ready.group(1), gens, batches, steps, average
    finally:
        tmux(tmux_socket, "send-keys", "C-q")
        time.sleep(2)
        tmux(tmux_socket, "kill-server")


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def generated_tokens(port: int) -> float:
    """The app's engine's count of generated tokens, off its API server's /metrics."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as response:
        return float(GENERATED.search(response.read().decode()).group(1))


def headless_demo(tree: Path, venv: Path, scratch: Path, readings: int, seed: int | None
                  ) -> tuple[list[int], list[int], float]:
    """(`gen` readouts, step ms readouts, tokens/s over their window) of the demo's chats
    driven without the UI (HEADLESS_DEMO)."""
    script = scratch / "headless_demo.py"
    script.write_text(HEADLESS_DEMO)
    out = python_in(tree, venv, str(script), str(WARM_S), str(readings), str(EVERY_S),
                    *([] if seed is None else [str(seed)]))
    gens, steps, average = json.loads(out.strip().splitlines()[-1])
    return gens, steps, average


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
    parser.add_argument("--readings", type=int, default=READINGS,
                        help=f"readouts a run, {EVERY_S:.0f} s apart (default {READINGS}, as the issue read it)")
    parser.add_argument("--seed", type=int, help="one seed for every demo (default: the clock's)")
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
                dtype, gens, batches, steps, average = demo_readouts(tree, args.venv, data, config,
                                                                     args.readings, args.seed)
                alone = engine_alone(tree, args.venv, dtype)
                headless, headless_steps, headless_average = headless_demo(
                    tree, args.venv, Path(scratch), args.readings, args.seed)
                gen, without_ui = statistics.median(gens), statistics.median(headless)
                step, step_without_ui = statistics.median(steps), statistics.median(headless_steps)
                print(f"round {round_ + 1} {tree} ({dtype}): panel gen {gens} (median {gen:.0f}), "
                      f"batch {batches}; engine alone {alone:.1f} tok/s: {100 * gen / alone:.0f}%; "
                      f"the demo without its UI {headless} (median {without_ui:.0f}): "
                      f"{100 * gen / without_ui:.0f}%; over the window {average:.0f} against "
                      f"{headless_average:.0f} without the UI: {100 * average / headless_average:.0f}%; "
                      f"step ms {steps} (median {step:.0f}) against {headless_steps} (median "
                      f"{step_without_ui:.0f}) without the UI: {100 * step_without_ui / step:.0f}% "
                      f"(load before {load})", flush=True)


if __name__ == "__main__":
    main()
