"""The TUI scenario in a real terminal: what drawing the app costs the engine.

`python -m benchmarks.tui_headless` runs the app headless, where Textual never turns a frame into escape
sequences and nothing reads them. Here the app as it ships (`paged-chat`, its engine in a
process of its own) runs in a child process whose terminal is real:

- `pty`: a pseudo-terminal of TERMINAL_SIZE whose output this process reads and drops
  (a terminal that costs nothing to draw);
- `tmux`: a tmux pane of that size, with a client attached through a pseudo-terminal this
  process drains (as someone watching it): tmux parses every byte the app writes and
  redraws what changed for its client, on the same cores as the engine.

The child streams the bench's chats (`tui_headless.measure`: one turn per tab, the tabs send
at once) and writes its figures to a JSON file: tokens/s, the UI thread's and the whole
app process's CPU (the engine's process not counted), and what its driver wrote to the
terminal (bytes and writes). The engine alone runs the same chats in this process
(`tui_headless.run_engine_alone`), alternating with the app, ROUNDS times each; the best of
each is compared. tmux's CPU (server and client) is read from /proc over the child's
streaming window.

From the repository root: `python -m benchmarks.tui_terminal --terminal headless,pty,tmux` (`-h` for the rest).
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import pty
import shlex
import shutil
import struct
import subprocess
import sys
import tempfile
import termios
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from benchmarks.tui_headless import (
    BenchApp,
    TuiBenchOptions,
    bench_app,
    demo_chats,
    engine_config,
    measure,
    run_engine_alone,
    warm_up,
    warmed_up,
)
from paged_chat.bench.own_thread import on_own_thread
from paged_chat.engine import Engine, SamplingParams

TERMINALS = ("headless", "pty", "tmux")
ROUNDS = 3                 # runs of the engine alone and of the app, alternating
CHILD_TIMEOUT_S = 600.0    # a child that has not reported by then has hung
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


@dataclass(slots=True)
class CountedWrites:
    """What the app's driver wrote to its terminal: characters (escape sequences included)
    and write calls (a frame is one or a few)."""

    chars: int = 0
    writes: int = 0


def _counting_driver(counts: CountedWrites):
    """Textual's driver for this platform, counting what it writes into `counts`."""
    from textual.drivers.linux_driver import LinuxDriver

    class CountingDriver(LinuxDriver):
        def write(self, data: str) -> None:
            counts.chars += len(data)
            counts.writes += 1
            super().write(data)

    return CountingDriver


def run_child(options: TuiBenchOptions, result_path: Path, headless: bool = False) -> None:
    """In the terminal's child process: the app as it ships (it starts its engine process),
    one warm-up turn, then `measure`; its figures go to `result_path` and the app exits.
    `headless`: Textual's headless driver instead (no frame is written anywhere)."""
    counts = CountedWrites()
    chats = demo_chats(options.tabs, options.seed)
    report: dict = {}

    async def bench(app: BenchApp) -> None:
        try:
            await warm_up(await app.wait_for_engine())
            written, process_cpu = asdict(counts), time.process_time()
            started = time.monotonic()
            result = await measure(app, chats)
            report.update(result, started_monotonic=started, ended_monotonic=time.monotonic(),
                          app_cpu_per_s=(time.process_time() - process_cpu) / result["wall_s"],
                          terminal_chars_per_s=(counts.chars - written["chars"]) / result["wall_s"],
                          terminal_writes_per_s=(counts.writes - written["writes"]) / result["wall_s"])
        except Exception as error:   # reported by the parent, which cannot see this terminal
            report["error"] = f"{type(error).__name__}: {error}"
        app.exit()

    params = SamplingParams(temperature=0, max_tokens=options.max_tokens, ignore_eos=True)
    app = bench_app(params, engine_config=engine_config(options), script=bench)
    app.driver_class = _counting_driver(counts)
    try:
        app.run(headless=headless)
    finally:
        app.store.close()
        result_path.write_text(json.dumps(report))


def _child_command(options: TuiBenchOptions, result_path: Path, headless: bool = False) -> list[str]:
    return [sys.executable, "-m", "benchmarks.tui_terminal", "--child", str(result_path),
            "--options", json.dumps(asdict(options)), *(["--headless"] if headless else [])]


def _child_env() -> dict[str, str]:
    # Without COLUMNS/LINES: Textual would take them over the terminal's size.
    env = {key: value for key, value in os.environ.items() if key not in ("COLUMNS", "LINES")}
    return env | {"TERM": "xterm-256color"}


def _open_pty(size: tuple[int, int]) -> tuple[int, int]:
    master, slave = pty.openpty()
    columns, rows = size
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", rows, columns, 0, 0))
    return master, slave


class Drain:
    """Reads a pty's master end on a thread until it closes, counting the bytes."""

    def __init__(self, master: int) -> None:
        self.master = master
        self.bytes = 0
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            try:
                data = os.read(self.master, 1 << 16)
            except OSError:   # EIO: the slave end closed
                return
            if not data:
                return
            self.bytes += len(data)

    def close(self) -> None:
        os.close(self.master)
        self._thread.join(timeout=5)


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of process `pid` so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


