"""Serving the API: the bind rules, and uvicorn on a socket of our own.

`paged-chat serve` runs the server as the program (uvicorn handles Ctrl+C and SIGTERM:
open requests are aborted, then it exits). The TUI runs it as one more task on its own
event loop (`embedded=True`): the app, not uvicorn, owns the signals there.
"""

from __future__ import annotations

import contextlib
import ipaddress
import socket
from collections.abc import Sequence
from typing import Any

import uvicorn

from paged_chat.engine.clients.protocol import EngineClient
from paged_chat.engine.errors import PagedChatError
from paged_chat.server.app import build_app

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8000


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


class ApiServer:
    """The API for one EngineClient on a bound socket (port 0 picks a free one: `port`)."""

    def __init__(self, client: EngineClient, host: str = DEFAULT_HOST, port: int = DEFAULT_PORT,
                 api_key: str | None = None, model_names: Sequence[str] = (),
                 embedded: bool = False, defaults: dict[str, Any] | None = None) -> None:
        """`defaults`: the sampling values requests that omit them get (build_app)."""
        check_bind(host, api_key)
        app = build_app(client, model_names, api_key, defaults=defaults)
        config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off",
                                timeout_graceful_shutdown=5)
        self.server = (_EmbeddedServer if embedded else uvicorn.Server)(config)
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

    async def serve(self) -> None:
        """Serve until `stop()` (or, not embedded, Ctrl+C / SIGTERM)."""
        try:
            await self.server.serve(sockets=[self.socket])
        finally:
            self.socket.close()

    def stop(self) -> None:
        self.server.should_exit = True
