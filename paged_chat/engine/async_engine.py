"""AsyncEngine: one background thread owns the Engine; asyncio code streams from it.

The engine thread steps while there is work and sleeps on its command queue when there
is none. Callers never touch the Engine: `stream()` sends an "add" command and reads
deltas from an asyncio queue that the thread fills, once per step per event loop (not
once per token). Cancelling or abandoning a stream aborts its request, which frees its
blocks. `stats()` returns the last snapshot the thread published (at most every
`stats_interval_s`, and once more when it goes idle): it never waits for the engine.

If a step raises, every open stream gets an EngineDeadError, all requests are aborted
and the prefix cache is dropped (a failed forward may have left indexed blocks
unwritten); the thread keeps serving, so the UI can carry on without a restart.
"""

from __future__ import annotations

import asyncio
import itertools
import queue
import threading
import time
from collections import defaultdict
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

from paged_chat.engine.config import EngineConfig
from paged_chat.engine.engine import Engine
from paged_chat.engine.errors import EngineDeadError
from paged_chat.engine.request import RequestOutput, SamplingParams
from paged_chat.engine.stats import EngineStats


@dataclass(slots=True)
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue


@dataclass(slots=True)
class _Add:
    request_id: str
    prompt: str | Sequence[int]
    params: SamplingParams | None
    owner: str | None


@dataclass(slots=True)
class _Abort:
    request_id: str


class _Shutdown:
    pass


class AsyncEngine:
    def __init__(self, engine: Engine, stats_interval_s: float = 0.05) -> None:
        self.engine = engine
        self.stats_interval_s = stats_interval_s
        self.last_error: str | None = None
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}
        self._streams_lock = threading.Lock()
        self._ids = itertools.count()
        self._stats = engine.stats()
        self._thread = threading.Thread(target=self._run, name="paged-chat-engine", daemon=True)
        self._thread.start()

    @classmethod
    def from_config(cls, config: EngineConfig) -> "AsyncEngine":
        return cls(Engine(config))

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def stats(self) -> EngineStats:
        return self._stats

    async def stream(self, prompt: str | Sequence[int], params: SamplingParams | None = None,
                     request_id: str | None = None, owner: str | None = None
                     ) -> AsyncIterator[RequestOutput]:
        """Yield the request's deltas until it finishes; stop early to abort it."""
        if not self._thread.is_alive():
            raise EngineDeadError("the engine has shut down")
        request_id = request_id or f"stream-{next(self._ids)}"
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        with self._streams_lock:
            if request_id in self._streams:
                raise ValueError(f"request id {request_id!r} is already streaming")
            self._streams[request_id] = stream
        self._commands.put(_Add(request_id, prompt, params, owner))
        finished = False
        try:
            while not finished:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished
                yield item
        finally:
            with self._streams_lock:
                self._streams.pop(request_id, None)
            if not finished:
                self._commands.put(_Abort(request_id))

    async def generate(self, prompt: str | Sequence[int], params: SamplingParams | None = None,
                       owner: str | None = None) -> RequestOutput:
        """The final output of one request."""
        last = None
        async for last in self.stream(prompt, params, owner=owner):
            pass
        return last

    def abort(self, request_id: str) -> None:
        self._commands.put(_Abort(request_id))

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Abort everything, stop the thread and wait for it."""
        if self._thread.is_alive():
            self._commands.put(_Shutdown())
            self._thread.join(timeout_s)

    # ---- the engine thread ----------------------------------------------------------

    def _run(self) -> None:
        last_publish = 0.0
        while True:
            idle = not self.engine.has_unfinished()
            if idle:
                self._publish()
            for command in self._drain(block=idle):
                if isinstance(command, _Shutdown):
                    self._fail_all(EngineDeadError("the engine has shut down"))
                    self._publish()
                    return
                self._apply(command)
            if not self.engine.has_unfinished():
                continue
            try:
                outputs = self.engine.step()
            except Exception as error:  # surfaced to every stream, never swallowed
                self.last_error = f"{type(error).__name__}: {error}"
                self._fail_all(EngineDeadError(f"the engine step failed: {self.last_error}"))
                self._publish()
                continue
            self._deliver(outputs)
            now = time.monotonic()
            if now - last_publish >= self.stats_interval_s:
                self._publish()
                last_publish = now

    def _drain(self, block: bool) -> list:
        commands = [self._commands.get()] if block else []
        while True:
            try:
                commands.append(self._commands.get_nowait())
            except queue.Empty:
                return commands

    def _apply(self, command: _Add | _Abort) -> None:
        if isinstance(command, _Abort):
            self.engine.abort(command.request_id)
            return
        with self._streams_lock:
            stream = self._streams.get(command.request_id)
        if stream is None:  # the consumer left before its request was added
            return
        try:
            self.engine.add_request(command.prompt, command.params, command.request_id,
                                    command.owner)
        except Exception as error:
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, error)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        by_loop: dict[asyncio.AbstractEventLoop, list] = defaultdict(list)
        with self._streams_lock:
            for output in outputs:
                stream = self._streams.get(output.request_id)
                if stream is not None:
                    by_loop[stream.loop].append((stream.queue, output))
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, items)
            except RuntimeError:  # that event loop has closed; its streams are gone
                pass

    def _fail_all(self, error: BaseException) -> None:
        for request_id in list(self.engine.requests):
            self.engine.abort(request_id)
        self.engine.step()  # collects the abort outputs; nothing is scheduled
        self.engine.kv_cache.pool.reset_prefix_cache()
        with self._streams_lock:
            streams = list(self._streams.values())
        for stream in streams:
            try:
                stream.loop.call_soon_threadsafe(stream.queue.put_nowait, error)
            except RuntimeError:
                pass

    def _publish(self) -> None:
        self._stats = self.engine.stats()


def _put_all(items: list[tuple[asyncio.Queue, RequestOutput]]) -> None:
    for target, output in items:
        target.put_nowait(output)
