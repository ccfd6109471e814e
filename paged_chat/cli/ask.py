"""`paged-chat ask`: one-shot chat on the command line, and batches of prompts.

stdout carries only answers (streamed, flushed per delta) or JSON; everything else
(loading, warnings, stats, errors) goes to stderr, so `ask` composes in pipes. Every
prompt is a ChatSession turn (paged_chat.app.chat_session, as in the TUI) through the
in-process engine client; several prompts (`--file`) all go into the one engine at once
and are answered in input order: the earliest unfinished answer streams live while later
ones are held until their turn.

Ctrl+C, SIGTERM (`timeout`, `kill`) and SIGHUP (the terminal went away) stop the replies
between steps (their blocks freed): the partial answers stay on stdout and are saved with
finish_reason "abort", and the exit code is 128 + the signal's number (130, 143, 129), as a
shell reports a process that signal ended. A second signal cancels at once, as does
STOP_GRACE_S without the replies ending (an engine stuck in a step is not waited for).

On a terminal, stdout shows the model's text sanitized (no escape sequences, no control
characters); piped, it is exact. What `ask` shares with `chat` (options, loading, the
chat to continue, stop signals, stderr) is in paged_chat.cli.plain_terminal.
"""

from __future__ import annotations

import asyncio
import dataclasses
import io
import json
import os
import sys
import time
from collections.abc import Iterator
from contextlib import ExitStack, aclosing, contextmanager
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, TextIO

import typer

from paged_chat.app.chat_session import ChatSession, Turn, chat_title
from paged_chat.app.reasoning import SplitText
from paged_chat.app.settings import chat_sampling
from paged_chat.app.text import StreamSanitizer
from paged_chat.cli.plain_terminal import (
    MODEL_HELP,
    STOP_SIGNALS,
    EngineFactory,
    PlainTerminalOptions,
    ReceivedSignals,
    UsageError,
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
    valid_text,
    warn,
    warnings_to_stderr,
)
from paged_chat.engine.regular_files import NotARegularFileError, open_regular

if TYPE_CHECKING:
    from paged_chat.app.settings import Settings
    from paged_chat.cli.state import CliState
    from paged_chat.engine import EngineClient, SamplingParams


# Under the cache dir: turns the chat store refused, one Markdown file each.
UNSAVED_DIR = "unsaved"


@dataclass(slots=True)
class FilePrompt:
    """One prompt of `ask --file`: a plain line, or a JSONL object {"prompt", "system"?}."""

    prompt: str
    system: str | None = None


def read_prompt(argument: str | None, stdin: TextIO | None) -> str:
    """The prompt: piped stdin first, then the argument, a blank line apart (like `llm`).

    A terminal stdin is never read (it would wait for input), so a missing prompt is an
    error, never a hang. Returns "" when there is no prompt at all.
    """
    argument = valid_text(argument or "", "the prompt argument")
    piped = ""
    if stdin is not None and not stdin.isatty():
        try:
            piped = valid_text(stdin.read(), "stdin")  # surrogates: a surrogateescape stdin
        except UnicodeDecodeError as exc:
            raise UsageError(f"stdin is not UTF-8 text ({exc.reason})") from exc
    return "\n\n".join(part for part in (piped.strip(), argument.strip()) if part)


@contextmanager
def open_prompt_file(name: str) -> Iterator[TextIO]:
    """The --file `name` to read prompts from: stdin for "-", else a regular file (a FIFO
    or a device is a usage error, never opened in a way that could wait), closed after."""
    if name == "-":
        yield sys.stdin
        return
    try:
        raw = open_regular(Path(name).expanduser())
    except OSError as exc:
        reason = str(exc) if isinstance(exc, NotARegularFileError) else f"{name}: {exc.strerror}"
        raise UsageError(f"cannot read the prompt file: {reason}") from None
    with io.TextIOWrapper(raw, encoding="utf-8") as file:
        yield file


