"""make_client: the one way a front end gets an EngineClient (the CLI, ask, the REPL, the
server, the TUI, the benchmarks).

A ClientSpec says which transport and with what: the engine on a thread of this process, in
a child process, or behind an OpenAI-compatible server's URL. The engine never imports the
app, so the app turns its settings into a spec itself (paged_chat/app/client_spec.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from paged_chat.engine.clients.client_protocol import EngineClient
from paged_chat.engine.core.config import EngineConfig

if TYPE_CHECKING:
    from paged_chat.engine.clients.process_transport import ProcessTransport
    from paged_chat.engine.core.engine import Engine
    from paged_chat.engine.models.loader import ProgressHook

LOCAL_TRANSPORTS = ("thread", "process")


@dataclass(slots=True, frozen=True)
class ClientSpec:
    """What `make_client` builds.

    `transport`: "thread" (the engine on a thread of this process), "process" (in a spawned
    child: no GIL shared with the caller) or an http(s) URL (an OpenAI-compatible server).
    A local engine is built from `config`, or is `engine`: one built elsewhere or a function
    that builds one (tests, an injected factory), which only a thread can take (neither
    crosses to a spawned process). `on_progress` hears a slow load advance; `log_path` takes
    a child's output; `leave_cores` is how many cores the caller needs while the engine
    steps (a child's StepThreads.leave_cores). A remote takes `api_key`, and
    `remote_model`: where to load the served model's tokenizer from (else the first id the
    server lists that resolves locally) and `cache_dir`: where a GGUF's converted tokenizer is
    saved (read rather than converted again; None: converted every time).
    `stats_interval_s`: the transport's default when None.
    `fork_if_safe`: a child process may be forked instead of spawned where that is safe (a
    caller with one thread and no torch: faster to start).
    """

    transport: str = "thread"
    config: EngineConfig | None = None
    engine: Engine | Callable[[], Engine] | None = None
    on_progress: ProgressHook | None = None
    log_path: Path | None = None
    leave_cores: int = 0
    api_key: str | None = None
    remote_model: str | None = None
    stats_interval_s: float | None = None
    fork_if_safe: bool = False
    cache_dir: Path | None = None

    def __post_init__(self) -> None:
        if not (self.transport in LOCAL_TRANSPORTS or is_url(self.transport)):
            raise ValueError(f"ClientSpec.transport={self.transport!r} is invalid: expected "
                             "'thread', 'process' or an http(s):// URL")
        if self.transport in LOCAL_TRANSPORTS and (self.config is None) == (self.engine is None):
            raise ValueError("a local engine client needs a config or an engine, not both")
        if self.transport == "process" and self.engine is not None:
            raise ValueError("an engine built here cannot cross to a child process: "
                             "use transport='thread', or give a config")


def is_url(transport: str) -> bool:
    return transport.startswith(("http://", "https://"))


def make_client(spec: ClientSpec) -> EngineClient:
    """Build the client `spec` describes; a failed load or an unreachable server is raised here."""
    return start_client(spec).result()


def start_client(spec: ClientSpec) -> StartingClient:
    """Begin building the client `spec` describes, and return at once: a child process is
    launched now, so its imports and model load overlap whatever the caller does next (an
    app importing its UI); `result()` waits for the client. Other transports start in
    `result()`, on the thread that waits (a thread transport's engine thread starts there)."""
    if spec.transport != "process":
        return StartingClient(spec)
    from paged_chat.engine.clients.process_transport import ProcessTransport

    assert spec.config is not None
    interval = _stats_interval(spec)
    transport = ProcessTransport(spec.config, spec.on_progress, spec.log_path, spec.leave_cores,
                                 fork_if_safe=spec.fork_if_safe, **interval)
    transport.launch()
    return StartingClient(spec, transport)


@dataclass(slots=True)
class StartingClient:
    """A client `start_client` has begun: `spec` and, for a child process, its transport,
    launched. `result()` is taken once; `cancel()` ends what was launched if it never was."""

    spec: ClientSpec
    launched: ProcessTransport | None = None
    taken: bool = False

    def result(self, on_progress: ProgressHook | None = None) -> EngineClient:
        """The client, once its engine has loaded (the load's error is raised here).
        `on_progress` hears the load advance from here on, instead of the spec's hook: a
        caller that started the engine before its listener existed gives it now."""
        assert not self.taken, "a started client is taken once"
        self.taken = True
        spec = self.spec
        if self.launched is not None:
            if on_progress is not None:
                self.launched.on_progress = on_progress
            from paged_chat.engine.clients.local import LocalClient

            return LocalClient(self.launched)
        if on_progress is not None:
            spec = dataclasses.replace(spec, on_progress=on_progress)
        return _build(spec)

    def cancel(self) -> None:
        """End a launched child that `result()` never took; nothing otherwise."""
        if self.launched is not None and not self.taken:
            self.taken = True
            self.launched.abandon()


def _stats_interval(spec: ClientSpec) -> dict[str, float]:
    """The spec's stats interval as a transport's keyword, or none (its own default)."""
    return {} if spec.stats_interval_s is None else {"stats_interval_s": spec.stats_interval_s}


def _build(spec: ClientSpec) -> EngineClient:
    """A client over a thread or a server (a child process is launched by `start_client`)."""
    interval = _stats_interval(spec)
    if is_url(spec.transport):
        from paged_chat.engine.clients.remote import RemoteClient

        return RemoteClient(spec.transport, spec.api_key, model=spec.remote_model,
                            cache_dir=spec.cache_dir, **interval)
    from paged_chat.engine.clients.local import LocalClient
    from paged_chat.engine.clients.thread_transport import ThreadTransport
    from paged_chat.engine.core.engine import Engine

    config, on_progress = spec.config, spec.on_progress
    assert spec.engine is not None or config is not None
    engine = spec.engine or (lambda: Engine(config, on_progress=on_progress))
    return LocalClient(ThreadTransport(engine, **interval))
