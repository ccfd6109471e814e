"""AsyncEngine: one background thread owns the Engine; asyncio code streams from it.

The engine thread runs the engine loop (engine_loop.py): it steps while there is work and
sleeps on its command queue when there is none. Callers never touch the Engine: `stream()`
sends an "add" command and reads deltas from an asyncio queue that the thread fills, once
per step per event loop (streams.py). Cancelling or abandoning a stream aborts its request,
which frees its blocks. `stats()` returns the last snapshot the thread published (at most every
`stats_interval_s`, and once more when it goes idle): it never waits for the engine.

If a step raises, every open stream gets an EngineDeadError, all requests are aborted
and the prefix cache is dropped (a failed forward may have left indexed blocks
unwritten); the thread keeps serving, so the UI can carry on without a restart. The
thread never dies silently: an error outside a step (an engine bug) ends every stream with
EngineDeadError and marks the engine stopped (`running` is False, `last_error` says why);
`restart()` brings it back, as it does after `shutdown()`.

Give it a function that builds the engine, not a built one, so the engine is built on the
thread that steps it. On Linux torch's CPU ops run on GNU OpenMP, which keeps a pool of
worker threads for every thread that has run a parallel op, for as long as that thread
lives, and spin-waits between parallel regions only while the process holds no more such
threads than cores. An engine loaded on the main thread leaves a pool there; once the
engine thread has its own, the workers sleep between regions and each of a step's hundreds
of regions waits for a wake-up (measured on 2 cores: 60-70% of the speed).
"""

from __future__ import annotations

import functools
import itertools
import queue
import sys
import threading
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import Future

from paged_chat.engine.client import ModelInfo
from paged_chat.engine.config import EngineConfig
from paged_chat.engine.engine import Engine
from paged_chat.engine.engine_loop import (Abort, Add, Command, ResetPrefixCache, Shutdown,
                                           serve_engine)
from paged_chat.engine.errors import EngineDeadError
from paged_chat.engine.models.loader import ProgressHook
from paged_chat.engine.request import RequestOutput, SamplingParams
from paged_chat.engine.stats import EngineStats
from paged_chat.engine.streams import Streams


# The engine thread lets go of the GIL in every torch op and must win it back after each one.
# A busy event loop on the other thread (a TUI frame, a burst of HTTP requests) keeps it for
# up to Python's switch interval each time: at the default 5 ms, a step of a few hundred ops
# crawls while the loop works. The interval is process-wide; lowering it costs the loop a few
# more hand-offs per frame.
GIL_SWITCH_INTERVAL_S = 0.0005


