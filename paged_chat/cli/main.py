"""The `paged-chat` command line: the TUI (bare command), `ask`, `chat`, `models`, `chats`,
`config`, `bench`, `cache`.

Only typer and the settings module are imported up front; torch, transformers, textual
and the store load inside the commands that need them, so `--help` and `--version` start
at once. Per-invocation state (debug flag, config path, loaded settings, the engine
factory tests replace) lives in `ctx.obj`, a CliState.

Exit codes: 0 ok, 1 runtime error (one `Error: ...` line on stderr; the traceback only
with --debug), 2 usage error, 130 Ctrl+C (143 SIGTERM, 129 SIGHUP during a reply).

Stored text (titles, messages) printed to a terminal is sanitized first: a chat can hold
anything a prompt or a model put in it, escape sequences included. Piped, it is exact.
"""

from __future__ import annotations

import signal

# Ctrl+C while the modules below import (up to a second on a busy machine) would print a
# KeyboardInterrupt traceback, before any command can catch it: until they are in, SIGINT
# ends the process as its default action does (status 130, nothing printed). First of
# all, before any other import; only the main thread may set a handler.
_QUIET_INTERRUPT = signal.getsignal(signal.SIGINT) is signal.default_int_handler
try:
    if _QUIET_INTERRUPT:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
except ValueError:  # imported on another thread
    _QUIET_INTERRUPT = False

import dataclasses  # noqa: E402
import json  # noqa: E402
import logging  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
import warnings  # noqa: E402
from collections.abc import Callable, Iterator  # noqa: E402
from contextlib import ExitStack, contextmanager, suppress  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from enum import Enum  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import TYPE_CHECKING, Annotated, NoReturn  # noqa: E402

import click  # noqa: E402
import typer  # noqa: E402
from typer.core import TyperGroup  # noqa: E402

from paged_chat.app.finish_labels import finish_label  # noqa: E402
from paged_chat.app.settings import Settings, config_path, load_settings  # noqa: E402
from paged_chat.app.text import sanitize_for_terminal  # noqa: E402

if _QUIET_INTERRUPT:
    signal.signal(signal.SIGINT, signal.default_int_handler)

if TYPE_CHECKING:
    from paged_chat.app.chat_store import ChatStore, StoredChat
    from paged_chat.engine import Engine, EngineClient, EngineConfig
    from paged_chat.app.settings import TuiVocabulary

# Short value placeholders: typer's own (`<float range>`) leave the help column too
# narrow at 80 columns.
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


class _FlagsShowNoType(TyperGroup):
    """Typer's help prints a type after every option, `<bool>` after flags too, as if they
    took a value: flags (--help included) show none, in this group and its commands."""

    def get_params(self, ctx: click.Context) -> list[click.Parameter]:
        return _without_flag_types(super().get_params(ctx), ctx)

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        command = super().get_command(ctx, name)
        if command is not None:
            _without_flag_types(command.get_params(ctx), ctx)
        return command


SERVE_PORT = 8000


class _RootGroup(_FlagsShowNoType):
    """The bare command: `--serve` takes its port optionally. Typer has no options with an
    optional value, so a bare `--serve` (last, or before anything that is not a port) gets
    the default port before parsing. Only the root's own options are looked at: the first
    command name ends them."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        commands = set(self.list_commands(ctx))
        given = list(args)
        for index, arg in enumerate(given):
            if arg == "--" or arg in commands:
                break
            if arg == "--serve" and (index + 1 == len(given) or not given[index + 1].isdigit()):
                given[index] = f"--serve={SERVE_PORT}"
        return super().parse_args(ctx, given)


# Markdown: a docstring's paragraphs are reflowed to the terminal's width (typer's "rich"
# mode keeps their source line breaks, which read as breaks mid-sentence).
app = typer.Typer(name="paged-chat", add_completion=False, pretty_exceptions_enable=False,
                  context_settings={"help_option_names": ["-h", "--help"]}, cls=_RootGroup,
                  rich_markup_mode="markdown")
chats_app = typer.Typer(cls=_FlagsShowNoType, rich_markup_mode="markdown")
app.add_typer(chats_app, name="chats")
cache_app = typer.Typer(help="The engine's disk cache (the KV tier: chat histories' KV).",
                        cls=_FlagsShowNoType, rich_markup_mode="markdown")
app.add_typer(cache_app, name="cache")
MODEL_HELP = ("Alias, .gguf file, HF folder, cached hub id, ollama:NAME(:TAG) or "
              "lmstudio:PUBLISHER/REPO(/FILE).")


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
        loop needs while it streams (measured with `python -m benchmarks.serve_overhead`, 32
        chats over HTTP on 2 cores, float32: 148-164 tok/s with the engine on a thread of
        the server, 164-183 like this, 144-148 in a process on every core). An injected
        factory's engine (tests) runs on a thread: it cannot cross to a spawned process."""
        from paged_chat.app.client_spec import client_spec
        from paged_chat.engine import make_client

        injected = self.make_engine if self.engine_factory is not None else None
        return make_client(client_spec(config, "process", make_engine=injected, leave_cores=1,
                                       on_progress=_load_progress()))


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
    from paged_chat.cli.ask import load_progress

    return load_progress() if sys.stderr.isatty() else None


