"""The chat store: chats and their messages in SQLite, shared by the TUI and `paged-chat ask`.

One file, `data_dir()/chats.db`, in WAL mode so a reader (the CLI listing chats) never
blocks a writer (the TUI streaming a reply), and two processes can use it at once.

Exact history. Each message row keeps the token ids of its turn, so a chat picks up where
it left off with its prompt ids unchanged and the engine's prefix cache hits:
- a user row holds the ids that turn added to the prompt: the template's tail after the
  previous reply, the new user turn and the generation prompt (for the first turn, the
  whole rendered prompt, system prompt included);
- an assistant row holds exactly the generated ids, end-of-turn token included; its
  content is the answer, and a reasoning model's thinking is apart in `reasoning`.
Concatenating the ids of every row of a branch in order gives its history (see
`Conversation.from_chat`). A reply is written when it starts (finish_reason None) and
updated as it streams; a row still None when loaded was cut by a crash or kill, and reads
back as finish_reason "interrupted" with whatever content was committed.

Branches. The messages of a chat form a tree: each row names its parent (the message it
follows; NULL for a first message), and an edited message or a regenerated reply is a new
sibling of the one it replaces, which stays. `chats.leaf_id` is the last message of the
branch last used: a chat is read as the path from its root to that leaf, and a new turn
continues it.

Search. An FTS5 index holds every final message (a reply once it has its finish reason,
so a streaming reply is indexed once, not at every save); `search_chats` reads the few
replies that are not final (streaming, or cut) itself, word for word as the index would.

Durability. Every write is one transaction, so a crash or a kill at any moment leaves the
file readable with every committed message intact (WAL with synchronous=NORMAL: a power
cut may lose the last commits, a killed process loses nothing committed).

Versions. `PRAGMA user_version` is the schema version; `MIGRATIONS[v]` takes a database
from version v to v + 1, all in one transaction. A database from a newer paged-chat is
refused and left byte-for-byte untouched. A corrupt file is never deleted: it is renamed
aside (`chats.db.corrupt-<time>`, never over an earlier one), an empty store takes its
place and `ChatStore.notice` says so, with both paths, for the UI to show. Processes that
find the store corrupt at once take turns (a lock file, `chats.db.lock`), and each looks
again when its turn comes, so only the first moves the corrupt file and none moves the
store that replaced it.

Privacy. Chats are personal: chats.db and its -wal and -shm files are created 0600 (SQLite
gives the -wal and -shm files the database's mode), and looser ones are tightened when
the store opens, with a notice (the data directory itself is settings.data_dir's). A
store file that is a symbolic link is refused: the store touches nothing outside its
directory.

Read-only stores. A store this process cannot write (a read-only file system, a file
without write permission) opens read-only, so it can still be listed and shown; a write
raises StoreError naming it. It is opened immutable, as SQLite can read a WAL database
on a read-only file system no other way.
"""

from __future__ import annotations

import errno
import fcntl
import itertools
import json
import os
import re
import sqlite3
import sys
import threading
import time
import unicodedata
import uuid
from array import array
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from paged_chat.app.settings import data_dir, make_private
from paged_chat.engine.core.errors import PagedChatError

ROLES = ("system", "user", "assistant")
INTERRUPTED = "interrupted"
# A search looks for at most this many different words: each is a subquery, and SQLite's
# expression tree has a depth limit (2,000 words fail), while a few dozen words already
# name one chat.
MAX_SEARCH_WORDS = 64



# A message row that is final: what the search index holds. A reply still streaming (or
# cut by a kill) has no finish reason yet.
_FINAL = "({row}.role != 'assistant' OR {row}.finish_reason IS NOT NULL)"


def _search_index(index: str, table: str, column: str, key: str) -> tuple[str, ...]:
    """An FTS5 index of `table.column` (external content: the text is not stored twice),
    kept in step by triggers, and built from the rows already there."""
    return (
        f"CREATE VIRTUAL TABLE {index} USING fts5({column}, content='{table}', "
        f"content_rowid='{key}', tokenize='unicode61 remove_diacritics 2')",
        f"""CREATE TRIGGER {index}_insert AFTER INSERT ON {table} BEGIN
            INSERT INTO {index} (rowid, {column}) VALUES (new.{key}, new.{column});
        END""",
        f"""CREATE TRIGGER {index}_delete AFTER DELETE ON {table} BEGIN
            INSERT INTO {index} ({index}, rowid, {column}) VALUES ('delete', old.{key}, old.{column});
        END""",
        f"""CREATE TRIGGER {index}_update AFTER UPDATE OF {column} ON {table} BEGIN
            INSERT INTO {index} ({index}, rowid, {column}) VALUES ('delete', old.{key}, old.{column});
            INSERT INTO {index} (rowid, {column}) VALUES (new.{key}, new.{column});
        END""",
        f"INSERT INTO {index} ({index}) VALUES ('rebuild')",
    )


