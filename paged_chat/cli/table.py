"""Tables on stdout: `models` and `chats list`."""

from __future__ import annotations

import shutil
import sys

import typer

from paged_chat.app.text import sanitize_for_terminal

_GAP = "  "
# A shortened cell keeps at least this many characters: less would say nothing.
_MIN_SHORTENED = 12


def print_table(header: list[str], rows: list[list[str]], fit_column: int | None = None) -> None:
    """Plain aligned columns: readable in a terminal, and easy to cut or grep in a pipe.
    On a terminal the cells are sanitized (they may hold stored text) and, where the table
    is wider than the terminal, the cells of `fit_column` (a long path) are shortened in
    their middle so that a row fits on one line; piped, every cell is exact."""
    width = terminal_width()
    if width is not None:
        rows = [[sanitize_for_terminal(str(cell)) for cell in row] for row in rows]
        if fit_column is not None:
            rows = _fitted(header, rows, fit_column, width)
    widths = _column_widths([header, *rows])
    for row in [header, *rows]:
        cells = (str(cell).ljust(column_width) for cell, column_width in zip(row, widths))
        typer.echo(_GAP.join(cells).rstrip(), color=True)


def terminal_width() -> int | None:
    """The terminal's columns, or None when stdout is not a terminal."""
    return shutil.get_terminal_size().columns if sys.stdout.isatty() else None


def _column_widths(rows: list[list[str]]) -> list[int]:
    return [max(len(str(row[i])) for row in rows) for i in range(len(rows[0]))]


def _fitted(header: list[str], rows: list[list[str]], column: int, width: int) -> list[list[str]]:
    """`rows` with the cells of `column` shortened to what the terminal leaves for it."""
    others = [w for i, w in enumerate(_column_widths([header, *rows])) if i != column]
    room = max(_MIN_SHORTENED, len(header[column]), width - sum(others) - len(_GAP) * len(others))
    return [[_shortened_middle(str(cell), room) if i == column else cell for i, cell in enumerate(row)]
            for row in rows]


def _shortened_middle(text: str, limit: int) -> str:
    """`text` with its middle replaced by "…" to fit `limit` characters: a path keeps the
    start of its root and, with twice the room, the end that names its file."""
    if len(text) <= limit:
        return text
    head = (limit - 1) // 3
    return text[:head] + "…" + text[len(text) - (limit - 1 - head):]
