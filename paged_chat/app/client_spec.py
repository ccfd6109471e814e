"""client_spec: the one place the app turns what it was told (config.toml, command-line
options, an injected engine factory) into the ClientSpec that `make_client` builds."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from paged_chat.engine.clients.factory import ClientSpec

if TYPE_CHECKING:
    from paged_chat.engine import Engine, EngineConfig
    from paged_chat.engine.models.loader import ProgressHook


def client_spec(config: EngineConfig | None, transport: Literal["thread", "process"] = "thread",
                *, server: str | None = None, api_key: str | None = None,
                model: str | None = None,
                make_engine: Callable[[EngineConfig], Engine] | None = None,
                on_progress: ProgressHook | None = None, log_path: Path | None = None,
                leave_cores: int = 0, fork_if_safe: bool = False) -> ClientSpec:
    """A `server` URL wins (http:// when it names no scheme; its tokenizer from `model`
    when given, the key `api_key`). An injected `make_engine` (tests,
    CliState.engine_factory) runs on a thread whatever `transport` says: the engine it
    builds cannot cross to a spawned process."""
    if server:
        from paged_chat.app.settings import cache_dir

        url = server if "://" in server else f"http://{server}"
        return ClientSpec(url, api_key=api_key, remote_model=model, cache_dir=cache_dir())
    assert config is not None, "a local engine needs its config"
    if make_engine is not None:
        return ClientSpec("thread", engine=lambda: make_engine(config))
    return ClientSpec(transport, config, on_progress=on_progress, log_path=log_path,
                      leave_cores=leave_cores, fork_if_safe=fork_if_safe)
