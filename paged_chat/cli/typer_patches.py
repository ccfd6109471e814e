"""Where the command line changes how Click and Typer behave, and why.

- Ctrl+C while the command line's modules import (up to a second on a busy machine) would
  print a KeyboardInterrupt traceback before any command can catch it. From this module's
  first line until `end_quiet_interrupt()` (paged_chat.cli.main calls it once its imports
  are in), SIGINT ends the process as its default action does: status 130, nothing printed.
  This module is therefore the first the command line imports.
- Typer's help prints a type after every option, `<bool>` after flags too, as if they took
  a value, and its placeholders (`<float range>`) leave the help column too narrow at 80
  columns: `FlagsShowNoType` shows none after flags and short ones elsewhere.
- Typer has no option whose value is optional (`paged-chat --serve [PORT]`):
  `OptionalValueGroup` gives such an option, given bare, its default value before parsing.
"""

from __future__ import annotations

import signal

# Only the main thread may set a handler; imported on another one, nothing changes.
_QUIET_INTERRUPT = signal.getsignal(signal.SIGINT) is signal.default_int_handler
try:
    if _QUIET_INTERRUPT:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
except ValueError:
    _QUIET_INTERRUPT = False

from typing import ClassVar  # noqa: E402

import click  # noqa: E402
from typer.core import TyperGroup  # noqa: E402


def end_quiet_interrupt() -> None:
    """Ctrl+C raises KeyboardInterrupt again, for the commands to handle."""
    if _QUIET_INTERRUPT:
        signal.signal(signal.SIGINT, signal.default_int_handler)


_SHORT_PLACEHOLDERS = {"<int range>": "<n>", "<int>": "<n>", "<float range>": "<x>",
                       "<float>": "<x>", "<str>": "<text>"}


def _without_flag_types(params: list[click.Parameter], ctx: click.Context) -> list[click.Parameter]:
    for param in params:
        if getattr(param, "is_flag", False):
            param.metavar = ""
        elif param.metavar is None and param.param_type_name == "option":
            shown = param.display_type_rich(ctx)
            param.metavar = _SHORT_PLACEHOLDERS.get(shown, shown)
    return params


class FlagsShowNoType(TyperGroup):
    """A command group whose help shows no type after flags (--help included) and short
    value placeholders, in the group and in its commands."""

    def get_params(self, ctx: click.Context) -> list[click.Parameter]:
        return _without_flag_types(super().get_params(ctx), ctx)

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        command = super().get_command(ctx, name)
        if command is not None:
            _without_flag_types(command.get_params(ctx), ctx)
        return command


class OptionalValueGroup(FlagsShowNoType):
    """A group whose options in `optional_values` take their value optionally: given last,
    or before anything that is not a number, such an option gets its default. Only the
    group's own options are looked at: the first command name ends them."""

    optional_values: ClassVar[dict[str, int]] = {}

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        commands = set(self.list_commands(ctx))
        given = list(args)
        for index, arg in enumerate(given):
            if arg == "--" or arg in commands:
                break
            if arg in self.optional_values and (index + 1 == len(given) or not given[index + 1].isdigit()):
                given[index] = f"{arg}={self.optional_values[arg]}"
        return super().parse_args(ctx, given)
