"""The paged-chat engine: paged KV cache, prefix caching, continuous batching.

Nothing in this package imports the TUI or the CLI. Its public names load on first use
(PEP 562), so code that only needs an exception class (the chat store, the CLI's
`chats` command) does not pay for importing torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

_EXPORTS = {
    "AsyncEngine": "paged_chat.engine.async_engine",
    "BlockMap": "paged_chat.engine.stats",
    "Engine": "paged_chat.engine.engine",
    "EngineClient": "paged_chat.engine.client",
    "EngineConfig": "paged_chat.engine.config",
    "EngineDeadError": "paged_chat.engine.errors",
    "EngineProcess": "paged_chat.engine.engine_process",
    "EngineStats": "paged_chat.engine.stats",
    "KVTierStats": "paged_chat.engine.stats",
    "KVTierWarning": "paged_chat.engine.errors",
    "ModelInfo": "paged_chat.engine.client",
    "ModelLoadError": "paged_chat.engine.errors",
    "PagedChatError": "paged_chat.engine.errors",
    "RequestOutput": "paged_chat.engine.request",
    "SamplingParams": "paged_chat.engine.request",
}
__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:
    from paged_chat.engine.async_engine import AsyncEngine
    from paged_chat.engine.client import EngineClient, ModelInfo
    from paged_chat.engine.config import EngineConfig
    from paged_chat.engine.engine import Engine
    from paged_chat.engine.engine_process import EngineProcess
    from paged_chat.engine.errors import (EngineDeadError, KVTierWarning, ModelLoadError,
                                          PagedChatError)
    from paged_chat.engine.request import RequestOutput, SamplingParams
    from paged_chat.engine.stats import BlockMap, EngineStats, KVTierStats


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'paged_chat.engine' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value