# MIGRATIONS[v]: the statements that take the schema from version v to v + 1. Append only:
# a released migration never changes, so every database walks the same path.
MIGRATIONS: list[tuple[str, ...]] = [
    (
        """CREATE TABLE chats (
            id TEXT PRIMARY KEY,
            title TEXT NOT NULL,
            model TEXT NOT NULL,
            system_prompt TEXT,
            sampling TEXT NOT NULL,          -- JSON object of SamplingParams fields
            created REAL NOT NULL,           -- Unix time
            updated REAL NOT NULL
        )""",
        "CREATE INDEX chats_by_updated ON chats (updated)",
        """CREATE TABLE messages (
            id INTEGER PRIMARY KEY AUTOINCREMENT,   -- never reused: UIs hold message ids
            chat_id TEXT NOT NULL REFERENCES chats (id) ON DELETE CASCADE,
            role TEXT NOT NULL CHECK (role IN ('system', 'user', 'assistant')),
            content TEXT NOT NULL,
            token_ids BLOB NOT NULL,         -- int32, little-endian
            finish_reason TEXT,              -- NULL on an assistant row: streaming, or cut
            created REAL NOT NULL,
            timings TEXT NOT NULL            -- JSON object
        )""",
        "CREATE INDEX messages_by_chat ON messages (chat_id, id)",
    ),
    _search_index("chat_search", "chats", "title", "rowid")
    + _search_index("message_search", "messages", "content", "id"),
    # A reply is indexed once it is final, not at every save while it streams (each save
    # re-indexed the whole text: quadratic in the reply's length). The index holds exactly
    # the final rows, so the delete it is told of is always what it holds.
    (
        "DROP TRIGGER message_search_insert",
        "DROP TRIGGER message_search_delete",
        "DROP TRIGGER message_search_update",
        f"""CREATE TRIGGER message_search_insert AFTER INSERT ON messages
            WHEN {_FINAL.format(row="new")} BEGIN
            INSERT INTO message_search (rowid, content) VALUES (new.id, new.content);
        END""",
        f"""CREATE TRIGGER message_search_delete AFTER DELETE ON messages
            WHEN {_FINAL.format(row="old")} BEGIN
            INSERT INTO message_search (message_search, rowid, content)
                VALUES ('delete', old.id, old.content);
        END""",
        f"""CREATE TRIGGER message_search_update AFTER UPDATE OF content, finish_reason
            ON messages BEGIN
            INSERT INTO message_search (message_search, rowid, content)
                SELECT 'delete', old.id, old.content WHERE {_FINAL.format(row="old")};
            INSERT INTO message_search (rowid, content)
                SELECT new.id, new.content WHERE {_FINAL.format(row="new")};
        END""",
        # What a search reads instead of the index: the few replies not final.
        ("CREATE INDEX messages_not_final ON messages (chat_id) "
         "WHERE role = 'assistant' AND finish_reason IS NULL"),
        "INSERT INTO message_search (message_search) VALUES ('delete-all')",
        ("INSERT INTO message_search (rowid, content) SELECT id, content FROM messages "
         f"WHERE {_FINAL.format(row='messages')}"),
    ),
    # Branches: each message names its parent, each chat the leaf of the branch last used.
    # A chat stored before had one branch: each message follows the one before it.
    (
        "ALTER TABLE messages ADD COLUMN parent_id INTEGER REFERENCES messages (id) ON DELETE CASCADE",
        "ALTER TABLE chats ADD COLUMN leaf_id INTEGER",
        """UPDATE messages SET parent_id = (SELECT max(earlier.id) FROM messages AS earlier
            WHERE earlier.chat_id = messages.chat_id AND earlier.id < messages.id)""",
        "UPDATE chats SET leaf_id = (SELECT max(id) FROM messages WHERE chat_id = chats.id)",
        "CREATE INDEX messages_by_parent ON messages (parent_id)",
    ),
    # Models that think: a reply's thinking apart from its answer (NULL: it had none), and
    # a chat's thinking switch (NULL: as the template has it).
    (
        "ALTER TABLE messages ADD COLUMN reasoning TEXT",
        "ALTER TABLE chats ADD COLUMN thinking INTEGER",
    ),
]

_CORRUPT = ("SQLITE_CORRUPT", "SQLITE_NOTADB")
# A full disk, as SQLite reports it: a write that did not fit, or a -shm file that could
# not grow to the size a connection needs.
_FULL = ("SQLITE_FULL", "SQLITE_IOERR_SHMSIZE")
_BUSY_TIMEOUT_S = 5.0   # how long a connection waits for another process's lock
_CHAT_COLUMNS = "id, title, model, system_prompt, sampling, created, updated, thinking"
_MESSAGE_COLUMNS = ("id, chat_id, role, content, token_ids, finish_reason, created, timings, "
                    "parent_id, reasoning")