def read_prompt_file(file: TextIO) -> list[FilePrompt]:
    """The prompts of the --file `file` (see `parse_prompt_file`); a file that is not
    UTF-8 is a usage error naming it, as non-UTF-8 stdin is."""
    name = "stdin" if file.name in ("-", "<stdin>") else f"the prompt file {file.name}"
    try:
        text = valid_text(file.read(), name)
    except UnicodeDecodeError as exc:
        raise UsageError(f"{name} is not UTF-8 text ({exc.reason})") from exc
    return parse_prompt_file(text)


def parse_prompt_file(text: str) -> list[FilePrompt]:
    """The prompts of a --file: JSONL when the first non-blank line is a JSON object (then
    every line must be one, with a "prompt" string and optionally a "system" string),
    else one prompt per line. Blank lines and a leading byte-order mark are skipped.
    UsageError names the bad line."""
    lines = [(number, line) for number, line in
             enumerate(text.removeprefix("\ufeff").splitlines(), start=1) if line.strip()]
    if not lines:
        raise UsageError("the prompt file has no prompts")
    if not _is_json_object(lines[0][1]):
        return [FilePrompt(valid_text(line.strip(), f"line {number} of the prompt file"))
                for number, line in lines]
    return [_json_prompt(number, line) for number, line in lines]


def _json_value(line: str) -> Any:
    """json.loads, where nesting too deep for the parser is a ValueError like any bad JSON."""
    try:
        return json.loads(line)
    except RecursionError:
        raise ValueError("nested too deeply") from None


def _is_json_object(line: str) -> bool:
    try:
        return isinstance(_json_value(line), dict)
    except ValueError:
        return False


def _json_prompt(number: int, line: str) -> FilePrompt:
    try:
        item = _json_value(line)
    except ValueError as exc:
        raise UsageError(f"line {number} of the prompt file is not JSON ({exc}); a JSONL file "
                         "holds one object per line") from exc
    prompt = item.get("prompt") if isinstance(item, dict) else None
    system = item.get("system") if isinstance(item, dict) else None
    if not isinstance(prompt, str) or not prompt.strip():
        raise UsageError(f'line {number} of the prompt file needs a non-empty "prompt" string')
    if system is not None and not isinstance(system, str):
        raise UsageError(f'line {number} of the prompt file: "system" must be a string')
    where = f"line {number} of the prompt file"
    return FilePrompt(valid_text(prompt, f'{where}: "prompt"'),
                      None if system is None else valid_text(system, f'{where}: "system"'))


def structured_output_options(json_schema: TextIO | None, choice: str | None) -> dict[str, Any]:
    """The SamplingParams fields of --json-schema FILE and --choice a,b,c (a UsageError names
    a file that is no JSON object, an empty choice, or both options)."""
    if json_schema is not None and choice is not None:
        raise UsageError("give --json-schema or --choice, not both")
    if choice is not None:
        choices = [item.strip() for item in choice.split(",")]
        if not all(choices):
            raise UsageError(f"--choice {choice!r}: expected comma-separated non-empty strings")
        return {"choice": choices}
    if json_schema is None:
        return {}
    try:
        schema = json.loads(json_schema.read())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise UsageError(f"--json-schema {json_schema.name}: not JSON: {error}") from error
    if not isinstance(schema, dict):
        raise UsageError(f"--json-schema {json_schema.name}: a JSON schema is an object, "
                         f"not {type(schema).__name__}")
    return {"json_schema": schema}


@dataclass(slots=True, eq=False)
class Answer:
    """One prompt of this run: its chat session and what its JSON object leads with; with
    `names_chat`, the id of the chat it was saved in follows (null when it was not)."""

    index: int
    session: ChatSession
    user_text: str
    params: SamplingParams
    meta: dict[str, Any] = field(default_factory=dict)
    names_chat: bool = False

    @property
    def turn(self) -> Turn:
        assert self.session.turn is not None, "the answer has not started"
        return self.session.turn

    @property
    def chat_id(self) -> str | None:
        """The chat this answer is saved in; None when it is in no chat of the store."""
        return self.session.chat_id if self.session.in_store else None

    def to_json(self, load_s: float) -> dict[str, Any]:
        turn, timings = self.turn, self.turn.timings()
        chat = {"chat_id": self.chat_id} if self.names_chat else {}
        return {**self.meta, **chat, "text": turn.text, "reasoning": turn.reasoning,
                "finish_reason": turn.finish_reason,
                "error": turn.error, "prompt_tokens": len(turn.prompt_ids),
                "cached_tokens": turn.num_cached_tokens,
                "tier_cached_tokens": turn.num_tier_cached_tokens,
                "completion_tokens": len(turn.token_ids), "reasoning_tokens": turn.reasoning_tokens,
                "timings": {"load_s": round(load_s, 3), "ttft_s": timings["ttft_s"],
                            "total_s": timings["total_s"], "tokens_per_s": timings["tokens_per_s"]}}


