"""Modal dialogs: confirm, a one-line text prompt (rename, broadcast), per-tab chat
settings (system prompt and sampling), and the help screen with the current keys."""

from __future__ import annotations

import typing

from rich.table import Table
from rich.text import Text
from textual import on
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Grid, Horizontal, VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Button, Input, Label, Static, TextArea

from paged_chat.app.settings import CHAT_SAMPLING_KEYS
from paged_chat.engine.core.sampling_params import SamplingParams

# The number type of each sampling field the dialog edits (an empty field means "the default").
SAMPLING_FIELDS: dict[str, type] = {
    name: next(kind for kind in typing.get_args(hint) or (hint,) if kind is not type(None))
    for name, hint in ((name, typing.get_type_hints(SamplingParams)[name])
                       for name in CHAT_SAMPLING_KEYS)}


class ConfirmScreen(ModalScreen[bool]):
    # Focus by selector when the screen is shown, not in on_mount: a key that answers the
    # question at once dismisses the screen before it mounts, and its buttons are gone then.
    AUTO_FOCUS = "#no"
    BINDINGS = [Binding("y", "answer(True)", "Yes"), Binding("n,escape", "answer(False)", "No")]

    def __init__(self, question: str, yes: str = "Yes") -> None:
        super().__init__(classes="dialog-screen")
        self.question = question
        self.yes = yes

    def compose(self) -> ComposeResult:
        with VerticalScroll(classes="dialog"):
            yield Label(self.question, classes="dialog-title")
            with Horizontal(classes="dialog-buttons"):
                yield Button(self.yes, variant="error", id="yes")
                yield Button("Cancel", id="no")

    def action_answer(self, answer: bool) -> None:
        self.dismiss(answer)

    @on(Button.Pressed)
    def _pressed(self, event: Button.Pressed) -> None:
        self.dismiss(event.button.id == "yes")


class TextPromptScreen(ModalScreen[str | None]):
    """Ask for one line of text; None when cancelled."""

    AUTO_FOCUS = "#text"
    BINDINGS = [Binding("escape", "cancel", "Cancel")]

    def __init__(self, title: str, value: str = "", placeholder: str = "") -> None:
        super().__init__(classes="dialog-screen")
        self.title_text = title
        self.value = value
        self.placeholder = placeholder

    def compose(self) -> ComposeResult:
        with VerticalScroll(classes="dialog"):
            yield Label(self.title_text, classes="dialog-title")
            yield Input(self.value, placeholder=self.placeholder, id="text")
            with Horizontal(classes="dialog-buttons"):
                yield Button("OK", variant="primary", id="ok")
                yield Button("Cancel", id="cancel")

    @on(Input.Submitted)
    @on(Button.Pressed, "#ok")
    def _ok(self) -> None:
        value = self.query_one(Input).value.strip()
        self.dismiss(value or None)

    @on(Button.Pressed, "#cancel")
    def action_cancel(self) -> None:
        self.dismiss(None)


def parse_sampling(values: dict[str, str]) -> dict:
    """Typed sampling overrides from the dialog's strings; ValueError names a bad field."""
    sampling = {}
    for name, kind in SAMPLING_FIELDS.items():
        raw = values.get(name, "").strip()
        if not raw:
            continue
        try:
            sampling[name] = kind(raw)
        except ValueError:
            raise ValueError(f"{name}: {raw!r} is not {'an integer' if kind is int else 'a number'}")
    SamplingParams(**sampling)  # validates ranges, naming the field
    return sampling


class ChatSettingsScreen(ModalScreen[tuple[str | None, dict] | None]):
    """The tab's system prompt and sampling settings."""

    AUTO_FOCUS = "#system-prompt"   # what is typed right after F4 is the system prompt
    BINDINGS = [Binding("escape", "cancel", "Cancel"), Binding("ctrl+s", "save", "Save")]

    def __init__(self, title: str, system_prompt: str | None, sampling: dict,
                 defaults: dict) -> None:
        super().__init__(classes="dialog-screen")
        self.title_text = title
        self.system_prompt = system_prompt or ""
        self.sampling = sampling
        self.defaults = defaults

    def compose(self) -> ComposeResult:
        with VerticalScroll(classes="dialog wide"):
            yield Label(f"Chat settings: {self.title_text}", classes="dialog-title")
            yield Label("System prompt")
            yield TextArea(self.system_prompt, id="system-prompt", soft_wrap=True)
            with Grid(id="sampling-grid"):
                for name in SAMPLING_FIELDS:
                    yield Label(name)
                    value = self.sampling.get(name)
                    default = self.defaults.get(name)
                    yield Input("" if value is None else str(value), id=f"f-{name}",
                                placeholder="default" if default is None else f"{default}")
            yield Static("", id="settings-error")
            with Horizontal(classes="dialog-buttons"):
                yield Button("Save", variant="primary", id="save")
                yield Button("Cancel", id="cancel")

    @on(Button.Pressed, "#save")
    @on(Input.Submitted)
    def action_save(self) -> None:
        values = {name: self.query_one(f"#f-{name}", Input).value for name in SAMPLING_FIELDS}
        try:
            sampling = parse_sampling(values)
        except ValueError as error:
            self.query_one("#settings-error", Static).update(Text(str(error), style="bold red"))
            return
        system = self.query_one("#system-prompt", TextArea).text.strip() or None
        self.dismiss((system, sampling))

    @on(Button.Pressed, "#cancel")
    def action_cancel(self) -> None:
        self.dismiss(None)


class HelpScreen(ModalScreen[None]):
    """The keys (as currently bound, keymap included) and what the panel shows."""

    BINDINGS = [Binding("escape,f1,q", "close", "Close")]

    def __init__(self, keys: list[tuple[str, str]]) -> None:
        super().__init__(classes="dialog-screen")
        self.keys = keys

    def compose(self) -> ComposeResult:
        table = Table(box=None, show_header=False, padding=(0, 2))
        table.add_column(style="bold")
        table.add_column()
        for key, description in self.keys:
            table.add_row(key, description)
        with VerticalScroll(classes="dialog wide help"):
            yield Label("paged-chat: keys (Esc closes this help)", classes="dialog-title")
            yield Static(table)
            yield Static(Text.from_markup(
                "\n[b]Prompt[/b]: Enter sends; Shift+Enter or Ctrl+J: new line; Up/Down on the "
                "first/last line recall earlier prompts.\n"
                "[b]Engine panel[/b]: one cell per KV block (two per cell as ▀ halves when the pool "
                "is large). Colour = the tab holding it; ◆/white = shared by several requests "
                "(a common system prompt, a fork); dim ░ = cached, evictable; blank = free. "
                "Hover or click a block for its id, ref count, owners and tokens.\n"
                "Keys can be changed in config.toml under \\[tui.keys], e.g. new_chat = \"ctrl+t\"."))

    def action_close(self) -> None:
        self.dismiss(None)
