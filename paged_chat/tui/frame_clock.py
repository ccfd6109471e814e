"""The app's frame clock: when the engine panel and the shown tab's streaming reply draw."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:   # the engine's start (engine_start.py) reads FRAME_S before Textual loads
    from textual.message_pump import MessagePump
    from textual.timer import Timer

FRAME_S = 0.2   # 5 frames a second: the panel promises at least 4


class FrameClock:
    """Ticks every `period_s` on a message pump's timer (`start`), each tick one call of
    `on_frame`. In a frame the app reads the engine's stats once, the panel draws them and
    the shown tab's reply renders what streamed since the last frame: the terminal gets
    one screen update per frame, and no snapshot is read that is not drawn. `tick()` is a
    frame now, between two of the clock's."""

    def __init__(self, on_frame: Callable[[], None], period_s: float = FRAME_S) -> None:
        self.period_s = period_s
        self._on_frame = on_frame
        self._timer: Timer | None = None

    def start(self, pump: MessagePump) -> None:
        """Tick on `pump`'s timer from now on, until the pump closes or `stop`."""
        self.stop()
        self._timer = pump.set_interval(self.period_s, self.tick)

    def stop(self) -> None:
        if self._timer is not None:
            self._timer.stop()
            self._timer = None

    def tick(self) -> None:
        self._on_frame()
