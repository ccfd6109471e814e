"""`paged-chat chat`: the interactive loop in a plain terminal, for who wants `ollama run`
or `llm chat` and no full-screen UI.

One engine is loaded once; each line typed is a ChatSession turn (paged_chat.app.chat_session,
as in `ask` and the TUI) through the in-process engine client, its reply streamed to stdout
and saved in the same chat store. A chat is created on its first message (titled by it);
`-c` / `--chat ID` go on with a stored one.

Keys: Ctrl+C stops a streaming reply (the partial reply is kept, and saved with
finish_reason "abort"); at the prompt it clears the line. Ctrl+D at the prompt exits.
SIGTERM and SIGHUP stop the reply and end the loop (status 143, 129).

Input: a terminal stdin gets readline line editing and history (the file `chat_history`
in the data dir); a piped stdin is read line by line, without prompts, so scripts and
tests can drive the loop. On a terminal, replies are sanitized as they stream.
"""

from __future__ import annotations

import asyncio
import signal
import sys
import time
from collections.abc import Callable
from contextlib import ExitStack, aclosing
from typing import TYPE_CHECKING, Annotated, TextIO

import typer

from paged_chat.app.chat_session import ChatSession, chat_title
from paged_chat.app.settings import chat_sampling, data_dir
from paged_chat.app.text import StreamSanitizer, sanitize_for_terminal
from paged_chat.cli.plain_terminal import (
    MODEL_HELP,
    STOP_SIGNALS,
    EngineFactory,
    PlainTerminalOptions,
    chat_to_continue,
    check_text_options,
    configure,
    load_client,
    model_sampling,
    model_spec,
    ready_words,
    say,
    stop_signals,
    turn_stats_line,
    warn,
    warnings_to_stderr,
)
from paged_chat.engine.core.errors import PagedChatError, describe_error

if TYPE_CHECKING:
    from paged_chat.app.chat_store import ChatStore
    from paged_chat.app.settings import Settings
    from paged_chat.cli.state import CliState
    from paged_chat.engine import EngineClient, EngineConfig, SamplingParams
    from paged_chat.engine.core.stats import EngineStats


PROMPT = ">>> "
HISTORY_FILE = "chat_history"
HISTORY_LENGTH = 1000
# How long /stats waits for the engine's snapshot of the step that ended the last reply
# (the engine publishes it when it goes idle, just after the reply's last text).
STATS_SETTLE_S = 1.0
HELP = """\
/new           start a new chat, with the default system prompt (this one stays saved)
/system TEXT   set this chat's system prompt (/system alone shows it)
/stats         the last reply's tokens, prefix-cache hits and speed; the KV pool
/help          this list
/quit          exit (so does Ctrl+D); Ctrl+C stops a streaming reply
"""
QUIT_COMMANDS = ("/quit", "/exit", "/bye")


def run_chat(options: PlainTerminalOptions, settings: Settings, make_engine: EngineFactory,
             stdin: TextIO, stdout: TextIO) -> int:
    """Load the engine, then chat until /quit or end of input; the exit status (0, or
    143 / 129 when SIGTERM / SIGHUP ended it)."""
    from paged_chat.app.chat_store import ChatStore

    with ExitStack() as cleanup, warnings_to_stderr():
        store = cleanup.enter_context(ChatStore())
        if store.notice:
            warn(store.notice)
        chat = (chat_to_continue(options, store)
                if options.continue_chat or options.chat_id is not None else None)
        engine_overrides = options.engine if chat is None else {**options.engine, "model": chat.model}
        sampling = {**(chat.sampling if chat else {}), **options.sampling}
        config = configure(settings, engine_overrides, sampling)
        client, load_s = load_client(make_engine, config, options)
        cleanup.callback(client.shutdown)
        params = model_sampling(settings, client, sampling)
        repl = Repl(client, store, config, params, options.system or settings.chat.system_prompt,
                    stdout, ready_words(options, client, load_s))
        if chat is not None:
            repl.session = ChatSession(store, chat, on_warning=warn)
        reader = cleanup.enter_context(LineReader(stdin, stdout))
        if reader.interactive:
            say(f"{repl.describe()}: /help lists the commands, Ctrl+D exits")
        return repl.run(reader)


class LineReader:
    """Lines from stdin: with readline (editing, history) on a terminal, plain reads from a
    pipe. `read` returns None at the end of input (Ctrl+D)."""

    def __init__(self, stdin: TextIO, stdout: TextIO) -> None:
        self.stdin, self.stdout = stdin, stdout
        self.interactive = stdin.isatty() and stdin is sys.stdin
        self._readline = None

    def __enter__(self) -> LineReader:
        if self.interactive:
            import readline

            self._readline = readline
            readline.set_history_length(HISTORY_LENGTH)
            try:
                readline.read_history_file(data_dir() / HISTORY_FILE)
            except OSError:  # none yet
                pass
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self._readline is not None:
            try:
                self._readline.write_history_file(data_dir() / HISTORY_FILE)
            except OSError as exc:
                warn(f"the chat history could not be saved ({exc})")

    def read(self) -> str | None:
        if self.interactive:
            try:
                return input(PROMPT)
            except EOFError:
                self.stdout.write("\n")
                return None
        line = self.stdin.readline()
        return line if line else None


