"""The app's actions: each has a key (rebindable in `[tui.keys]`) and a palette entry.

`ChatActions` is mixed into the app; it acts on the active tab through the tab's own
methods and on the tabs through the ChatTabs widget's (`app.tabs`: `open_new_chat`,
`fork_tab`, `close_tab`, `cycle_tabs`, `pause_demo`), and reads only the app's public
surface (`active_tab`, `chat_tabs`, `panel`, `store`, `settings`, `keymap`).
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from functools import partial
from typing import TYPE_CHECKING

from textual import work
from textual.app import SystemCommand
from textual.binding import Binding
from textual.command import DiscoveryHit, Hit, Hits, Provider
from textual.screen import ModalScreen, Screen

from paged_chat.tui.chat_search import open_chat_label
from paged_chat.tui.dialogs import ChatSettingsScreen, ConfirmScreen, HelpScreen, TextPromptScreen

if TYPE_CHECKING:
    from paged_chat.tui.chat_tab import ChatTab

# (action, default keys, footer label, description, priority): every action also has a
# palette entry. The action name is the binding id: `[tui.keys] new_chat = "ctrl+t"`.
# A dialog's key has priority: the app takes it before the keys typed after it, which then
# reach the dialog, not the prompt behind it (a binding found by bubbling runs only after
# the focused prompt got them).
ACTIONS: list[tuple[str, str, str, str, bool]] = [
    ("new_chat", "ctrl+n", "New", "New chat", True),
    ("close_chat", "ctrl+w", "Close", "Close chat", True),
    ("next_chat", "ctrl+pagedown,alt+right", "Next", "Next chat", True),
    ("prev_chat", "ctrl+pageup,alt+left", "Prev", "Previous chat", True),
    ("rename_chat", "f2", "Rename", "Rename chat", False),
    ("fork_chat", "ctrl+f", "Fork", "Fork chat (shares its KV blocks)", True),
    ("chat_settings", "f4", "Settings", "System prompt and sampling", True),
    ("stop", "escape", "Stop", "Stop the reply", False),
    ("regenerate", "ctrl+r", "Regenerate", "Regenerate the selected or the last reply", True),
    ("select_prev_message", "alt+up", "Earlier message", "Select the message before", False),
    ("select_next_message", "alt+down", "Later message", "Select the message after", False),
    ("edit_message", "alt+e", "Edit", "Edit the selected message (branches the chat)", False),
    ("prev_branch", "alt+shift+left", "◀ Branch", "Previous branch of the selected message", False),
    ("next_branch", "alt+shift+right", "Branch ▶", "Next branch of the selected message", False),
    ("copy_reply", "alt+c", "Copy", "Copy the last reply", False),
    ("copy_code", "alt+x", "Copy code", "Copy the last code block", False),
    ("broadcast", "ctrl+b", "Broadcast", "Broadcast the prompt to every tab", True),
    ("show_thinking", "alt+t", "Thinking", "Show or hide the last reply's thinking", False),
    ("switch_thinking", "f3", "Think", "Turn the model's thinking on or off in this chat", False),
    ("toggle_panel", "f8", "Panel", "Show or hide the engine panel", False),
    ("restart_engine", "f5", "Restart engine", "Restart the engine (the model loads again)", False),
    ("help", "f1", "Help", "Help and keys", False),
]
# The footer's actions, most needed first: a narrow terminal shows only the first few.
SHOWN = ("help", "new_chat", "close_chat", "stop", "chat_settings", "toggle_panel", "regenerate",
         "fork_chat", "broadcast")
DELETE_CHAT_HELP = "Delete this chat from the store"


def make_bindings() -> list[Binding]:
    footer_rank = {action: rank for rank, action in enumerate(SHOWN)}
    in_footer_order = sorted(ACTIONS, key=lambda row: footer_rank.get(row[0], len(SHOWN)))
    return [Binding(keys, action, label, show=action in SHOWN, priority=priority, id=action,
                    tooltip=description)
            for action, keys, label, description, priority in in_footer_order]


class StoredChats(Provider):
    """Palette: reopen a chat from the store that has no open tab."""

    async def search(self, query: str) -> Hits:
        tabs = self.app.tabs
        matcher = self.matcher(query)
        for chat in tabs.closed_chats():
            text = open_chat_label(chat.title)
            score = matcher.match(text)
            if score > 0:
                yield Hit(score, matcher.highlight(text), partial(tabs.open_stored_chat, chat.id),
                          help=f"last used {time.strftime('%Y-%m-%d %H:%M', time.localtime(chat.updated))}")

    async def discover(self) -> Hits:
        tabs = self.app.tabs
        for chat in tabs.closed_chats()[:20]:
            yield DiscoveryHit(open_chat_label(chat.title), partial(tabs.open_stored_chat, chat.id))


class ChatActions:
    """The action_* methods of the app (mixed into PagedChatApp, whose tabs they act on),
    and what the palette and help list of them."""

    def _need_tab(self) -> ChatTab | None:
        tab = self.active_tab
        if tab is None:
            self.notify("no chat is open", severity="warning", markup=False)
        return tab

    async def action_new_chat(self) -> None:
        await self.tabs.open_new_chat()

    @work(group="dialog")
    async def action_close_chat(self) -> None:
        tab = self._need_tab()
        if tab is None:
            return
        if tab.streaming and not await self.push_screen_wait(
                ConfirmScreen(f"A reply is streaming in {tab.title!r}. Close it anyway?", "Close")):
            return
        await self.tabs.close_tab(tab)

    def action_next_chat(self) -> None:
        self.tabs.cycle_tabs(+1)

    def action_prev_chat(self) -> None:
        self.tabs.cycle_tabs(-1)

    @work(group="dialog")
    async def action_rename_chat(self) -> None:
        tab = self._need_tab()
        if tab is None:
            return
        title = await self.push_screen_wait(TextPromptScreen("Rename chat", tab.title))
        if title:
            tab.set_title(title)

    async def action_fork_chat(self) -> None:
        tab = self._need_tab()
        if tab is None:
            return
        if tab.streaming:
            self.notify("wait for the reply to finish (or stop it) before forking",
                        severity="warning", markup=False)
            return
        await self.tabs.fork_tab(tab)
        self.notify(f"forked {tab.title!r}: the fork shares every full KV block of its history",
                    markup=False)

    def action_chat_settings(self) -> None:
        """Pushed at once, not from a worker: keys typed right after F4 go to the dialog."""
        if isinstance(self.screen, ModalScreen):   # a priority key: not over another dialog
            return
        tab = self._need_tab()
        if tab is None:
            return
        tab.session.load()   # a restored tab's settings as stored

        def apply(result: tuple[str | None, dict] | None) -> None:
            if result is not None:
                tab.apply_settings(*result)

        self.push_screen(ChatSettingsScreen(tab.title, tab.session.system_prompt,
                                            tab.session.sampling, self.model_sampling()),
                         apply)

    def action_stop(self) -> None:
        tab = self.active_tab
        if tab is not None:
            self.tabs.pause_demo(tab)
            tab.stop()

    def action_regenerate(self) -> None:
        tab = self._need_tab()
        if tab is not None:
            tab.regenerate()

    async def action_select_prev_message(self) -> None:
        tab = self._need_tab()
        if tab is not None:
            await tab.select_message(-1)

    async def action_select_next_message(self) -> None:
        tab = self._need_tab()
        if tab is not None:
            await tab.select_message(+1)

    def action_edit_message(self) -> None:
        tab = self._need_tab()
        if tab is not None:
            tab.edit_selected()

    async def action_prev_branch(self) -> None:
        tab = self._need_tab()
        if tab is not None:
            await tab.switch_branch(-1)

    async def action_next_branch(self) -> None:
        tab = self._need_tab()
        if tab is not None:
            await tab.switch_branch(+1)

    def action_copy_reply(self) -> None:
        tab = self._need_tab()
        text = tab.last_reply() if tab else None
        if not text:
            self.notify("no reply to copy yet", severity="warning", markup=False)
            return
        self.copy_to_clipboard(text)
        self.notify(f"copied the last reply ({len(text)} characters)", markup=False)

    def action_copy_code(self, index: int = -1) -> None:
        tab = self._need_tab()
        blocks = tab.code_blocks() if tab else []
        if not blocks:
            self.notify("no code block in this chat", severity="warning", markup=False)
            return
        self.copy_to_clipboard(blocks[index])
        self.notify(f"copied a code block ({len(blocks[index].splitlines())} lines)", markup=False)

    @work(group="dialog")
    async def action_broadcast(self) -> None:
        tab = self.active_tab
        text = tab.prompt.text.strip() if tab else ""
        if not text:
            text = await self.push_screen_wait(TextPromptScreen(
                "Broadcast: send this prompt to every open tab", placeholder="prompt"))
            if not text:
                return
        elif tab is not None:
            tab.prompt.remember(text)
        sent = [t for t in self.chat_tabs if not t.streaming and t.send(text)]
        busy = len(self.chat_tabs) - len(sent)
        self.notify(f"sent to {len(sent)} tabs" + (f" ({busy} busy, skipped)" if busy else ""),
                    markup=False)

    def action_show_thinking(self) -> None:
        tab = self._need_tab()
        if tab is not None and not tab.toggle_last_thinking():
            self.notify("the last reply has no thinking to show", severity="warning", markup=False)

    @work(group="dialog")
    async def action_switch_thinking(self) -> None:
        tab = self._need_tab()
        if tab is None:
            return
        thinking = await tab.switch_thinking()
        if thinking is None:
            self.notify("this model's chat template cannot turn its thinking on or off",
                        severity="warning", markup=False)
        else:
            self.notify(f"thinking {'on' if thinking else 'off'} in {tab.title!r} from its next "
                        "turn", markup=False)

    def action_toggle_panel(self) -> None:
        """Hide the panel if it is shown, else show it (also on a narrow terminal)."""
        shown = self.panel.display
        self.panel.set_class(shown, "collapsed")
        self.panel.set_class(not shown, "expanded")

    def action_restart_engine(self) -> None:
        self.restart_engine()

    def action_help(self) -> None:
        if isinstance(self.screen, HelpScreen):
            return
        self.push_screen(HelpScreen(self.key_help()))

    @work(group="dialog")
    async def action_delete_chat(self) -> None:
        tab = self._need_tab()
        if tab is None:
            return
        if not await self.push_screen_wait(ConfirmScreen(
                f"Delete {tab.title!r} and its messages from the store?", "Delete")):
            return
        chat_id, in_store = tab.chat_id, tab.session.in_store
        await self.tabs.close_tab(tab)
        if in_store:  # a chat with no message yet is in no store
            self.store.delete_chat(chat_id)

    def keys_of(self, action: str) -> str:
        """The keys bound to `action` now (keymap applied), as the footer shows them."""
        bound = self.keymap.get(action, next(keys for name, keys, *_ in ACTIONS if name == action))
        return ", ".join(self.get_key_display(Binding(key.strip(), action))
                         for key in bound.split(","))

    def key_help(self) -> list[tuple[str, str]]:
        """(keys, description) per action, as currently bound (keymap applied)."""
        rows = [(self.keys_of(action), description) for action, _, _, description, _ in ACTIONS]
        rows += [("enter", "Send the prompt"), ("shift+enter, ctrl+j", "New line in the prompt"),
                 ("up / down", "Earlier prompts (on the first / last line)"),
                 ("ctrl+p", "Command palette (every action)"), ("ctrl+q", "Quit")]
        return rows

    def get_system_commands(self, screen: Screen) -> Iterable[SystemCommand]:
        yield from super().get_system_commands(screen)
        for (keys, description), (action, *_) in zip(self.key_help(), ACTIONS):
            yield SystemCommand(description, f"key: {keys}", partial(self.run_action, action))
        yield SystemCommand("Delete chat", DELETE_CHAT_HELP, partial(self.run_action, "delete_chat"))
        tab = self.active_tab
        if tab is not None:
            for label, message_id, step in tab.branch_choices():
                yield SystemCommand(label, "show this branch of the chat",
                                    partial(tab.switch_branch, step, message_id), discover=False)
            for index, block in enumerate(tab.code_blocks()):
                first = block.strip().splitlines()[0][:40] if block.strip() else ""
                yield SystemCommand(f"Copy code block {index + 1}", first,
                                    partial(self.action_copy_code, index), discover=False)
