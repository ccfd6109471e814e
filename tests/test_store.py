"""The chat store: exact token ids, transactions, migrations, refusal of newer files,
corrupt files moved aside, a writer killed mid-stream; and Conversation rebuilding a
stored chat's exact history."""

from __future__ import annotations

import hashlib
import sqlite3
import subprocess
import sys
import threading
import warnings
from pathlib import Path

import pytest
from helpers import REPO, sqlite
from hypothesis import given, settings
from hypothesis import strategies as st

from paged_chat.app import chat_store as store_module
from paged_chat.app.chat_store import ChatNotFound, ChatStore, MessageNotFound, StoreError
from paged_chat.app.conversation import Conversation


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# ---- the API ---------------------------------------------------------------------------


def test_default_path_is_in_the_data_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGED_CHAT_DATA_DIR", str(tmp_path / "data"))
    with ChatStore() as chat_store:
        assert chat_store.path == tmp_path / "data" / "chats.db"
        chat_store.create_chat("t", "m")
    assert sqlite(tmp_path / "data" / "chats.db", "PRAGMA journal_mode") == [("wal",)]


def test_chats_round_trip(store):
    chat = store.create_chat("Caches", "smollm2-135m", "Be brief.", {"temperature": 0.2, "top_k": 5})
    loaded = store.get_chat(chat.id)
    assert loaded == chat and loaded.messages == []
    assert store.list_chats() == [chat] and store.latest_chat() == chat
    store.rename_chat(chat.id, "Pages")
    store.update_chat_settings(chat.id, None, {"temperature": 1.0})
    loaded = store.get_chat(chat.id)
    assert (loaded.title, loaded.system_prompt, loaded.sampling) == ("Pages", None, {"temperature": 1.0})
    assert loaded.updated > chat.updated and loaded.created == chat.created


def test_list_is_most_recently_updated_first(store):
    older, newer = store.create_chat("a", "m"), store.create_chat("b", "m")
    assert [c.id for c in store.list_chats()] == [newer.id, older.id]
    store.add_message(older.id, "user", "hi", [1])
    assert [c.id for c in store.list_chats()] == [older.id, newer.id]
    assert store.latest_chat().id == older.id and store.latest_chat().messages[0].content == "hi"
    assert all(c.messages == [] for c in store.list_chats())


def test_messages_keep_their_exact_token_ids(store):
    chat = store.create_chat("t", "m")
    ids = [0, 1, 2**31 - 1, 49151, 7, 7]
    user = store.add_message(chat.id, "user", "question", ids, timings={"x": 1})
    reply = store.add_message(chat.id, "assistant", "answer", [], "stop")
    messages = store.get_chat(chat.id).messages
    assert messages == [user, reply]
    assert messages[0].token_ids == ids and messages[1].token_ids == [] and messages[0].timings == {"x": 1}


def test_a_reply_that_never_finished_reads_as_interrupted(store):
    chat = store.create_chat("t", "m")
    store.add_message(chat.id, "user", "q", [1])
    store.add_message(chat.id, "assistant", "partial", [5, 6])
    store.add_message(chat.id, "assistant", "stopped", [7], "abort")
    assert [m.finish_reason for m in store.get_chat(chat.id).messages] == [None, "interrupted", "abort"]


def test_update_message(store):
    chat = store.create_chat("t", "m")
    reply = store.add_message(chat.id, "assistant", "", [], timings={"ttft_s": 0.1})
    store.update_message(reply.id, "Hel", [10, 11], None)
    assert store.get_chat(chat.id).messages[0].timings == {"ttft_s": 0.1}  # None keeps them
    store.update_message(reply.id, "Hello", [10, 11, 12, 2], "stop", {"total_s": 1.5})
    [loaded] = store.get_chat(chat.id).messages
    assert (loaded.content, loaded.token_ids, loaded.finish_reason, loaded.timings) == \
        ("Hello", [10, 11, 12, 2], "stop", {"total_s": 1.5})
    assert store.get_chat(chat.id).updated >= loaded.created
    with pytest.raises(MessageNotFound, match="no message with id 999"):
        store.update_message(999, "x", [], "stop")


