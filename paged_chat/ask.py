"""`paged-chat ask`: one-shot chat on the command line, and batches of prompts.

stdout carries only answers (streamed, flushed per delta) or JSON; everything else
(loading, warnings, stats, errors) goes to stderr, so `ask` composes in pipes. Several
prompts (`--file`) all go into the one engine at once and are answered in input order:
the earliest unfinished answer streams live while later ones are held until their turn.

Ctrl+C, SIGTERM (`timeout`, `kill`) and SIGHUP (the terminal went away) set a flag that
the step loop checks between steps, so the engine is never interrupted mid-step: the
requests are aborted (their blocks freed), the partial answers stay on stdout and are
saved with finish_reason "abort", and the exit code is 128 + the signal's number (130,
143, 129), as a shell reports a process that signal ended.

On a terminal, stdout shows the model's text sanitized (no escape sequences, no control
characters); piped, it is exact.
"""

from __future__ import annotations

import json
import signal
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from paged_chat.settings import SAMPLING_KEYS
from paged_chat.text import StreamSanitizer, check_text, sanitize_for_terminal

if TYPE_CHECKING:
    from paged_chat.chat import Conversation
    from paged_chat.engine import Engine, EngineConfig, RequestOutput, SamplingParams
    from paged_chat.settings import Settings
    from paged_chat.store import Chat, ChatStore

EngineFactory = Callable[["EngineConfig"], "Engine"]

# A streaming reply is saved at most this often, so a killed process keeps most of it.
SAVE_INTERVAL_S = 1.0
_TITLE_LENGTH = 60
# The signals that stop a reply the way Ctrl+C does.
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class UsageError(ValueError):
    """The command line asks for something impossible; the CLI exits with status 2."""


@dataclass(slots=True)
class AskOptions:
    """Everything `paged-chat ask` was given. `engine` and `sampling` hold the overrides
    of the settings (None: not given)."""

    prompt: str | None = None
    system: str | None = None
    engine: dict[str, Any] = field(default_factory=dict)
    sampling: dict[str, Any] = field(default_factory=dict)
    stats: bool = False
    json: bool = False
    continue_chat: bool = False
    chat_id: str | None = None
    save: bool = True
    file: TextIO | None = None


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
    argument = _valid_text(argument or "", "the prompt argument")
    piped = ""
    if stdin is not None and not stdin.isatty():
        try:
            piped = stdin.read()
        except UnicodeDecodeError as exc:
            raise UsageError(f"stdin is not UTF-8 text ({exc.reason})") from exc
    return "\n\n".join(part for part in (piped.strip(), argument.strip()) if part)


