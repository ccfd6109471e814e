"""ProcessTransport: the Engine in a child process of its own (LocalClient's second transport).

Why a process. In one process the UI's event loop and the engine thread share one GIL: the
engine thread gives it up in every torch op and must win it back after each one, while the
loop holds it for a frame's layout and paint. On 2 cores the app kept 68-83% of the
engine's speed with the engine on a thread, whatever the frame rate or switch interval; the
same app with the same engine in another process kept 87-104%. vLLM v1 splits its
EngineCore off the same way.

How. The child is spawned (a fresh interpreter): a parent may have threads or torch, and a
forked torch would inherit their locks. A caller that launches it from its main thread
alone with no torch imported (the TUI's start, before Textual) may ask for a fork
(`fork_if_safe`, checked here): no interpreter to start and no modules of the parent's to
import again. Either way it builds the Engine on its
main thread, so its OpenMP pool is the only one, and runs the same loop as the thread
transport (engine_loop.py) over one duplex pipe:

    parent -> child   Add, Abort, Reprioritize, ResetPrefixCache, Shutdown  (engine_loop's)
    child -> parent   _Progress while loading, _Tokenizer once the model's source is read
                      (the tokenizer, or the folder it is saved in), then _Ready
                      (ModelInfo less its tokenizer, first stats) or
                      _LoadFailed; then per step _Outputs, every stats_interval_s _Stats,
                      _RequestFailed, _StepFailed, and last _Stopped

A step's outputs cross as the core made them: ids and counts, no text and no history (a
reply's whole ids and text, pickled every step, would cost time that grows with every
token). The client's output processor turns them into text on the
parent's reader thread.

In the parent a sender thread writes the commands (a long prompt never blocks the event
loop on a full pipe while the child is in a step) and a reader thread hands each step's
core outputs, stats and failures to the client, as the engine thread does in-process.
The client's `stats()` is the last snapshot the child sent, block map included: a snapshot
crosses without the map's per-block arrays (2 MB for an H200's pool), and the reader keeps
them by applying each snapshot's block changes (core/block_states.py) in order.

Failures. A failed step ends the open streams and the child keeps serving, as on a thread.
A child that dies (killed, out of memory, a crash in native code) ends every stream with
EngineDeadError naming its exit code, and the client's `last_error` says so. A child that
stops without dying (SIGSTOP, a hang that holds its GIL) is told by its heartbeat: a thread
of its own sends one every HEARTBEAT_S on a second, one-way pipe whatever its main thread
does (a long step included), and `responding` turns False after NOT_RESPONDING_S without
one. `stop` waits for a responding child up to its timeout and kills one that does not
respond at once, so an app quits in about a second whatever the child does. A restart
starts a new child (the model loads again). A child whose parent dies, however it died,
sees its pipe close and exits; one whose main thread reads no pipe then (a load, a long
step) is ended by a thread of its own that sees it was orphaned (its parent pid changed)
within PARENT_WATCH_S and gives the main thread PARENT_GONE_GRACE_S to finish first. (Not
PR_SET_PDEATHSIG: that fires when the *thread* that started the child ends, and a restart
may run on a worker thread.) It ignores SIGINT, so Ctrl+C in a terminal reaches only the
app, which shuts the child down. Its stdout and stderr go to `log_path` when given (a TUI
owns the terminal), with Python's fault handler on, so a native crash leaves a trace there.
"""

from __future__ import annotations

import contextlib
import dataclasses
import faulthandler
import multiprocessing
import os
import pickle
import queue
import signal
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import TYPE_CHECKING, Any

from paged_chat.engine.clients.engine_loop import Command, Shutdown
from paged_chat.engine.core.block_states import BlockStates
from paged_chat.engine.core.config import EngineConfig
from paged_chat.engine.core.errors import EngineDeadError, PagedChatError, describe_error
from paged_chat.engine.core.outputs import EngineCoreOutput, ModelInfo
from paged_chat.engine.core.stats import EngineStats

if TYPE_CHECKING:   # the parent never imports torch: the Engine and its loader are the child's
    from paged_chat.engine.clients.local import TransportEvents
    from paged_chat.engine.models.loader import ProgressHook

HEARTBEAT_S = 0.2        # how often the child says it is alive
NOT_RESPONDING_S = 3.0   # no heartbeat for this long: the child is stopped or hung
PARENT_WATCH_S = 0.5     # how often the child checks that its parent lives
PARENT_GONE_GRACE_S = 3.0   # an orphaned child's main thread gets this long to exit itself


@dataclass(slots=True)
class _Progress:
    stage: str
    done: int
    total: int


