"""The TUI headless: what watching the engine costs it.

The same chats (the demo's tabs: their system prompts and first prompts, greedy, EOS
ignored so every run produces the same tokens) run through the engine alone
(`Engine.generate`) and through the real app run headless (Textual's `run_test`) with one tab
streaming each chat: the app as it ships, its engine in a process of its own (the process
transport), and the app with its engine on a thread of its own process (the thread
transport over the same engine the alone runs use, `[tui] engine_process = false`). Each
runs ROUNDS times, alternating, so a change in the machine's load between runs hits all three; the best run of
each is compared. Then the app as it ships runs twice more: while a key is typed into the
shown tab's prompt every TYPE_EVERY_S (keypress-to-echo times), and under cProfile.
cProfile watches only the thread that enables it, here the app's event loop (the UI
thread), so its figures are where the UI's time goes; they are divided by the profiled
run's streaming time (seconds of UI work per second of streaming). The prefix
cache is reset before each run so none of them starts warm. The engine is built, and runs
alone, on threads that end afterwards (`on_own_thread`), as the app builds it on its engine
thread: a main thread that had run torch ops would keep an OpenMP pool that slows the app's
engine thread, and the comparison would measure that instead.

From the repository root (`-h` for the options):

    python -m benchmarks.tui_headless --tabs 8 [--model smollm2-135m] [--max-tokens 96] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import cProfile
import json
import math
import pstats
import re
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from textual import events

from paged_chat.app.chat_store import ChatStore
from paged_chat.app.conversation import Conversation
from paged_chat.app.settings import ChatSettings, Settings
from paged_chat.bench.own_thread import on_own_thread
from paged_chat.engine import (
    ClientSpec,
    Engine,
    EngineClient,
    EngineConfig,
    SamplingParams,
    make_client,
)
from paged_chat.tui.app import PagedChatApp
from paged_chat.tui.engine_start import start_engine

PROFILE_TOP = 12        # functions listed by own time
ROUNDS = 2              # runs of the engine alone and of each app variant, alternating
TYPE_EVERY_S = 0.1      # a fast typist's pace, for the keypress-to-echo samples
ECHO_TIMEOUT_S = 5.0    # an echo slower than this counts as this
AREAS = {               # where a profiled function's file lies -> what it is part of
    "markdown": ("textual/widgets/_markdown", "markdown_it", "paged_chat/tui/message_widgets"),
    "engine panel": ("paged_chat/tui/engine_panel", "paged_chat/tui/block_map",
                     "paged_chat/tui/sparkline", "paged_chat/engine/stats"),
    "engine hand-off": ("paged_chat/session", "paged_chat/engine/clients",
                        "paged_chat/engine/output_processor", "paged_chat/engine/detokenizer",
                        "paged_chat/store", "sqlite3"),
    "layout and paint": ("textual/_compositor", "textual/_arrange", "textual/_layout",
                         "textual/layouts", "textual/strip", "textual/_styles_cache",
                         "textual/css", "textual/widget", "rich/"),
    "event loop": ("asyncio/", "textual/message_pump", "textual/_context", "selectors"),
}


@dataclass(slots=True)
class TuiBenchOptions:
    model: str = "smollm2-135m"
    tabs: int = 8
    max_tokens: int = 96
    dtype: str = "auto"
    threads: int | None = None          # torch threads of the engine, alone and in the app
                                        # (None: each adapts them itself, as it ships)
    seed: int = 0
    size: tuple[int, int] = (160, 50)   # the headless terminal, columns x rows


def demo_chats(count: int, seed: int) -> list[tuple[str | None, str]]:
    """(system prompt, first prompt) of each of `count` demo tabs."""
    from paged_chat.tui.demo import demo_tabs

    return [(system, autopilot.first_prompt()) for _, system, autopilot in demo_tabs(count, seed)]


def run_engine_alone(engine: Engine, chats: list[tuple[str | None, str]],
                     params: SamplingParams) -> dict:
    info = engine.info
    prompts = [Conversation(info.tokenizer, info.chat_template, system).next_prompt_ids(prompt)
               for system, prompt in chats]
    engine.reset_prefix_cache()
    started = time.perf_counter()
    outputs = engine.generate(prompts, params)
    wall = time.perf_counter() - started
    tokens = sum(len(output.token_ids) for output in outputs)
    return {"output_tokens": tokens, "wall_s": wall, "output_tokens_per_s": tokens / wall}


class BenchApp(PagedChatApp):
    """The app as it ships, every turn sampled with the bench's parameters; `script`, if
    given, runs as a worker once the app is ready (a run in a real terminal drives itself)."""

    def __init__(self, params: SamplingParams,
                 script: Callable[[BenchApp], Awaitable[None]] | None = None, **options) -> None:
        super().__init__(**options)
        self.params = params
        self.script = script

    def sampling_params(self, sampling: dict) -> SamplingParams:
        return self.params

    def on_ready(self) -> None:
        if self.script is not None:
            self.run_worker(self.script(self), exit_on_error=False)


def bench_app(params: SamplingParams, engine: EngineClient | None = None,
              engine_config: EngineConfig | None = None,
              script: Callable[[BenchApp], Awaitable[None]] | None = None) -> BenchApp:
    """The app on `engine` (or one it starts from `engine_config`, as it ships), with a
    throwaway chat store and no restored tabs."""
    folder = Path(tempfile.mkdtemp(prefix="paged-chat-bench-tui-"))
    return BenchApp(params, script, settings=Settings(chat=ChatSettings()), engine=engine,
                    engine_config=engine_config, store=ChatStore(folder / "chats.db"),
                    session_path=folder / "tabs.json", restore=False)


async def measure(app: BenchApp, chats: list[tuple[str | None, str]],
                  profile: cProfile.Profile | None = None, typing: bool = False) -> dict:
    """One turn per tab in the running app (headless or in a terminal); the tabs send at
    once and the clock stops when the last reply is complete. With `typing`, keys go to the
    shown tab's prompt while the tabs stream (keypress-to-echo times in the result)."""
    client = await app.wait_for_engine()
    client.reset_prefix_cache()
    tabs = []
    for index, (system, _) in enumerate(chats):
        chat = app.store.create_chat(f"Demo {index + 1}", client.info.name, system, {})
        tabs.append(await app.tabs.open_chat_tab(chat, activate=index == 0, loaded=True))
    if profile is not None:
        profile.enable()
    started, ui_started = time.perf_counter(), time.thread_time()
    for tab, (_, prompt) in zip(tabs, chats):
        tab.send(prompt)
    echoes = await type_while_streaming(app, tabs) if typing else []
    while any(tab.streaming for tab in tabs):
        await asyncio.sleep(0.02)
    wall, ui_cpu = time.perf_counter() - started, time.thread_time() - ui_started
    if profile is not None:
        profile.disable()
    tokens = sum(len(tab.session.turn.token_ids) for tab in tabs)
    result = {"engine": client.capabilities.where, "output_tokens": tokens, "wall_s": wall,
              "output_tokens_per_s": tokens / wall, "ui_cpu_per_s": ui_cpu / wall}
    if echoes:
        echoes.sort()
        # nearest-rank p95: never below the median, however few the samples
        result |= {"keypress_echo_samples": len(echoes),
                   "keypress_echo_median_ms": 1e3 * statistics.median(echoes),
                   "keypress_echo_p95_ms": 1e3 * echoes[math.ceil(0.95 * len(echoes)) - 1]}
    return result


