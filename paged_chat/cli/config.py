"""`paged-chat config`: where the config file is, and the settings in effect."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated

import typer

from paged_chat.app.settings import config_path

if TYPE_CHECKING:
    from paged_chat.cli.state import CliState


def show_config(ctx: typer.Context,
                path_only: Annotated[bool, typer.Option("--path", help="Print only the path.")] = False,
                ) -> None:
    """Print the config file's path and the effective settings (as config.toml text)."""
    from paged_chat.app.settings import cache_dir, data_dir

    state: CliState = ctx.obj
    path = state.config or config_path()
    if path_only:
        typer.echo(str(path))
        return
    with state.reported():
        settings = state.settings(check_tui=True)
        store, cache = data_dir() / "chats.db", cache_dir()
    where = "" if settings.path is not None else " (not found: defaults)"
    typer.echo(f"# config: {path}{where}\n# chats:  {store}\n# cache:  {cache}\n")
    typer.echo(settings.to_toml(), nl=False)
