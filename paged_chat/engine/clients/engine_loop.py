"""The loop that serves an Engine: apply the commands that came in, step while there is work,
sleep on the commands when there is none, and report what happened.

It runs wherever the engine lives: on the thread transport's thread, or as the main loop
of the process transport's child. Only the transport differs, behind two small surfaces:
where the commands come from (`receive`) and who hears of core outputs, stats and failures
(`LoopEvents`). The commands are plain picklable dataclasses, so they cross a pipe as they
are.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from paged_chat.engine.core.outputs import EngineCoreOutput
from paged_chat.engine.core.sampling_params import SamplingParams
from paged_chat.engine.core.stats import EngineStats

if TYPE_CHECKING:   # a client in another process than its Engine never imports torch
    from paged_chat.engine.core.engine import Engine


@dataclass(slots=True)
class Add:
    request_id: str
    prompt: str | Sequence[int]
    params: SamplingParams | None
    owner: str | None
    priority: int = 0


@dataclass(slots=True)
class Abort:
    request_id: str


@dataclass(slots=True)
class Reprioritize:
    request_id: str
    priority: int


@dataclass(slots=True)
class ResetPrefixCache:
    pass


@dataclass(slots=True)
class Shutdown:
    reason: str  # what the open streams are told


Command = Add | Abort | Reprioritize | ResetPrefixCache | Shutdown

# Requests sent together (tabs that send at once, a broadcast, `ask --file`) arrive
# milliseconds apart: each is encoded and stored before it goes, and a busy UI thread holds
# up the thread that sends them. Waking from idle for a request, the loop takes those that
# keep coming within BURST_GAP_S of the last, for at most BURST_MAX_S, into its first step:
# one prefill of them all, where the first alone would hold the others back by its whole
# step. A lone request waits BURST_GAP_S more.
BURST_GAP_S = 0.01
BURST_MAX_S = 0.1


class LoopEvents(Protocol):
    """What the loop reports, from the thread that runs it."""

    def on_outputs(self, outputs: list[EngineCoreOutput]) -> None:
        """One step's core outputs (ids, no text)."""

    def on_stats(self, stats: EngineStats) -> None:
        """A new snapshot: at most every `stats_interval_s` while stepping, and when idle."""

    def on_request_failed(self, request_id: str, error: Exception) -> None:
        """The engine refused to add a request (a bad prompt); nothing else is affected."""

    def on_step_failed(self, message: str) -> None:
        """A step raised: every request has been aborted and the prefix cache dropped (a
        failed forward may have left indexed blocks unwritten); the loop goes on serving."""


def serve_engine(engine: Engine, receive: Callable[[bool], list[Command]], events: LoopEvents,
                 stats_interval_s: float) -> str:
    """Serve until a Shutdown command and return its reason. `receive(block)` returns the
    commands that came in, waiting for one when `block` (the engine is idle). Any error
    outside a step (an engine bug) propagates: the caller ends the streams with it."""
    last_publish = 0.0
    while True:
        idle = not engine.has_unfinished()
        if idle:
            engine.settle()
            events.on_stats(engine.stats())
        commands = receive(idle)
        if idle and any(isinstance(command, Add) for command in commands):
            commands += _rest_of_burst(receive)
        for command in commands:
            if isinstance(command, Shutdown):  # the cached prefixes stay valid
                engine.abort_all()
                events.on_stats(engine.stats())
                return command.reason
            _apply(engine, command, events)
        if not engine.has_unfinished():
            continue
        try:
            outputs = engine.step()
        except Exception as error:  # surfaced to every stream, never swallowed
            engine.reset()
            events.on_step_failed(f"{type(error).__name__}: {error}")
            events.on_stats(engine.stats())
            continue
        events.on_outputs(outputs)
        now = time.monotonic()
        if now - last_publish >= stats_interval_s:
            events.on_stats(engine.stats())
            last_publish = now


def _rest_of_burst(receive: Callable[[bool], list[Command]]) -> list[Command]:
    """The commands that follow within BURST_GAP_S of each other, for at most BURST_MAX_S."""
    deadline = time.monotonic() + BURST_MAX_S
    commands: list[Command] = []
    while time.monotonic() < deadline:
        time.sleep(BURST_GAP_S)
        more = receive(False)
        if not more:
            break
        commands += more
    return commands


def _apply(engine: Engine, command: Add | Abort | Reprioritize | ResetPrefixCache,
           events: LoopEvents) -> None:
    if isinstance(command, Abort):
        engine.abort(command.request_id)
    elif isinstance(command, Reprioritize):
        engine.reprioritize(command.request_id, command.priority)
    elif isinstance(command, ResetPrefixCache):
        engine.reset_prefix_cache()
    else:
        try:
            engine.add_request(command.prompt, command.params, command.request_id, command.owner,
                               priority=command.priority)
        except Exception as error:  # a bad prompt: that stream raises it
            events.on_request_failed(command.request_id, error)