@dataclass(slots=True)
class _Tokenizer:
    """Sent before the weights load. Where the model's tokenizer is saved (a GGUF's warm
    start), its folder: the parent loads it from there meanwhile, and the child never
    loads it unless a request needs it (tokenizer_source.py). Else the tokenizer itself,
    which the parent unpickles meanwhile."""

    tokenizer: Any = None
    saved_folder: Path | None = None


@dataclass(slots=True)
class _Ready:
    info: ModelInfo   # its tokenizer None (and its template "" when the parent loads the
                      # tokenizer itself): the _Tokenizer before it says where they are
    stats: _Stats


@dataclass(slots=True)
class _LoadFailed:
    error: BaseException


@dataclass(slots=True)
class _Outputs:
    outputs: list[EngineCoreOutput]


@dataclass(slots=True)
class _Stats:
    """A snapshot, its block map without the per-block arrays: its block changes bring
    them, so the parent must apply every snapshot's, in order (BlockStates)."""

    stats: EngineStats

    @classmethod
    def of(cls, stats: EngineStats) -> "_Stats":
        return cls(dataclasses.replace(stats, blocks=stats.blocks.without_states()))

    def restore(self, states: BlockStates) -> EngineStats:
        """The whole snapshot: `states` (this stream's, applied up to the last snapshot)
        take its changes, and its map gets their arrays."""
        states.apply(self.stats.block_changes)
        return dataclasses.replace(self.stats, blocks=self.stats.blocks.with_states(states))


@dataclass(slots=True)
class _RequestFailed:
    request_id: str
    error: Exception


@dataclass(slots=True)
class _StepFailed:
    message: str


@dataclass(slots=True)
class _Stopped:
    reason: str
    error: str | None  # the internal error that stopped the loop, if one did


