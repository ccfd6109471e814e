"""What the engine panel and its legend know of a chat tab (or of another owner of blocks)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class TabInfo:
    """What the panel needs to know of a tab: its title, colour and live token ids."""

    title: str
    colour: int
    tokens_of: Callable[[str], Sequence[int] | None] = lambda request_id: None
