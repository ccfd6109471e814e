"""`paged-chat chats`: list, search, show, export and delete saved chats.

Stored text (titles, messages) printed to a terminal is sanitized first: a chat can hold
anything a prompt or a model put in it, escape sequences included. Piped, it is exact.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from enum import Enum
from typing import TYPE_CHECKING, Annotated

import typer

from paged_chat.app.finish_labels import finish_label
from paged_chat.app.text import sanitize_for_terminal
from paged_chat.cli.table import print_table
from paged_chat.cli.typer_patches import FlagsShowNoType

if TYPE_CHECKING:
    from paged_chat.app.chat_store import ChatStore, Message, StoredChat
    from paged_chat.cli.state import CliState

chats_app = typer.Typer(cls=FlagsShowNoType, rich_markup_mode="markdown")


class ExportFormat(str, Enum):
    md = "md"
    json = "json"


ChatId = Annotated[str, typer.Argument(help="A chat id, or its first characters.", show_default=False)]


@chats_app.callback(invoke_without_command=True)
def chats(ctx: typer.Context) -> None:
    """List, search, show, export and delete saved chats. Without a command, lists them."""
    if ctx.invoked_subcommand is None:
        list_chats(ctx, search=None)


@chats_app.command("list")
def list_chats(ctx: typer.Context,
               search: Annotated[str | None, typer.Option(
                   "--search", "-s", help="Only the chats whose title or messages hold every "
                                          "word of this text (or words starting with it).")] = None,
               ) -> None:
    """List saved chats, most recent first."""
    from paged_chat.app.chat_store import MAX_SEARCH_WORDS, search_words

    if search is not None and len(search_words(search)) > MAX_SEARCH_WORDS:
        typer.echo(f"Warning: the search has {len(search_words(search)):,} different words: "
                   f"the first {MAX_SEARCH_WORDS} are searched", err=True)
    with _open_store(ctx) as store:
        found = store.list_chats() if search is None else store.search_chats(search)
        rows = [[chat.id, _local_time(chat.updated), chat.model, chat.title] for chat in found]
    if not rows:
        typer.echo('no chats yet: `paged-chat ask "..."` starts one' if search is None
                   else f"no chat holds {_shortened(search)!r}", err=True)
        return
    print_table(["ID", "UPDATED", "MODEL", "TITLE"], rows)


@chats_app.command("search")
def search_chats(ctx: typer.Context,
                 words: Annotated[list[str], typer.Argument(
                     help="Words the chats' titles or messages all hold (or words starting "
                          "with them).", show_default=False)],
                 ) -> None:
    """List the saved chats that hold these words, most recent first (as `chats list
    --search`)."""
    list_chats(ctx, search=" ".join(words))


@chats_app.command("show")
def show_chat(ctx: typer.Context, chat_id: ChatId) -> None:
    """Print a chat as Markdown: the branch last used (`paged-chat` switches branches)."""
    with _open_store(ctx) as store:
        chat = store.get_chat(store.resolve_id(chat_id))
    _echo_stored(_markdown(chat), nl=False)


@chats_app.command("export")
def export_chat(ctx: typer.Context, chat_id: ChatId,
                export_format: Annotated[ExportFormat, typer.Option(
                    "--format", help="md: readable Markdown; json: everything, token ids included.")
                ] = ExportFormat.md,
                all_branches: Annotated[bool, typer.Option(
                    "--all-branches", help="Every branch of the chat (edited messages, "
                                           "regenerated replies), not only the one last used.")
                ] = False,
                ) -> None:
    """Print a chat as Markdown or JSON (redirect it to a file to keep it): the branch last
    used, or with --all-branches every one (JSON: every message, each with its parent_id)."""
    from dataclasses import asdict

    with _open_store(ctx) as store:
        found = store.resolve_id(chat_id)
        chat = store.get_chat_tree(found) if all_branches else store.get_chat(found)
    if export_format is ExportFormat.json:
        _echo_stored(json.dumps(asdict(chat), ensure_ascii=False, indent=2))
    elif all_branches:
        _echo_stored(_all_branches_markdown(chat), nl=False)
    else:
        _echo_stored(_markdown(chat), nl=False)


@chats_app.command("delete")
def delete_chat(ctx: typer.Context, chat_id: ChatId,
                yes: Annotated[bool, typer.Option(
                    "--yes", "-y", help="Do not ask for confirmation.")] = False,
                ) -> None:
    """Delete a chat and its messages. Asks first, reading the answer from stdin (a
    terminal or a pipe: `echo y | paged-chat chats delete ID`); no answer is a no."""
    with _open_store(ctx) as store:
        chat = store.get_chat(store.resolve_id(chat_id))
        title = sanitize_for_terminal(chat.title)
        if not yes:
            typer.echo(f"Delete chat {chat.id} ({title!r}, {len(chat.messages)} messages)? [y/N] ",
                       nl=False, err=True)
            answer = sys.stdin.readline()
            if not sys.stdin.isatty():  # a terminal echoed the answer and its newline
                typer.echo(answer.strip(), err=True)
            if not answer:
                from paged_chat.cli.plain_terminal import UsageError

                raise UsageError("no answer on stdin: the chat was not deleted (--yes "
                                 "deletes without asking)")
            if answer.strip().lower() not in ("y", "yes"):
                typer.echo(f"not deleted: chat {chat.id}", err=True)
                raise typer.Exit(1)
        store.delete_chat(chat.id)
    typer.echo(f"deleted chat {chat.id} ({title})", err=True)


@contextmanager
def _open_store(ctx: typer.Context) -> Iterator[ChatStore]:
    """The chat store for one command, with errors reported and a recovery notice shown."""
    state: CliState = ctx.obj
    with state.reported():
        from paged_chat.app.chat_store import ChatStore

        store = ChatStore()
        if store.notice:
            typer.echo(f"Warning: {store.notice}", err=True)
        try:
            yield store
        finally:
            store.close()


def _markdown(chat: StoredChat) -> str:
    """A chat as Markdown: a heading, what it ran on, then each message of its branch under
    its role (and which of its versions it is, where it has several)."""
    return "\n".join(_heading(chat) + _message_lines(chat.messages, chat.branches))


def _all_branches_markdown(tree: StoredChat) -> str:
    """Every branch of a chat (a tree from `get_chat_tree`) in full, oldest first, each
    under its own heading."""
    children = {message.parent_id for message in tree.messages}
    by_id = {message.id: message for message in tree.messages}
    leaves = [message.id for message in tree.messages if message.id not in children]
    lines = _heading(tree)
    for number, leaf in enumerate(leaves, 1):
        branch = [by_id[leaf]]
        while branch[-1].parent_id is not None:
            branch.append(by_id[branch[-1].parent_id])
        current = " (current)" if leaf == tree.leaf_id else ""
        lines += [f"# Branch {number} of {len(leaves)}{current}", ""]
        lines += _message_lines(branch[::-1], {})
    return "\n".join(lines)


def _heading(chat: StoredChat) -> list[str]:
    lines = [f"# {chat.title}", "", f"chat `{chat.id}` · {chat.model} · {_local_time(chat.created)}", ""]
    if chat.system_prompt:
        lines += ["## System", "", chat.system_prompt, ""]
    return lines


def _message_lines(messages: list[Message], branches: dict[int, list[int]]) -> list[str]:
    lines = []
    for message in messages:
        label = finish_label(message.finish_reason) if message.finish_reason else ""
        versions = branches.get(message.id)
        notes = [note for note in (label, versions and f"branch {versions.index(message.id) + 1} "
                                                       f"of {len(versions)}") if note]
        suffix = f" ({', '.join(notes)})" if notes else ""
        lines += [f"## {message.role.capitalize()}{suffix}", "", message.content, ""]
    return lines


def _echo_stored(text: str, nl: bool = True) -> None:
    """Print stored text on stdout: sanitized on a terminal, exact in a pipe (color=True:
    click would otherwise strip what looks like a color code from piped output)."""
    typer.echo(sanitize_for_terminal(text) if sys.stdout.isatty() else text, nl=nl, color=True)


def _shortened(text: str, limit: int = 60) -> str:
    return text if len(text) <= limit else text[:limit - 1] + "…"


def _local_time(timestamp: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M", time.localtime(timestamp))
