"""The focused tab first: the shown tab's turns go to the engine at the top priority, hidden
tabs' (a broadcast's, the demo's) lower, and switching tabs moves the replies in flight.
First with a client that records what the app asks of it, then on a real engine."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

from helpers import wait_until
from tui_helpers import make_app, new_tab, press

from paged_chat.engine import (
    ClientCapabilities,
    Engine,
    EngineConfig,
    RequestOutput,
    SamplingParams,
)
from paged_chat.tui.chat_tab import HIDDEN_TAB_PRIORITY, SHOWN_TAB_PRIORITY


class RecordingClient:
    """An EngineClient that records each stream's priority and each reprioritize; a reply
    streams one piece, then waits until the test ends it (`finish`)."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.last_error: str | None = None
        self.running = True
        self.priorities: dict[str, int] = {}          # by request id, as it is now
        self.submitted: dict[str, int] = {}           # by request id, as it was submitted
        self.owners: dict[str, str | None] = {}
        self._ends: dict[str, asyncio.Event] = {}

    @property
    def info(self):
        return self.engine.info

    @property
    def capabilities(self) -> ClientCapabilities:
        return ClientCapabilities(block_map=True, metrics=True, where="recorded",
                                  reprioritize=True)

    def stats(self):
        return self.engine.stats()

    async def stream(self, prompt: str | Sequence[int], params: SamplingParams | None = None,
                     request_id: str | None = None, owner: str | None = None, priority: int = 0
                     ) -> AsyncIterator[RequestOutput]:
        request_id = request_id or f"recorded-{len(self.submitted)}"
        self.submitted[request_id] = self.priorities[request_id] = priority
        self.owners[request_id] = owner
        end = self._ends[request_id] = asyncio.Event()
        ids = self.info.tokenizer.encode("A piece", add_special_tokens=False)
        text = self.info.tokenizer.decode(ids)
        yield RequestOutput(request_id, ids, text, ids, text, False, None, len(prompt), 0)
        await end.wait()
        yield RequestOutput(request_id, [], "", ids, text, True, "stop", len(prompt), 0)

    def reprioritize(self, request_id: str, priority: int) -> None:
        self.priorities[request_id] = priority

    def finish(self) -> None:
        for end in self._ends.values():
            end.set()

    def abort(self, request_id: str) -> None:
        self._ends[request_id].set()

    def reset_prefix_cache(self) -> None:
        pass

    def shutdown(self) -> None:
        pass


def request_of(client: RecordingClient, tab) -> str:
    [request_id] = [rid for rid, owner in client.owners.items() if owner == tab.chat_id]
    return request_id


async def test_the_shown_tab_submits_first_and_a_switch_moves_the_replies_in_flight(
        chat_model_dir: Path, tmp_path: Path):
    engine = Engine(EngineConfig(model=str(chat_model_dir), device="cpu", dtype="float32",
                                 num_blocks=64, block_size=16))
    client = RecordingClient(engine)
    app = make_app(client, tmp_path)
    async with app.run_test(size=(120, 40)) as pilot:
        first = app.active_tab
        await press(pilot, *"hi", "enter")
        await wait_until(lambda: len(client.submitted) == 1, what="the first turn submitted")
        assert client.submitted[request_of(client, first)] == SHOWN_TAB_PRIORITY

        second = await new_tab(pilot)      # shown now: the first tab's reply goes behind it
        await wait_until(lambda: client.priorities[request_of(client, first)] == HIDDEN_TAB_PRIORITY,
                         what="the hidden tab's reply lowered")
        await press(pilot, *"yo", "enter")
        await wait_until(lambda: len(client.submitted) == 2, what="the second turn submitted")
        assert client.submitted[request_of(client, second)] == SHOWN_TAB_PRIORITY

        await press(pilot, "alt+left")     # back to the first tab: its reply first again
        await wait_until(lambda: app.active_tab is first and client.priorities == {
            request_of(client, first): SHOWN_TAB_PRIORITY,
            request_of(client, second): HIDDEN_TAB_PRIORITY}, what="the priorities swapped")
        client.finish()
        await wait_until(lambda: not first.streaming and not second.streaming)

        third = await new_tab(pilot)       # a broadcast: the shown tab's turn first
        await press(pilot, *"all", "ctrl+b")
        await wait_until(lambda: len(client.submitted) == 5, what="the broadcast submitted")
        assert client.submitted[request_of_turn(client, third, 1)] == SHOWN_TAB_PRIORITY
        for tab in (first, second):
            assert client.submitted[request_of_turn(client, tab, 2)] == HIDDEN_TAB_PRIORITY
        client.finish()
        await wait_until(lambda: not any(tab.streaming for tab in app.chat_tabs))


def request_of_turn(client: RecordingClient, tab, turn: int) -> str:
    """The request id of the tab's `turn`th turn this run (ChatSession names them so)."""
    request_id = f"{tab.chat_id}/{turn}"
    assert request_id in client.submitted
    return request_id


async def test_a_broadcast_reaches_a_real_engine_with_the_shown_tab_first(engine, tmp_path,
                                                                          monkeypatch):
    core = engine.transport.engine
    priorities: dict[str | None, int] = {}

    def add_request(prompt, params=None, request_id=None, owner=None, priority=0) -> str:
        priorities[owner] = priority
        return add(prompt, params, request_id, owner, priority=priority)

    add = core.add_request
    monkeypatch.setattr(core, "add_request", add_request)
    app = make_app(engine, tmp_path)
    async with app.run_test(size=(120, 40)) as pilot:
        tabs = [app.active_tab, await new_tab(pilot), await new_tab(pilot)]
        await press(pilot, *"all", "ctrl+b")
        await wait_until(lambda: len(priorities) == 3 and not any(tab.streaming for tab in tabs),
                         what="every tab's reply")
        assert priorities == {tabs[0].chat_id: HIDDEN_TAB_PRIORITY,
                              tabs[1].chat_id: HIDDEN_TAB_PRIORITY,
                              tabs[2].chat_id: SHOWN_TAB_PRIORITY}
