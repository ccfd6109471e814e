"""`paged-chat serve`: the engine as an OpenAI-compatible API."""

from __future__ import annotations

from enum import Enum
from typing import TYPE_CHECKING, Annotated

import typer

if TYPE_CHECKING:
    from paged_chat.cli.state import CliState

SERVE_PORT = 8000


class ToolChoiceDefault(str, Enum):
    auto = "auto"
    required = "required"


def serve(ctx: typer.Context,
          host: Annotated[str, typer.Option(help="Address to bind; any but loopback needs --api-key.")
                          ] = "127.0.0.1",
          port: Annotated[int, typer.Option(min=0, max=65535, help="Port (0: any free one).")] = SERVE_PORT,
          model: Annotated[str | None, typer.Option(
              "--model", "-m", help="Alias, .gguf file, HF folder or cached hub id.")] = None,
          api_key: Annotated[str | None, typer.Option(
              "--api-key", envvar="PAGED_CHAT_API_KEY",
              help="Require `Authorization: Bearer KEY` on every request.")] = None,
          allowed_origin: Annotated[list[str] | None, typer.Option(
              "--allowed-origin", metavar="ORIGIN",
              help="A web origin (https://host:port) whose pages may use a server without "
                   "--api-key, besides loopback ones; repeatable, adds to [server] allowed_origins.")
                                    ] = None,
          tool_choice: Annotated[ToolChoiceDefault, typer.Option(
              help="tool_choice of a request with tools that sends none: auto (the model "
                   "decides), or required (a turn that answers the user must call a tool, one "
                   "that answers tool results may not): for clients that send none, such as "
                   "`llm`, with a model too small to call on its own.")
                                 ] = ToolChoiceDefault.auto,
          ) -> None:
    """Serve the engine as an OpenAI-compatible API (/v1/chat/completions, /v1/completions,
    /v1/models, /health, /metrics) until Ctrl+C, SIGTERM or SIGHUP (the engine is shut down,
    then exit 130, 143, 129), or until the engine stops (then exit 1).
    Without --api-key it takes JSON bodies only, for a loopback Host, from no web page but
    those of loopback and allowed origins. Sampling fields a request omits take the model's
    generation_config.json values, else [chat]'s (listed in /v1/models).

    Example:

        paged-chat serve --port 8000 &

        curl localhost:8000/v1/chat/completions -H 'Content-Type: application/json' -d '{"messages": [{"role": "user", "content": "Hi"}]}'
    """
    state: CliState = ctx.obj
    with state.reported():
        import asyncio

        from paged_chat.server import ApiServer, check_bind
        from paged_chat.server.guards import normalize_origin

        check_bind(host, api_key)
        settings = state.settings()
        origins = [normalize_origin(origin) for origin in [*settings.server.allowed_origins,
                                                           *(allowed_origin or [])]]
        config = settings.engine_config(model=model)
        client = state.server_engine(config)
        generation_defaults = client.info.generation_defaults
        try:
            server = ApiServer(client, host, port, api_key, model_names=[config.model],
                               allowed_origins=origins,
                               defaults=settings.request_defaults(generation_defaults) | {
                                   "max_tokens": settings.model_sampling(generation_defaults)["max_tokens"]},
                               tool_choice=tool_choice.value)
            typer.echo(f"serving {client.info.name} on {server.url}/v1 (Ctrl+C stops)", err=True)
            asyncio.run(server.serve())
        finally:
            client.shutdown()
        if server.stop_signal is not None:
            raise typer.Exit(128 + server.stop_signal)