def _state(ctx: typer.Context) -> CliState:
    return ctx.ensure_object(CliState)


@contextmanager
def _reported(ctx: typer.Context) -> Iterator[None]:
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
        if _state(ctx).debug:
            raise
        typer.echo(f"Error: {_describe(error)}", err=True)
        raise typer.Exit(1) from None


def _describe(error: Exception) -> str:
    """A surprise (not an error written for the user) says how to see more."""
    from paged_chat.engine.core.errors import USER_ERRORS, describe_error

    line = describe_error(error)
    return line if isinstance(error, USER_ERRORS) else f"{line} (`paged-chat --debug ...` shows the traceback)"


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
    state = _state(ctx)
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
    with _reported(ctx):
        from paged_chat.tui.start import run_app

        settings = state.settings(check_tui=True)
        if model is not None:
            settings = dataclasses.replace(settings, engine=dataclasses.replace(settings.engine, model=model))
        if serve is not None and (server or settings.server.url):
            raise typer.BadParameter("--serve serves the local engine; it cannot with --server",
                                     param_hint="--serve")
        run_app(settings, demo, serve_port=serve, server=server or settings.server.url)


def _has_terminal() -> bool:
    return sys.stdin.isatty() and sys.stdout.isatty()


@app.command()
def ask(ctx: typer.Context,
        prompt: Annotated[str | None, typer.Argument(
            help="The prompt. Piped stdin is read too and comes first.", show_default=False)] = None,
        model: Annotated[str | None, typer.Option(
            "--model", "-m", help=MODEL_HELP)] = None,
        system: Annotated[str | None, typer.Option("--system", "-s", help="System prompt.")] = None,
        max_tokens: Annotated[int | None, typer.Option(
            min=1, help="Most tokens to generate.")] = None,
        temperature: Annotated[float | None, typer.Option(min=0.0, help="0 is greedy.")] = None,
        top_p: Annotated[float | None, typer.Option(help="Nucleus sampling, in (0, 1].")] = None,
        top_k: Annotated[int | None, typer.Option(
            min=0, help="Keep the k likeliest tokens; 0: off.")] = None,
        seed: Annotated[int | None, typer.Option(
            min=0, help="Sampling seed, for repeatable output.")] = None,
        device: Annotated[str | None, typer.Option(help="auto, cpu or cuda.")] = None,
        dtype: Annotated[str | None, typer.Option(help="auto, float32, bfloat16 or float16.")] = None,
        stats: Annotated[bool, typer.Option(
            "--stats", help="Print prompt tokens, prefix-cache hits, time to first token and "
                            "tokens/s to stderr.")] = False,
        json_output: Annotated[bool, typer.Option(
            "--json", help="Print one JSON object (text, token counts, timings, finish reason) "
                           "instead of streaming text; JSONL with --file.")] = False,
        continue_chat: Annotated[bool, typer.Option(
            "--continue", "-c",
            help="Continue the most recent chat, reusing its exact token history.")] = False,
        chat: Annotated[str | None, typer.Option(
            "--chat", help="Continue this chat (an id or its first characters).")] = None,
        no_save: Annotated[bool, typer.Option("--no-save", help="Do not save this turn.")] = False,
        file: Annotated[str | None, typer.Option(
            "--file", "-f", metavar="<file>", help="Answer every prompt of this file at once (one per line, or JSONL "
                                 'with {"prompt": ...}); "-" reads stdin. Not saved.')] = None,
        server: Annotated[str | None, typer.Option(
            "--server", help="Ask this OpenAI-compatible server (URL) instead of the local engine; "
                             "--model then names a local copy of its tokenizer.")] = None,
        api_key: Annotated[str | None, typer.Option(
            "--api-key", envvar="PAGED_CHAT_API_KEY", help="The --server's API key.")] = None,
        json_schema: Annotated[typer.FileText | None, typer.Option(
            "--json-schema", encoding="utf-8", metavar="<file>",
            help="Answer with JSON that this JSON schema (a file) accepts.")] = None,
        choice: Annotated[str | None, typer.Option(
            "--choice", metavar="a,b,c", help="Answer with exactly one of these strings.")] = None,
        ) -> None:
    """Answer a prompt, streaming the reply to stdout. Saved as a chat unless --no-save.

    Examples:

        paged-chat ask "Why is the sky blue?"

        git diff | paged-chat ask "Review this change"

        paged-chat ask -c "And in one sentence?"

        paged-chat ask --file prompts.txt --json

        paged-chat ask --json-schema person.json "Describe a baker"
    """
    from paged_chat.cli.ask import (check_text_options, open_prompt_file, run_ask,
                                structured_output_options)
    from paged_chat.cli.plain_terminal import AskOptions

    state = _state(ctx)
    options = AskOptions(
        prompt=prompt if prompt and prompt.strip() else None, system=system, stats=stats,
        json=json_output, continue_chat=continue_chat, chat_id=chat, save=not no_save,
        engine={"model": model, "device": device, "dtype": dtype},
        sampling={"max_tokens": max_tokens, "temperature": temperature, "top_p": top_p,
                  "top_k": top_k, "seed": seed})
    with _reported(ctx), ExitStack() as cleanup:
        check_text_options(options)
        if file is not None:
            options.file = cleanup.enter_context(open_prompt_file(file))
        options.sampling |= structured_output_options(json_schema, choice)
        settings = state.settings()
        options.server = server or settings.server.url
        options.api_key = api_key or settings.server.api_key
        options.remote_model = model or settings.engine.model
        if system == "":  # an explicit empty --system clears the configured one
            settings = dataclasses.replace(settings, chat=dataclasses.replace(settings.chat, system_prompt=None))
        code = run_ask(options, settings, state.make_engine, sys.stdin)
    raise typer.Exit(code)


