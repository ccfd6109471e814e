"""What the plain-terminal front ends, `paged-chat ask` and `paged-chat chat`, share: their
options, the settings with the command line on top, the engine client they load, the stored
chat that -c / --chat name, the stop signals, and the lines they write on stderr.

stdout belongs to the answers: everything here that talks to the user writes to stderr.
"""

from __future__ import annotations

import asyncio
import signal
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from paged_chat.app.text import check_text

if TYPE_CHECKING:
    from paged_chat.app.chat_session import Turn
    from paged_chat.app.chat_store import ChatStore, StoredChat
    from paged_chat.app.settings import Settings
    from paged_chat.engine import Engine, EngineClient, EngineConfig, SamplingParams

EngineFactory = Callable[["EngineConfig"], "Engine"]

MODEL_HELP = ("Alias, .gguf file, HF folder, cached hub id, ollama:NAME(:TAG) or "
              "lmstudio:PUBLISHER/REPO(/FILE).")

STOP_SIGNALS = {signal.SIGINT: 130, signal.SIGTERM: 143, signal.SIGHUP: 129}
# How long replies get to end after a stop signal (one step, on any machine) before they
# are cancelled without the engine.
STOP_GRACE_S = 3.0


class UsageError(ValueError):
    """The command line asks for something impossible; the CLI exits with status 2."""


@dataclass(slots=True)
class PlainTerminalOptions:
    """Everything `paged-chat ask` (or `chat`) was given. `engine` and `sampling` hold the
    overrides of the settings (None: not given)."""

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
    server: str | None = None       # an OpenAI-compatible server's URL instead of the engine
    api_key: str | None = None
    remote_model: str | None = None  # the --server's tokenizer to try: --model, else [engine] model
    show_thinking: bool = False     # print a reasoning model's thinking before its answer
    thinking: bool | None = None    # turn the model's thinking on or off (None: as the template has it)


def configure(settings: Settings, engine: dict[str, Any], sampling: dict[str, Any]
              ) -> EngineConfig:
    """The engine settings with the command line's values on top, the sampling options
    checked too (before anything loads; `model_sampling` builds them once the model's
    defaults are known). config.toml was checked when it was read, so a bad value here
    came from an option: a usage error."""
    try:
        settings.sampling_params(**sampling)
        return settings.engine_config(**engine)
    except ValueError as exc:
        raise UsageError(str(exc)) from exc


def model_sampling(settings: Settings, client: EngineClient, sampling: dict[str, Any]
                   ) -> SamplingParams:
    """A turn's sampling: the options over the loaded model's defaults (its generation
    config, else `[chat]`: Settings.model_sampling, what `serve` gives requests too)."""
    try:
        return settings.sampling_params(client.info.generation_defaults, **sampling)
    except ValueError as exc:
        raise UsageError(f"the model's generation_config.json: {exc}") from exc


def load_client(make_engine: EngineFactory, config: EngineConfig, options: PlainTerminalOptions
                ) -> tuple[EngineClient, float]:
    """The engine client (in-process, or the --server's), and how long it took; says what
    is loading when stderr is a terminal."""
    from paged_chat.app.client_spec import client_spec
    from paged_chat.engine import make_client

    started = time.perf_counter()
    if sys.stderr.isatty():
        say(f"loading {options.server or config.model} ...")
    client = make_client(client_spec(config, server=options.server, api_key=options.api_key,
                                     model=options.remote_model, make_engine=make_engine))
    return client, time.perf_counter() - started


def chat_to_continue(options: PlainTerminalOptions, store: ChatStore) -> StoredChat:
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


def _check_continuable(options: PlainTerminalOptions, chat: StoredChat) -> None:
    """A chat's token ids belong to its model and its system prompt: continuing it with
    others would silently re-encode (or mis-read) its history."""
    model = options.engine.get("model")
    if model is not None and not _same_model(model, chat.model):
        raise UsageError(f"chat {chat.id} uses the model {chat.model!r}: drop --model to continue "
                         "it, or start a new chat")
    if options.system is not None and options.system != (chat.system_prompt or ""):
        has = f"the system prompt {chat.system_prompt!r}" if chat.system_prompt else "no system prompt"
        raise UsageError(f"chat {chat.id} has {has} and --system would change it: drop --system "
                         "to continue it, or start a new chat without -c")


def check_text_options(options: PlainTerminalOptions) -> None:
    """The options that reach the tokenizer or the store hold text: a UsageError names
    the one that does not (undecodable bytes in argv), before anything loads."""
    valid_text(options.system or "", "--system")
    valid_text(options.chat_id or "", "--chat")


