"""The `paged-chat` command line's root: the bare command (the TUI), the command groups
(one module each: ask, chat, serve, models, config, bench, chats, cache), and what happens
to an error and to the process at the end.

Only typer and light modules are imported up front; torch, transformers, textual and the
store load inside the commands that need them, so `--help` and `--version` start at once.
Per-invocation state (debug flag, config path, loaded settings, the engine factory tests
replace) lives in `ctx.obj`, a CliState (cli/state.py).

Exit codes: 0 ok, 1 runtime error (one `Error: ...` line on stderr; the traceback only
with --debug), 2 usage error, 130 Ctrl+C (143 SIGTERM, 129 SIGHUP during a reply or `serve`).
"""

from __future__ import annotations

# First of all: Ctrl+C stays quiet until the imports below are in (see typer_patches).
from paged_chat.cli.typer_patches import OptionalValueGroup, end_quiet_interrupt  # isort: skip

import dataclasses
import logging
import os
import sys
import threading
from collections.abc import Callable
from contextlib import suppress
from pathlib import Path
from typing import Annotated, ClassVar, NoReturn

import typer

from paged_chat.cli.ask import ask
from paged_chat.cli.bench import bench
from paged_chat.cli.cache import cache_app
from paged_chat.cli.chat import chat
from paged_chat.cli.chats import chats_app
from paged_chat.cli.config import show_config
from paged_chat.cli.models import models
from paged_chat.cli.serve import SERVE_PORT, serve
from paged_chat.cli.state import CliState

end_quiet_interrupt()


class RootGroup(OptionalValueGroup):
    """The bare command: `--serve` takes its port optionally."""

    optional_values: ClassVar[dict[str, int]] = {"--serve": SERVE_PORT}


# Markdown: a docstring's paragraphs are reflowed to the terminal's width (typer's "rich"
# mode keeps their source line breaks, which read as breaks mid-sentence).
app = typer.Typer(name="paged-chat", add_completion=False, pretty_exceptions_enable=False,
                  context_settings={"help_option_names": ["-h", "--help"]}, cls=RootGroup,
                  rich_markup_mode="markdown")
app.add_typer(chats_app, name="chats")
app.add_typer(cache_app, name="cache")
app.command()(ask)
app.command()(chat)
app.command()(serve)
app.command()(models)
app.command("config")(show_config)
app.command()(bench)


class _StderrHandler(logging.StreamHandler):
    """Log lines to whatever sys.stderr is when they are written (a test runner swaps it)."""

    def __init__(self) -> None:
        super().__init__()
        self.setFormatter(logging.Formatter("%(name)s: %(message)s"))

    @property
    def stream(self):  # noqa: ANN201 (StreamHandler's attribute)
        return sys.stderr

    @stream.setter
    def stream(self, _value) -> None:  # noqa: ANN001
        pass


def _log_to_stderr() -> Callable[[], None]:
    """--debug: paged-chat's own log lines (which kernels were compiled, and in how long;
    the server's) on stderr, not other libraries'. Returns what undoes it (the command's
    end, so a later command in the same process logs as it did before)."""
    package = logging.getLogger("paged_chat")
    handler, level = _StderrHandler(), package.level
    package.addHandler(handler)
    package.setLevel(logging.DEBUG)

    def undo() -> None:
        package.removeHandler(handler)
        package.setLevel(level)
    return undo


def _version(value: bool) -> None:
    if value:
        from importlib.metadata import version

        typer.echo(f"paged-chat {version('paged-chat')}")
        raise typer.Exit()


