"""Streams: the asyncio side of an engine client, one queue per open request.

The thread that hears the engine (a local client's engine thread or pipe reader, a remote
client's HTTP tasks) hands each step's deltas to the streams' event loops, once per loop per
step (not once per token).
Leaving a stream early, or an error in it, sends an Abort for its request, so its blocks go
back to the pool. Once `end()` has said why the engine stopped, no stream can open until
`reopen()`.
"""

from __future__ import annotations

import asyncio
import threading
from collections import defaultdict
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass

from paged_chat.engine.clients.engine_loop import Abort, Add, Command
from paged_chat.engine.core.errors import EngineDeadError
from paged_chat.engine.core.outputs import RequestOutput


@dataclass(slots=True)
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue


class Streams:
    """Open requests by id, each with the event loop that reads it."""

    def __init__(self) -> None:
        self._open: dict[str, _Stream] = {}
        self._lock = threading.Lock()
        self.stopped: str | None = None  # why the engine stopped; None while it serves

    def __len__(self) -> int:
        """Streams open now."""
        return len(self._open)

    async def stream(self, add: Add, send: Callable[[Command], None]
                     ) -> AsyncIterator[RequestOutput]:
        """Send `add` and yield its request's deltas until it finishes; stop early to abort
        it. Raises EngineDeadError when a step fails or the engine stops."""
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        with self._lock:  # `end` marks the engine stopped under this lock: no race
            if self.stopped is not None:
                raise EngineDeadError(self.stopped)
            if add.request_id in self._open:
                raise ValueError(f"request id {add.request_id!r} is already streaming")
            self._open[add.request_id] = stream
        send(add)
        finished = False
        try:
            while not finished:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
        finally:
            with self._lock:
                self._open.pop(add.request_id, None)
            if not finished:  # also after an error: its add may still be queued behind it
                send(Abort(add.request_id))

    def deliver(self, outputs: list[RequestOutput]) -> list[str]:
        """Hand one step's deltas to their streams. Returns the ids of requests whose event
        loop has closed (an app that exited mid-stream): nobody reads them again, and their
        consumers can no longer run the `finally` that would abort them, so the caller must."""
        by_loop: dict[asyncio.AbstractEventLoop, list] = defaultdict(list)
        with self._lock:
            for output in outputs:
                stream = self._open.get(output.request_id)
                if stream is not None:
                    by_loop[stream.loop].append((stream.queue, output))
        orphans: list[str] = []
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, items)
            except RuntimeError:  # that event loop has closed
                orphans += self._drop_loop(loop)
        return orphans

    def fail(self, request_ids: Iterable[str] | None, error: Exception) -> None:
        """Raise `error` in these streams (None: in every open one)."""
        with self._lock:
            streams = (list(self._open.values()) if request_ids is None
                       else [self._open[rid] for rid in request_ids if rid in self._open])
        _send(streams, error)

    def end(self, reason: str) -> None:
        """The engine stopped: no new stream opens, and every open one raises EngineDeadError."""
        with self._lock:
            self.stopped = reason
            streams = list(self._open.values())
        _send(streams, EngineDeadError(reason))

    def reopen(self) -> None:
        with self._lock:
            self.stopped = None

    def _drop_loop(self, loop: asyncio.AbstractEventLoop) -> list[str]:
        with self._lock:
            orphans = [rid for rid, stream in self._open.items() if stream.loop is loop]
            for request_id in orphans:
                del self._open[request_id]
        return orphans


def _send(streams: list[_Stream], error: Exception) -> None:
    for stream in streams:
        try:
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, error)
        except RuntimeError:  # that event loop has closed
            pass


def _put_all(items: list[tuple[asyncio.Queue, RequestOutput]]) -> None:
    for target, output in items:
        target.put_nowait(output)