@app.command("chat")
def chat_command(ctx: typer.Context,
                 model: Annotated[str | None, typer.Option("--model", "-m", help=MODEL_HELP)] = None,
                 system: Annotated[str | None, typer.Option("--system", "-s", help="System prompt.")] = None,
                 continue_chat: Annotated[bool, typer.Option(
                     "--continue", "-c", help="Go on with the most recent chat.")] = False,
                 chat_id: Annotated[str | None, typer.Option(
                     "--chat", help="Go on with this chat (an id or its first characters).")] = None,
                 ) -> None:
    """Chat in this terminal, line by line: replies stream, and every turn is saved.

    Commands: /new, /system TEXT, /stats, /help, /quit (or Ctrl+D); Ctrl+C stops a reply.
    """
    from paged_chat.cli.ask import check_text_options
    from paged_chat.cli.chat import run_chat
    from paged_chat.cli.plain_terminal import AskOptions

    state = _state(ctx)
    options = AskOptions(system=system, continue_chat=continue_chat, chat_id=chat_id,
                         engine={"model": model})
    with _reported(ctx):
        check_text_options(options)
        code = run_chat(options, state.settings(), state.make_engine, sys.stdin, sys.stdout)
    raise typer.Exit(code)


class ToolChoiceDefault(str, Enum):
    auto = "auto"
    required = "required"


