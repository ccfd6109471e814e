"""Finding old chats: full-text search over titles and messages (SQLite FTS5), kept in
step with the store by triggers, and built for stores from before it existed."""

from __future__ import annotations

from helpers import insert_old_chat, insert_old_message, sqlite
from hypothesis import given, settings
from hypothesis import strategies as st

from paged_chat.app import chat_store as store_module
from paged_chat.app.chat_store import ChatStore

SEARCH_VERSION = 1   # the schema version before the search index


def found(store: ChatStore, text: str) -> list[str]:
    return [chat.title for chat in store.search_chats(text)]


def test_titles_and_messages_are_found_most_recent_first(store):
    lighthouse = store.create_chat("A lighthouse story", "m")
    store.add_message(lighthouse.id, "user", "Tell me about the keeper", [1])
    caching = store.create_chat("Caching", "m")
    store.add_message(caching.id, "user", "What is a KV cache?", [1])
    reply = store.add_message(caching.id, "assistant", "", [])
    store.update_message(reply.id, "Keys and values kept per token, like a lighthouse log", [2], "stop")
    assert found(store, "lighthouse") == ["Caching", "A lighthouse story"]
    assert found(store, "KEEPER") == ["A lighthouse story"]
    assert found(store, "light") == ["Caching", "A lighthouse story"]   # a prefix of a word
    assert found(store, "kv values") == ["Caching"]   # every word, anywhere in the chat
    assert found(store, "kv keeper") == []
    assert found(store, "submarine") == []


def test_the_index_follows_updates_renames_forks_and_deletes(store):
    chat = store.create_chat("First title", "m")
    reply = store.add_message(chat.id, "assistant", "draft words", [])
    store.update_message(reply.id, "final answer", [1], "stop")
    assert found(store, "draft") == [] and found(store, "final") == ["First title"]
    store.rename_chat(chat.id, "Renamed")
    assert found(store, "first") == [] and found(store, "renamed") == ["Renamed"]
    fork = store.fork_chat(chat.id, "Fork")
    assert sorted(found(store, "final")) == ["Fork", "Renamed"]
    store.delete_chat(chat.id)   # its messages go by ON DELETE CASCADE: the triggers still fire
    assert found(store, "final") == ["Fork"] and found(store, "renamed") == []
    store.delete_chat(fork.id)
    assert found(store, "final") == []
    # FTS5's own check of the index against its rows: it raises if they disagree.
    sqlite(store.path, "INSERT INTO message_search (message_search) VALUES ('integrity-check')")


def indexed(store: ChatStore, word: str) -> list[int]:
    """The message ids the search index itself holds `word` for."""
    return [row[0] for row in sqlite(store.path, "SELECT rowid FROM message_search WHERE "
                                                 f"message_search MATCH '\"{word}\"'")]


def test_a_streaming_reply_is_indexed_once_when_it_is_final(store):
    """Re-indexing the whole reply at every save made a long reply's saves quadratic: the
    index takes a reply once it is final, and a search meanwhile still finds what it said
    so far (and no longer what a regenerated reply said)."""
    chat = store.create_chat("Tides", "m")
    store.add_message(chat.id, "user", "Tell me about the sea", [1])
    reply = store.add_message(chat.id, "assistant", "", [])
    words = []
    for number in range(20):
        words.append(f"Wäve{number}")
        store.update_message(reply.id, " ".join(words), list(range(number + 1)), None)
        assert found(store, f"wave{number}") == ["Tides"]   # case and accents ignored, as indexed
    assert indexed(store, "wave0") == []
    store.update_message(reply.id, " ".join(words) + " calm", list(range(21)), "stop")
    assert indexed(store, "wave0") == indexed(store, "calm") == [reply.id]
    sqlite(store.path, "INSERT INTO message_search (message_search) VALUES ('integrity-check')")
    store.update_message(reply.id, "A regenerated storm", [7], None)   # a regenerate streams
    assert found(store, "calm") == [] and found(store, "storm") == ["Tides"]
    assert found(store, "sea regenerated") == ["Tides"] and found(store, "sea calm") == []


@settings(max_examples=80, deadline=None)
@given(text=st.text(alphabet=st.sampled_from("abé É_'-.\"ßΣ1"), max_size=16),
       query=st.text(alphabet=st.sampled_from("abé É_'-.\"ßΣ1*"), max_size=8))
