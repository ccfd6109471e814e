"""ChatSession: the one turn implementation under `ask` and the TUI, against a real engine
and a real store: rows written as the reply streams, a store that fails mid-reply, a chat
that another writer moved on, regenerate, fork and stop."""

from __future__ import annotations

import asyncio
import sqlite3
import threading
from contextlib import aclosing

import pytest
from helpers import assert_no_leaks, engine_config, step_as_a_client

from paged_chat.app.chat_session import ChatSession, Turn, chat_title
from paged_chat.app.chat_store import ChatMovedOn, ChatStore, StoreFullError, new_chat
from paged_chat.engine import ClientSpec, Engine, SamplingParams, make_client
from paged_chat.engine.core.errors import EngineDeadError

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture
def client(chat_model_dir, new_engine):
    engine = make_client(ClientSpec(engine=new_engine(engine_config(chat_model_dir))))
    yield engine
    engine.shutdown()
    assert_no_leaks(engine.transport.engine)


def new_session(store: ChatStore, warnings: list[str] | None = None) -> ChatSession:
    chat = store.create_chat("Chat 1", "tiny", "Be brief.", {})
    return ChatSession(store, chat, on_warning=(warnings if warnings is not None else []).append)


async def run(deltas) -> str:
    async with aclosing(deltas) as stream:
        return "".join([output.new_text async for output in stream])


async def test_a_turn_writes_its_rows_and_the_next_turn_starts_from_its_ids(client, store):
    session = new_session(store)
    first = await asyncio.wait_for(run(session.send(client, "Hello there", GREEDY)), 60)
    rows = store.get_chat(session.chat_id).messages
    assert [(m.role, m.finish_reason) for m in rows] == [("user", None), ("assistant", "length")]
    assert rows[1].content == first == session.turn.text and len(rows[1].token_ids) == 12
    assert rows[1].timings["prompt_tokens"] == len(session.turn.prompt_ids)
    history = rows[0].token_ids + rows[1].token_ids
    await asyncio.wait_for(run(session.send(client, "And again?", GREEDY)), 60)
    assert session.turn.prompt_ids[:len(history)] == history
    assert session.turn.num_cached_tokens >= (len(history) - 1) // 16 * 16 > 0


async def test_a_store_that_fails_mid_reply_costs_one_warning_not_the_reply(client, store, monkeypatch):
    """The disk fills up while a reply streams: the reply goes on to the end, the user is
    told once, and the text is saved as soon as the store takes writes again."""
    monkeypatch.setattr("paged_chat.app.chat_session.SAVE_INTERVAL_S", 0.0)
    warnings: list[str] = []
    session = new_session(store, warnings)
    update, failures = store.update_message, []

    def full_disk(message_id, content, token_ids, finish_reason, timings=None, **rest):
        if content and len(failures) < 3:
            failures.append(content)
            raise sqlite3.OperationalError("database or disk is full")
        return update(message_id, content, token_ids, finish_reason, timings, **rest)

    monkeypatch.setattr(store, "update_message", full_disk)
    text = await asyncio.wait_for(run(session.send(client, "Tell me more", GREEDY)), 60)
    assert len(failures) == 3 and len(session.turn.token_ids) == 12
    assert len(warnings) == 1 and "database or disk is full" in warnings[0]
    reply = store.get_chat(session.chat_id).messages[-1]
    assert reply.content == text and reply.finish_reason == "length"


async def test_streaming_saves_are_written_off_the_event_loop(client, store, monkeypatch):
    """A save while the reply streams must not hold the UI's loop (every tab's keys and
    frames) for the write; the last save, once a turn, may."""
    monkeypatch.setattr("paged_chat.app.chat_session.SAVE_INTERVAL_S", 0.0)
    session = new_session(store)
    update, saves = store.update_message, []

    def recording(message_id, content, token_ids, finish_reason, timings=None, **rest):
        saves.append((finish_reason, threading.get_ident()))
        return update(message_id, content, token_ids, finish_reason, timings, **rest)

    monkeypatch.setattr(store, "update_message", recording)
    text = await asyncio.wait_for(run(session.send(client, "Tell me more", GREEDY)), 60)
    streaming = [thread for reason, thread in saves if reason is None]
    assert streaming and threading.get_ident() not in streaming
    assert store.get_chat(session.chat_id).messages[-1].content == text


async def test_a_turn_the_store_cannot_start_runs_unsaved_and_leaves_the_chat_whole(
        client, store, monkeypatch):
    """A full disk when a turn starts: the reply still streams, the user is told once, the
    store keeps no part of the turn, and the last saved reply is not written over."""
    warnings: list[str] = []
    session = new_session(store, warnings)
    first = await asyncio.wait_for(run(session.send(client, "Hello there", GREEDY)), 60)

    def full_disk(*args, **kwargs):
        raise StoreFullError(f"the disk holding the chat store {store.path} is full", store.path)

    monkeypatch.setattr(store, "start_turn", full_disk)
    text = await asyncio.wait_for(run(session.send(client, "Tell me more", GREEDY)), 60)
    assert text and isinstance(session.unsaved, StoreFullError)
    assert len(warnings) == 1 and "is full" in warnings[0]
    rows = store.get_chat(session.chat_id).messages
    assert [m.content for m in rows[1:]] == [first] and len(rows) == 2


