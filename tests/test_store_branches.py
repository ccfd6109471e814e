"""Branches in the chat store: a tree of messages (each names its parent), the branch last
used (the chat's leaf) read and continued, a store from before branches migrated in place,
search in every branch, and `chats show` / `chats export` (`--all-branches`)."""

from __future__ import annotations

import json

import pytest
from helpers import insert_old_chat, insert_old_message, sqlite
from typer.testing import CliRunner

from paged_chat.app import chat_store as store_module
from paged_chat.app.chat_store import ChatMovedOn, ChatStore, MessageNotFound
from paged_chat.cli.main import app
from paged_chat.cli.state import CliState

BRANCHES_VERSION = 3   # the schema version before branches


def contents(chat) -> list[str]:
    return [message.content for message in chat.messages]


def two_branches(store: ChatStore):
    """q1 a1 q2 a2, then q2 edited: q1 a1 q2' a2' (the branch last used)."""
    chat = store.create_chat("Tides", "m")
    q1 = store.add_message(chat.id, "user", "q1", [1])
    a1 = store.add_message(chat.id, "assistant", "a1", [2], "stop")
    q2 = store.add_message(chat.id, "user", "q2", [3])
    store.add_message(chat.id, "assistant", "a2", [4], "stop")
    edited, reply = store.start_turn(chat, ("q2 edited", [5]), parent=a1.id, after=store.get_chat(chat.id).leaf_id)
    store.update_message(reply, "a2 edited", [6], "stop")
    return chat, q1, a1, q2, edited


def test_an_edit_branches_and_the_old_branch_stays(store):
    chat, q1, a1, q2, edited = two_branches(store)
    branch = store.get_chat(chat.id)
    assert contents(branch) == ["q1", "a1", "q2 edited", "a2 edited"]
    assert [m.parent_id for m in branch.messages] == [None, q1.id, a1.id, edited]
    assert branch.leaf_id == branch.messages[-1].id
    assert branch.branches == {edited: [q2.id, edited]}
    old = store.select_branch(chat.id, q2.id)
    assert contents(old) == ["q1", "a1", "q2", "a2"] and old.branches == {q2.id: [q2.id, edited]}
    assert contents(store.get_chat(chat.id)) == ["q1", "a1", "q2", "a2"]   # the branch last used
    assert contents(store.get_chat(chat.id, branch.leaf_id)) == contents(branch)
    assert len(store.get_chat_tree(chat.id).messages) == 6


def test_a_new_turn_continues_the_branch_last_used(store):
    chat, _, _, q2, _ = two_branches(store)
    old = store.select_branch(chat.id, q2.id)
    store.add_message(chat.id, "user", "q3", [7])
    assert contents(store.get_chat(chat.id)) == ["q1", "a1", "q2", "a2", "q3"]
    with pytest.raises(ChatMovedOn):   # a writer that saw the leaf before q3
        store.start_turn(chat, ("late", [8]), parent=old.leaf_id, after=old.leaf_id)


def test_a_regenerate_is_a_sibling_reply_and_a_withdrawn_one_leaves_the_old(store):
    chat = store.create_chat("t", "m")
    question = store.add_message(chat.id, "user", "q", [1])
    answer = store.add_message(chat.id, "assistant", "a", [2], "stop")
    _, again = store.start_turn(chat, None, parent=question.id, after=answer.id)
    store.update_message(again, "a again", [3], "stop")
    assert contents(store.get_chat(chat.id)) == ["q", "a again"]
    assert store.get_chat(chat.id).branches == {again: [answer.id, again]}
    _, withdrawn = store.start_turn(chat, None, parent=question.id, after=again)
    store.withdraw_turn(chat.id, withdrawn, again)
    assert contents(store.get_chat(chat.id)) == ["q", "a again"]
    assert len(store.get_chat_tree(chat.id).messages) == 3