class Switch(str, Enum):
    """An on/off option's value (`--thinking on`)."""
    on = "on"
    off = "off"


class OrderedOutput:
    """Writes answers to stdout in input order while they finish in any order: the earliest
    unfinished answer streams live, later ones are held until it is done. Plain text puts
    a blank line between answers; JSON writes one object per line as each one's turn comes.
    On a terminal the text is sanitized as it streams, each answer on its own, so a
    sequence the model leaves open never reaches into the next answer."""

    def __init__(self, count: int, as_json: bool, stdout: TextIO, show_thinking: bool = False) -> None:
        self.count = count
        self.as_json = as_json
        self.show_thinking = show_thinking
        self._thought: set[int] = set()   # the answers whose thinking was written
        self.stdout = stdout
        self.current = 0
        self.held: dict[int, list[str]] = {}
        self.done: dict[int, dict[str, Any]] = {}
        self.sanitizer = StreamSanitizer() if stdout.isatty() else None

    def split_delta(self, index: int, split: SplitText) -> None:
        """A turn's latest delta: its answer, after its thinking when that is shown (a
        blank line between them)."""
        text = split.answer
        if self.show_thinking:
            if split.reasoning:
                self._thought.add(index)
            if text and index in self._thought:
                self._thought.discard(index)
                text = "\n\n" + text
            text = split.reasoning + text
        self.delta(index, text)

    def delta(self, index: int, text: str) -> None:
        if self.as_json or not text:
            return
        if index == self.current:
            self._write(text)
        else:
            self.held.setdefault(index, []).append(text)

    def finished(self, index: int, as_json: dict[str, Any]) -> None:
        self.done[index] = as_json
        while self.current in self.done:
            self._end_of_answer()
            finished = self.done.pop(self.current)
            self._write(json.dumps(finished, ensure_ascii=False) + "\n" if self.as_json else "\n")
            self.current += 1
            if self.current < self.count and not self.as_json:
                self._write("\n" + "".join(self.held.pop(self.current, [])))

    def _write(self, text: str) -> None:
        if self.sanitizer is not None:
            text = self.sanitizer.feed(text)
        self.stdout.write(text)
        self.stdout.flush()

    def _end_of_answer(self) -> None:
        if self.sanitizer is not None:
            self.stdout.write(self.sanitizer.flush())


def run_ask(options: PlainTerminalOptions, settings: Settings, make_engine: EngineFactory,
            stdin: TextIO | None) -> int:
    """Answer the prompt (or the --file prompts); return the exit status: 0, 1 when a
    request failed (its error is on stderr), 130 on Ctrl+C."""
    if options.file is not None:
        return _run_batch(options, settings, make_engine)
    return _run_turn(options, settings, make_engine, stdin)


