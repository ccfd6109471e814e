"""Who may use a server that has no API key: the programs of this machine, not the web pages
its browser runs. An ASGI middleware in front of every route refuses:

- a `Host` that is not a loopback name (localhost, 127.0.0.0/8, [::1], any port): a page
  that rebinds its own DNS name to 127.0.0.1 reaches the server as `Host: evil.example`,
  and, being same-origin then, could read every answer (403);
- an `Origin` that is neither a loopback origin nor in `allowed_origins` (`[server]
  allowed_origins`, `serve --allowed-origin`; "*" allows any): a browser names the page's
  origin on every cross-origin fetch (403). Without an Origin, `Sec-Fetch-Site:
  cross-site` is refused too;
- a body that is not `application/json`: text/plain, form and multipart bodies are
  "simple" requests a page can send blind, without the preflight a JSON body needs (415).

Refusals are one-line OpenAI error objects, sent before the app reads anything. Origins
that pass get CORS answers (preflights included, by Starlette's CORSMiddleware inside this
guard), so a web UI on localhost or on an allowed origin can read the replies.
"""

from __future__ import annotations

import ipaddress
import json
import re
from collections.abc import Sequence

from starlette.middleware.cors import CORSMiddleware
from starlette.types import ASGIApp, Receive, Scope, Send

from paged_chat.engine.core.errors import PagedChatError
from paged_chat.server.api_types import error_body

# An origin as a browser sends it: scheme, host and an optional port, nothing after.
_ORIGIN = re.compile(r"(?P<scheme>https?)://(?P<host>\[[0-9a-f:.]+\]|[^/:\[\]\s]+)"
                     r"(?::(?P<port>\d{1,5}))?", re.IGNORECASE)
_DEFAULT_PORTS = {"http": "80", "https": "443"}
# Any port of a loopback name: the origins of web UIs this machine serves (Ollama's default).
LOOPBACK_ORIGIN_PATTERN = r"https?://(localhost|127(\.\d{1,3}){3}|\[::1\])(:\d{1,5})?"


class OriginError(PagedChatError):
    """An `allowed_origins` entry that is not an origin like http://host:port."""


def normalize_origin(origin: str) -> str:
    """`origin` as a browser serializes it (lower case, no default port), or OriginError."""
    if origin.strip() == "*":
        return "*"
    match = _ORIGIN.fullmatch(origin.strip())
    if match is None:
        raise OriginError(f"allowed origin {origin!r} is not an origin: write it as "
                          "http://host or https://host:port (no path), or * for any")
    scheme, host, port = match["scheme"].lower(), match["host"].lower(), match["port"]
    return f"{scheme}://{host}" + ("" if port in (None, _DEFAULT_PORTS[scheme]) else f":{port}")


def is_loopback_host(host: str) -> bool:
    """Whether a Host header's value (a name or address, with or without a port) names this
    machine's loopback: localhost, 127.x.x.x or [::1] (in a Host, IPv6 is in brackets)."""
    if host.startswith("["):
        name, bracket, port = host[1:].partition("]")
        port = port.removeprefix(":") if bracket and port.startswith(":") else port
    else:
        name, _, port = host.partition(":")
    if port and not port.isdigit():
        return False
    if name.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


class LocalOnlyGuard:
    """The keyless server's guard (see the module docstring), wrapped around `app`; with
    `keyless=False` (a server with an API key) it only answers CORS. `allowed_origins` are
    as normalize_origin gives them."""

    def __init__(self, app: ASGIApp, allowed_origins: Sequence[str] = (), keyless: bool = True) -> None:
        self.any_origin = "*" in allowed_origins
        self.allowed_origins = frozenset(allowed_origins)
        self.keyless = keyless
        self.app = CORSMiddleware(app, allow_origins=list(allowed_origins),
                                  allow_origin_regex=LOOPBACK_ORIGIN_PATTERN,
                                  allow_methods=["GET", "POST"],
                                  allow_headers=["authorization", "content-type"])

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        refusal = self.refusal(scope) if scope["type"] == "http" and self.keyless else None
        if refusal is None:
            await self.app(scope, receive, send)
            return
        status, message = refusal
        body = json.dumps(error_body(message, status)).encode()
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(body)).encode()),
                                (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body})

    def refusal(self, scope: Scope) -> tuple[int, str] | None:
        """(status, message) for a request this guard refuses, None for one it lets by."""
        headers = {name.decode("latin-1"): value.decode("latin-1") for name, value in scope["headers"]}
        host = headers.get("host")
        if host is not None and not is_loopback_host(host):
            return 403, (f"refused: Host {host!r} is not a loopback name; a server without "
                         "--api-key answers only requests for localhost, 127.0.0.1 or [::1]")
        origin = headers.get("origin")
        if origin is not None and not self.origin_allowed(origin):
            return 403, (f"refused: requests from the web page at {origin!r} are not allowed; a "
                         "server without --api-key takes only loopback origins and those in "
                         "[server] allowed_origins (serve --allowed-origin)")
        if origin is None and headers.get("sec-fetch-site") == "cross-site":
            return 403, ("refused: a cross-site request from a web page; a server without "
                         "--api-key takes only loopback origins and [server] allowed_origins")
        if scope["method"] not in ("GET", "HEAD", "OPTIONS"):
            media_type = headers.get("content-type", "").split(";", 1)[0].strip().lower()
            if media_type != "application/json":
                got = f"got {media_type!r}" if media_type else "it had none"
                return 415, f"send the body as JSON with `Content-Type: application/json` ({got})"
        return None

    def origin_allowed(self, origin: str) -> bool:
        if self.any_origin or re.fullmatch(LOOPBACK_ORIGIN_PATTERN, origin):
            return True
        try:
            return normalize_origin(origin) in self.allowed_origins
        except OriginError:  # "null" (a sandboxed page, a file) or garbage
            return False
