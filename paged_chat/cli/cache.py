"""`paged-chat cache`: the engine's disk cache."""

from __future__ import annotations

from typing import TYPE_CHECKING

import typer

from paged_chat.cli.typer_patches import FlagsShowNoType

if TYPE_CHECKING:
    from paged_chat.cli.state import CliState

cache_app = typer.Typer(help="The engine's disk cache (the KV tier: chat histories' KV).",
                        cls=FlagsShowNoType, rich_markup_mode="markdown")


@cache_app.command("clear")
def clear_cache(ctx: typer.Context) -> None:
    """Delete the disk KV tier (every model's); the next turn of each chat prefills its history."""
    state: CliState = ctx.obj
    with state.reported():
        from paged_chat.app.settings import cache_dir
        from paged_chat.engine.kv.tier import TIER_DIR, clear_disk_tier

        files, freed = clear_disk_tier(cache_dir())
    typer.echo(f"freed {freed / 2**20:,.1f} MiB ({files} KV blocks) from {cache_dir() / TIER_DIR}")
