"""How a reply ended, in the one word the TUI's reply footers and `chats show` both use
(the store keeps the engine's finish reasons: stop, length, abort, error, interrupted)."""

from __future__ import annotations

FINISH_LABELS: dict[str | None, str] = {
    None: "interrupted",     # the TUI: a turn that ended without a finish reason
    "stop": "",              # the model finished: nothing to say
    "length": "max tokens",
    "abort": "stopped",      # Esc, Ctrl+C, SIGHUP, a closed tab
    "error": "error",
}


def finish_label(reason: str | None) -> str:
    """The word shown for `reason`; an unknown reason shows as itself."""
    return FINISH_LABELS.get(reason, reason or "")