async def test_a_turn_whose_engine_stops_before_a_word_is_withdrawn(client, store, monkeypatch):
    """Issue 31 item 10: the engine child is killed while it prefills a message. No empty
    `error` reply is kept: the turn's rows leave the store, the session says the turn was
    withdrawn (the TUI gives the text back), and the same message then goes through."""
    session = new_session(store)
    await asyncio.wait_for(run(session.send(client, "Hello there", GREEDY)), 60)
    before = [(m.role, m.content) for m in store.get_chat(session.chat_id).messages]

    async def killed(*args, **kwargs):
        raise EngineDeadError("the engine process exited unexpectedly (exit code -9)")
        yield  # an async generator, as EngineClient.stream is

    monkeypatch.setattr(client, "stream", killed)
    with pytest.raises(EngineDeadError):
        await asyncio.wait_for(run(session.send(client, "And now?", GREEDY)), 60)
    assert session.turn.withdrawn
    assert [(m.role, m.content) for m in store.get_chat(session.chat_id).messages] == before
    monkeypatch.undo()
    await asyncio.wait_for(run(session.send(client, "And now?", GREEDY)), 60)
    rows = store.get_chat(session.chat_id).messages
    assert [m.role for m in rows] == ["user", "assistant", "user", "assistant"]
    assert rows[2].content == "And now?" and rows[3].content and not session.turn.withdrawn


async def test_a_new_chat_is_written_with_its_first_turn_and_leaves_with_it(
        client, store, monkeypatch):
    """A chat not yet in the store (a new TUI tab, `/new`) is written with its first turn,
    renamed and set up in memory until then; a first turn withdrawn takes it out again,
    so no empty chat is ever kept (issue 48, item 19)."""
    session = ChatSession(store, new_chat("Chat 2", "tiny", "Be brief."), in_store=False)
    session.rename("Renamed")
    session.update_settings("Be terse.", {"temperature": 0.5})
    assert store.list_chats() == []

    async def killed(*args, **kwargs):
        raise EngineDeadError("the engine process exited unexpectedly (exit code -9)")
        yield  # an async generator, as EngineClient.stream is

    monkeypatch.setattr(client, "stream", killed)
    with pytest.raises(EngineDeadError):
        await asyncio.wait_for(run(session.send(client, "Hello there", GREEDY)), 60)
    assert session.turn.withdrawn and not session.in_store and store.list_chats() == []
    monkeypatch.undo()
    await asyncio.wait_for(run(session.send(client, "Hello there", GREEDY)), 60)
    [chat] = store.list_chats()
    assert (chat.id, chat.title, chat.system_prompt, chat.sampling) == (
        session.chat_id, "Renamed", "Be terse.", {"temperature": 0.5})
    assert [m.role for m in store.get_chat(chat.id).messages] == ["user", "assistant"]

    session.start_over("tiny")
    assert not session.in_store and [c.id for c in store.list_chats()] == [chat.id]
    await asyncio.wait_for(run(session.send(client, "Hi again", GREEDY)), 60)
    assert {c.id for c in store.list_chats()} == {chat.id, session.chat_id}


async def test_a_regenerate_whose_engine_stops_before_a_word_keeps_the_old_reply(
        client, store, monkeypatch):
    """The same for a regenerate (issue 31 item 10): the reply it would replace stays, in
    the store and in the conversation the next turn continues, instead of being emptied."""
    session = new_session(store)
    await asyncio.wait_for(run(session.send(client, "Hello there", GREEDY)), 60)
    before = [(m.role, m.content, m.token_ids) for m in store.get_chat(session.chat_id).messages]
    conversation = session.conversation

    async def killed(*args, **kwargs):
        raise EngineDeadError("the engine process exited unexpectedly (exit code -9)")
        yield  # an async generator, as EngineClient.stream is

    monkeypatch.setattr(client, "stream", killed)
    with pytest.raises(EngineDeadError):
        await asyncio.wait_for(run(session.regenerate(client, GREEDY)), 60)
    assert session.turn.withdrawn
    assert [(m.role, m.content, m.token_ids)
            for m in store.get_chat(session.chat_id).messages] == before
    assert session.conversation is conversation
    monkeypatch.undo()
    await asyncio.wait_for(run(session.regenerate(client, GREEDY)), 60)
    rows = store.get_chat(session.chat_id).messages
    assert [m.role for m in rows] == ["user", "assistant"] and rows[1].content