class AsyncEngine:
    """The in-process EngineClient (paged_chat.engine.client): an Engine on its own thread."""

    def __init__(self, engine: Engine | Callable[[], Engine], stats_interval_s: float = 0.05
                 ) -> None:
        """`engine`: a function that builds the Engine, called on the engine thread (its
        error is raised here), or an Engine built elsewhere (see the module's docstring)."""
        self.stats_interval_s = stats_interval_s
        self.last_error: str | None = None
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams = Streams()
        self._ids = itertools.count()
        self._thread = self._start_thread(engine)

    @classmethod
    def from_config(cls, config: EngineConfig, on_progress: ProgressHook | None = None
                    ) -> "AsyncEngine":
        """Load the model (`on_progress(stage, done, total)` hears a slow load advance)."""
        return cls(lambda: Engine(config, on_progress=on_progress))

    @property
    def info(self) -> ModelInfo:
        return self.engine.info

    @property
    def running(self) -> bool:
        """Whether the engine thread serves requests (False after shutdown or a crash)."""
        return self._streams.stopped is None

    def stats(self) -> EngineStats:
        return self._stats

    def stream(self, prompt: str | Sequence[int], params: SamplingParams | None = None,
               request_id: str | None = None, owner: str | None = None
               ) -> AsyncIterator[RequestOutput]:
        """Yield the request's deltas until it finishes; stop early to abort it.

        Raises EngineDeadError when a step fails or the engine stops; the request is then
        gone from the engine too.
        """
        request_id = request_id or f"stream-{next(self._ids)}"
        return self._streams.stream(Add(request_id, prompt, params, owner), self._send)

    def abort(self, request_id: str) -> None:
        self._send(Abort(request_id))

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix, on the engine thread, before its next step."""
        self._send(ResetPrefixCache())

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Abort everything, stop the thread and wait for it and for the KV tier's writes."""
        self._stop("the engine has shut down", timeout_s)
        self.engine.flush()

    def restart(self, timeout_s: float = 30.0) -> None:
        """Serve again after `shutdown()` or a crash of the engine thread, or start afresh.

        A failed step needs no restart: the thread ends the open streams and keeps serving
        by itself. This is for the rest (`running` is False), or for a user who wants a clean
        slate: every open stream ends with EngineDeadError, every request is aborted, the
        prefix cache is dropped, and a new thread serves the same model (no reload). If the
        engine's state cannot be reset (the crash left it inconsistent), a new Engine is built
        from the same config, which loads the model again. Blocks until the old thread has
        stopped (a step in progress finishes first): call it from a worker thread, not from the
        event loop. Raises EngineDeadError if the old thread does not stop within `timeout_s`.
        """
        self._stop("the engine was restarted", timeout_s)
        if self._thread.is_alive():
            raise EngineDeadError(f"the engine thread did not stop within {timeout_s} s "
                                  "(a step is stuck?); restart the app")
        try:
            self.engine.reset()
            self.engine.kv_cache.check_invariants()
            engine: Engine | Callable[[], Engine] = self.engine
        except Exception:  # an inconsistent engine: rebuild it rather than trust it
            engine = functools.partial(Engine, self.engine.config)
        self.last_error = None
        self._commands = queue.SimpleQueue()  # no stream opened since the stop: all stale
        self._streams.reopen()
        self._thread = self._start_thread(engine)

    def _send(self, command: Command) -> None:
        self._commands.put(command)

    def _start_thread(self, engine: Engine | Callable[[], Engine]) -> threading.Thread:
        """Start the engine thread, building the engine on it first when given a builder."""
        sys.setswitchinterval(min(sys.getswitchinterval(), GIL_SWITCH_INTERVAL_S))
        built: Future = Future()
        thread = threading.Thread(target=self._run, args=(engine, built),
                                  name="paged-chat-engine", daemon=True)
        thread.start()
        built.result()  # the builder's error, if any, is raised here
        return thread

    def _stop(self, reason: str, timeout_s: float) -> None:
        if self._thread.is_alive():
            self._send(Shutdown(reason))
            self._thread.join(timeout_s)

    # ---- the engine thread ----------------------------------------------------------

    def _run(self, engine: Engine | Callable[[], Engine], built: Future) -> None:
        try:
            engine = engine if isinstance(engine, Engine) else engine()
            self._stats = engine.stats()
        except BaseException as error:  # a bad model path, a failed load: raised to the caller
            self._streams.end(f"the engine could not be built ({type(error).__name__}: {error})")
            built.set_exception(error)
            return
        self.engine = engine
        built.set_result(None)
        try:
            reason = serve_engine(engine, self._receive, self, self.stats_interval_s)
        except Exception as error:  # an engine bug outside a step: say so, never die silently
            self.last_error = f"{type(error).__name__}: {error}"
            reason = f"the engine stopped after an internal error ({self.last_error}); restart it"
        self._streams.end(reason)

    def _receive(self, block: bool) -> list[Command]:
        commands = [self._commands.get()] if block else []
        while True:
            try:
                commands.append(self._commands.get_nowait())
            except queue.Empty:
                return commands

    # LoopEvents, called on the engine thread

    def on_outputs(self, outputs: list[RequestOutput]) -> None:
        for request_id in self._streams.deliver(outputs):
            self._send(Abort(request_id))

    def on_stats(self, stats: EngineStats) -> None:
        self._stats = stats

    def on_request_failed(self, request_id: str, error: Exception) -> None:
        self._streams.fail([request_id], error)

    def on_step_failed(self, message: str) -> None:
        self.last_error = message
        self._streams.fail(None, EngineDeadError(f"the engine step failed: {message}"))
