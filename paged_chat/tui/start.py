"""The bare `paged-chat` command's start: the engine first, then the UI.

A warm start (the model's tokenizer and weights converted and cached) waits on the engine
child: its interpreter, `import torch` and the engine's imports, the model load. Textual's
import and the first layout take long too. So the child is launched
here, before this module imports Textual (it imports none itself), and the two overlap;
the app's worker then waits for the child the CLI launched (`PagedChatApp(engine_start=)`),
and a failed load reaches the status line as it always has.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from paged_chat.app.settings import Settings
from paged_chat.tui.engine_start import app_engine_config, start_engine

if TYPE_CHECKING:
    from paged_chat.engine import EngineClient, EngineConfig, StartingClient


def run_app(settings: Settings, demo: int | None = None, serve_port: int | None = None,
            server: str | None = None) -> int:
    """The bare `paged-chat` command: open the TUI (with `demo`, N self-chatting tabs; with
    `serve_port`, the API on its engine too; with `server`, on that remote server's engine).
    Returns the exit status: 0, or 128 + the signal that ended it (SIGTERM: 143)."""
    engine: EngineClient | None = None
    engine_start: StartingClient | None = None
    config: EngineConfig | None = None
    if server:
        from paged_chat.app.client_spec import client_spec
        from paged_chat.engine import make_client

        engine = make_client(client_spec(None, server=server, api_key=settings.server.api_key,
                                         model=settings.engine.model))
    else:
        config = app_engine_config(settings, demo)
        engine_start = start_engine(config, settings.tui.engine_process)
    try:
        from paged_chat.tui.app import PagedChatApp  # Textual: while the child loads

        app = PagedChatApp(settings, demo=demo, engine=engine, engine_config=config,
                           engine_start=engine_start, serve_port=serve_port)
        try:
            app.run()
        finally:
            if app.demo_dir is None:
                app.store.close()
        return app.return_code or 0
    finally:
        if engine_start is not None:
            engine_start.cancel()   # the app ended before its worker took the engine