def test_select_branch_refuses_a_message_of_another_chat(store):
    chat, *_ = two_branches(store)
    other = store.create_chat("other", "m")
    stranger = store.add_message(other.id, "user", "x", [1])
    with pytest.raises(MessageNotFound):
        store.select_branch(chat.id, stranger.id)


def test_a_fork_copies_the_branch_last_used(store):
    chat, *_ = two_branches(store)
    fork = store.fork_chat(chat.id)
    assert contents(fork) == ["q1", "a1", "q2 edited", "a2 edited"] and fork.branches == {}
    assert len(store.get_chat_tree(fork.id).messages) == 4


def test_search_finds_text_in_any_branch(store):
    chat, _, _, q2, _ = two_branches(store)
    assert [c.id for c in store.search_chats("edited")] == [chat.id]
    store.select_branch(chat.id, q2.id)   # "edited" is now only in the other branch
    assert [c.id for c in store.search_chats("edited")] == [chat.id]


def test_a_store_from_before_branches_is_migrated_in_place(tmp_path, monkeypatch):
    """A store at the schema before branches, rows written as that schema has them: opened,
    each message follows the one before it and the chat's leaf is its last message."""
    path = tmp_path / "chats.db"
    monkeypatch.setattr(store_module, "MIGRATIONS", store_module.MIGRATIONS[:BRANCHES_VERSION])
    ChatStore(path).close()
    insert_old_chat(path, "first", "first")
    insert_old_chat(path, "second", "second")
    for index in range(3):   # interleaved: a chat's parent is its own previous message
        insert_old_message(path, "first", ("user", "assistant")[index % 2], f"first {index}", [index])
        insert_old_message(path, "second", ("user", "assistant")[index % 2], f"second {index}", [index])
    assert sqlite(path, "PRAGMA user_version") == [(BRANCHES_VERSION,)]
    monkeypatch.undo()
    with ChatStore(path) as new:
        assert sqlite(path, "PRAGMA user_version") == [(len(store_module.MIGRATIONS),)]
        chat = new.get_chat("first")
        assert contents(chat) == ["first 0", "first 1", "first 2"]
        assert [m.token_ids for m in chat.messages] == [[0], [1], [2]]
        ids = [m.id for m in chat.messages]
        assert [m.parent_id for m in chat.messages] == [None, *ids[:-1]]
        assert chat.leaf_id == ids[-1] and chat.branches == {}
        new.add_message("second", "user", "second 3", [3])
        assert contents(new.get_chat("second")) == [f"second {i}" for i in range(4)]


def test_chats_show_and_export_read_the_branch_last_used(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGED_CHAT_DATA_DIR", str(tmp_path))
    with ChatStore() as store:
        chat, _, _, q2, _ = two_branches(store)
    runner = CliRunner()

    def run(*args: str) -> str:
        result = runner.invoke(app, ["chats", *args], obj=CliState())
        assert result.exit_code == 0, result.stderr
        return result.stdout

    shown = run("show", chat.id)
    assert "q2 edited" in shown and "a2 edited" in shown and "\nq2\n" not in shown
    assert "branch 2 of 2" in shown
    exported = json.loads(run("export", chat.id, "--format", "json"))
    assert [m["content"] for m in exported["messages"]] == ["q1", "a1", "q2 edited", "a2 edited"]
    every = json.loads(run("export", chat.id, "--format", "json", "--all-branches"))
    assert sorted(m["content"] for m in every["messages"]) == sorted(
        ["q1", "a1", "q2", "a2", "q2 edited", "a2 edited"])
    assert every["leaf_id"] == exported["leaf_id"]
    markdown = run("export", chat.id, "--all-branches")
    first, second = markdown.index("Branch 1 of 2"), markdown.index("Branch 2 of 2 (current)")
    assert first < markdown.index("\nq2\n") < second < markdown.index("q2 edited")
    with ChatStore() as store:
        store.select_branch(chat.id, q2.id)
    assert "\nq2\n" in run("show", chat.id) and "branch 1 of 2" in run("show", chat.id)