def _run_turn(options: PlainTerminalOptions, settings: Settings, make_engine: EngineFactory,
              stdin: TextIO | None) -> int:
    """One chat turn: a new chat, or the next turn of a stored one (-c, --chat)."""
    from paged_chat.app.chat_store import ChatStore, StoreWriteError, new_chat
    from paged_chat.app.conversation import Conversation

    user_text = read_prompt(options.prompt, stdin)
    if not user_text:
        raise UsageError('no prompt: give one as an argument or on stdin, or use --file '
                         '(e.g. paged-chat ask "Why is the sky blue?")')
    continuing = options.continue_chat or options.chat_id is not None
    with ExitStack() as cleanup, warnings_to_stderr():
        store, store_error = None, None
        try:
            store = cleanup.enter_context(ChatStore()) if options.save or continuing else None
        except StoreWriteError as error:  # a full disk: a new chat is answered all the same
            if continuing:
                raise
            store_error = error
        if store is not None and store.notice:
            warn(store.notice)
        chat = chat_to_continue(options, store) if continuing else None
        engine_overrides = options.engine if chat is None else {**options.engine, "model": chat.model}
        sampling = {**(chat.sampling if chat else {}), **options.sampling}
        config = configure(settings, engine_overrides, sampling)
        client, load_s = load_client(make_engine, config, options)
        params = model_sampling(settings, client, sampling)
        system = options.system or settings.chat.system_prompt
        if store is not None and options.save:
            new = chat is None
            chat = chat or new_chat(chat_title((options.prompt or "").strip() or user_text),
                                    model_spec(config.model), system, chat_sampling(params))
            session = ChatSession(store, chat, in_store=not new, on_warning=warn)
        else:
            info = client.info
            conversation = (Conversation.from_chat(chat, info.tokenizer, info.chat_template)
                            if chat is not None else None)
            session = ChatSession(system_prompt=system, conversation=conversation,
                                  thinking=chat.thinking if chat is not None else None)
        if options.thinking is not None:
            session.set_thinking(options.thinking)
        answer = Answer(0, session, user_text, params, {"model": config.model}, names_chat=True)
        code = _answer(client, [answer], options, load_s)
        unsaved = session.unsaved or store_error
        if unsaved is not None:
            say(f"Error: {unsaved_reply_line(answer, unsaved)}")
            return code or 1
        return code


def unsaved_reply_line(answer: Answer, error: Exception) -> str:
    """Keep a reply the store refused (a full disk) in a recovery file in the cache dir (often
    another file system; the chat store's own directory is full), the prompt with it; the
    line that says why it is not in the chat and where it is."""
    from paged_chat.app.settings import cache_dir
    from paged_chat.engine.core.errors import describe_error

    turn, chat_id = answer.turn, answer.chat_id
    chat = f"chat {chat_id} ({answer.session.title})" if chat_id else "a new chat"
    text = (f"# Unsaved turn of {chat}\n\n"
            f"## User\n\n{turn.user_text}\n\n## Assistant\n\n{turn.text}\n")
    why = f"the reply was not saved to the chat ({describe_error(error)})"
    try:
        folder = cache_dir() / UNSAVED_DIR
        folder.mkdir(mode=0o700, exist_ok=True)
        path = folder / f"{chat_id or 'new-chat'}-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.md"
        with open(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w",
                  encoding="utf-8") as file:
            file.write(text)
    except OSError as exc:
        return f"{why}, nor to a recovery file ({exc.strerror}): it is only in the output above"
    return f"{why}: it is kept in {path}"


def _run_batch(options: PlainTerminalOptions, settings: Settings, make_engine: EngineFactory) -> int:
    """--file: every prompt a one-shot chat, all through the engine at once; not saved."""
    if options.prompt or options.continue_chat or options.chat_id is not None:
        raise UsageError("--file runs its own prompts: drop the PROMPT argument, -c and --chat")
    prompts = read_prompt_file(options.file)
    config = configure(settings, options.engine, options.sampling)
    with warnings_to_stderr():
        client, load_s = load_client(make_engine, config, options)
        params = model_sampling(settings, client, options.sampling)
        answers = [Answer(index, ChatSession(system_prompt=item.system or options.system
                                             or settings.chat.system_prompt,
                                             thinking=options.thinking),
                          item.prompt, params,
                          {"index": index, "prompt": item.prompt, "model": config.model})
                   for index, item in enumerate(prompts)]
        return _answer(client, answers, options, load_s)