def run_app(client: EngineClient, chats: list[tuple[str | None, str]], params: SamplingParams,
            size: tuple[int, int], profile: cProfile.Profile | None = None,
            typing: bool = False) -> dict:
    """`measure` in the real app run headless (Textual's `run_test`) on `client`."""
    app = bench_app(params, engine=client)

    async def drive() -> dict:
        async with app.run_test(size=size):
            return await measure(app, chats, profile, typing)

    try:
        return asyncio.run(drive())
    finally:
        app.store.close()


async def type_while_streaming(app, tabs: list) -> list[float]:
    """Seconds from a key event reaching the app to its character being in the shown tab's
    prompt, one key every TYPE_EVERY_S while at least half the tabs stream."""
    prompt = app.active_tab.prompt
    prompt.focus()
    echoes = []
    while sum(tab.streaming for tab in tabs) * 2 >= len(tabs):
        before, started = prompt.text, time.perf_counter()
        app.post_message(events.Key("x", "x"))
        while prompt.text == before and time.perf_counter() - started < ECHO_TIMEOUT_S:
            await asyncio.sleep(0.001)
        echoes.append(time.perf_counter() - started)
        await asyncio.sleep(TYPE_EVERY_S)
    return echoes


def profile_summary(profile: cProfile.Profile, streaming_s: float) -> dict:
    """The UI thread's time per second of streaming: by area, and the top functions."""
    stats = pstats.Stats(profile)
    areas = dict.fromkeys([*AREAS, "other"], 0.0)
    idle, rows = 0.0, []
    for (path, line, name), (_, _, own, cumulative, _) in stats.stats.items():
        if name.endswith("of 'select.epoll' objects>") or name.endswith("of 'select.select' objects>"):
            idle += own  # the event loop waiting for something to do
            continue
        where = path.replace("\\", "/")
        area = next((area for area, parts in AREAS.items() if any(p in where for p in parts)),
                    "other")
        areas[area] += own
        rows.append((own, cumulative, f"{_short(where)}:{line}({name})"))
    rows.sort(reverse=True)
    return {"ui_busy_per_s": sum(areas.values()) / streaming_s, "ui_idle_per_s": idle / streaming_s,
            "areas_per_s": {area: own / streaming_s for area, own in areas.items()},
            "top": [{"function": where, "own_per_s": own / streaming_s,
                     "cumulative_per_s": cumulative / streaming_s}
                    for own, cumulative, where in rows[:PROFILE_TOP]]}