@app.command()
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
    /v1/models, /health, /metrics) until Ctrl+C, or until the engine stops (then exit 1).
    Without --api-key it takes JSON bodies only, for a loopback Host, from no web page but
    those of loopback and allowed origins. Sampling fields a request omits take the model's
    generation_config.json values, else [chat]'s (listed in /v1/models).

    Example:

        paged-chat serve --port 8000 &

        curl localhost:8000/v1/chat/completions -H 'Content-Type: application/json' -d '{"messages": [{"role": "user", "content": "Hi"}]}'
    """
    state = _state(ctx)
    with _reported(ctx):
        import asyncio

        from paged_chat.server import ApiServer, check_bind
        from paged_chat.server.guards import normalize_origin

        check_bind(host, api_key)
        settings = state.settings()
        origins = [normalize_origin(origin) for origin in [*settings.server.allowed_origins,
                                                           *(allowed_origin or [])]]
        config = settings.engine_config(model=model)
        client = state.server_engine(config)
        try:
            server = ApiServer(client, host, port, api_key, model_names=[config.model],
                               allowed_origins=origins,
                               defaults=settings.request_defaults(client.info.generation_defaults),
                               tool_choice=tool_choice.value)
            typer.echo(f"serving {client.info.name} on {server.url}/v1 (Ctrl+C stops)", err=True)
            asyncio.run(server.serve())
        finally:
            client.shutdown()


@app.command()
def models(ctx: typer.Context) -> None:
    """List the model aliases and the models found offline in the Hugging Face cache and in
    Ollama's and LM Studio's stores."""
    from paged_chat.app.catalog import find_models

    with _reported(ctx):
        entries, notes = find_models()
    _print_table(["MODEL", "KIND", "SIZE", "ARCH", "STATUS", "WEIGHTS"],
                 [[e.name, e.kind, e.size, e.architecture, e.status, e.weights] for e in entries])
    for note in notes:
        typer.echo(note, err=True)


@app.command("config")
def show_config(ctx: typer.Context,
                path_only: Annotated[bool, typer.Option("--path", help="Print only the path.")] = False,
                ) -> None:
    """Print the config file's path and the effective settings (as config.toml text)."""
    from paged_chat.app.settings import cache_dir, data_dir

    state = _state(ctx)
    path = state.config or config_path()
    if path_only:
        typer.echo(str(path))
        return
    with _reported(ctx):
        settings = state.settings(check_tui=True)
        store, cache = data_dir() / "chats.db", cache_dir()
    where = "" if settings.path is not None else " (not found: defaults)"
    typer.echo(f"# config: {path}{where}\n# chats:  {store}\n# cache:  {cache}\n")
    typer.echo(settings.to_toml(), nl=False)


@app.command()
def bench(ctx: typer.Context,
          model: Annotated[str, typer.Option(help="Alias, .gguf, HF folder or hub id.")] = "smollm2-135m",
          chats: Annotated[int, typer.Option("--chats", min=1, help="Concurrent chats.")] = 32,
          min_output: Annotated[int, typer.Option(min=1, help="Shortest reply, tokens.")] = 32,
          max_output: Annotated[int, typer.Option(min=1, help="Longest reply, tokens.")] = 256,
          dtype: Annotated[str, typer.Option(
              help="paged-chat's: auto (as it ships), float32, bfloat16 or float16.")] = "auto",
          baseline_dtype: Annotated[str | None, typer.Option(
              help="The HF baselines' (default: --dtype; auto: bfloat16 where the CPU has bf16 "
                   "dot products, else float32).")] = None,
          threads: Annotated[int, typer.Option(min=1, help="torch threads for every system.")] = 2,
          block_size: Annotated[int, typer.Option(help="KV block size, tokens (paged-chat and hf-cb).")] = 16,
          systems: Annotated[str, typer.Option(
              show_default=False,
              help="Comma-separated, of paged-chat, hf-seq, hf-static, hf-cb (default: these "
                   "four) and openai:URL (any OpenAI-compatible server, e.g. llama-server).")
          ] = "paged-chat,hf-seq,hf-static,hf-cb",
          quick: Annotated[bool, typer.Option(
              "--quick", help="8 chats, replies of 16-48 tokens, hf-seq on 2 of them (the others "
                             "extrapolated).")] = False,
          scenarios: Annotated[bool, typer.Option(help="Run the memory scenarios too.")] = True,
          roofline: Annotated[bool, typer.Option(
              "--roofline", help="Measure bandwidth and matmul peak; compare a decode step.")] = False,
          json_path: Annotated[Path | None, typer.Option("--json", help="Write the report here.")] = None,
          plot_path: Annotated[Path | None, typer.Option("--plot", help="Draw a PNG here.")] = None,
          seed: Annotated[int, typer.Option(help="Workload seed.")] = 0,
          engine_threads: Annotated[int | None, typer.Option(
              min=1, help="paged-chat's threads (default: adapt to the machine).")] = None,
          weights: Annotated[str, typer.Option(
              help="paged-chat's GGUF weights: quantized or dequantize.")] = "quantized",
          ) -> None:
    """Run one seeded chat workload through paged-chat and the Hugging Face baselines, side
    by side in one process, and print absolute figures and ratios."""
    from paged_chat.bench import BenchOptions, run_bench
    from paged_chat.bench.report import format_report, plot, write_json

    with _reported(ctx):
        sizes = (dict(num_chats=8, min_output=16, max_output=48, hf_seq_requests=2) if quick else
                 dict(num_chats=chats, min_output=min_output, max_output=max_output))
        if sizes["min_output"] > sizes["max_output"]:
            raise typer.BadParameter("must not exceed --max-output", param_hint="--min-output")
        options = BenchOptions(model=model, dtype=dtype, baseline_dtype=baseline_dtype,
                               threads=threads, seed=seed, block_size=block_size, scenarios=scenarios, roofline=roofline,
                               systems=tuple(name.strip() for name in systems.split(",") if name.strip()),
                               engine_threads=engine_threads, weights=weights, **sizes)
        report = run_bench(options, log=lambda line: typer.echo(line, err=True))
        typer.echo(format_report(report))
        if json_path is not None:
            write_json(report, str(json_path))
        if plot_path is not None:
            plot(report, str(plot_path))