def _answer(client: EngineClient, answers: list[Answer], options: PlainTerminalOptions, load_s: float) -> int:
    """Stream every answer through the engine together; the exit status."""
    output = OrderedOutput(len(answers), options.json, sys.stdout, options.show_thinking)
    signals = ReceivedSignals()
    try:
        signals = asyncio.run(_stream_all(client, answers, output, load_s))
        stats = client.stats()
    finally:
        if not signals.overdue:  # else the engine is stuck in a step: the CLI exits past it
            client.shutdown()
    if options.stats:
        _print_stats(answers, ready_words(options, client, load_s), stats.num_preemptions,
                     client.info.weights)
        if stats.blocks_freed_by_window:
            say(f"{stats.blocks_freed_by_window} KV blocks freed behind the sliding window")
    failed = [answer for answer in answers if answer.turn.finish_reason == "error"]
    for answer in failed:
        say(f"Error: {f'prompt {answer.index + 1}: ' if len(answers) > 1 else ''}{answer.turn.error}")
    return STOP_SIGNALS[signals[0]] if signals else 1 if failed else 0


async def _stream_all(client: EngineClient, answers: list[Answer], output: OrderedOutput,
                      load_s: float) -> ReceivedSignals:
    """Run the answers' turns at once; the stop signals received meanwhile."""

    async def answer_one(answer: Answer) -> None:
        async with aclosing(answer.session.send(client, answer.user_text, answer.params)) as deltas:
            async for _ in deltas:
                output.split_delta(answer.index, answer.turn.last)
        output.finished(answer.index, answer.to_json(load_s))

    def stop_all() -> None:
        for answer in answers:
            answer.session.stop()

    with stop_signals(stop_all) as received:
        try:
            await asyncio.gather(*(answer_one(answer) for answer in answers))
        except asyncio.CancelledError:  # a second signal: every turn was saved as stopped
            if not received:
                raise
    return received


def _print_stats(answers: list[Answer], ready: str, preemptions: int, weights: str) -> None:
    held = f", weights held: {weights}" if weights else ""
    if len(answers) == 1:
        say(turn_stats_line(answers[0].turn, ready) + held)
        return
    for answer in answers:
        say(f"[{answer.index + 1}] {turn_stats_line(answer.turn, ready)}")
    turns = [answer.turn for answer in answers]
    started = min(turn.submitted_at for turn in turns)
    ended = max(turn.finished_at or started for turn in turns)
    generated = sum(len(turn.token_ids) for turn in turns)
    rate = generated / (ended - started) if ended > started else 0.0
    known = [turn.num_cached_tokens for turn in turns if turn.num_cached_tokens is not None]
    cached = f"{sum(known)}" if len(known) == len(turns) else "unknown"
    say(f"{len(answers)} prompts: {generated} tokens generated in {ended - started:.2f} s "
        f"({rate:.1f} tokens/s together), {cached} prompt tokens from the prefix cache, "
        f"{preemptions} preemptions{held}")


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
        kv_cache_dtype: Annotated[str | None, typer.Option(
            help="The KV cache's: auto (the model's dtype), bfloat16 (the CPU's default) or int8.")] = None,
        stats: Annotated[bool, typer.Option(
            "--stats", help="Print prompt tokens, prefix-cache hits, time to first token and "
                            "tokens/s to stderr.")] = False,
        json_output: Annotated[bool, typer.Option(
            "--json", help="Print one JSON object (text, reasoning, token counts, timings, "
                           "finish reason) instead of streaming text; JSONL with --file.")] = False,
        show_thinking: Annotated[bool, typer.Option(
            "--show-thinking", help="Print a reasoning model's thinking before its answer.")] = False,
        thinking: Annotated[Switch | None, typer.Option(
            "--thinking", help="Turn the model's thinking on or off, where its template can "
                               "(Qwen3); saved with the chat.",
            show_default=False)] = None,
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
    state: CliState = ctx.obj
    options = PlainTerminalOptions(
        prompt=prompt if prompt and prompt.strip() else None, system=system, stats=stats,
        json=json_output, continue_chat=continue_chat, chat_id=chat, save=not no_save,
        show_thinking=show_thinking,
        thinking=None if thinking is None else thinking is Switch.on,
        engine={"model": model, "device": device, "dtype": dtype,
                "kv_cache_dtype": kv_cache_dtype},
        sampling={"max_tokens": max_tokens, "temperature": temperature, "top_p": top_p,
                  "top_k": top_k, "seed": seed})
    with state.reported(), ExitStack() as cleanup:
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