def valid_text(text: str, what: str) -> str:
    """`text`, once it is clear the tokenizer and the store can take it; else a UsageError
    naming `what` (an option, a file's line)."""
    try:
        return check_text(text, what)
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def model_spec(model: str) -> str:
    """What a chat stores as its model: a path made absolute, so -c works from anywhere."""
    path = Path(model).expanduser()
    return str(path.resolve()) if path.exists() else model


def _same_model(a: str, b: str) -> bool:
    return a == b or Path(a).expanduser().resolve() == Path(b).expanduser().resolve()


def ready_words(options: PlainTerminalOptions, client: EngineClient, load_s: float) -> str:
    """How the engine came to be ready: a model loaded, or a --server connected to (and
    whose tokenizer the chat uses)."""
    if options.server:
        return (f"connected to {options.server} in {load_s:.1f} s "
                f"({client.info.tokenizer_from} tokenizer)")
    return f"model loaded in {load_s:.1f} s"


def turn_stats_line(turn: Turn, ready: str) -> str:
    """One turn's numbers for --stats and /stats: prompt and cached tokens, generated
    tokens, time to the first token, speed, and `ready` (ready_words)."""
    timings = turn.timings()
    first = "no token" if timings["ttft_s"] is None else f"first token after {timings['ttft_s']:.2f} s"
    tier = (f", {turn.num_tier_cached_tokens:,} of them read back from the KV tier"
            if turn.num_tier_cached_tokens else "")
    cached = (f"{turn.num_cached_tokens:,} from the cache{tier}" if turn.num_cached_tokens is not None
              else "from the cache: unknown, the server did not say (vLLM says it with "
                   "--enable-prompt-tokens-details)")
    return (f"{len(turn.prompt_ids):,} prompt tokens ({cached}), {len(turn.token_ids)} "
            f"generated, {first}, {timings['tokens_per_s']:.1f} tokens/s, {ready}")


class ReceivedSignals(list[int]):
    """The stop signals received, in order; `overdue` once the replies did not end within
    STOP_GRACE_S of the first (the engine is stuck in a step: waiting on it is pointless)."""

    overdue: bool = False


@contextmanager
def stop_signals(stop: Callable[[], None]) -> Iterator[ReceivedSignals]:
    """While inside, Ctrl+C, SIGTERM and SIGHUP call `stop` (the replies end between steps,
    their partial text kept); a second one, or STOP_GRACE_S without the replies ending,
    cancels the running task at once, so a signal ends the process whatever the engine is
    blocked on. Yields the signals received. Outside the main thread signals cannot be
    caught: they act as usual."""
    loop = asyncio.get_running_loop()
    task = asyncio.current_task()
    received = ReceivedSignals()
    overdue: list[asyncio.TimerHandle] = []

    def give_up() -> None:
        received.overdue = True
        task.cancel()

    def on_signal(signum: int) -> None:
        received.append(signum)
        if len(received) == 1:
            stop()
            overdue.append(loop.call_later(STOP_GRACE_S, give_up))
        else:
            task.cancel()

    installed = []
    for signum in STOP_SIGNALS:
        try:
            loop.add_signal_handler(signum, on_signal, signum)
        except (ValueError, RuntimeError):  # not the main thread
            break
        installed.append(signum)
    try:
        yield received
    finally:
        for handle in overdue:
            handle.cancel()
        for signum in installed:
            loop.remove_signal_handler(signum)


@contextmanager
def warnings_to_stderr() -> Iterator[None]:
    """Python warnings (a template that forces a re-encode, a missing chat template) as
    one `Warning: ...` line each, not the module:line format meant for developers."""
    with warnings.catch_warnings():
        warnings.simplefilter("default")
        warnings.showwarning = lambda message, *args, **kwargs: warn(str(message))
        yield


def warn(message: str) -> None:
    say(f"Warning: {message}")


def say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def load_progress() -> Callable[[str, int, int], None]:
    """A one-line progress bar on stderr for a slow model load (a GGUF's first conversion),
    redrawn at most ten times a second."""
    drawn = {"at": 0.0, "stage": ""}

    def show(stage: str, done: int, total: int) -> None:
        now = time.monotonic()
        if stage == drawn["stage"] and done < total and now - drawn["at"] < 0.1:
            return
        drawn.update(at=now, stage=stage)
        filled = 30 * done // max(total, 1)
        end = "\n" if done >= total else ""
        sys.stderr.write(f"\r{stage} [{'#' * filled}{'.' * (30 - filled)}] {done}/{total}{end}")
        sys.stderr.flush()

    return show