def read_prompt_file(file: TextIO) -> list[FilePrompt]:
    """The prompts of the --file `file` (see `parse_prompt_file`); a file that is not
    UTF-8 is a usage error naming it, as non-UTF-8 stdin is."""
    name = "stdin" if file.name in ("-", "<stdin>") else f"the prompt file {file.name}"
    try:
        text = file.read()
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
        return [FilePrompt(_valid_text(line.strip(), f"line {number} of the prompt file"))
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
    return FilePrompt(_valid_text(prompt, f'{where}: "prompt"'),
                      None if system is None else _valid_text(system, f'{where}: "system"'))


def check_text_options(options: AskOptions) -> None:
    """The options that reach the tokenizer or the store hold text: a UsageError names
    the one that does not (undecodable bytes in argv), before anything loads."""
    _valid_text(options.system or "", "--system")
    _valid_text(options.chat_id or "", "--chat")


def _valid_text(text: str, what: str) -> str:
    try:
        return check_text(text, what)
    except ValueError as exc:
        raise UsageError(str(exc)) from None


@dataclass(slots=True, eq=False)
class Answer:
    """One prompt's reply as it streams, with its timings."""

    index: int
    prompt_ids: list[int]
    params: SamplingParams
    load_s: float  # how long the model took to load, for --stats and --json
    meta: dict[str, Any] = field(default_factory=dict)  # leads its JSON object
    request_id: str = ""
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None
    num_cached_tokens: int = 0
    added_at: float = 0.0
    first_token_at: float | None = None
    finished_at: float | None = None

    def update(self, output: RequestOutput, now: float) -> None:
        if output.new_token_ids and self.first_token_at is None:
            self.first_token_at = now
        self.text, self.token_ids = output.text, output.token_ids
        self.num_cached_tokens = output.num_cached_tokens
        if output.finished:
            self.finished_at = now
            self.finish_reason, self.error = output.finish_reason, output.error

    def timings(self) -> dict[str, float]:
        """Seconds to load the model, to the first token and to the end; the generation
        speed after the first token (tokens/s)."""
        end = self.finished_at or time.perf_counter()
        first = self.first_token_at or end
        decode_s = end - first
        speed = (len(self.token_ids) - 1) / decode_s if len(self.token_ids) > 1 and decode_s > 0 else 0.0
        return {"load_s": round(self.load_s, 3), "ttft_s": round(first - self.added_at, 3),
                "total_s": round(end - self.added_at, 3), "tokens_per_s": round(speed, 1)}

    def to_json(self) -> dict[str, Any]:
        return {**self.meta, "text": self.text, "finish_reason": self.finish_reason,
                "error": self.error, "prompt_tokens": len(self.prompt_ids),
                "cached_tokens": self.num_cached_tokens, "completion_tokens": len(self.token_ids),
                "timings": self.timings()}

    def stats_line(self) -> str:
        t = self.timings()
        return (f"{len(self.prompt_ids)} prompt tokens ({self.num_cached_tokens} from the prefix "
                f"cache), {len(self.token_ids)} generated, first token after {t['ttft_s']:.2f} s, "
                f"{t['tokens_per_s']:.1f} tokens/s, model loaded in {t['load_s']:.1f} s")


class OrderedOutput:
    """Writes answers to stdout in input order while they finish in any order: the earliest
    unfinished answer streams live, later ones are held until it is done. Plain text puts
    a blank line between answers; JSON writes one object per line as each one's turn comes.
    On a terminal the text is sanitized as it streams, each answer on its own, so a
    sequence the model leaves open never reaches into the next answer."""

    def __init__(self, answers: list[Answer], as_json: bool, stdout: TextIO) -> None:
        self.answers = answers
        self.as_json = as_json
        self.stdout = stdout
        self.current = 0
        self.held: dict[int, list[str]] = {}
        self.done: set[int] = set()
        self.sanitizer = StreamSanitizer() if stdout.isatty() else None

    def delta(self, answer: Answer, text: str) -> None:
        if self.as_json or not text:
            return
        if answer.index == self.current:
            self._write(text)
        else:
            self.held.setdefault(answer.index, []).append(text)

    def finished(self, answer: Answer) -> None:
        self.done.add(answer.index)
        while self.current in self.done:
            self._end_of_answer()
            finished = self.answers[self.current]
            self._write(json.dumps(finished.to_json(), ensure_ascii=False) + "\n" if self.as_json else "\n")
            self.current += 1
            if self.current < len(self.answers) and not self.as_json:
                self._write("\n" + "".join(self.held.pop(self.current, [])))

    def _write(self, text: str) -> None:
        if self.sanitizer is not None:
            text = self.sanitizer.feed(text)
        self.stdout.write(text)
        self.stdout.flush()

    def _end_of_answer(self) -> None:
        if self.sanitizer is not None:
            self.stdout.write(self.sanitizer.flush())


def run_requests(engine: Engine, answers: list[Answer], output: OrderedOutput,
                 on_progress: Callable[[Answer], None]) -> int | None:
    """Run every answer's request through the engine together; return the number of the
    signal (Ctrl+C, SIGTERM, SIGHUP) that stopped them, None when they all finished."""
    by_request = {}
    for answer in answers:
        answer.request_id = engine.add_request(answer.prompt_ids, answer.params)
        answer.added_at = time.perf_counter()
        by_request[answer.request_id] = answer
    stopping = None
    with _stop_flag() as stopped_by:
        while engine.has_unfinished():
            if stopped_by() and not stopping:
                stopping = stopped_by()
                for answer in answers:
                    engine.abort(answer.request_id)
            for delta in engine.step():
                answer = by_request.get(delta.request_id)
                if answer is None:
                    continue
                answer.update(delta, time.perf_counter())
                output.delta(answer, delta.new_text)
                if delta.finished:
                    output.finished(answer)
                else:
                    on_progress(answer)
    return stopping


@contextmanager
def _stop_flag() -> Iterator[Callable[[], int | None]]:
    """While inside, a STOP_SIGNALS signal only raises a flag: the callable returns the
    first one's number (None before any). A second signal interrupts at once. Outside the
    main thread signals cannot be caught: they then act as usual."""
    received: list[int] = []

    def on_signal(signum: int, frame: object) -> None:
        received.append(signum)
        if len(received) > 1:
            raise KeyboardInterrupt

    previous = {}
    try:
        for signum in STOP_SIGNALS:
            previous[signum] = signal.signal(signum, on_signal)
    except ValueError:  # not the main thread
        pass
    try:
        yield lambda: received[0] if received else None
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


class ChatRecorder:
    """Saves one `ask` turn in the chat store: the user row and an assistant row written
    before the reply starts, updated while it streams (every SAVE_INTERVAL_S) and when it
    ends, so a kill keeps what was said so far."""

    def __init__(self, store: ChatStore, chat: Chat) -> None:
        self.store = store
        self.chat = chat
        self.reply_id = 0
        self.saved_at = 0.0

    def start(self, conversation: Conversation, user_text: str, prompt_ids: list[int]) -> None:
        self.store.add_message(self.chat.id, "user", user_text, conversation.added_ids(prompt_ids))
        self.reply_id = self.store.add_message(self.chat.id, "assistant", "", []).id
        self.saved_at = time.monotonic()

    def progress(self, answer: Answer) -> None:
        if time.monotonic() - self.saved_at >= SAVE_INTERVAL_S:
            self.store.update_message(self.reply_id, answer.text, answer.token_ids, None)
            self.saved_at = time.monotonic()

    def finish(self, answer: Answer) -> None:
        self.store.update_message(self.reply_id, answer.text, answer.token_ids,
                                  answer.finish_reason, answer.timings())


def run_ask(options: AskOptions, settings: Settings, make_engine: EngineFactory,
            stdin: TextIO | None) -> int:
    """Answer the prompt (or the --file prompts); return the exit status: 0, 1 when a
    request failed (its error is on stderr), 130 on Ctrl+C."""
    if options.file is not None:
        return _run_batch(options, settings, make_engine)
    return _run_turn(options, settings, make_engine, stdin)


def _run_turn(options: AskOptions, settings: Settings, make_engine: EngineFactory,
              stdin: TextIO | None) -> int:
    """One chat turn: a new chat, or the next turn of a stored one (-c, --chat)."""
    from paged_chat.chat import Conversation
    from paged_chat.store import ChatStore

    user_text = read_prompt(options.prompt, stdin)
    if not user_text:
        raise UsageError('no prompt: give one as an argument or on stdin, or use --file '
                         '(e.g. paged-chat ask "Why is the sky blue?")')
    continuing = options.continue_chat or options.chat_id is not None
    with ExitStack() as cleanup, _warnings_to_stderr():
        store = cleanup.enter_context(ChatStore()) if options.save or continuing else None
        if store is not None and store.notice:
            _say(f"Warning: {store.notice}")
        chat = _chat_to_continue(options, store) if continuing else None
        engine_overrides = options.engine if chat is None else {**options.engine, "model": chat.model}
        config, params = _configure(settings, engine_overrides,
                                    {**(chat.sampling if chat else {}), **options.sampling})
        engine, load_s = _load(make_engine, config)
        if chat is not None:
            conversation = Conversation.from_chat(chat, engine.tokenizer, engine.chat_template)
        else:
            conversation = Conversation(engine.tokenizer, engine.chat_template,
                                        options.system or settings.chat.system_prompt)
        prompt_ids = conversation.next_prompt_ids(user_text)
        recorder = None
        if options.save:
            sampling = {name: getattr(params, name) for name in SAMPLING_KEYS}
            chat = chat or store.create_chat(_title(options.prompt or user_text), _model_spec(config.model),
                                             conversation.system_prompt, sampling)
            recorder = ChatRecorder(store, chat)
            recorder.start(conversation, user_text, prompt_ids)
        meta = {"model": config.model, "chat_id": chat.id if recorder is not None else None}
        return _generate(engine, [Answer(0, prompt_ids, params, load_s, meta)], options, recorder)


def _run_batch(options: AskOptions, settings: Settings, make_engine: EngineFactory) -> int:
    """--file: every prompt a one-shot chat, all through the engine at once; not saved."""
    from paged_chat.chat import Conversation

    if options.prompt or options.continue_chat or options.chat_id is not None:
        raise UsageError("--file runs its own prompts: drop the PROMPT argument, -c and --chat")
    prompts = read_prompt_file(options.file)
    config, params = _configure(settings, options.engine, options.sampling)
    with _warnings_to_stderr():
        engine, load_s = _load(make_engine, config)
        answers = []
        for index, item in enumerate(prompts):
            system = item.system or options.system or settings.chat.system_prompt
            conversation = Conversation(engine.tokenizer, engine.chat_template, system)
            meta = {"index": index, "prompt": item.prompt, "model": config.model}
            answers.append(Answer(index, conversation.next_prompt_ids(item.prompt), params, load_s, meta))
        return _generate(engine, answers, options, None)


def _configure(settings: Settings, engine: dict[str, Any], sampling: dict[str, Any]
               ) -> tuple[EngineConfig, SamplingParams]:
    """The settings with the command line's values on top. config.toml was checked when
    it was read, so a bad value here came from an option: a usage error."""
    try:
        return settings.engine_config(**engine), settings.sampling_params(**sampling)
    except ValueError as exc:
        raise UsageError(str(exc)) from exc


def _generate(engine: Engine, answers: list[Answer], options: AskOptions,
              recorder: ChatRecorder | None) -> int:
    output = OrderedOutput(answers, options.json, sys.stdout)
    try:
        interrupted = run_requests(engine, answers, output,
                                   recorder.progress if recorder is not None else _ignore)
    finally:
        if recorder is not None:  # also when cut short: the row keeps what was said
            recorder.finish(answers[0])
    if options.stats:
        _print_stats(answers, engine)
    failed = [answer for answer in answers if answer.finish_reason == "error"]
    for answer in failed:
        _say(f"Error: {f'prompt {answer.index + 1}: ' if len(answers) > 1 else ''}{answer.error}")
    return 128 + interrupted if interrupted else 1 if failed else 0


def _ignore(answer: Answer) -> None:
    pass


def _chat_to_continue(options: AskOptions, store: ChatStore) -> Chat:
    """The chat -c or --chat names, once it is clear the options can continue it."""
    if options.continue_chat and options.chat_id is not None:
        raise UsageError("give -c (the latest chat) or --chat ID, not both")
    if options.chat_id is not None:
        chat = store.get_chat(store.resolve_id(options.chat_id))
    else:
        chat = store.latest_chat()
        if chat is None:
            raise UsageError("there is no chat to continue yet: ask without -c to start one")
    _check_continuable(options, chat)
    return chat


def _check_continuable(options: AskOptions, chat: Chat) -> None:
    """A chat's token ids belong to its model and its system prompt: continuing it with
    others would silently re-encode (or mis-read) its history."""
    model = options.engine.get("model")
    if model is not None and not _same_model(model, chat.model):
        raise UsageError(f"chat {chat.id} uses the model {chat.model!r}: drop --model to continue "
                         "it, or start a new chat")
    if options.system is not None and options.system != (chat.system_prompt or ""):
        raise UsageError(f"chat {chat.id} has its own system prompt: drop --system to continue it")


def _model_spec(model: str) -> str:
    """What a chat stores as its model: a path made absolute, so -c works from anywhere."""
    path = Path(model).expanduser()
    return str(path.resolve()) if path.exists() else model


def _same_model(a: str, b: str) -> bool:
    return a == b or Path(a).expanduser().resolve() == Path(b).expanduser().resolve()


def _load(make_engine: EngineFactory, config: EngineConfig) -> tuple[Engine, float]:
    """The engine, and how long it took; says what is loading when stderr is a terminal."""
    started = time.perf_counter()
    if sys.stderr.isatty():
        _say(f"loading {config.model} ...")
    engine = make_engine(config)
    return engine, time.perf_counter() - started


def _title(prompt: str) -> str:
    """A new chat's title: the first non-blank line of the argument (what was asked, not
    the piped material it was about) or else of stdin, shortened. Sanitized before it is
    cut, so a title holds no escape sequence, whole or cut open, wherever it is printed."""
    lines = sanitize_for_terminal(prompt).splitlines()
    first = next((line.strip() for line in lines if line.strip()), "")
    return first if len(first) <= _TITLE_LENGTH else first[:_TITLE_LENGTH - 1].rstrip() + "…"


def _print_stats(answers: list[Answer], engine: Engine) -> None:
    if len(answers) == 1:
        _say(answers[0].stats_line())
        return
    for answer in answers:
        _say(f"[{answer.index + 1}] {answer.stats_line()}")
    started = min(answer.added_at for answer in answers)
    ended = max(answer.finished_at or started for answer in answers)
    generated = sum(len(answer.token_ids) for answer in answers)
    rate = generated / (ended - started) if ended > started else 0.0
    cached = sum(answer.num_cached_tokens for answer in answers)
    _say(f"{len(answers)} prompts: {generated} tokens generated in {ended - started:.2f} s "
         f"({rate:.1f} tokens/s together), {cached} prompt tokens from the prefix cache, "
         f"{engine.stats().num_preemptions} preemptions")


@contextmanager
def _warnings_to_stderr() -> Iterator[None]:
    """Python warnings (a template that forces a re-encode, a missing chat template) as
    one `Warning: ...` line each, not the module:line format meant for developers."""
    with warnings.catch_warnings():
        warnings.simplefilter("default")
        warnings.showwarning = lambda message, *args, **kwargs: _say(f"Warning: {message}")
        yield


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)
