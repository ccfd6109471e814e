"""ThreadTransport: the Engine on a background thread of this process (LocalClient's
in-process transport).

The engine thread runs the engine loop (engine_loop.py): it steps while there is work and
sleeps on its command queue when there is none, and hands each step's core outputs to the
client on the same thread (the client's output processor runs there). If a step raises,
the loop aborts every request and drops the prefix cache (a failed forward may have left
indexed blocks unwritten) and keeps serving. An error outside a step (an engine bug) stops
the thread, loudly: the client hears `on_stopped` with the error.

Give it a function that builds the engine, not a built one, so the engine is built on the
thread that steps it. On Linux torch's CPU ops run on GNU OpenMP, which keeps a pool of
worker threads for every thread that has run a parallel op, for as long as that thread
lives, and spin-waits between parallel regions only while the process holds no more such
threads than cores. An engine loaded on the main thread leaves a pool there; once the
engine thread has its own, the workers sleep between regions and each of a step's hundreds
of regions waits for a wake-up, which slows every step.
"""

from __future__ import annotations

import functools
import queue
import sys
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING

from paged_chat.engine.clients.engine_loop import Command, Shutdown, serve_engine
from paged_chat.engine.core.engine import Engine
from paged_chat.engine.core.errors import EngineDeadError
from paged_chat.engine.core.outputs import ModelInfo

if TYPE_CHECKING:
    from paged_chat.engine.clients.local import TransportEvents

# The engine thread lets go of the GIL in every torch op and must win it back after each one.
# A busy event loop on the other thread (a TUI frame, a burst of HTTP requests) keeps it for
# up to Python's switch interval each time: at the default 5 ms, a step of a few hundred ops
# crawls while the loop works. The interval is process-wide; lowering it costs the loop a few
# more hand-offs per frame.
GIL_SWITCH_INTERVAL_S = 0.0005

EngineBuilder = Callable[[], Engine]
# The engine thread's name: a front end that exits while it still runs (a load cut short
# by Ctrl+C goes on there) must end the process without finalizing under it.
ENGINE_THREAD_NAME = "paged-chat-engine"


class ThreadTransport:
    """An Engine on a thread named "paged-chat-engine"."""

    where = "on a thread of this process"
    responding = True   # a thread of this process stops only with the process

    def __init__(self, engine: Engine | EngineBuilder, stats_interval_s: float = 0.05) -> None:
        """`engine`: a function that builds the Engine, called on the engine thread (its
        error is raised by `start`), or an Engine built elsewhere (the module's docstring)."""
        self._build = engine
        self.stats_interval_s = stats_interval_s
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    @property
    def info(self) -> ModelInfo:
        return self.engine.info

    def start(self, events: TransportEvents) -> None:
        self._events = events
        self._start_thread(self._build)

    def send(self, command: Command) -> None:
        self._commands.put(command)

    def stop(self, reason: str, timeout_s: float) -> None:
        assert self._thread is not None
        if self._thread.is_alive():
            self._commands.put(Shutdown(reason))
            self._thread.join(timeout_s)
        if not self._thread.is_alive():
            self.engine.flush()

    def restart(self, timeout_s: float) -> None:
        """A new thread serves the same Engine (no reload) once its state is reset; if it
        cannot be (a crash left it inconsistent), a new Engine is built from the same config,
        which loads the model again."""
        assert self._thread is not None
        if self._thread.is_alive():
            raise EngineDeadError(f"the engine thread did not stop within {timeout_s} s "
                                  "(a step is stuck?); restart the app")
        try:
            self.engine.reset()
            self.engine.kv_cache.check_invariants()
            engine: Engine | EngineBuilder = self.engine
        except Exception:  # an inconsistent engine: rebuild it rather than trust it
            engine = functools.partial(Engine, self.engine.config)
        self._commands = queue.SimpleQueue()  # no stream opened since the stop: all stale
        self._start_thread(engine)

    def _start_thread(self, engine: Engine | EngineBuilder) -> None:
        """Start the engine thread, building the engine on it first when given a builder."""
        sys.setswitchinterval(min(sys.getswitchinterval(), GIL_SWITCH_INTERVAL_S))
        built: Future = Future()
        self._thread = threading.Thread(target=self._run, args=(engine, built),
                                        name=ENGINE_THREAD_NAME, daemon=True)
        self._thread.start()
        try:
            built.result()  # the builder's error, if any, is raised here
        except BaseException:  # Ctrl+C while it builds: the engine it finishes stops at once
            self._commands.put(Shutdown("the engine was not wanted any more"))
            raise

    # ---- the engine thread ----------------------------------------------------------

    def _run(self, engine: Engine | EngineBuilder, built: Future) -> None:
        events = self._events
        try:
            engine = engine if isinstance(engine, Engine) else engine()
            events.on_stats(engine.stats())
        except BaseException as error:  # a bad model path, a failed load: raised to the caller
            events.on_stopped(f"the engine could not be built ({type(error).__name__}: {error})",
                              None)
            built.set_exception(error)
            return
        self.engine = engine
        built.set_result(None)
        error = None
        try:
            reason = serve_engine(engine, self._receive, events, self.stats_interval_s)
        except Exception as exc:  # an engine bug outside a step: say so, never die silently
            error = f"{type(exc).__name__}: {exc}"
            reason = f"the engine stopped after an internal error ({error}); restart it"
        events.on_stopped(reason, error)

    def _receive(self, block: bool) -> list[Command]:
        commands = [self._commands.get()] if block else []
        while True:
            try:
                commands.append(self._commands.get_nowait())
            except queue.Empty:
                return commands