# The messages of one branch: the path from the leaf ?1 up to its root, in chat ?2.
_BRANCH = ("WITH RECURSIVE branch (id) AS (SELECT ?1 UNION ALL SELECT messages.parent_id "
           "FROM messages JOIN branch ON messages.id = branch.id "
           "WHERE messages.parent_id IS NOT NULL) "
           f"SELECT {_MESSAGE_COLUMNS} FROM messages "
           "WHERE chat_id = ?2 AND id IN (SELECT id FROM branch) ORDER BY id")
_FILE_SUFFIXES = ("", "-wal", "-shm")
_LOCK_SUFFIX = ".lock"   # the recovery lock's file (see the module docstring)
# A chat holds search term ?n in its title or in one of its messages: a final one by the
# index, a reply that is not (streaming, or cut) by reading it (`_holds_word`).
_CHAT_HOLDS = ("(rowid IN (SELECT rowid FROM chat_search WHERE chat_search MATCH ?{n}) "
               "OR id IN (SELECT chat_id FROM messages WHERE id IN "
               "(SELECT rowid FROM message_search WHERE message_search MATCH ?{n})) "
               "OR id IN (SELECT chat_id FROM messages WHERE role = 'assistant' AND "
               "finish_reason IS NULL AND holds_word(content, ?{n})))")


class StoreError(PagedChatError):
    """The chat store cannot be opened or written (newer schema, unwritable file)."""


class StoreWriteError(StoreError):
    """SQLite could not write to the store (an I/O error, a file system gone read-only):
    nothing of that write was kept. `path` is the store's file."""

    def __init__(self, message: str, path: Path) -> None:
        super().__init__(message)
        self.path = path


class StoreFullError(StoreWriteError):
    """The disk (or quota) holding the store is full: nothing of that write was kept."""