class ProcessTransport:
    """An Engine in a spawned child process named "paged-chat-engine"."""

    def __init__(self, config: EngineConfig, on_progress: ProgressHook | None = None,
                 log_path: Path | None = None, leave_cores: int = 0,
                 stats_interval_s: float = 0.05, fork_if_safe: bool = False) -> None:
        """`on_progress(stage, done, total)` hears a slow load advance; `log_path` takes the
        child's stdout and stderr; `leave_cores`: how many cores the parent needs while the
        engine steps (StepThreads.leave_cores); `fork_if_safe`: fork the child where
        `start_method` says that is safe, else spawn it."""
        self.config = config
        self.on_progress = on_progress
        self.log_path = log_path
        self.leave_cores = leave_cores
        self.fork_if_safe = fork_if_safe
        self.stats_interval_s = stats_interval_s
        self._process: multiprocessing.process.BaseProcess | None = None

    @property
    def info(self) -> ModelInfo:
        return self._info

    @property
    def where(self) -> str:
        return f"in a child process (pid {self.pid})"

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process is not None else None

    def launch(self) -> None:
        """Start the child, which loads the model while the caller goes on; `start` waits
        for it. A launched child that no `start` takes is ended by `abandon`."""
        assert self._process is None, "the child is launched already"
        method = start_method() if self.fork_if_safe else "spawn"
        context = multiprocessing.get_context(method)
        self._conn, child_conn = context.Pipe()
        self._beats, child_beats = context.Pipe(duplex=False)
        self._beats_lock = threading.Lock()   # `responding` drains the pipe from any thread
        # A forked child holds copies of this side's ends too: it closes them, or it would
        # never see EOF once this process has gone.
        inherited = (self._conn, self._beats) if method == "fork" else ()
        self._process = context.Process(
            target=_child_main, args=(child_conn, child_beats, self.config, self.stats_interval_s,
                                      self.log_path, self.leave_cores, inherited, os.getpid()),
            name="paged-chat-engine", daemon=True)
        with _stderr_with_a_descriptor():
            self._process.start()
        child_conn.close()  # the child's ends live in the child: EOF here once it exits
        child_beats.close()

    def abandon(self) -> None:
        """End a launched child that was never started (its caller gave up first)."""
        assert self._process is not None
        self._conn.close()
        self._beats.close()
        self._process.kill()
        self._process.join()

    def start(self, events: TransportEvents) -> None:
        """Launch the child unless `launch` has, and wait until it has loaded the model. The
        load's error is raised here; a child that dies while loading is an EngineDeadError."""
        self._events = events
        if self._process is None:
            self.launch()
        # While the child loads, on the other core: what unpickling its ModelInfo needs.
        import transformers.tokenization_utils_fast  # noqa: F401
        try:
            self._info, stats = self._wait_until_ready()
        except BaseException:
            self._conn.close()
            self._beats.close()
            self._process.join(10.0)
            raise
        self._last_beat = time.monotonic()
        events.on_stats(stats)
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._sender = threading.Thread(target=self._write, name="paged-chat-engine-sender",
                                        daemon=True)
        self._reader = threading.Thread(target=self._read, name="paged-chat-engine-reader",
                                        daemon=True)
        self._sender.start()
        self._reader.start()

    @property
    def responding(self) -> bool:
        """Whether the child's heartbeat came within NOT_RESPONDING_S (False once it has
        exited). Cheap: it drains the heartbeat pipe without waiting."""
        with self._beats_lock:
            try:
                while self._beats.poll():
                    self._beats.recv_bytes()
                    self._last_beat = time.monotonic()
            except (EOFError, OSError):  # the child has exited (the reader says why), or stop closed the pipe
                return False
            return time.monotonic() - self._last_beat < NOT_RESPONDING_S

    def send(self, command: Command) -> None:
        self._commands.put(command)

    def stop(self, reason: str, timeout_s: float) -> None:
        """Let the child abort everything, finish the KV tier's writes and exit, and wait for
        it: killed after `timeout_s`, or at once when it does not respond (a stopped or hung
        child never would). Returns once the reader has told the client."""
        assert self._process is not None
        if self.responding:
            deadline = time.monotonic() + timeout_s
            self._commands.put(Shutdown(reason))
            self._reader.join(timeout_s)
            self._process.join(max(0.0, deadline - time.monotonic()))
        if self._process.is_alive():
            self._process.kill()   # SIGKILL ends a stopped process too
            self._process.join()
        self._reader.join()        # EOF on the pipe now: it reports the end
        self._commands.put(None)   # ends the sender (a write to a dead child fails at once)
        self._sender.join(timeout_s)
        self._conn.close()
        with self._beats_lock:
            self._beats.close()

    def restart(self, timeout_s: float) -> None:
        """A new child, which loads the model again."""
        self._process = None
        self.start(self._events)

    # ---- the parent's threads ---------------------------------------------------------

    def _wait_until_ready(self) -> tuple[ModelInfo, EngineStats]:
        from paged_chat.engine.models.tokenizer_source import TokenizerSource, load_saved_tokenizer

        assert self._process is not None
        tokenizer, loaded_here = None, False
        while True:
            try:
                message = self._conn.recv()
            except (EOFError, OSError):
                self._process.join(10.0)
                raise EngineDeadError(f"the engine process exited while loading the model "
                                      f"(exit code {self._process.exitcode})") from None
            if isinstance(message, _Progress):
                if self.on_progress is not None:
                    self.on_progress(message.stage, message.done, message.total)
            elif isinstance(message, _Tokenizer):
                loaded_here = message.saved_folder is not None
                tokenizer = (load_saved_tokenizer(message.saved_folder) if loaded_here
                             else message.tokenizer)
            elif isinstance(message, _LoadFailed):
                raise message.error
            else:
                assert tokenizer is not None, "the child sends its tokenizer first"
                template = (TokenizerSource.loaded(message.info.name, tokenizer).chat_template
                            if loaded_here else message.info.chat_template)
                self._block_states = BlockStates(message.info.num_blocks)
                return (dataclasses.replace(message.info, tokenizer=tokenizer,
                                            chat_template=template),
                        message.stats.restore(self._block_states))

    def _write(self) -> None:
        while (command := self._commands.get()) is not None:
            try:
                self._conn.send(command)
            except OSError:  # the child has gone: the reader says why
                return

    def _read(self) -> None:
        assert self._process is not None
        events = self._events
        try:
            while not isinstance(message := self._conn.recv(), _Stopped):
                if isinstance(message, _Outputs):
                    events.on_outputs(message.outputs)
                elif isinstance(message, _Stats):
                    events.on_stats(message.restore(self._block_states))
                elif isinstance(message, _RequestFailed):
                    events.on_request_failed(message.request_id, message.error)
                else:
                    events.on_step_failed(message.message)
            reason, error = message.reason, message.error
        except (EOFError, OSError):
            self._process.join(10.0)
            reason = error = (f"the engine process exited unexpectedly (exit code "
                              f"{self._process.exitcode})")
        except Exception as exc:  # a message this side cannot take: a bug; never hang on it
            self._process.kill()
            reason = error = (f"the engine process sent what could not be read "
                              f"({describe_error(exc)})")
        events.on_stopped(reason, error)


def start_method() -> str:
    """How this process may start the child now: "fork" on Linux from a process whose only
    Python thread is the main one and that has not imported torch (numpy's BLAS threads
    are stopped around a fork by the library itself), else "spawn"."""
    if sys.platform == "linux" and threading.active_count() == 1 and "torch" not in sys.modules:
        return "fork"
    return "spawn"


# ---- the child ------------------------------------------------------------------------