def test_unknown_chats_are_clear_errors(store):
    calls = [lambda: store.get_chat("nope"), lambda: store.rename_chat("nope", "x"),
             lambda: store.update_chat_settings("nope", None, {}), lambda: store.fork_chat("nope"),
             lambda: store.delete_chat("nope"), lambda: store.add_message("nope", "user", "x", [])]
    for call in calls:
        with pytest.raises(ChatNotFound) as caught:
            call()
        assert isinstance(caught.value, KeyError) and "'nope'" in str(caught.value)
        assert not str(caught.value).startswith('"')  # not KeyError's quoted repr


def test_a_bad_role_is_refused(store):
    chat = store.create_chat("t", "m")
    with pytest.raises(ValueError, match="role 'robot'"):
        store.add_message(chat.id, "robot", "x", [])


def test_fork_copies_every_message_with_its_token_ids(store):
    chat = store.create_chat("Original", "m", "sys", {"temperature": 0.5})
    store.add_message(chat.id, "user", "q", [1, 2, 3], timings={"a": 1})
    store.add_message(chat.id, "assistant", "a", [4, 5, 2], "stop", {"total_s": 2.0})
    store.add_message(chat.id, "assistant", "cut", [6])
    fork = store.fork_chat(chat.id)
    original = store.get_chat(chat.id)
    assert fork.id != chat.id and fork.title == "Original (fork)"
    assert (fork.model, fork.system_prompt, fork.sampling) == ("m", "sys", {"temperature": 0.5})

    def content(c):
        return [(m.role, m.content, m.token_ids, m.finish_reason, m.timings, m.created) for m in c.messages]

    assert content(fork) == content(original)
    assert {m.id for m in fork.messages}.isdisjoint(m.id for m in original.messages)
    store.add_message(fork.id, "user", "only in the fork", [9])
    assert len(store.get_chat(chat.id).messages) == 3
    assert store.fork_chat(chat.id, "Named").title == "Named"


def test_delete_removes_the_messages(store):
    chat = store.create_chat("t", "m")
    store.add_message(chat.id, "user", "q", [1])
    store.delete_chat(chat.id)
    assert store.list_chats() == [] and sqlite(store.path, "SELECT count(*) FROM messages") == [(0,)]


def test_resolve_id_takes_a_unique_prefix(store):
    chats = [store.create_chat(str(i), "m") for i in range(40)]
    target = chats[0].id
    assert store.resolve_id(target) == target
    unique = next(target[:n] for n in range(1, 13)
                  if sum(c.id.startswith(target[:n]) for c in chats) == 1)
    assert store.resolve_id(unique) == target
    with pytest.raises(ChatNotFound, match="no chat"):
        store.resolve_id("xyz")
    with pytest.raises(ChatNotFound, match="several chats"):
        store.resolve_id(next(digit for digit in "0123456789abcdef"  # 40 ids, 16 digits
                              if sum(c.id.startswith(digit) for c in chats) > 1))
    with pytest.raises(ChatNotFound, match="empty chat id"):
        store.resolve_id("")


def test_a_failed_write_changes_nothing(store):
    chat = store.create_chat("t", "m")
    sqlite(store.path, "CREATE TRIGGER boom BEFORE INSERT ON messages WHEN NEW.content = 'boom' "
                       "BEGIN SELECT RAISE(ABORT, 'boom'); END")
    with pytest.raises(sqlite3.IntegrityError):
        store.add_message(chat.id, "user", "boom", [1])
    assert store.get_chat(chat.id).updated == chat.updated  # the chat's touch rolled back too
    store.add_message(chat.id, "user", "fine", [1])
    assert [m.content for m in store.get_chat(chat.id).messages] == ["fine"]


def test_two_stores_on_one_file_see_each_other(tmp_path):
    with ChatStore(tmp_path / "chats.db") as tui, ChatStore(tmp_path / "chats.db") as cli:
        chat = cli.create_chat("from ask", "m")
        cli.add_message(chat.id, "user", "q", [1])
        tui.add_message(chat.id, "assistant", "a", [2], "stop")
        assert [m.content for m in cli.get_chat(chat.id).messages] == ["q", "a"]


