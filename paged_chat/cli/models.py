"""`paged-chat models`: the models this machine can run, found offline."""

from __future__ import annotations

from typing import TYPE_CHECKING

import typer

from paged_chat.cli.table import print_table

if TYPE_CHECKING:
    from paged_chat.cli.state import CliState


def models(ctx: typer.Context) -> None:
    """List the model aliases and the models found offline in the Hugging Face cache and in
    Ollama's and LM Studio's stores."""
    from paged_chat.app.catalog import find_models

    state: CliState = ctx.obj
    with state.reported():
        entries, notes = find_models()
    print_table(["MODEL", "KIND", "SIZE", "ARCH", "STATUS", "WEIGHTS"],
                [[e.name, e.kind, e.size, e.architecture, e.status, e.weights] for e in entries],
                fit_column=0)
    for note in notes:
        typer.echo(note, err=True)
