"""LocalClient: the EngineClient over an Engine this machine runs, on a thread of this process
or in a child process: one client, two transports (thread_transport.py, process_transport.py).

The client owns what both share: the open streams (streams.py) and the output processor
(output_processor.py). A transport moves engine_loop's commands in, and the core's outputs,
stats snapshots and failures out, on a thread of its own (the engine thread, or the reader of
the child's pipe), where they reach the client's TransportEvents: each step's core outputs
become RequestOutputs there, and are handed to the streams' event loops once per loop per
step.

Leaving a stream early, or its event loop closing under it (an app that exited mid-stream,
whose consumers can never run the `finally` that would abort), aborts its request in the
core, which frees its blocks. A stop string ends a request in the processor, which has the
core abort it too. A failed step ends every open stream with EngineDeadError and the engine
goes on serving; an engine that stops (shutdown, an internal error, a dead child) ends them
with the reason, `running` turns False and `last_error` says why; `restart()` serves again.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import AsyncIterator, Sequence
from typing import Protocol

from paged_chat.engine.clients.client_protocol import ClientCapabilities
from paged_chat.engine.clients.engine_loop import (
    Abort,
    Add,
    Command,
    LoopEvents,
    Reprioritize,
    ResetPrefixCache,
)
from paged_chat.engine.clients.streams import Streams
from paged_chat.engine.core.errors import EngineDeadError
from paged_chat.engine.core.output_processor import OutputProcessor
from paged_chat.engine.core.outputs import EngineCoreOutput, ModelInfo, RequestOutput
from paged_chat.engine.core.request import check_priority
from paged_chat.engine.core.sampling_params import SamplingParams
from paged_chat.engine.core.stats import EngineStats


class TransportEvents(LoopEvents, Protocol):
    """What a transport reports, from its own thread: the engine loop's events, and its end."""

    def on_stopped(self, reason: str, error: str | None) -> None:
        """The engine stopped serving (shut down, an internal error, a dead child): `reason`
        is what open streams are told, `error` the failure behind it, if one was."""


class Transport(Protocol):
    """Where the Engine runs, and the way to it."""

    @property
    def info(self) -> ModelInfo: ...

    @property
    def where(self) -> str:
        """One line on where the engine runs."""

    @property
    def responding(self) -> bool:
        """Whether the engine shows signs of life (a child process that is stopped or hung
        does not); `stop` does not wait for one that does not."""

    def start(self, events: TransportEvents) -> None:
        """Build or start the engine; its error is raised here. Once started, `events` hears
        everything, first a stats snapshot."""

    def send(self, command: Command) -> None:
        """Queue a command for the engine loop; never blocks on the engine."""

    def stop(self, reason: str, timeout_s: float) -> None:
        """Abort everything, stop the loop (`on_stopped(reason)`) and wait for it, the KV
        tier's writes included; nothing if it has stopped already."""

    def restart(self, timeout_s: float) -> None:
        """Start serving again after `stop`; raises EngineDeadError if the old loop is stuck."""


class LocalClient:
    """An EngineClient (client_protocol.py) over a transport to an Engine on this machine."""

    def __init__(self, transport: Transport) -> None:
        """Start the transport (a load's error is raised here)."""
        self.transport = transport
        self.last_error: str | None = None
        self._streams = Streams()
        self._ids = itertools.count()
        # the processor is fed by the transport's thread, opened and left by event loops
        self._lock = threading.Lock()
        self._processor: OutputProcessor | None = None
        transport.start(self)
        self._processor = OutputProcessor(transport.info.tokenizer)

    @property
    def info(self) -> ModelInfo:
        return self.transport.info

    @property
    def capabilities(self) -> ClientCapabilities:
        return ClientCapabilities(block_map=True, metrics=True, where=self.transport.where,
                                  restart=True, reprioritize=True)

    @property
    def running(self) -> bool:
        """Whether the engine serves requests (False after shutdown, a crash, a dead child)."""
        return self._streams.stopped is None

    @property
    def responding(self) -> bool:
        """Whether the engine shows signs of life: False while a child process is stopped
        or hung (it may come back), and once it has died."""
        return self.transport.responding

    def stats(self) -> EngineStats:
        """The last snapshot the engine published (after a step, at most every
        stats_interval_s, and when it goes idle); never waits for the engine."""
        return self._stats

    def stream(self, prompt: str | Sequence[int], params: SamplingParams | None = None,
               request_id: str | None = None, owner: str | None = None, priority: int = 0
               ) -> AsyncIterator[RequestOutput]:
        """Yield the request's deltas until it finishes; stop early to abort it. Raises
        EngineDeadError when a step fails or the engine stops; the request is then gone from
        the engine too."""
        request_id = request_id or f"stream-{next(self._ids)}"
        return self._streams.stream(Add(request_id, prompt, params, owner, priority),
                                    self._from_stream)

    def abort(self, request_id: str) -> None:
        self.transport.send(Abort(request_id))

    def reprioritize(self, request_id: str, priority: int) -> None:
        """Serve a request in flight at `priority` from the engine's next step on; an id the
        engine does not hold (finished, or not sent yet) is ignored; a priority that is no
        int raises ValueError here."""
        check_priority(priority)
        self.transport.send(Reprioritize(request_id, priority))

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix, where the engine runs, before its next step."""
        self.transport.send(ResetPrefixCache())

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Abort everything, stop the engine and wait for it and for the KV tier's writes."""
        self.transport.stop("the engine has shut down", timeout_s)

    def restart(self, timeout_s: float = 30.0) -> None:
        """Serve again after `shutdown()` or a stopped engine, or start afresh: every open
        stream ends with EngineDeadError, every request is aborted, the prefix cache is
        dropped (the transports' docstrings say how much is rebuilt). Blocks until the old
        loop has stopped (a step in progress finishes first): call it from a worker thread,
        not from the event loop. Raises EngineDeadError if it does not stop within `timeout_s`."""
        self.transport.stop("the engine was restarted", timeout_s)
        self.transport.restart(timeout_s)
        self.last_error = None
        self._streams.reopen()

    def _from_stream(self, command: Command) -> None:
        """A stream's commands: its Add, and its Abort once it is left before the end."""
        with self._lock:
            assert self._processor is not None
            if isinstance(command, Add):
                self._processor.add_request(command.request_id, command.params)
            else:
                self._processor.abort_request(command.request_id)
        self.transport.send(command)

    # ---- TransportEvents, on the transport's thread ---------------------------------

    def on_outputs(self, outputs: list[EngineCoreOutput]) -> None:
        with self._lock:
            assert self._processor is not None
            processed = self._processor.process(outputs)
        for request_id in processed.to_abort:
            self.transport.send(Abort(request_id))
        for request_id in self._streams.deliver(processed.outputs):
            self._from_stream(Abort(request_id))

    def on_stats(self, stats: EngineStats) -> None:
        self._stats = stats

    def on_request_failed(self, request_id: str, error: Exception) -> None:
        with self._lock:
            if self._processor is not None:
                self._processor.drop(request_id)
        self._streams.fail([request_id], error)

    def on_step_failed(self, message: str) -> None:
        self.last_error = message
        self._forget_requests()
        self._streams.fail(None, EngineDeadError(f"the engine step failed: {message}"))

    def on_stopped(self, reason: str, error: str | None) -> None:
        if error is not None:
            self.last_error = error
        self._forget_requests()
        self._streams.end(reason)

    def _forget_requests(self) -> None:
        """The engine aborted every request without a word (a failed step, a stop)."""
        with self._lock:
            if self._processor is not None:
                self._processor.clear()