class ExportFormat(str, Enum):
    md = "md"
    json = "json"


ChatId = Annotated[str, typer.Argument(help="A chat id, or its first characters.", show_default=False)]


@chats_app.callback(invoke_without_command=True)
def chats(ctx: typer.Context) -> None:
    """List, show, export and delete saved chats. Without a command, lists them."""
    if ctx.invoked_subcommand is None:
        list_chats(ctx, search=None)


@chats_app.command("list")
def list_chats(ctx: typer.Context,
               search: Annotated[str | None, typer.Option(
                   "--search", "-s", help="Only the chats whose title or messages hold every "
                                          "word of this text (or words starting with it).")] = None,
               ) -> None:
    """List saved chats, most recent first."""
    from paged_chat.app.chat_store import MAX_SEARCH_WORDS, search_words

    if search is not None and len(search_words(search)) > MAX_SEARCH_WORDS:
        typer.echo(f"Warning: the search has {len(search_words(search)):,} different words: "
                   f"the first {MAX_SEARCH_WORDS} are searched", err=True)
    with _open_store(ctx) as store:
        found = store.list_chats() if search is None else store.search_chats(search)
        rows = [[chat.id, _local_time(chat.updated), chat.model, chat.title] for chat in found]
    if not rows:
        typer.echo('no chats yet: `paged-chat ask "..."` starts one' if search is None
                   else f"no chat holds {_shortened(search)!r}", err=True)
        return
    _print_table(["ID", "UPDATED", "MODEL", "TITLE"], rows)


@chats_app.command("show")
def show_chat(ctx: typer.Context, chat_id: ChatId) -> None:
    """Print a chat as Markdown."""
    with _open_store(ctx) as store:
        chat = store.get_chat(store.resolve_id(chat_id))
    _echo_stored(_markdown(chat), nl=False)


@chats_app.command("export")
def export_chat(ctx: typer.Context, chat_id: ChatId,
                export_format: Annotated[ExportFormat, typer.Option(
                    "--format", help="md: readable Markdown; json: everything, token ids included.")
                ] = ExportFormat.md,
                ) -> None:
    """Print a chat as Markdown or JSON (redirect it to a file to keep it)."""
    from dataclasses import asdict

    with _open_store(ctx) as store:
        chat = store.get_chat(store.resolve_id(chat_id))
    if export_format is ExportFormat.json:
        _echo_stored(json.dumps(asdict(chat), ensure_ascii=False, indent=2))
    else:
        _echo_stored(_markdown(chat), nl=False)


@chats_app.command("delete")
def delete_chat(ctx: typer.Context, chat_id: ChatId,
                yes: Annotated[bool, typer.Option(
                    "--yes", "-y", help="Do not ask for confirmation.")] = False,
                ) -> None:
    """Delete a chat and its messages. Asks first, reading the answer from stdin (a
    terminal or a pipe: `echo y | paged-chat chats delete ID`); no answer is a no."""
    with _open_store(ctx) as store:
        chat = store.get_chat(store.resolve_id(chat_id))
        title = sanitize_for_terminal(chat.title)
        if not yes:
            typer.echo(f"Delete chat {chat.id} ({title!r}, {len(chat.messages)} messages)? [y/N] ",
                       nl=False, err=True)
            answer = sys.stdin.readline()
            if not sys.stdin.isatty():  # a terminal echoed the answer and its newline
                typer.echo(answer.strip(), err=True)
            if not answer:
                from paged_chat.cli.plain_terminal import UsageError

                raise UsageError("no answer on stdin: the chat was not deleted (--yes "
                                 "deletes without asking)")
            if answer.strip().lower() not in ("y", "yes"):
                typer.echo(f"not deleted: chat {chat.id}", err=True)
                raise typer.Exit(1)
        store.delete_chat(chat.id)
    typer.echo(f"deleted chat {chat.id} ({title})", err=True)