async def test_a_chat_deleted_mid_reply_still_streams_the_reply(client, store, monkeypatch):
    monkeypatch.setattr("paged_chat.app.chat_session.SAVE_INTERVAL_S", 0.0)
    warnings: list[str] = []
    session = new_session(store, warnings)
    shown = []
    async with aclosing(session.send(client, "Hi", GREEDY)) as stream:
        async for output in stream:
            shown.append(output.new_text)
            if len(shown) == 2:
                store.delete_chat(session.chat_id)
    assert session.turn.finish_reason == "length" and "".join(shown) == session.turn.text
    assert len(warnings) == 1 and "no message with id" in warnings[0]


async def test_a_chat_that_moved_on_refuses_the_turn(client, store):
    """Two `ask -c` on one chat: the second to save finds the chat has moved on since it
    read it, and saves nothing rather than interleave two conversations."""
    session = new_session(store)
    await asyncio.wait_for(run(session.send(client, "First", GREEDY)), 60)
    one = ChatSession(store, store.get_chat(session.chat_id))
    other = ChatSession(store, store.get_chat(session.chat_id))
    await asyncio.wait_for(run(one.send(client, "From one", GREEDY)), 60)
    with pytest.raises(ChatMovedOn, match="run it again"):
        await asyncio.wait_for(run(other.send(client, "From the other", GREEDY)), 60)
    contents = [m.content for m in store.get_chat(session.chat_id).messages if m.role == "user"]
    assert contents == ["First", "From one"]


async def test_stop_ends_the_turn_as_stopped_and_keeps_it_in_the_context(client, store):
    session = new_session(store)
    long = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
    stopped = []
    async with aclosing(session.send(client, "Go on", long)) as stream:
        async for _ in stream:
            if len(session.turn.token_ids) >= 3 and not stopped:
                stopped.append(session.stop())
    assert stopped == [True] and not session.stop()
    assert session.turn.finish_reason == "abort" and 3 <= len(session.turn.token_ids) < 400
    assert session.conversation.token_ids[-len(session.turn.token_ids):] == session.turn.token_ids
    assert store.get_chat(session.chat_id).messages[-1].finish_reason == "abort"


async def test_leaving_the_stream_early_aborts_and_saves_the_turn(client, store):
    session = new_session(store)
    long = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
    async with aclosing(session.send(client, "Go on", long)) as stream:
        async for _ in stream:
            break
    assert session.turn.finish_reason == "abort"
    assert store.get_chat(session.chat_id).messages[-1].finish_reason == "abort"


async def test_regenerate_replaces_the_last_reply_and_fork_shares_the_history(client, store):
    session = new_session(store)
    await asyncio.wait_for(run(session.send(client, "Name a colour", GREEDY)), 60)
    first_reply = session.turn.token_ids
    again = SamplingParams(temperature=1.0, seed=3, max_tokens=12, ignore_eos=True)
    await asyncio.wait_for(run(session.regenerate(client, again)), 60)
    rows = store.get_chat(session.chat_id).messages
    assert [m.role for m in rows] == ["user", "assistant"]
    assert rows[1].token_ids == session.turn.token_ids != first_reply
    fork = session.fork("Fork")
    assert fork.conversation.token_ids == session.conversation.token_ids
    await asyncio.wait_for(run(fork.send(client, "Another", GREEDY)), 60)
    assert fork.turn.num_cached_tokens >= (len(session.conversation.token_ids) - 1) // 16 * 16


def test_chat_titles_are_one_clean_line():
    assert chat_title("\n  Why is   the sky blue?\nBecause...") == "Why is the sky blue?"
    assert chat_title("x" * 100) == "x" * 59 + "…"
    assert chat_title("\x1b]0;evil\x07 hi") == "hi"


def test_a_turn_fed_deltas_late_keeps_the_ids_that_go_with_each_text(chat_model_dir):
    """A delta's `token_ids` is the request's own list, which the output processor extends
    after handing it out: a consumer that lags behind the engine (its queue holds several steps)
    must not take ids from later steps with an earlier step's text."""
    engine = Engine(engine_config(chat_model_dir))
    prompt = engine.tokenizer.encode("Hello there")
    engine.add_request(prompt, GREEDY)
    deltas = []
    while engine.has_unfinished():
        deltas += step_as_a_client(engine)
    turn, seen = Turn("Hello there", prompt), []
    for output in deltas:
        turn.add(output, 0.0)
        seen.append((list(turn.token_ids), turn.text))
    generated = deltas[-1].token_ids
    assert len(generated) == GREEDY.max_tokens
    assert [ids for ids, _ in seen] == [generated[:count] for count in range(1, len(generated) + 1)]
    assert seen[-1][1] == engine.tokenizer.decode(generated, skip_special_tokens=True)
    assert_no_leaks(engine)