@app.callback(invoke_without_command=True)
def root(ctx: typer.Context,
         demo: Annotated[int | None, typer.Option(
             min=1, help="Open the TUI with N demo chats generating at once.")] = None,
         config: Annotated[Path | None, typer.Option(
             "--config", exists=True, dir_okay=False,
             help="The config.toml to read (default: $PAGED_CHAT_CONFIG, else the user config dir).")
         ] = None,
         serve: Annotated[int | None, typer.Option(
             "--serve", min=0, max=65535, metavar="[PORT]",
             help=f"Also serve the OpenAI-compatible API on 127.0.0.1:PORT (default {SERVE_PORT}) "
                  "on the engine the TUI shows.")] = None,
         server: Annotated[str | None, typer.Option(
             "--server", metavar="URL", help="Chat on this OpenAI-compatible server (vLLM, "
                                             "another paged-chat...) instead of the local engine.")] = None,
         model: Annotated[str | None, typer.Option(
             "--model", "-m", help="The model to chat with (default: [engine] model); with "
                                   "--server, a local copy of the served model's tokenizer, "
                                   "else the server's own is used.")] = None,
         debug: Annotated[bool, typer.Option("--debug", help="Show tracebacks on errors.")] = False,
         version: Annotated[bool, typer.Option("--version", callback=_version, is_eager=True,
                                               help="Print the version and exit.")] = False,
         ) -> None:
    """Chat with local LLMs in many terminal tabs on one paged-KV-cache engine.

    Without a command, opens the chat TUI (it needs a terminal: in pipes and scripts use
    `paged-chat ask`).
    """
    state = ctx.ensure_object(CliState)
    state.debug = debug
    state.config = config
    if debug:
        ctx.call_on_close(_log_to_stderr())
    if ctx.invoked_subcommand is not None:
        for name, value in (("--demo", demo), ("--serve", serve), ("--server", server),
                            ("--model", model)):
            if value is not None:
                raise typer.BadParameter("it opens the TUI, so it takes no command", param_hint=name)
        return
    if not _has_terminal():
        typer.echo("Error: the chat TUI needs a terminal; in pipes and scripts use "
                   "`paged-chat ask` (see `paged-chat ask -h`)", err=True)
        raise typer.Exit(2)
    with state.reported():
        from paged_chat.tui.start import run_app

        settings = state.settings(check_tui=True)
        if model is not None:
            settings = dataclasses.replace(settings, engine=dataclasses.replace(settings.engine, model=model))
        if serve is not None and (server or settings.server.url):
            raise typer.BadParameter("--serve serves the local engine; it cannot with --server",
                                     param_hint="--serve")
        code = run_app(settings, demo, serve_port=serve, server=server or settings.server.url)
        if code:
            raise typer.Exit(code)


def _has_terminal() -> bool:
    return sys.stdin.isatty() and sys.stdout.isatty()


def main() -> NoReturn:
    """The console script: run the command, then end the process with its status."""
    try:
        app(prog_name="paged-chat")
        code: int | str | None = 0
    except SystemExit as done:
        code = done.code
    _end_process(code)


def _end_process(code: int | str | None) -> NoReturn:
    """Exit with `code`. A thread still alive here that would hold the interpreter's exit
    ends the process at once, once its output is flushed (every store was closed on the way
    here); otherwise it exits as usual.

    - The engine thread, in native code that does not return in time: a model load that
      Ctrl+C cut short goes on on its thread, or a step is stuck. Finalizing the interpreter
      under it kills the process: CPython ends a daemon thread that takes the GIL during
      finalization with pthread_exit, whose unwinding through torch's C++ frames calls
      std::terminate ("terminate called without an active exception", status 134), and
      torch's atexit hooks run while it still uses torch (a traceback).
    - Textual's input thread on a terminal that hung up (tui/textual_compat.py,
      INPUT_THREAD_NAME): the exit would wait on it for good, spinning a core."""
    names = {getattr(sys.modules.get(module), attribute, None) for module, attribute in (
        ("paged_chat.engine.clients.thread_transport", "ENGINE_THREAD_NAME"),
        ("paged_chat.tui.textual_compat", "INPUT_THREAD_NAME"))} - {None}
    if any(thread.name in names and thread.is_alive() for thread in threading.enumerate()):
        for stream in (sys.stdout, sys.stderr):
            with suppress(OSError, ValueError):
                stream.flush()
        os._exit(code if isinstance(code, int) else 0 if code is None else 1)
    sys.exit(code)