def _short(path: str) -> str:
    """A profiled file's path from its package on."""
    return re.sub(r"^.*/(?:site-packages/|python3\.\d+/|(?=paged_chat/))", "", path)


def warmed_up(engine: Engine) -> Engine:
    engine.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=2))
    return engine


def engine_config(options: TuiBenchOptions) -> EngineConfig:
    """The engine the alone runs and the app's engine are built from."""
    return EngineConfig(model=options.model, device="cpu", dtype=options.dtype,
                        max_num_seqs=max(options.tabs, 1), threads=options.threads)


def run_tui_bench(options: TuiBenchOptions, log: Callable[[str], None] = print) -> dict:
    # By default the engine alone and the app's engine each adapt their thread count, as they
    # ship: the policy must hold up beside the UI (issue 18). A fixed count compares the two at
    # equal threads instead.
    config = engine_config(options)
    engine = on_own_thread(lambda: warmed_up(Engine(config)))
    chats = demo_chats(options.tabs, options.seed)
    params = SamplingParams(temperature=0, max_tokens=options.max_tokens, ignore_eos=True)
    log("tui: starting the engine process ...")
    with contextlib.ExitStack() as clients:
        process = start_engine(config).result()
        clients.callback(process.shutdown)
        asyncio.run(warm_up(process))
        on_thread = make_client(ClientSpec("thread", engine=engine))
        clients.callback(on_thread.shutdown)
        rounds: dict[str, list[dict]] = {"engine_alone": [], "app": [], "app_engine_on_a_thread": []}
        for round_ in range(1, ROUNDS + 1):
            log(f"tui: {options.tabs} tabs x {options.max_tokens} tokens, engine alone ({round_}/{ROUNDS}) ...")
            rounds["engine_alone"].append(on_own_thread(lambda: run_engine_alone(engine, chats, params)))
            log(f"tui: the app, headless ({round_}/{ROUNDS}) ...")
            rounds["app"].append(run_app(process, chats, params, options.size))
            log(f"tui: the app with its engine on a thread ({round_}/{ROUNDS}) ...")
            rounds["app_engine_on_a_thread"].append(run_app(on_thread, chats, params, options.size))
        best = {name: max(runs, key=lambda run: run["output_tokens_per_s"])
                for name, runs in rounds.items()}
        log("tui: the app while a key is typed every 0.1 s ...")
        typed = run_app(process, chats, params, options.size, typing=True)
        log("tui: the app under cProfile (its UI thread) ...")
        profile = cProfile.Profile()
        profiled = run_app(process, chats, params, options.size, profile)
    alone = best["engine_alone"]["output_tokens_per_s"]
    return {"options": asdict(options), "engine_alone": best["engine_alone"], "app": best["app"],
            "app_engine_on_a_thread": best["app_engine_on_a_thread"],
            "app_vs_engine": best["app"]["output_tokens_per_s"] / alone,
            "thread_app_vs_engine": best["app_engine_on_a_thread"]["output_tokens_per_s"] / alone,
            "rounds": rounds, "typing_app": typed,
            "profiled_app": profiled, "profile": profile_summary(profile, profiled["wall_s"])}