class _PipeEvents:
    """LoopEvents that go to the parent over the pipe."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn

    def on_outputs(self, outputs: list[EngineCoreOutput]) -> None:
        if outputs:
            self.conn.send(_Outputs(outputs))

    def on_stats(self, stats: EngineStats) -> None:
        self.conn.send(_Stats.of(stats))

    def on_request_failed(self, request_id: str, error: Exception) -> None:
        self.conn.send(_RequestFailed(request_id, _portable(error)))

    def on_step_failed(self, message: str) -> None:
        self.conn.send(_StepFailed(message))


def _child_main(conn: Connection, beats: Connection, config: EngineConfig,
                stats_interval_s: float, log_path: Path | None, leave_cores: int,
                inherited: tuple[Connection, ...], parent_pid: int) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    threading.Thread(target=_end_with_parent, args=(parent_pid,), name="paged-chat-parent-watch",
                     daemon=True).start()
    for parent_end in inherited:
        parent_end.close()
    if log_path is not None:
        _log_to(log_path)
    faulthandler.enable()
    from paged_chat.engine.clients.engine_loop import serve_engine
    from paged_chat.engine.core.engine import Engine
    from paged_chat.engine.models.loader import load_model_source

    def progress(stage: str, done: int, total: int) -> None:
        conn.send(_Progress(stage, done, total))

    try:
        source = load_model_source(config.model, config.cache_dir, progress)
        saved_folder = source.tokenizer_source.saved_folder
        conn.send(_Tokenizer(saved_folder=saved_folder) if saved_folder is not None
                  else _Tokenizer(source.tokenizer))
        engine = Engine(config, source, on_progress=progress,
                        tokenizer_on_demand=saved_folder is not None)
    except BaseException as error:
        conn.send(_LoadFailed(_portable(error)))
        return
    engine.threads.leave_cores(leave_cores)
    conn.send(_Ready(dataclasses.replace(engine.info, tokenizer=None), _Stats.of(engine.stats())))
    threading.Thread(target=_beat, args=(beats,), name="paged-chat-heartbeat", daemon=True).start()

    def receive(block: bool) -> list[Command]:
        try:
            commands = [conn.recv()] if block else []
            while conn.poll():
                commands.append(conn.recv())
        except (EOFError, OSError):  # the parent has gone
            return [Shutdown("the app has gone")]
        return commands

    error = None
    try:
        reason = serve_engine(engine, receive, _PipeEvents(conn), stats_interval_s)
    except Exception as exc:  # an engine bug outside a step, or the parent gone mid-send
        error = f"{type(exc).__name__}: {exc}"
        reason = f"the engine stopped after an internal error ({error})"
    engine.flush()
    try:
        conn.send(_Stopped(reason, error))
    except OSError:
        pass
    # Done: the KV tier is flushed and the parent told. The interpreter's teardown (torch's
    # included) took longer than a quitting app gives the child, so it is skipped.
    for stream in (sys.stdout, sys.stderr):
        if stream is not None:
            stream.flush()
    os._exit(0)


def _beat(beats: Connection) -> None:
    """The heartbeat, on a thread of its own: it goes on through a long step, and stops
    with the whole process (SIGSTOP, a hang that holds the GIL). A parent that reads no
    beats for a while only fills the pipe: this thread then waits, and nothing else does."""
    try:
        while True:
            beats.send_bytes(b"")
            time.sleep(HEARTBEAT_S)
    except OSError:  # the parent has gone
        return


def _end_with_parent(parent_pid: int) -> None:
    """End this process once its parent has gone (it was then re-parented), whatever its
    main thread is doing: that gets PARENT_GONE_GRACE_S to exit by itself first."""
    while os.getppid() == parent_pid:
        time.sleep(PARENT_WATCH_S)
    time.sleep(PARENT_GONE_GRACE_S)
    os._exit(1)


def _log_to(path: Path) -> None:
    """Send this process's stdout and stderr, native writes included, to `path`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    for stream in (sys.stdout, sys.stderr):
        if stream is not None:
            stream.flush()
    os.dup2(descriptor, 1)
    os.dup2(descriptor, 2)
    os.close(descriptor)


@contextlib.contextmanager
def _stderr_with_a_descriptor() -> Iterator[None]:
    """multiprocessing hands `sys.stderr.fileno()` to the resource tracker it starts with the
    first child; a TUI's print capture (Textual's) answers -1 there, and the start fails with
    "bad value(s) in fds_to_keep". So the process's own stderr stands in while it starts."""
    try:
        usable = sys.stderr is not None and sys.stderr.fileno() >= 0
    except (AttributeError, OSError, ValueError):
        usable = False
    if usable or sys.__stderr__ is None:
        yield
        return
    captured, sys.stderr = sys.stderr, sys.__stderr__
    try:
        yield
    finally:
        sys.stderr = captured


def _portable(error: BaseException) -> BaseException:
    """`error` if it crosses the pipe intact, else a PagedChatError with its one line."""
    try:
        pickle.loads(pickle.dumps(error))
        return error
    except Exception:
        return PagedChatError(describe_error(error))