@cache_app.command("clear")
def clear_cache(ctx: typer.Context) -> None:
    """Delete the disk KV tier (every model's); the next turn of each chat prefills its history."""
    with _reported(ctx):
        from paged_chat.engine.kv.tier import TIER_DIR, clear_disk_tier
        from paged_chat.app.settings import cache_dir

        files, freed = clear_disk_tier(cache_dir())
    typer.echo(f"freed {freed / 2**20:,.1f} MiB ({files} KV blocks) from {cache_dir() / TIER_DIR}")


@contextmanager
def _open_store(ctx: typer.Context) -> Iterator[ChatStore]:
    """The chat store for one command, with errors reported and a recovery notice shown."""
    with _reported(ctx):
        from paged_chat.app.chat_store import ChatStore

        store = ChatStore()
        if store.notice:
            typer.echo(f"Warning: {store.notice}", err=True)
        try:
            yield store
        finally:
            store.close()


def _markdown(chat: StoredChat) -> str:
    """A chat as Markdown: a heading, what it ran on, then each message under its role."""
    lines = [f"# {chat.title}", "", f"chat `{chat.id}` · {chat.model} · {_local_time(chat.created)}", ""]
    if chat.system_prompt:
        lines += ["## System", "", chat.system_prompt, ""]
    for message in chat.messages:
        label = finish_label(message.finish_reason) if message.finish_reason else ""
        cut = f" ({label})" if label else ""
        lines += [f"## {message.role.capitalize()}{cut}", "", message.content, ""]
    return "\n".join(lines)


def _echo_stored(text: str, nl: bool = True) -> None:
    """Print stored text on stdout: sanitized on a terminal, exact in a pipe (color=True:
    click would otherwise strip what looks like a color code from piped output)."""
    typer.echo(sanitize_for_terminal(text) if sys.stdout.isatty() else text, nl=nl, color=True)


def _shortened(text: str, limit: int = 60) -> str:
    return text if len(text) <= limit else text[:limit - 1] + "…"


def _local_time(timestamp: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M", time.localtime(timestamp))


def _print_table(header: list[str], rows: list[list[str]]) -> None:
    """Plain aligned columns: readable in a terminal, and easy to cut or grep in a pipe."""
    if sys.stdout.isatty():
        rows = [[sanitize_for_terminal(str(cell)) for cell in row] for row in rows]
    widths = [max(len(str(row[i])) for row in [header, *rows]) for i in range(len(header))]
    for row in [header, *rows]:
        typer.echo("  ".join(str(cell).ljust(width) for cell, width in zip(row, widths)).rstrip(), color=True)


def main() -> NoReturn:
    """The console script: run the command, then end the process with its status."""
    try:
        app(prog_name="paged-chat")
        code: int | str | None = 0
    except SystemExit as done:
        code = done.code
    _end_process(code)


def _end_process(code: int | str | None) -> NoReturn:
    """Exit with `code`. An engine thread still alive here is in native code that does not
    return in time: a model load that Ctrl+C cut short goes on on its thread, or a step is
    stuck. Finalizing the interpreter under it kills the process: CPython ends a daemon
    thread that takes the GIL during finalization with pthread_exit, whose unwinding through
    torch's C++ frames calls std::terminate ("terminate called without an active
    exception", status 134), and torch's atexit hooks run while it still uses torch (a
    traceback). So then, and only then, the process ends at once, once its output is
    flushed; every store was closed on the way here."""
    transport = sys.modules.get("paged_chat.engine.clients.thread_transport")
    engine_name = getattr(transport, "ENGINE_THREAD_NAME", None)
    if engine_name and any(thread.name == engine_name and thread.is_alive()
                           for thread in threading.enumerate()):
        for stream in (sys.stdout, sys.stderr):
            with suppress(OSError, ValueError):
                stream.flush()
        os._exit(code if isinstance(code, int) else 0 if code is None else 1)
    sys.exit(code)