async def warm_up(client: EngineClient) -> None:
    """One short request, as `warmed_up` does for the engine alone: the first step's one-off
    costs stay out of the timed runs."""
    async for _ in client.stream([1, 2, 3], SamplingParams(temperature=0, max_tokens=2)):
        pass


def format_tui_report(report: dict) -> str:
    alone, app, profile = report["engine_alone"], report["app"], report["profile"]
    typed = report["typing_app"]
    rounds = "; ".join(f"{name.replace('_', ' ')} " + ", ".join(
        f"{run['output_tokens_per_s']:.1f}" for run in runs) for name, runs in report["rounds"].items())
    lines = [f"tui: engine alone {alone['output_tokens_per_s']:.1f} tok/s, app "
             f"{app['output_tokens_per_s']:.1f} tok/s ({100 * report['app_vs_engine']:.0f}% of the "
             f"engine alone; best of {len(report['rounds']['app'])} runs each: {rounds}; "
             f"{report['options']['tabs']} tabs, {alone['output_tokens']} tokens each run; "
             f"torch threads {report['options']['threads'] or 'adaptive'}); UI thread CPU "
             f"{app['ui_cpu_per_s']:.2f} s per s",
             f"tui: the app with its engine on a thread instead of in its own process: "
             f"{report['app_engine_on_a_thread']['output_tokens_per_s']:.1f} tok/s "
             f"({100 * report['thread_app_vs_engine']:.0f}% of the engine alone)",
             f"tui: UI thread busy {profile['ui_busy_per_s']:.2f} s, idle {profile['ui_idle_per_s']:.2f} s "
             f"per s of streaming (profiled run "
             f"{report['profiled_app']['output_tokens_per_s']:.1f} tok/s): " + ", ".join(
                 f"{area} {share:.2f}" for area, share in profile["areas_per_s"].items())]
    if "keypress_echo_median_ms" in typed:
        lines.append(f"tui: keypress to echo while the tabs stream: median "
                     f"{typed['keypress_echo_median_ms']:.1f} ms, p95 {typed['keypress_echo_p95_ms']:.1f} ms "
                     f"({typed['keypress_echo_samples']} keys; the app "
                     f"{typed['output_tokens_per_s']:.1f} tok/s meanwhile)")
    lines += [f"  {row['own_per_s']:.3f} s/s own, {row['cumulative_per_s']:.3f} cum  {row['function']}"
              for row in profile["top"]]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.tui_headless",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--tabs", type=int, default=8, help="streaming tabs (default 8)")
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--max-tokens", type=int, default=96, help="each reply's length")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--threads", type=int, help="torch threads (default: adapt, as it ships)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="write the report here")
    args = parser.parse_args()
    options = TuiBenchOptions(model=args.model, tabs=args.tabs, max_tokens=args.max_tokens,
                              dtype=args.dtype, threads=args.threads, seed=args.seed)
    report = run_tui_bench(options, log=lambda line: print(line, file=sys.stderr))
    print(format_tui_report(report))
    if args.json:
        with open(args.json, "w") as out:
            json.dump(report, out, indent=2)


if __name__ == "__main__":
    main()
