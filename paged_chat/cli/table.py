"""Tables on stdout: `models` and `chats list`."""

from __future__ import annotations

import sys

import typer

from paged_chat.app.text import sanitize_for_terminal


def print_table(header: list[str], rows: list[list[str]]) -> None:
    """Plain aligned columns: readable in a terminal, and easy to cut or grep in a pipe.
    On a terminal the cells are sanitized (they may hold stored text); piped, exact."""
    if sys.stdout.isatty():
        rows = [[sanitize_for_terminal(str(cell)) for cell in row] for row in rows]
    widths = [max(len(str(row[i])) for row in [header, *rows]) for i in range(len(header))]
    for row in [header, *rows]:
        typer.echo("  ".join(str(cell).ljust(width) for cell, width in zip(row, widths)).rstrip(), color=True)
