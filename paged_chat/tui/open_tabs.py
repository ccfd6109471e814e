"""Which chats have tabs open, and which one is active, kept in `tui-session.json` beside
the chat store so the next start reopens them (their messages load when first shown)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path


@dataclass(slots=True)
class OpenTabs:
    """The file of one app's open tabs; `path` None keeps nothing (the demo's tabs)."""

    path: Path | None

    def read(self) -> tuple[list[str], str | None]:
        """The chat ids that had tabs, in order, and the active one; nothing for a missing
        or unreadable file."""
        if self.path is None:
            return [], None
        try:
            state = json.loads(self.path.read_text())
            return [str(chat_id) for chat_id in state.get("open", [])], state.get("active")
        except (OSError, ValueError, AttributeError, TypeError):
            return [], None

    def save(self, chat_ids: list[str], active: str | None) -> None:
        if self.path is None:
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.path.write_text(json.dumps({"open": chat_ids, "active": active}))
        except OSError:  # the tabs are a convenience: a read-only data dir costs only that
            pass