class CpuSampler:
    """CPU seconds of some processes, sampled every 0.1 s on a thread, so the share of any
    window (the child's streaming, on the monotonic clock) can be read afterwards."""

    def __init__(self, pids: dict[str, int]) -> None:
        self.pids = pids
        self.samples: list[tuple[float, dict[str, float]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.1):
            try:
                self.samples.append((time.monotonic(), {name: _cpu_s(pid) for name, pid in self.pids.items()}))
            except OSError:   # a process ended
                return

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def per_s(self, start: float, end: float) -> dict[str, float]:
        """Each process's CPU seconds per second between the samples nearest `start` and `end`."""
        inside = [sample for sample in self.samples if start <= sample[0] <= end]
        if len(inside) < 2:
            return {}
        (t0, first), (t1, last) = inside[0], inside[-1]
        return {name: (last[name] - first[name]) / (t1 - t0) for name in self.pids}


def _read_result(result_path: Path, what: str) -> dict:
    if not result_path.exists() or not result_path.read_text():
        raise RuntimeError(f"{what}: the app wrote no result (see the engine log)")
    result = json.loads(result_path.read_text())
    if "error" in result:
        raise RuntimeError(f"{what}: {result['error']}")
    return result


def run_headless(options: TuiBenchOptions) -> dict:
    """The same child with Textual's headless driver: what `benchmarks.tui_headless` sees, in the same
    process layout as the terminal runs."""
    with tempfile.TemporaryDirectory(prefix="paged-chat-bench-headless-") as folder:
        result_path = Path(folder) / "result.json"
        subprocess.run(_child_command(options, result_path, headless=True), stdin=subprocess.DEVNULL,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=_child_env(),
                       timeout=CHILD_TIMEOUT_S)
        return _read_result(result_path, "the app headless")


def run_in_pty(options: TuiBenchOptions) -> dict:
    """The app's child on a pseudo-terminal whose output is drained and dropped."""
    with tempfile.TemporaryDirectory(prefix="paged-chat-bench-pty-") as folder:
        result_path = Path(folder) / "result.json"
        master, slave = _open_pty(options.size)
        child = subprocess.Popen(_child_command(options, result_path), stdin=slave, stdout=slave,
                                 stderr=slave, env=_child_env(), start_new_session=True)
        os.close(slave)
        drain = Drain(master)
        try:
            child.wait(timeout=CHILD_TIMEOUT_S)
        finally:
            if child.poll() is None:
                child.kill()
            drain.close()
        result = _read_result(result_path, "the app in a pty")
        result["terminal_bytes"] = drain.bytes
        return result


def run_in_tmux(options: TuiBenchOptions) -> dict:
    """The app's child in a tmux pane, a client attached through a drained pseudo-terminal;
    tmux's server and client CPU over the streaming window."""
    if shutil.which("tmux") is None:
        raise RuntimeError("tmux is not installed (try --terminal pty)")
    columns, rows = options.size
    socket = f"paged-chat-bench-{os.getpid()}"
    tmux = ["tmux", "-L", socket, "-f", "/dev/null"]
    with tempfile.TemporaryDirectory(prefix="paged-chat-bench-tmux-") as folder:
        result_path = Path(folder) / "result.json"
        command = shlex.join(_child_command(options, result_path))
        env = _child_env()
        exports = [arg for key in ("PYTHONPATH", "HF_HUB_OFFLINE", "PAGED_CHAT_CACHE_DIR",
                                   "PAGED_CHAT_CONFIG", "PAGED_CHAT_DATA_DIR") if key in env
                   for arg in ("-e", f"{key}={env[key]}")]
        subprocess.run([*tmux, "new-session", "-d", "-s", "bench", "-x", str(columns), "-y", str(rows),
                        *exports, f"{command}; tmux -L {socket} wait-for -S done"],
                       check=True, env=env)
        master, slave = _open_pty(options.size)
        client = subprocess.Popen([*tmux, "attach", "-t", "bench"], stdin=slave, stdout=slave,
                                  stderr=slave, env=env, start_new_session=True)
        os.close(slave)
        drain = Drain(master)
        try:
            server = int(subprocess.run([*tmux, "display", "-p", "-t", "bench", "#{pid}"], check=True,
                                        capture_output=True, text=True).stdout)
            sampler = CpuSampler({"tmux_server": server, "tmux_client": client.pid})
            subprocess.run([*tmux, "wait-for", "done"], timeout=CHILD_TIMEOUT_S)
            sampler.stop()
        finally:
            subprocess.run([*tmux, "kill-server"], capture_output=True)
            client.wait(timeout=10)
            drain.close()
        result = _read_result(result_path, "the app in tmux")
        window = result["started_monotonic"], result["ended_monotonic"]
        result |= {f"{name}_cpu_per_s": share for name, share in sampler.per_s(*window).items()}
        result["terminal_bytes"] = drain.bytes
        return result


RUNS = {"headless": run_headless, "pty": run_in_pty, "tmux": run_in_tmux}


def run_terminal_bench(options: TuiBenchOptions, terminals: tuple[str, ...], rounds: int = ROUNDS,
                       log: Callable[[str], None] = print) -> dict:
    """The engine alone, then the app in each of `terminals`, `rounds` times in turn."""
    assert terminals and set(terminals) <= set(TERMINALS), terminals
    engine = on_own_thread(lambda: warmed_up(Engine(engine_config(options))))
    chats = demo_chats(options.tabs, options.seed)
    params = SamplingParams(temperature=0, max_tokens=options.max_tokens, ignore_eos=True)
    runs: dict[str, list[dict]] = {name: [] for name in ("engine_alone", *terminals)}
    loads = []
    for round_ in range(1, rounds + 1):
        log(f"tui-terminal: {options.tabs} tabs x {options.max_tokens} tokens, engine alone "
            f"({round_}/{rounds}) ...")
        runs["engine_alone"].append(on_own_thread(lambda: run_engine_alone(engine, chats, params)))
        for terminal in terminals:
            log(f"tui-terminal: the app, {terminal} {options.size[0]}x{options.size[1]} "
                f"({round_}/{rounds}) ...")
            runs[terminal].append(RUNS[terminal](options))
        loads.append(os.getloadavg()[0])
    best = {name: max(results, key=lambda run: run["output_tokens_per_s"]) for name, results in runs.items()}
    alone = best["engine_alone"]["output_tokens_per_s"]
    return {"options": asdict(options), "terminals": list(terminals), "load_average_1m": loads,
            "best": best, "rounds": runs,
            "vs_engine": {terminal: best[terminal]["output_tokens_per_s"] / alone for terminal in terminals}}


def format_terminal_report(report: dict) -> str:
    options, best = report["options"], report["best"]
    alone = best["engine_alone"]
    rounds = "; ".join(f"{name.replace('_', ' ')} " + ", ".join(
        f"{run['output_tokens_per_s']:.1f}" for run in runs) for name, runs in report["rounds"].items())
    lines = [f"tui in a terminal of {options['size'][0]}x{options['size'][1]}: engine alone "
             f"{alone['output_tokens_per_s']:.1f} tok/s; " + ", ".join(
                 f"app {terminal} {best[terminal]['output_tokens_per_s']:.1f} tok/s "
                 f"({100 * report['vs_engine'][terminal]:.0f}%)" for terminal in report["terminals"]),
             f"  best of {len(report['rounds']['engine_alone'])} runs each ({rounds}); "
             f"{options['tabs']} tabs, {alone['output_tokens']} tokens each run; 1-min load "
             f"average after each round {', '.join(f'{load:.2f}' for load in report['load_average_1m'])}"]
    for terminal in report["terminals"]:
        app = best[terminal]
        tmux = ""
        if "tmux_server_cpu_per_s" in app:
            tmux = (f", tmux server {app['tmux_server_cpu_per_s']:.2f}, client "
                    f"{app.get('tmux_client_cpu_per_s', 0):.2f}")
        lines.append(f"  {terminal}: CPU s per s of streaming: UI thread {app['ui_cpu_per_s']:.2f}, "
                     f"app process {app['app_cpu_per_s']:.2f}{tmux}; written to the terminal "
                     f"{app['terminal_chars_per_s'] / 1e3:.1f} k chars/s in "
                     f"{app['terminal_writes_per_s']:.0f} writes/s")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.tui_terminal",
        description="The app in a real terminal (a drained pty, or tmux with a client "
                    "attached) against the engine alone on the same demo chats.")
    defaults = TuiBenchOptions()
    parser.add_argument("--terminal", default="headless,tmux",
                        help=f"comma-separated, of {', '.join(TERMINALS)}")
    parser.add_argument("--tabs", type=int, default=defaults.tabs)
    parser.add_argument("--max-tokens", type=int, default=defaults.max_tokens)
    parser.add_argument("--model", default=defaults.model)
    parser.add_argument("--dtype", default="auto", help="as the app ships unless set")
    parser.add_argument("--threads", type=int, help="a fixed torch thread count for the engine alone "
                        "and the app's engine (default: each adapts its own, as it ships)")
    parser.add_argument("--rounds", type=int, default=ROUNDS)
    parser.add_argument("--json", type=Path, help="write the report here")
    parser.add_argument("--child", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--options", help=argparse.SUPPRESS)
    parser.add_argument("--headless", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child is not None:
        options = json.loads(args.options)
        run_child(TuiBenchOptions(**options | {"size": tuple(options["size"])}), args.child,
                  args.headless)
        return
    options = TuiBenchOptions(model=args.model, tabs=args.tabs, max_tokens=args.max_tokens,
                              dtype=args.dtype, threads=args.threads)
    terminals = tuple(name.strip() for name in args.terminal.split(","))
    if not set(terminals) <= set(TERMINALS):
        parser.error(f"--terminal: one or more of {', '.join(TERMINALS)}")
    report = run_terminal_bench(options, terminals, args.rounds,
                                log=lambda line: print(line, file=sys.stderr))
    print(format_terminal_report(report))
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