class ChatNotFound(StoreError, KeyError):
    """No chat has this id (or, for `resolve_id`, this id prefix)."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0])


class ChatMovedOn(StoreError):
    """A turn was started from a chat that someone else (another `ask -c`, another window)
    added to in the meantime: saving it would interleave two conversations."""


class MessageNotFound(StoreError, KeyError):
    """No message has this id."""

    def __str__(self) -> str:
        return str(self.args[0])


@dataclass(slots=True)
class Message:
    id: int
    chat_id: str
    role: str
    content: str
    token_ids: list[int]
    finish_reason: str | None
    created: float
    timings: dict
    parent_id: int | None = None   # the message this one follows; None for a first message
    reasoning: str | None = None   # a reasoning model's thinking, apart from its answer


@dataclass(slots=True)
class StoredChat:
    """One chat as the store keeps it: its row, and its messages once loaded: the branch
    last used (root first, `leaf_id` last), or every message (`get_chat_tree`).
    `branches` maps each message of the branch that has siblings (other versions of it: an
    edited message, a regenerated reply) to their ids, its own included, oldest first."""

    id: str
    title: str
    model: str
    system_prompt: str | None
    sampling: dict
    created: float
    updated: float
    messages: list[Message] = field(default_factory=list)  # empty unless loaded
    leaf_id: int | None = None
    branches: dict[int, list[int]] = field(default_factory=dict)
    thinking: bool | None = None   # the model thinks (where its template can say); None: as it will


class _CorruptDatabase(Exception):
    pass


class ChatStore:
    """All reads and writes of chats.db. Thread-safe (one connection behind a lock), and
    safe to use from several processes at once (SQLite's own locking, 5 s busy timeout).
    `notice` is what the UI should tell the user about opening it (a corrupt file moved
    aside, files made private), None when there is nothing to say; `read_only` is True
    for a store that can only be read."""

    def __init__(self, path: Path | None = None) -> None:
        self.path = path or data_dir() / "chats.db"
        self.moved_aside: Path | None = None
        self._lock = threading.RLock()
        notices = self._prepare_files()
        self.read_only = not (os.access(self.path, os.W_OK) and os.access(self.path.parent, os.W_OK))
        try:
            self._conn = self._open()
        except _CorruptDatabase as exc:
            if self.read_only:
                raise StoreError(f"the chat store {self.path} is corrupt ({exc}) and read-only, "
                                 "so it cannot be moved aside") from exc
            with self._exclusive():
                notices.append(self._recover())
        self.notice = "; ".join(notices) or None

    def __enter__(self) -> ChatStore:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # ---- chats ------------------------------------------------------------------------

    def create_chat(self, title: str, model: str, system_prompt: str | None = None,
                    sampling: dict | None = None) -> StoredChat:
        chat = new_chat(title, model, system_prompt, sampling)
        with self._transaction() as db:
            _insert_chat(db, chat)
        return chat

    def list_chats(self) -> list[StoredChat]:
        """Every chat, most recently updated first, without messages."""
        with self._transaction(write=False) as db:
            rows = db.execute(f"SELECT {_CHAT_COLUMNS} FROM chats ORDER BY updated DESC, rowid DESC")
            return [_chat(row) for row in rows]

    def search_chats(self, text: str) -> list[StoredChat]:
        """The chats that hold every word of `text` in their title or messages (as a word
        or the start of one, case and accents ignored), most recently updated first,
        without messages. Each word is quoted, so FTS5's syntax characters are searched
        for as text, never parsed; a word given twice is searched once, and only the first
        MAX_SEARCH_WORDS different words are searched."""
        terms = _search_terms(text)
        if not terms:
            return []
        where = " AND ".join(_CHAT_HOLDS.format(n=n) for n in range(1, len(terms) + 1))
        with self._transaction(write=False) as db:
            rows = db.execute(f"SELECT {_CHAT_COLUMNS} FROM chats WHERE {where} "
                              "ORDER BY updated DESC, rowid DESC", terms)
            return [_chat(row) for row in rows]

    def get_chat(self, chat_id: str, leaf_id: int | None = None) -> StoredChat:
        """The chat with the messages of a branch in order: the branch last used, or the one
        ending at `leaf_id`; ChatNotFound if there is none."""
        with self._transaction(write=False) as db:
            return self._load_chat(db, chat_id, leaf_id)

    def get_chat_tree(self, chat_id: str) -> StoredChat:
        """The chat with every message of every branch, in the order they were written
        (each names its parent); `leaf_id` is the branch last used."""
        with self._transaction(write=False) as db:
            chat = self._load_chat(db, chat_id)
            rows = db.execute(f"SELECT {_MESSAGE_COLUMNS} FROM messages WHERE chat_id = ? ORDER BY id",
                              (chat_id,))
            chat.messages = [_message(row) for row in rows]
            return chat

    def select_branch(self, chat_id: str, message_id: int) -> StoredChat:
        """Make the branch through `message_id` the chat's branch (the one `get_chat` reads
        and a new turn continues): it ends at the newest message below `message_id`. The
        chat read along it."""
        with self._transaction() as db:
            if db.execute("SELECT 1 FROM messages WHERE id = ? AND chat_id = ?",
                          (message_id, chat_id)).fetchone() is None:
                raise MessageNotFound(f"chat {chat_id} has no message with id {message_id}")
            leaf = message_id
            while (child := db.execute("SELECT max(id) FROM messages WHERE parent_id = ?",
                                       (leaf,)).fetchone()[0]) is not None:
                leaf = child
            db.execute("UPDATE chats SET leaf_id = ? WHERE id = ?", (leaf, chat_id))
            return self._load_chat(db, chat_id)

    def latest_chat(self) -> StoredChat | None:
        """The most recently updated chat, with its messages; None when there is none."""
        with self._transaction(write=False) as db:
            row = db.execute("SELECT id FROM chats ORDER BY updated DESC, rowid DESC LIMIT 1").fetchone()
            return None if row is None else self._load_chat(db, row[0])

    def resolve_id(self, prefix: str) -> str:
        """The id of the one chat whose id starts with `prefix` (so users can type a few
        characters, as with git); ChatNotFound when none or several match, or when
        `prefix` is blank (it would match every chat)."""
        if not prefix.strip():
            raise ChatNotFound("an empty chat id names no chat: give an id or its first "
                               "characters (`paged-chat chats` lists them)")
        with self._transaction(write=False) as db:
            ids = [row[0] for row in db.execute(
                "SELECT id FROM chats WHERE substr(id, 1, length(?1)) = ?1 LIMIT 2", (prefix,))]
        if len(ids) != 1:
            what = "no chat" if not ids else "several chats"
            raise ChatNotFound(f"{what} with an id starting {prefix!r}: `paged-chat chats` lists them")
        return ids[0]

    def rename_chat(self, chat_id: str, title: str) -> None:
        self._update_chat(chat_id, "title = ?", (title,))

    def update_chat_settings(self, chat_id: str, system_prompt: str | None, sampling: dict) -> None:
        self._update_chat(chat_id, "system_prompt = ?, sampling = ?", (system_prompt, json.dumps(sampling)))

    def set_thinking(self, chat_id: str, thinking: bool | None) -> None:
        self._update_chat(chat_id, "thinking = ?", (thinking,))

    def fork_chat(self, chat_id: str, title: str | None = None) -> StoredChat:
        """A new chat with a copy of every message of the branch last used, token ids
        included, so the fork's next prompt shares the original's cached blocks."""
        new_id, now = _new_id(), time.time()
        with self._transaction() as db:
            source = db.execute("SELECT title FROM chats WHERE id = ?", (chat_id,)).fetchone()
            if source is None:
                raise ChatNotFound(f"no chat with id {chat_id!r} to fork")
            db.execute(f"INSERT INTO chats ({_CHAT_COLUMNS}) SELECT ?, ?, model, system_prompt, "
                       "sampling, ?, ?, thinking FROM chats WHERE id = ?",
                       (new_id, title or f"{source[0]} (fork)", now, now, chat_id))
            parent = None
            for message in self._load_chat(db, chat_id).messages:
                parent = db.execute(
                    "INSERT INTO messages (chat_id, role, content, token_ids, finish_reason, "
                    "created, timings, parent_id, reasoning) SELECT ?, role, content, token_ids, "
                    "finish_reason, created, timings, ?, reasoning FROM messages WHERE id = ?",
                    (new_id, parent, message.id)).lastrowid
            self._set_leaf(db, new_id, parent)
        return self.get_chat(new_id)

    def delete_chat(self, chat_id: str) -> None:
        """Delete the chat and its messages."""
        with self._transaction() as db:
            if db.execute("DELETE FROM chats WHERE id = ?", (chat_id,)).rowcount == 0:
                raise ChatNotFound(f"no chat with id {chat_id!r} to delete")

    # ---- messages ---------------------------------------------------------------------

    def add_message(self, chat_id: str, role: str, content: str, token_ids: list[int],
                    finish_reason: str | None = None, timings: dict | None = None,
                    after: int | None = None) -> Message:
        """Append a message to the branch last used (see the module docstring for which
        token ids it holds).

        `after` is the id of the chat's last message as the writer last saw it (0: none):
        if the chat has moved on since, nothing is written and ChatMovedOn is raised.
        """
        if role not in ROLES:
            raise ValueError(f"message role {role!r} is invalid: expected one of {', '.join(ROLES)}")
        message = Message(0, chat_id, role, content, list(token_ids), finish_reason,
                          time.time(), dict(timings or {}))
        with self._transaction() as db:
            self._touch(db, "id = ?", chat_id, message.created)
            if after is not None:
                self._check_after(db, chat_id, after)
            message.parent_id = self._leaf(db, chat_id)
            message.id = self._insert_message(db, message)
            self._set_leaf(db, chat_id, message.id)
        return message

    def start_turn(self, chat: StoredChat, user: tuple[str, list[int]] | None,
                   parent: int | None, after: int, create: bool = False) -> tuple[int | None, int]:
        """The rows a turn starts with, all written or none (a full disk never leaves a
        user row without its reply): `chat` itself when `create` (a chat from `new_chat`,
        saved with its first turn), the user row (`user`: its text and token ids; None for
        a regenerate) and an empty reply row, which becomes the chat's leaf; their ids
        (user, reply). The first of them follows `parent` (None: a first message): the
        leaf for a turn that continues the branch, an earlier message for one that branches
        off it. `after` is the leaf as the writer last saw it, as for `add_message`."""
        now = time.time()
        with self._transaction() as db:
            if create:
                _insert_chat(db, chat)
            self._check_after(db, chat.id, after)
            user_id = None
            if user is not None:
                user_id = parent = self._insert_message(db, Message(
                    0, chat.id, "user", user[0], list(user[1]), None, now, {}, parent))
            reply_id = self._insert_message(db, Message(0, chat.id, "assistant", "", [], None,
                                                        now, {}, parent))
            self._set_leaf(db, chat.id, reply_id)
            self._touch(db, "id = ?", chat.id, now)
        return user_id, reply_id

    def withdraw_turn(self, chat_id: str, first_id: int, leaf_id: int | None) -> None:
        """Delete a turn withdrawn whole (its engine stopped before it said a word, so it
        holds nothing but what was sent): its first row `first_id` and the rows below it;
        the chat's leaf goes back to `leaf_id`."""
        with self._transaction() as db:
            db.execute("DELETE FROM messages WHERE chat_id = ? AND id = ?", (chat_id, first_id))
            self._set_leaf(db, chat_id, leaf_id)

    def update_message(self, message_id: int, content: str, token_ids: list[int],
                       finish_reason: str | None, timings: dict | None = None,
                       reasoning: str | None = None) -> None:
        """Replace a message's content, thinking and ids (a streaming reply); timings=None
        keeps them."""
        with self._transaction() as db:
            cursor = db.execute(
                "UPDATE messages SET content = ?, token_ids = ?, finish_reason = ?, "
                "timings = coalesce(?, timings), reasoning = ? WHERE id = ?",
                (content, _pack(token_ids), finish_reason,
                 None if timings is None else json.dumps(timings), reasoning, message_id))
            if cursor.rowcount == 0:
                raise MessageNotFound(f"no message with id {message_id}")
            self._touch(db, "id = (SELECT chat_id FROM messages WHERE id = ?)", message_id, time.time())

    def close(self) -> None:
        with self._lock:
            self._conn.close()

    # ---- internals --------------------------------------------------------------------

    @staticmethod
    def _load_chat(db: sqlite3.Connection, chat_id: str, leaf_id: int | None = None) -> StoredChat:
        """The chat with the branch ending at `leaf_id` (None: its leaf) and its siblings."""
        row = db.execute(f"SELECT {_CHAT_COLUMNS} FROM chats WHERE id = ?", (chat_id,)).fetchone()
        if row is None:
            raise ChatNotFound(f"no chat with id {chat_id!r}: `paged-chat chats` lists them")
        chat = _chat(row)
        chat.leaf_id = ChatStore._leaf(db, chat_id) if leaf_id is None else leaf_id
        if chat.leaf_id is None:
            return chat
        chat.messages = [_message(row) for row in db.execute(_BRANCH, (chat.leaf_id, chat_id))]
        children: dict[int | None, list[int]] = {}
        for message_id, parent_id in db.execute(
                "SELECT id, parent_id FROM messages WHERE chat_id = ? ORDER BY id", (chat_id,)):
            children.setdefault(parent_id, []).append(message_id)
        chat.branches = {message.id: children[message.parent_id] for message in chat.messages
                         if len(children[message.parent_id]) > 1}
        return chat

    @staticmethod
    def _leaf(db: sqlite3.Connection, chat_id: str) -> int | None:
        row = db.execute("SELECT leaf_id FROM chats WHERE id = ?", (chat_id,)).fetchone()
        return None if row is None else row[0]

    @staticmethod
    def _set_leaf(db: sqlite3.Connection, chat_id: str, leaf_id: int | None) -> None:
        db.execute("UPDATE chats SET leaf_id = ? WHERE id = ?", (leaf_id, chat_id))

    def _update_chat(self, chat_id: str, assignments: str, values: tuple) -> None:
        with self._transaction() as db:
            db.execute(f"UPDATE chats SET {assignments} WHERE id = ?", (*values, chat_id))
            self._touch(db, "id = ?", chat_id, time.time())

    @staticmethod
    def _check_after(db: sqlite3.Connection, chat_id: str, after: int) -> None:
        """ChatMovedOn unless the chat's leaf is still `after` (0: none)."""
        if (ChatStore._leaf(db, chat_id) or 0) != after:
            raise ChatMovedOn(f"chat {chat_id} gained a message while this turn was "
                              "being prepared (another `ask -c` or window?): nothing "
                              "was saved; run it again to continue from the latest")

    @staticmethod
    def _insert_message(db: sqlite3.Connection, message: Message) -> int:
        """Insert `message` (its id is ignored); the id it got."""
        return db.execute(
            f"INSERT INTO messages ({_MESSAGE_COLUMNS}) VALUES (NULL, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (message.chat_id, message.role, message.content, _pack(message.token_ids),
             message.finish_reason, message.created, json.dumps(message.timings),
             message.parent_id, message.reasoning)).lastrowid

    @staticmethod
    def _touch(db: sqlite3.Connection, where: str, key: object, now: float) -> None:
        if db.execute(f"UPDATE chats SET updated = ? WHERE {where}", (now, key)).rowcount == 0:
            raise ChatNotFound(f"no chat with id {key!r}: `paged-chat chats` lists them")

    @contextmanager
    def _transaction(self, write: bool = True) -> Iterator[sqlite3.Connection]:
        """One transaction: all of it commits or none of it does. Writers take the write
        lock up front (IMMEDIATE), so they wait on the busy timeout instead of failing on
        upgrade; readers get one consistent snapshot across their statements."""
        if write and self.read_only:
            raise StoreError(f"cannot save to the chat store {self.path}: it is read-only (no "
                             "write permission, or a read-only file system)")
        with self._lock:
            try:
                self._conn.execute("BEGIN IMMEDIATE" if write else "BEGIN")
                try:
                    yield self._conn
                    self._conn.execute("COMMIT")
                except BaseException:
                    if self._conn.in_transaction:  # SQLite may have rolled back already
                        self._conn.execute("ROLLBACK")
                    raise
            except sqlite3.OperationalError as exc:
                if not write:
                    raise
                raise self._write_error(exc) from exc

    def _write_error(self, exc: sqlite3.OperationalError, doing: str = "write to") -> StoreWriteError:
        """The precise error for a write SQLite refused (the disk full, an I/O error);
        `doing` says what failed ("write to", "open")."""
        if getattr(exc, "sqlite_errorname", None) in _FULL:
            return StoreFullError(f"the disk holding the chat store {self.path} is full",
                                  self.path)
        return StoreWriteError(f"cannot {doing} the chat store {self.path}: {exc}", self.path)

    def _prepare_files(self) -> list[str]:
        """Check the path, create a missing database file private, and make existing ones
        private; the notices of what was tightened. A link among the store's files is
        refused before anything follows it (a chmod, a move aside, SQLite's writes would
        reach a file outside the data directory)."""
        for file in self._files(*_FILE_SUFFIXES, _LOCK_SUFFIX):
            if file.is_symlink():
                raise StoreError(f"the chat store's file {file} is a symbolic link: paged-chat "
                                 "does not follow it out of its data directory; move it away, "
                                 "or set PAGED_CHAT_DATA_DIR to use another store")
        if self.path.is_dir():
            raise StoreError(f"the chat store {self.path} is a directory, not a file: move it "
                             "away, or set PAGED_CHAT_DATA_DIR to use another store")
        try:
            self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            if not self.path.exists():
                self._create()
        except OSError as exc:
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                raise StoreFullError(f"the disk holding the chat store {self.path} is full",
                                     self.path) from exc
            raise StoreError(f"cannot create the chat store {self.path}: {exc.strerror}") from exc
        return [notice for file in self._files(*_FILE_SUFFIXES)
                if file.exists() and (notice := make_private(file, 0o600))]

    def _files(self, *suffixes: str) -> list[Path]:
        """The store's files with these suffixes ("" is the database itself)."""
        return [self.path.with_name(self.path.name + suffix) for suffix in suffixes]

    def _create(self) -> None:
        """An empty database file, private (SQLite would create it with the umask's mode)."""
        os.close(os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW, 0o600))

    def _recover(self) -> str:
        """Under the recovery lock: open the store if another process has already set it
        right, else move the corrupt file aside and start an empty one; the notice."""
        try:
            self._conn = self._open()
            return (f"the chat store {self.path} was corrupt: another paged-chat moved it aside "
                    "and started an empty one")
        except _CorruptDatabase as exc:
            self.moved_aside = self._move_aside()
            self._create()
            self._conn = self._open()
            return (f"the chat store {self.path} is corrupt ({exc}): moved it to "
                    f"{self.moved_aside} and started an empty one")

    @contextmanager
    def _exclusive(self) -> Iterator[None]:
        """Hold `chats.db.lock` (an advisory lock every paged-chat process takes here)."""
        lock = os.open(self._files(_LOCK_SUFFIX)[0], os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
        try:
            fcntl.flock(lock, fcntl.LOCK_EX)
            yield
        finally:
            os.close(lock)

    def _open(self) -> sqlite3.Connection:
        """Connect, check the file, and migrate it to the current schema.

        The version is read before anything writes (switching to WAL writes the header),
        so a newer database is refused untouched.
        """
        target, uri = self.path, False
        if self.read_only:
            target, uri = f"{self.path.resolve().as_uri()}?mode=ro&immutable=1", True
        conn = sqlite3.connect(target, timeout=_BUSY_TIMEOUT_S, isolation_level=None,
                               check_same_thread=False, uri=uri)
        conn.create_function("holds_word", 2, _holds_word, deterministic=True)
        try:
            version = conn.execute("PRAGMA user_version").fetchone()[0]
            if version > len(MIGRATIONS):
                raise StoreError(
                    f"{self.path} was written by a newer paged-chat (schema version {version}; "
                    f"this one reads up to {len(MIGRATIONS)}): upgrade paged-chat, or set "
                    "PAGED_CHAT_DATA_DIR to use another store; the file was left untouched")
            check = conn.execute("PRAGMA quick_check").fetchone()[0]
            if check != "ok":
                raise _CorruptDatabase(f"integrity check: {check}")
            if self.read_only:
                if version < len(MIGRATIONS):
                    raise StoreError(f"the chat store {self.path} is read-only and needs an "
                                     "upgrade (or is empty): make it writable once")
                return conn
            _set_wal_mode(conn)
            conn.execute("PRAGMA synchronous = NORMAL")
            conn.execute("PRAGMA foreign_keys = ON")
            self._migrate(conn)
        except sqlite3.DatabaseError as exc:
            conn.close()
            name = getattr(exc, "sqlite_errorname", None)
            if name in _CORRUPT:
                raise _CorruptDatabase(str(exc)) from exc
            if name in _FULL or (name or "").startswith("SQLITE_IOERR"):
                raise self._write_error(exc, "open") from exc
            raise StoreError(f"cannot open the chat store {self.path}: {exc}") from exc
        except BaseException:
            conn.close()
            raise
        return conn

    @staticmethod
    def _migrate(conn: sqlite3.Connection) -> None:
        """Walk the schema forward, all steps in one transaction (another process may have
        migrated meanwhile, so the version is read again under the write lock)."""
        if conn.execute("PRAGMA user_version").fetchone()[0] >= len(MIGRATIONS):
            return
        conn.execute("BEGIN IMMEDIATE")
        try:
            version = conn.execute("PRAGMA user_version").fetchone()[0]
            for statements in MIGRATIONS[version:]:
                for statement in statements:
                    conn.execute(statement)
            if version < len(MIGRATIONS):
                conn.execute(f"PRAGMA user_version = {len(MIGRATIONS)}")
        except BaseException:
            conn.execute("ROLLBACK")
            raise
        conn.execute("COMMIT")

    def _move_aside(self) -> Path:
        """Rename the corrupt file (and its WAL and shared-memory files) out of the way, to
        a name no earlier corrupt file has (under the recovery lock, so none can race)."""
        stamp = time.strftime("%Y%m%d-%H%M%S")
        for attempt in itertools.count(1):
            target = self.path.with_name(f"{self.path.name}.corrupt-{stamp}"
                                         + (f"-{attempt}" if attempt > 1 else ""))
            if not any(target.with_name(target.name + suffix).exists() for suffix in _FILE_SUFFIXES):
                break
        for suffix in _FILE_SUFFIXES:
            source = self.path.with_name(self.path.name + suffix)
            if source.exists():
                source.rename(target.with_name(target.name + suffix))
        return target


def _set_wal_mode(conn: sqlite3.Connection) -> None:
    """Switch to WAL, waiting for other processes as any statement does: the switch needs
    the database to itself, and SQLite answers "database is locked" at once, without its
    busy wait, while another process opening the same store holds a lock."""
    give_up = time.monotonic() + _BUSY_TIMEOUT_S
    while True:
        try:
            conn.execute("PRAGMA journal_mode = WAL")
            return
        except sqlite3.OperationalError as exc:
            if getattr(exc, "sqlite_errorname", None) != "SQLITE_BUSY" or time.monotonic() > give_up:
                raise
            time.sleep(0.02)


def new_chat(title: str, model: str, system_prompt: str | None = None,
             sampling: dict | None = None) -> StoredChat:
    """A chat not yet in any store: `ChatStore.start_turn(create=True)` writes it with its
    first turn, so a chat whose first turn could not be saved leaves nothing behind."""
    now = time.time()
    return StoredChat(_new_id(), title, model, system_prompt, dict(sampling or {}), now, now)


def _insert_chat(db: sqlite3.Connection, chat: StoredChat) -> None:
    db.execute(f"INSERT INTO chats ({_CHAT_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
               (chat.id, chat.title, chat.model, chat.system_prompt, json.dumps(chat.sampling),
                chat.created, chat.updated, chat.thinking))


def _new_id() -> str:
    """12 hex digits: short enough to type (a unique prefix will do), 48 random bits."""
    return uuid.uuid4().hex[:12]


def search_words(text: str) -> list[str]:
    """The words of `text` a search looks for, in order: each once (case ignored, as the
    index ignores it), without those that hold no letter or digit (there is nothing in
    them to find)."""
    words: dict[str, str] = {}
    for word in text.split():
        if any(char.isalnum() for char in word):
            words.setdefault(word.casefold(), word)
    return list(words.values())


def _search_terms(text: str) -> list[str]:
    """The first MAX_SEARCH_WORDS search words of `text`, each a quoted FTS5 prefix query
    ("word"*)."""
    return ['"' + word.replace('"', '""') + '"*' for word in search_words(text)[:MAX_SEARCH_WORDS]]


def _index_words(text: str) -> list[str]:
    """`text`'s words as the search index's tokenizer (unicode61, remove_diacritics 2)
    sees them: runs of letters and digits, accents dropped, in lower case."""
    bare = "".join(char for char in unicodedata.normalize("NFD", text)
                   if unicodedata.category(char) != "Mn")
    return re.findall(r"[^\W_]+", bare.lower())


def _holds_word(text: str, term: str) -> bool:
    """Whether `text` holds search term `term` (a quoted FTS5 prefix query, "word"*) as
    the index would find it: its words in a row, the last as the start of a word."""
    words = _index_words(term[1:-2].replace('""', '"'))
    if not words:
        return False
    *whole, start = words
    tokens = _index_words(text)
    return any(tokens[i:i + len(whole)] == whole and tokens[i + len(whole)].startswith(start)
               for i in range(len(tokens) - len(whole)))


def _chat(row: tuple) -> StoredChat:
    chat_id, title, model, system_prompt, sampling, created, updated, thinking = row
    return StoredChat(chat_id, title, model, system_prompt, json.loads(sampling), created, updated,
                      thinking=None if thinking is None else bool(thinking))


def _message(row: tuple) -> Message:
    (message_id, chat_id, role, content, token_ids, finish_reason, created, timings, parent_id,
     reasoning) = row
    if role == "assistant" and finish_reason is None:
        finish_reason = INTERRUPTED
    return Message(message_id, chat_id, role, content, _unpack(token_ids), finish_reason,
                   created, json.loads(timings), parent_id, reasoning)


def _pack(token_ids: list[int]) -> bytes:
    packed = array("i", token_ids)
    if sys.byteorder == "big":
        packed.byteswap()
    return packed.tobytes()


def _unpack(blob: bytes) -> list[int]:
    unpacked = array("i")
    unpacked.frombytes(blob)
    if sys.byteorder == "big":
        unpacked.byteswap()
    return unpacked.tolist()
