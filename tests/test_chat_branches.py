"""Edit and branch at any message through ChatSession and `ask -c`, on a real engine and
store: a branch's prompt is the stored ids up to the branch point (the prefix cache holds
them all), the branch it replaces stays, and a new turn continues the branch last used."""

from __future__ import annotations

import asyncio
import json
from contextlib import aclosing

import numpy as np
import pytest
from helpers import assert_no_leaks, blocks_owned, engine_config

from paged_chat.app.chat_session import ChatSession
from paged_chat.cli.state import CliState
from paged_chat.engine import ClientSpec, SamplingParams, make_client
from paged_chat.engine.core.errors import PagedChatError

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
BLOCK = 16   # engine_config's block size


@pytest.fixture
def client(chat_model_dir, new_engine):
    engine = make_client(ClientSpec(engine=new_engine(engine_config(chat_model_dir))))
    yield engine
    engine.shutdown()
    assert_no_leaks(engine.transport.engine)


async def run(deltas) -> str:
    async with aclosing(deltas) as stream:
        return "".join([output.new_text async for output in stream])


async def four_turns(client, store) -> ChatSession:
    chat = store.create_chat("Chat 1", "tiny", "Be brief.", {})
    session = ChatSession(store, chat)
    for text in ("first question", "second question", "third question", "fourth question"):
        await asyncio.wait_for(run(session.send(client, text, GREEDY)), 60)
    return session


def texts(messages) -> list[str]:
    return [m.content for m in messages if m.role == "user"]


async def test_an_edit_prefills_only_from_the_edited_message_and_keeps_the_old_branch(client, store):
    session = await four_turns(client, store)
    messages = session.chat.messages
    second = messages[2]
    shared = [t for m in messages[:2] for t in m.token_ids]   # the first turn's exact ids
    await asyncio.wait_for(run(session.edit(client, second.id, "second, edited", GREEDY)), 60)
    turn = session.turn
    assert turn.prompt_ids[:len(shared)] == shared
    assert turn.num_cached_tokens >= (len(shared) - 1) // BLOCK * BLOCK > 0
    # Not the old branch's later turns: those are not in the prompt.
    assert len(turn.prompt_ids) < len(shared) + len(second.token_ids) + len(messages[3].token_ids)
    branch = store.get_chat(session.chat_id)
    assert texts(branch.messages) == ["first question", "second, edited"]
    assert [m.id for m in branch.messages] == [m.id for m in session.chat.messages]
    assert session.branch_of(branch.messages[2].id) == (2, 2)
    # The next turn continues the new branch from its exact ids.
    history = list(session.conversation.token_ids)
    await asyncio.wait_for(run(session.send(client, "and then?", GREEDY)), 60)
    assert session.turn.prompt_ids[:len(history)] == history
    # Back to the old branch: all four turns, and a turn there continues them.
    assert session.switch_branch(session.chat.messages[2].id, -1)
    assert texts(session.chat.messages) == ["first question", "second question",
                                            "third question", "fourth question"]
    assert not session.switch_branch(session.chat.messages[2].id, -1)
    assert texts(store.get_chat(session.chat_id).messages)[-1] == "fourth question"
    old = [t for m in session.chat.messages for t in m.token_ids]
    await asyncio.wait_for(run(session.send(client, "fifth question", GREEDY)), 60)
    assert session.turn.prompt_ids[:len(old)] == old
    assert session.turn.num_cached_tokens >= (len(old) - 1) // BLOCK * BLOCK


async def test_a_branch_holds_the_very_blocks_its_shared_history_is_in(client, store):
    """What the block map shows: the edited branch's request holds the blocks the first
    turn's KV is in (the blocks of the old branch's second turn), not copies of them."""
    chat = store.create_chat("Chat 1", "tiny", "Be brief.", {})
    session = ChatSession(store, chat)

    async def blocks_held(deltas) -> set[int]:
        """The blocks of the chat's request in the first snapshot that shows it running: the
        reply goes on (no end of sequence) until the published stats catch it."""
        async with aclosing(deltas) as stream:
            async for _ in stream:
                held = blocks_owned(client.stats(), chat.id)
                if held.size:
                    return set(held.tolist())
        raise AssertionError("no snapshot showed the request running")

    until_seen = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
    await asyncio.wait_for(run(session.send(client, "first question", GREEDY)), 60)
    old = await asyncio.wait_for(blocks_held(session.send(client, "second question", until_seen)),
                                 60)
    second = session.chat.messages[2]
    first_turn = [t for m in session.chat.messages[:2] for t in m.token_ids]
    edited = await asyncio.wait_for(blocks_held(session.edit(client, second.id, "other",
                                                             until_seen)), 60)
    assert len(np.intersect1d(list(old), list(edited))) >= (len(first_turn) - 1) // BLOCK > 0


async def test_any_reply_regenerates_as_a_branch_beside_it(client, store):
    session = await four_turns(client, store)
    first_reply = session.chat.messages[1]
    again = SamplingParams(temperature=1.0, seed=3, max_tokens=12, ignore_eos=True)
    await asyncio.wait_for(run(session.regenerate(client, again, first_reply.id)), 60)
    branch = store.get_chat(session.chat_id).messages
    assert texts(branch) == ["first question"] and branch[1].token_ids == session.turn.token_ids
    assert branch[1].token_ids != first_reply.token_ids
    assert session.branch_of(branch[1].id) == (2, 2)
    assert session.turn.num_cached_tokens >= (len(session.turn.prompt_ids) - 1) // BLOCK * BLOCK
    with pytest.raises(PagedChatError, match="no assistant message"):
        session.regenerate(client, again, branch[0].id)


def test_ask_c_continues_the_branch_last_used(cli):
    shared_engine = CliState(engine_factory=lambda config: cli.engines[0] if cli.engines
                             else cli.engine_factory(config))
    first = json.loads(cli("ask", "--json", "first question", obj=shared_engine).stdout)
    cli("ask", "--json", "-c", "second question", obj=shared_engine)
    with cli.store() as store:
        chat = store.get_chat(first["chat_id"])
        old_second = chat.messages[2]
        _, reply = store.start_turn(chat, ("second, edited", [1, 2, 3]), parent=chat.messages[1].id,
                                    after=chat.leaf_id)
        store.update_message(reply, "edited reply", [4], "stop")
        store.select_branch(chat.id, old_second.id)   # the TUI switched back to it
    third = json.loads(cli("ask", "--json", "-c", "third question", obj=shared_engine).stdout)
    with cli.store() as store:
        branch = store.get_chat(first["chat_id"]).messages
    assert texts(branch) == ["first question", "second question", "third question"]
    history = [t for m in branch[:4] for t in m.token_ids]
    assert third["prompt_tokens"] == len(history) + len(branch[4].token_ids)
    block = cli.engines[0].block_size
    assert third["cached_tokens"] >= (len(history) - 1) // block * block > 0
