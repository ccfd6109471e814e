"""The multiline prompt: Enter sends, Shift+Enter or Ctrl+J inserts a newline, Up on the
first line and Down on the last line walk through earlier prompts; Alt+key never types
(it is the app's: copy reply, copy code, ...)."""

from __future__ import annotations

from textual import events
from textual.message import Message
from textual.widgets import TextArea


class PromptInput(TextArea):
    DEFAULT_CSS = """
    PromptInput { height: auto; max-height: 10; min-height: 3; }
    """

    class Submitted(Message):
        def __init__(self, prompt: "PromptInput", text: str) -> None:
            super().__init__()
            self.prompt = prompt
            self.text = text

        @property
        def control(self) -> "PromptInput":
            return self.prompt

    def __init__(self, history: list[str] | None = None, *, id: str | None = None,
                 placeholder: str = "") -> None:
        super().__init__(id=id, soft_wrap=True, show_line_numbers=False, tab_behavior="focus",
                         compact=True, placeholder=placeholder)
        # A steady cursor: each blink would be a screen update of its own, taking the
        # cores from the engine while the tabs stream.
        self.cursor_blink = False
        self.prompt_history: list[str] = list(history or [])
        self._recall: int | None = None   # index into history while walking it
        self._draft = ""                  # what was typed before walking started

    async def on_key(self, event: events.Key) -> None:
        if event.key == "enter":
            event.stop()
            event.prevent_default()
            text = self.text
            if text.strip():
                self.post_message(self.Submitted(self, text))
            return
        if event.key in ("shift+enter", "ctrl+j"):
            event.stop()
            event.prevent_default()
            if not self.read_only:
                start, end = self.selection
                self.replace("\n", start, end, maintain_selection_offset=False)
            return
        if event.key.startswith("alt+"):
            # A terminal sends Alt+C as ESC c, which Textual reads as a printable `c`:
            # keep it out of the text so it reaches the app's bindings (copy, ...).
            event.prevent_default()
            return
        # Anything else: TextArea's own handler runs next (one handler per class, down the MRO).

    def remember(self, text: str) -> None:
        """Add a sent prompt to the history and clear the input."""
        if text.strip() and (not self.prompt_history or self.prompt_history[-1] != text):
            self.prompt_history.append(text)
        self._recall = None
        self._draft = ""
        self.clear()

    def _show(self, text: str) -> None:
        self.text = text
        self.move_cursor(self.document.end)

    def action_cursor_up(self, select: bool = False) -> None:
        if select or self.cursor_location[0] != 0 or not self.prompt_history:
            super().action_cursor_up(select)
            return
        if self._recall is None:
            self._draft = self.text
            self._recall = len(self.prompt_history)
        if self._recall > 0:
            self._recall -= 1
            self._show(self.prompt_history[self._recall])

    def action_cursor_down(self, select: bool = False) -> None:
        last_row = self.document.line_count - 1
        if select or self._recall is None or self.cursor_location[0] != last_row:
            super().action_cursor_down(select)
            return
        self._recall += 1
        if self._recall >= len(self.prompt_history):
            self._recall = None
            self._show(self._draft)
        else:
            self._show(self.prompt_history[self._recall])