def test_a_streaming_reply_is_found_as_its_final_text_would_be(tmp_path_factory, text, query):
    with ChatStore(tmp_path_factory.mktemp("store") / "chats.db") as store:
        chat = store.create_chat("t", "m")
        reply = store.add_message(chat.id, "assistant", text, [])
        streaming = found(store, query)
        store.update_message(reply.id, text, [], "stop")
        assert streaming == found(store, query)


def test_a_reply_cut_by_a_kill_stays_findable(tmp_path):
    with ChatStore(tmp_path / "chats.db") as store:
        chat = store.create_chat("Cut short", "m")
        reply = store.add_message(chat.id, "assistant", "", [])
        store.update_message(reply.id, "half a sentence about lighthouses", [1], None)
    with ChatStore(tmp_path / "chats.db") as reopened:
        assert found(reopened, "lighthouse") == ["Cut short"]


@settings(max_examples=60, deadline=None)
@given(st.text(alphabet=st.sampled_from('ab "*^:()-+.NEAR AND OR NOT {}[]\\\'é_'), max_size=20))
def test_queries_with_fts_syntax_never_fail(tmp_path_factory, text):
    with ChatStore(tmp_path_factory.mktemp("s") / "chats.db") as store:
        store.create_chat('ab "quoted" (x) a*b NEAR/2 é', "m")
        store.search_chats(text)


def test_syntax_characters_are_searched_as_text(store):
    store.create_chat('C++ and "quotes" (maybe)', "m")
    store.create_chat("AND OR NOT", "m")
    for query in ('"quotes"', "(maybe", "C++", 'quotes" OR "', "NOT", "*", '"', "AND OR"):
        assert isinstance(found(store, query), list)
    assert found(store, '"quotes"') == ['C++ and "quotes" (maybe)']
    assert found(store, "NOT") == ["AND OR NOT"]
    assert found(store, "*") == [] and found(store, "   ") == []


def test_a_store_from_before_search_is_indexed_when_opened(tmp_path, monkeypatch):
    """The migration on a database made at the previous schema version: the index is
    built from the rows already there, and kept in step from then on."""
    path = tmp_path / "chats.db"
    monkeypatch.setattr(store_module, "MIGRATIONS", store_module.MIGRATIONS[:SEARCH_VERSION])
    with ChatStore(path):
        assert sqlite(path, "PRAGMA user_version") == [(SEARCH_VERSION,)]
    monkeypatch.undo()
    insert_old_chat(path, "old", "Old chat about tides")
    insert_old_message(path, "old", "user", "How do the moon and tides relate?", [1, 2])
    with ChatStore(path) as new:
        assert sqlite(path, "PRAGMA user_version") == [(len(store_module.MIGRATIONS),)]
        assert found(new, "tides") == ["Old chat about tides"]
        assert found(new, "moon") == ["Old chat about tides"]
        new.add_message("old", "assistant", "Gravity pulls the oceans", [3])
        assert found(new, "gravity") == ["Old chat about tides"]
        assert new.get_chat("old").messages[0].token_ids == [1, 2]


def test_chats_list_search_on_the_command_line(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from paged_chat.cli.main import app
    from paged_chat.cli.state import CliState

    monkeypatch.setenv("PAGED_CHAT_DATA_DIR", str(tmp_path))
    with ChatStore() as store:
        tides = store.create_chat("Tides", "m")
        store.add_message(tides.id, "assistant", "The moon's gravity", [1], "stop")
        store.create_chat("Other", "m")
    result = CliRunner().invoke(app, ["chats", "list", "--search", "GRAVITY"], obj=CliState())
    assert result.exit_code == 0, result.stderr
    assert [line.split()[0] for line in result.stdout.splitlines()] == ["ID", tides.id]
    result = CliRunner().invoke(app, ["chats", "list", "--search", 'nothing" OR "*'], obj=CliState())
    assert result.exit_code == 0 and result.stdout == ""
    assert "no chat holds 'nothing\" OR \"*'" in result.stderr
    assert len(CliRunner().invoke(app, ["chats", "list"], obj=CliState()).stdout.splitlines()) == 3