class Repl:
    """The loop: each line a turn of the current chat, or a /command."""

    def __init__(self, client: EngineClient, store: ChatStore, config: EngineConfig,
                 params: SamplingParams, default_system: str | None, stdout: TextIO, ready: str) -> None:
        """`default_system`: the system prompt every new chat starts from (/new included);
        `ready`: how the engine came to be ready (ready_words), for /stats."""
        self.client, self.store, self.config, self.params = client, store, config, params
        self.default_system, self.stdout, self.ready = default_system, stdout, ready
        self.system = default_system  # the next new chat's, until /system changes it
        self.session: ChatSession | None = None
        self.sanitizer = StreamSanitizer() if stdout.isatty() else None

    def describe(self) -> str:
        chat = "a new chat" if self.session is None else f"chat {self.session.chat_id}"
        return f"{chat} with {self.config.model}"

    def run(self, reader: LineReader) -> int:
        while True:
            try:
                line = reader.read()
            except KeyboardInterrupt:  # Ctrl+C at the prompt: a fresh line, as in a shell
                self._print("")
                continue
            if line is None:
                return 0
            text = line.strip()
            if not text:
                continue
            if text.startswith("/"):
                if text.split()[0] in QUIT_COMMANDS:
                    return 0
                self.command(text)
                continue
            signum = self.reply(text)
            if signum is not None and signum != signal.SIGINT:
                return STOP_SIGNALS[signum]

    # ---- commands -------------------------------------------------------------------

    def command(self, text: str) -> None:
        name, _, argument = text.partition(" ")
        handlers: dict[str, Callable[[str], None]] = {
            "/new": self._new, "/system": self._system, "/stats": self._stats, "/help": self._help}
        handler = handlers.get(name)
        if handler is None:
            say(f"unknown command {sanitize_for_terminal(name)!r}: /help lists them")
            return
        handler(argument.strip())

    def _new(self, _: str) -> None:
        self.session = None
        self.system = self.default_system
        self._print("(a new chat starts with your next message)")

    def _system(self, text: str) -> None:
        if not text:
            current = self.system if self.session is None else self.session.system_prompt
            self._print(f"system prompt: {current!r}" if current else "no system prompt")
            return
        if self.session is None:
            self.system = text
            self._print("(system prompt set for the next chat)")
            return
        restarted = self.session.update_settings(text, self.session.sampling)
        self._print("(system prompt set: the next reply reads the whole chat again)" if restarted
                    else "(system prompt set)")

    def _stats(self, _: str) -> None:
        stats = self._settled_stats()
        if self.session is None or self.session.turn is None:
            self._print("no reply yet in this chat")
        else:
            self._print(turn_stats_line(self.session.turn, self.ready))
        self._print(f"KV pool: {stats.blocks_in_use} of {stats.num_blocks} blocks in use, "
                    f"{stats.blocks_cached} cached for reuse")

    def _settled_stats(self) -> EngineStats:
        """The engine's snapshot once it shows no request running or waiting, or after
        STATS_SETTLE_S (a server's other callers may keep it busy): the snapshot at hand
        when a reply ends may be from a step before its last."""
        deadline = time.monotonic() + STATS_SETTLE_S
        stats = self.client.stats()
        while (stats.num_running or stats.num_waiting) and time.monotonic() < deadline:
            time.sleep(0.01)
            stats = self.client.stats()
        return stats

    def _help(self, _: str) -> None:
        self.stdout.write(HELP)
        self.stdout.flush()

    # ---- turns ----------------------------------------------------------------------

    def reply(self, text: str) -> int | None:
        """Stream the reply to `text`; the first stop signal received meanwhile, if any."""
        if self.session is None:
            chat = self.store.create_chat(chat_title(text), model_spec(self.config.model),
                                          self.system, chat_sampling(self.params))
            self.session = ChatSession(self.store, chat, on_warning=warn)
        try:
            signals = asyncio.run(self._stream(self.session, text))
        except PagedChatError as error:  # the turn could not start (the chat moved on)
            say(f"Error: {describe_error(error)}")
            return None
        self._write_end()
        turn = self.session.turn
        if turn.finish_reason == "abort":
            say("(stopped: the reply so far is saved)")
        elif turn.finish_reason == "error":
            say(f"Error: {turn.error}")
        return signals[0] if signals else None

    async def _stream(self, session: ChatSession, text: str) -> list[int]:
        with stop_signals(session.stop) as received:
            try:
                async with aclosing(session.send(self.client, text, self.params)) as deltas:
                    async for _ in deltas:
                        if not received:  # after ^C the terminal shows the reply as it stopped
                            self._write(session.turn.last.answer)  # the thinking stays out
            except asyncio.CancelledError:  # a second signal: the turn was saved as stopped
                if not received:
                    raise
        return received

    def _write(self, text: str) -> None:
        self.stdout.write(self.sanitizer.feed(text) if self.sanitizer is not None else text)
        self.stdout.flush()

    def _write_end(self) -> None:
        self.stdout.write((self.sanitizer.flush() if self.sanitizer is not None else "") + "\n")
        self.stdout.flush()

    def _print(self, line: str) -> None:
        self.stdout.write(line + "\n")
        self.stdout.flush()


def chat(ctx: typer.Context,
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
    state: CliState = ctx.obj
    options = PlainTerminalOptions(system=system, continue_chat=continue_chat, chat_id=chat_id,
                           engine={"model": model})
    with state.reported():
        check_text_options(options)
        code = run_chat(options, state.settings(), state.make_engine, sys.stdin, sys.stdout)
    raise typer.Exit(code)
