"""The app's main screen: Textual's Screen, whose partial updates render only the rows of
the updated areas that widgets show (textual_compat.crop_screen_updates)."""

from __future__ import annotations

from textual.screen import Screen

from paged_chat.tui.textual_compat import crop_screen_updates


class ChatScreen(Screen):
    """The app's default screen."""

    def __init__(self, name: str | None = None, id: str | None = None,
                 classes: str | None = None) -> None:
        super().__init__(name, id, classes)
        crop_screen_updates(self)
