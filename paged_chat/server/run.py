"""Serving the API: the bind rules, and uvicorn on a socket of our own.

`paged-chat serve` runs the server as the program: Ctrl+C, SIGTERM and SIGHUP end it
gracefully (open requests are aborted) and `serve()` returns, the signal kept in
`stop_signal`, so that the program shuts its engine down before it exits (uvicorn itself
raises the signal again, which ended the program before that); once its engine stops (a
dead engine process) it exits too, with EngineDeadError, so that a supervisor restarts it
(as vLLM's API server does) instead of it answering 503 forever. The TUI runs it as one
more task on its own event loop (`embedded=True`): the app, not uvicorn, owns the signals
and the engine there.

Connections are bounded: at most MAX_CONNECTIONS at once (uvicorn answers 503 past them),
idle keep-alive ones close after KEEP_ALIVE_S, and one whose request headers are not all
in within `header_timeout_s` is closed (uvicorn itself never times out a request's headers).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import ipaddress
import signal
import socket
import threading
from collections.abc import Iterator, Sequence
from types import FrameType
from typing import Any

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from paged_chat.engine.clients.client_protocol import EngineClient
from paged_chat.engine.core.errors import EngineDeadError, PagedChatError
from paged_chat.server.app import build_app
from paged_chat.server.tool_calls import DefaultToolChoice

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8000
MAX_CONNECTIONS = 1024
KEEP_ALIVE_S = 5
HEADER_TIMEOUT_S = 10.0
ENGINE_WATCH_S = 0.5   # how often a server that is the program checks its engine still runs


class UnsafeBindError(PagedChatError):
    """A non-loopback address without an API key: anyone who reaches it could use the engine."""


def check_bind(host: str, api_key: str | None) -> None:
    if api_key or _is_loopback(host):
        return
    raise UnsafeBindError(f"refusing to serve on {host} without --api-key: anyone who can "
                          "reach that address could use the engine (bind 127.0.0.1, or set a key)")


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: it may resolve anywhere
        return False


class _EmbeddedServer(uvicorn.Server):
    """uvicorn without its signal handlers: the host application keeps its own."""

    def capture_signals(self) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()


class _ProgramServer(uvicorn.Server):
    """uvicorn as the program: its graceful shutdown on STOP_SIGNALS, the first of them kept
    in `stop_signal` instead of raised again after the shutdown."""

    STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    stop_signal: int | None = None

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():  # only it may set handlers
            yield
            return
        previous = {signum: signal.signal(signum, self.handle_exit) for signum in self.STOP_SIGNALS}
        try:
            yield
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.stop_signal is None:
            self.stop_signal = sig
        super().handle_exit(sig, frame)


class _HeaderTimeoutH11(H11Protocol):
    """uvicorn's h11 protocol, closing a connection whose request headers are not all in
    within `header_timeout_s` of its opening or of its last response. (uvicorn's keep-alive
    timer starts only after a response, and any byte cancels it.)"""

    def __init__(self, *args, header_timeout_s: float, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.header_timeout_s = header_timeout_s
        self.header_deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        self._await_headers()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._await_headers()

    def connection_lost(self, exc: Exception | None) -> None:
        if self.header_deadline is not None:
            self.header_deadline.cancel()
        super().connection_lost(exc)

    def _await_headers(self) -> None:
        if self.header_deadline is not None:
            self.header_deadline.cancel()
        self.header_deadline = self.loop.call_later(self.header_timeout_s, self._headers_late, self.cycle)

    def _headers_late(self, cycle: object) -> None:
        """Close the connection if no request began since the deadline was set and none runs."""
        idle = self.cycle is cycle and (cycle is None or self.cycle.response_complete)
        if idle and not self.transport.is_closing():
            self.transport.close()


class ApiServer:
    """The API for one EngineClient on a bound socket (port 0 picks a free one: `port`).
    The options past `embedded` are build_app's and `header_timeout_s` (module docstring)."""

    def __init__(self, client: EngineClient, host: str = DEFAULT_HOST, port: int = DEFAULT_PORT,
                 api_key: str | None = None, model_names: Sequence[str] = (),
                 embedded: bool = False, allowed_origins: Sequence[str] = (),
                 share_cache_with_tui: bool = False, max_body_bytes: int | None = None,
                 header_timeout_s: float = HEADER_TIMEOUT_S,
                 defaults: dict[str, Any] | None = None,
                 tool_choice: DefaultToolChoice = "auto") -> None:
        """`defaults`, `tool_choice`: what requests that omit them get (build_app)."""
        check_bind(host, api_key)
        self.client, self.embedded = client, embedded
        self.engine_stopped: str | None = None
        app = build_app(client, model_names, api_key, max_body_bytes, allowed_origins,
                        share_cache_with_tui, defaults, tool_choice)
        protocol = functools.partial(_HeaderTimeoutH11, header_timeout_s=header_timeout_s)
        config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off",
                                timeout_graceful_shutdown=5, http=protocol,
                                limit_concurrency=MAX_CONNECTIONS, timeout_keep_alive=KEEP_ALIVE_S)
        self.server = (_EmbeddedServer if embedded else _ProgramServer)(config)
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.socket = socket.socket(family, socket.SOCK_STREAM)
        try:
            self.socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self.socket.bind((host, port))
        except OSError as error:
            self.socket.close()
            raise PagedChatError(f"cannot serve on {host}:{port}: {error.strerror}") from error
        self.host, self.port = host, self.socket.getsockname()[1]

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    @property
    def started(self) -> bool:
        return self.server.started

    @property
    def stop_signal(self) -> int | None:
        """The signal that stopped a server that is the program, once `serve()` returned."""
        return self.server.stop_signal if isinstance(self.server, _ProgramServer) else None

    async def serve(self) -> None:
        """Serve until `stop()` (or, not embedded, a stop signal: see `stop_signal`; or the
        engine stopping: then it raises EngineDeadError once the open requests are answered)."""
        watch = None if self.embedded else asyncio.create_task(self._stop_with_the_engine())
        try:
            await self.server.serve(sockets=[self.socket])
        finally:
            self.socket.close()
            if watch is not None:
                watch.cancel()
        if self.engine_stopped is not None:
            raise EngineDeadError(f"the engine stopped ({self.engine_stopped}), so the server "
                                  "did too")

    async def _stop_with_the_engine(self) -> None:
        while self.client.running:
            await asyncio.sleep(ENGINE_WATCH_S)
        self.engine_stopped = self.client.last_error or "it was shut down"
        self.server.should_exit = True

    def stop(self) -> None:
        self.server.should_exit = True
