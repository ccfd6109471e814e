"""What the commands of one `paged-chat` invocation share (`ctx.obj`): the debug flag, the
config path and settings read once, the engine factory tests replace, and how a failure
becomes one line and an exit code."""

from __future__ import annotations

import os
import sys
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import click
import typer

from paged_chat.app.settings import Settings, load_settings
from paged_chat.cli.plain_terminal import load_progress

if TYPE_CHECKING:
    from paged_chat.app.settings import TuiVocabulary
    from paged_chat.engine import Engine, EngineClient, EngineConfig


@dataclass(slots=True)
class CliState:
    """What the commands of one invocation share. Tests pass their own in
    `CliRunner.invoke(app, ..., obj=CliState(engine_factory=...))` to reuse one engine."""

    debug: bool = False
    config: Path | None = None
    engine_factory: Callable[[EngineConfig], Engine] | None = None
    _settings: Settings | None = None

    def settings(self, check_tui: bool = False) -> Settings:
        """config.toml (from --config, $PAGED_CHAT_CONFIG or the user config dir), read once;
        `check_tui` checks `[tui]` against the TUI's actions, themes and key names too (it
        imports Textual: only the TUI and `config` pay for that)."""
        if self._settings is None:
            self._settings = load_settings(self.config, _tui_vocabulary if check_tui else None)
        return self._settings

    def make_engine(self, config: EngineConfig) -> Engine:
        if self.engine_factory is not None:
            return self.engine_factory(config)
        from paged_chat.engine import Engine

        return Engine(config, on_progress=_load_progress())

    def server_engine(self, config: EngineConfig) -> EngineClient:
        """The engine a server streams from: in a process of its own, so the HTTP event loop
        and the engine share no GIL, its decode steps a core short of every core, which the
        loop needs while it streams (`python -m benchmarks.serve_overhead` compares the
        layouts). An injected factory's engine (tests) runs on a thread: it cannot cross to
        a spawned process."""
        from paged_chat.app.client_spec import client_spec
        from paged_chat.engine import make_client

        injected = self.make_engine if self.engine_factory is not None else None
        return make_client(client_spec(config, "process", make_engine=injected, leave_cores=1,
                                       on_progress=_load_progress()))

    @contextmanager
    def reported(self) -> Iterator[None]:
        """Turn failures into exit codes: a usage error is one line and status 2, any other
        error one line and status 1 (re-raised with --debug), Ctrl+C status 130. Python
        warnings (e.g. a directory made private) are one `Warning: ...` line each."""
        from paged_chat.cli.plain_terminal import UsageError

        try:
            with warnings.catch_warnings():
                warnings.simplefilter("default")
                warnings.showwarning = lambda message, *args, **kwargs: typer.echo(f"Warning: {message}", err=True)
                yield
        except (click.exceptions.Exit, typer.Exit, click.ClickException, click.Abort):
            raise
        except KeyboardInterrupt:  # while loading; during a reply `ask` handles Ctrl+C itself
            raise typer.Exit(130) from None
        except BrokenPipeError:  # `paged-chat ask ... | head`: the reader left; say nothing
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            raise typer.Exit(1) from None
        except UsageError as error:
            typer.echo(f"Error: {error}", err=True)
            raise typer.Exit(2) from None
        except Exception as error:
            if self.debug:
                raise
            typer.echo(f"Error: {_describe(error)}", err=True)
            raise typer.Exit(1) from None


def _tui_vocabulary() -> TuiVocabulary:
    """The TUI's action names, its themes and the key names Textual binds."""
    from textual.keys import KEY_NAME_REPLACEMENTS, KEY_TO_UNICODE_NAME, Keys
    from textual.theme import BUILTIN_THEMES

    from paged_chat.app.settings import TuiVocabulary
    from paged_chat.tui.actions import ACTIONS

    names = {key.value for key in Keys if key.value.isidentifier() or key.value.isalnum()}
    names |= {name for name in (*KEY_TO_UNICODE_NAME, *KEY_NAME_REPLACEMENTS.values())}
    return TuiVocabulary(actions=frozenset(action for action, *_ in ACTIONS),
                         themes=frozenset(BUILTIN_THEMES), key_names=frozenset(names))


def _load_progress() -> Callable[[str, int, int], None] | None:
    """A progress bar for a slow model load, where stderr is a terminal to draw it on."""
    return load_progress() if sys.stderr.isatty() else None


def _describe(error: Exception) -> str:
    """A surprise (not an error written for the user) says how to see more."""
    from paged_chat.engine.core.errors import USER_ERRORS, describe_error

    line = describe_error(error)
    return line if isinstance(error, USER_ERRORS) else f"{line} (`paged-chat --debug ...` shows the traceback)"