def test_threads_can_share_a_store(store):
    chat = store.create_chat("t", "m")

    def write(worker: int) -> None:
        for i in range(25):
            store.add_message(chat.id, "user", f"{worker}-{i}", [worker, i])

    threads = [threading.Thread(target=write, args=(w,)) for w in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    messages = store.get_chat(chat.id).messages
    assert len(messages) == 100 and len({m.id for m in messages}) == 100


# ---- versions, corruption, kills -----------------------------------------------------


def test_a_new_file_is_at_the_latest_schema(store):
    assert sqlite(store.path, "PRAGMA user_version") == [(len(store_module.MIGRATIONS),)]


def test_migrations_walk_forward_and_keep_the_data(tmp_path, monkeypatch):
    path = tmp_path / "chats.db"
    with ChatStore(path) as old:
        chat = old.create_chat("kept", "m")
        old.add_message(chat.id, "user", "q", [1, 2])
    monkeypatch.setattr(store_module, "MIGRATIONS", [
        *store_module.MIGRATIONS, ("ALTER TABLE chats ADD COLUMN pinned INTEGER NOT NULL DEFAULT 0",)])
    with ChatStore(path) as new:
        assert new.get_chat(chat.id).messages[0].token_ids == [1, 2]
    assert sqlite(path, "PRAGMA user_version") == [(len(store_module.MIGRATIONS),)]
    assert sqlite(path, "SELECT pinned FROM chats") == [(0,)]


def test_a_failed_migration_changes_nothing(tmp_path, monkeypatch):
    path = tmp_path / "chats.db"
    with ChatStore(path) as old:
        old.create_chat("kept", "m")
    version = len(store_module.MIGRATIONS)
    monkeypatch.setattr(store_module, "MIGRATIONS", [
        *store_module.MIGRATIONS, ("ALTER TABLE chats ADD COLUMN pinned INTEGER", "NOT SQL AT ALL")])
    with pytest.raises(StoreError, match=f"cannot open the chat store {path}"):
        ChatStore(path)
    assert sqlite(path, "PRAGMA user_version") == [(version,)]
    assert "pinned" not in [row[1] for row in sqlite(path, "PRAGMA table_info(chats)")]
    assert [p.name for p in tmp_path.iterdir() if "corrupt" in p.name] == []


def test_a_newer_database_is_refused_untouched(tmp_path):
    path = tmp_path / "chats.db"
    with ChatStore(path) as old:
        old.create_chat("from the future", "m")
    newer = len(store_module.MIGRATIONS) + 1
    sqlite(path, f"PRAGMA user_version = {newer}")
    before = digest(path)
    with pytest.raises(StoreError) as caught:
        ChatStore(path)
    message = str(caught.value)
    assert str(path) in message and "newer paged-chat" in message and f"version {newer}" in message
    assert digest(path) == before and sorted(p.name for p in tmp_path.iterdir()) == ["chats.db"]


def test_a_file_that_is_not_a_database_is_moved_aside(tmp_path):
    path = tmp_path / "chats.db"
    garbage = b"this is not SQLite" * 500
    path.write_bytes(garbage)
    with ChatStore(path) as recovered:
        assert recovered.moved_aside.read_bytes() == garbage
        assert recovered.moved_aside.name.startswith("chats.db.corrupt-")
        assert str(path) in recovered.notice and str(recovered.moved_aside) in recovered.notice
        assert recovered.list_chats() == []
        recovered.create_chat("fresh start", "m")
    with ChatStore(path) as reopened:
        assert reopened.notice is None and len(reopened.list_chats()) == 1


def test_a_damaged_database_is_moved_aside(tmp_path):
    path = tmp_path / "chats.db"
    with ChatStore(path) as chat_store:
        chat = chat_store.create_chat("t", "m")
        for i in range(300):
            chat_store.add_message(chat.id, "user", "x" * 200, list(range(50)))
    sqlite(path, "PRAGMA wal_checkpoint(TRUNCATE)")
    data = bytearray(path.read_bytes())
    page = 4096
    data[3 * page:6 * page] = bytes(range(256)) * (3 * page // 256)  # scribble over b-tree pages
    path.write_bytes(bytes(data))
    with ChatStore(path) as recovered:
        assert recovered.moved_aside is not None and recovered.moved_aside.exists()
        assert recovered.list_chats() == []


WRITER = """
import sys
from pathlib import Path
from paged_chat.app.chat_store import ChatStore

store = ChatStore(Path(sys.argv[1]))
chat = store.create_chat("killed mid-stream", "m")
print(chat.id, flush=True)
turn = 0
while True:
    store.add_message(chat.id, "user", f"q{turn}", [turn])
    reply = store.add_message(chat.id, "assistant", "", [])
    for step in range(1, 6):
        store.update_message(reply.id, f"a{turn}-{step}", list(range(step)), None)
    store.update_message(reply.id, f"a{turn}", list(range(5)), "stop")
    print(turn, flush=True)
    turn += 1
"""


def test_a_killed_writer_leaves_every_committed_message(tmp_path):
    path = tmp_path / "chats.db"
    writer = subprocess.Popen([sys.executable, "-c", WRITER, str(path)], cwd=REPO,
                              stdout=subprocess.PIPE, text=True)
    chat_id = writer.stdout.readline().strip()
    for _ in range(30):  # 30 turns committed, then kill it wherever it is
        last_done = int(writer.stdout.readline())
    writer.kill()
    writer.wait()
    assert sqlite(path, "PRAGMA integrity_check") == [("ok",)]
    with ChatStore(path) as reopened:
        assert reopened.notice is None
        messages = reopened.get_chat(chat_id).messages
    done = messages[:2 * (last_done + 1)]
    assert [m.content for m in done] == [text for turn in range(last_done + 1)
                                         for text in (f"q{turn}", f"a{turn}")]
    assert all(m.finish_reason == "stop" for m in done[1::2])
    for message in messages[len(done):]:  # what it was writing when killed: whole rows only
        if message.role == "assistant" and message.finish_reason == "interrupted":
            assert message.token_ids == list(range(len(message.token_ids)))


# ---- Conversation over stored chats --------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer(smollm2_source):
    return smollm2_source.tokenizer, smollm2_source.chat_template


def reply_ids(tokenizer, text: str, finished: bool = True) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False) + ([2] if finished else [])  # 2: <|im_end|>


def save_turn(store, chat, conversation, user_text, reply_text, finished=True) -> list[int]:
    prompt = conversation.next_prompt_ids(user_text)
    store.add_message(chat.id, "user", user_text, conversation.added_ids(prompt))
    ids = reply_ids(conversation.tokenizer, reply_text, finished)
    conversation.add_reply(prompt, ids, reply_text)
    store.add_message(chat.id, "assistant", reply_text, ids, "stop" if finished else "abort")
    return prompt


def test_a_stored_chat_rebuilds_its_exact_history(store, tokenizer):
    tok, template = tokenizer
    chat = store.create_chat("t", "m", "Be brief.")
    live = Conversation(tok, template, "Be brief.")
    first = save_turn(store, chat, live, "What is a page?", "A fixed-size block.")
    assert store.get_chat(chat.id).messages[0].token_ids == first  # the first turn: everything
    save_turn(store, chat, live, "And a block table?", "A map from positions to blocks.")
    rebuilt = Conversation.from_chat(store.get_chat(chat.id), tok, template)
    assert (rebuilt.messages, rebuilt.token_ids) == (live.messages, live.token_ids)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "re-encoding" fallback
        prompt = rebuilt.next_prompt_ids("Thanks!")
    assert prompt == live.next_prompt_ids("Thanks!") and prompt[:len(live.token_ids)] == live.token_ids
    assert tok.decode(rebuilt.added_ids(prompt)) == \
        "\n<|im_start|>user\nThanks!<|im_end|>\n<|im_start|>assistant\n"


def test_an_interrupted_reply_continues_from_its_partial_ids(store, tokenizer):
    tok, template = tokenizer
    chat = store.create_chat("t", "m")
    save_turn(store, chat, Conversation(tok, template), "Tell me a story", "Once upon a", finished=False)
    stored = store.get_chat(chat.id)
    conversation = Conversation.from_chat(stored, tok, template)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        prompt = conversation.next_prompt_ids("Go on")
    assert prompt[:len(conversation.token_ids)] == conversation.token_ids
    assert tok.decode(conversation.added_ids(prompt)).startswith("<|im_end|>\n<|im_start|>user\nGo on")


def test_a_user_message_with_no_reply_gets_an_empty_one(store, tokenizer):
    tok, template = tokenizer
    chat = store.create_chat("t", "m")
    conversation = Conversation(tok, template)
    store.add_message(chat.id, "user", "Hello?", conversation.next_prompt_ids("Hello?"))
    rebuilt = Conversation.from_chat(store.get_chat(chat.id), tok, template)
    assert rebuilt.messages[-1] == {"role": "assistant", "content": ""}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        prompt = rebuilt.next_prompt_ids("Anyone?")
    assert tok.decode(rebuilt.added_ids(prompt)).startswith("<|im_end|>\n<|im_start|>user\nAnyone?")


def test_a_changed_system_prompt_re_encodes_the_chat(store, tokenizer):
    tok, template = tokenizer
    chat = store.create_chat("t", "m", "Be brief.")
    save_turn(store, chat, Conversation(tok, template, "Be brief."), "Hi", "Hello.")
    store.update_chat_settings(chat.id, "Be verbose.", {})
    conversation = Conversation.from_chat(store.get_chat(chat.id), tok, template)
    with pytest.warns(UserWarning, match="re-encoding"):
        prompt = conversation.next_prompt_ids("Again")
    assert tok.decode(prompt).startswith("<|im_start|>system\nBe verbose.<|im_end|>")
    assert conversation.added_ids(prompt) == prompt


def test_a_fork_has_the_same_history(store, tokenizer):
    tok, template = tokenizer
    chat = store.create_chat("t", "m")
    save_turn(store, chat, Conversation(tok, template), "Hi", "Hello.")
    fork = store.fork_chat(chat.id)
    assert Conversation.from_chat(fork, tok, template).token_ids == \
        Conversation.from_chat(store.get_chat(chat.id), tok, template).token_ids


def test_a_refused_turn_stays_stored_but_out_of_the_context(tmp_path, tokenizer):
    tok, template = tokenizer
    with ChatStore(tmp_path / "chats.db") as store:
        chat = store.create_chat("refused", "m")
        store.add_message(chat.id, "user", "hi", [1, 2, 3])
        store.add_message(chat.id, "assistant", "hello", [4, 5], finish_reason="stop")
        store.add_message(chat.id, "user", "x" * 100, [6] * 50)
        store.add_message(chat.id, "assistant", "", [], finish_reason="error")
        restored = Conversation.from_chat(store.get_chat(chat.id), tok, template)
    assert restored.token_ids == [1, 2, 3, 4, 5]
    assert [m["content"] for m in restored.messages] == ["hi", "hello"]


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**53, 2**53) | st.floats(allow_nan=False) | st.text(),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(), children, max_size=4),
    max_leaves=12)


@settings(max_examples=60, deadline=None)
@given(sampling=st.dictionaries(st.text(), json_values, max_size=5),
       timings=st.dictionaries(st.text(), json_values, max_size=5),
       content=st.text(), token_ids=st.lists(st.integers(0, 2**31 - 1), max_size=40))
def test_json_columns_and_ids_round_trip(tmp_path_factory, sampling, timings, content, token_ids):
    with ChatStore(tmp_path_factory.mktemp("fuzz") / "chats.db") as store:
        chat = store.create_chat(content or "untitled", "m", sampling=sampling)
        store.add_message(chat.id, "assistant", content, token_ids, "stop", timings)
        stored = store.get_chat(chat.id)
    assert stored.sampling == sampling
    [message] = stored.messages
    assert (message.content, message.token_ids, message.timings) == (content, token_ids, timings)
