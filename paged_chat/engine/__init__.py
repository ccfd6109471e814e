"""The paged-chat engine: paged KV cache, prefix caching, continuous batching.

Nothing in this package imports the app, the TUI, the CLI, the server or the bench
(test_engine_layering.py). Its public names load on first use (PEP 562), so code that only
needs an exception class (the chat store, the CLI's `chats` command) does not pay for
importing torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

_EXPORTS = {
    "BlockMap": "paged_chat.engine.core.stats",
    "ClientCapabilities": "paged_chat.engine.clients.client_protocol",
    "ClientSpec": "paged_chat.engine.clients.factory",
    "Engine": "paged_chat.engine.core.engine",
    "EngineClient": "paged_chat.engine.clients.client_protocol",
    "EngineConfig": "paged_chat.engine.core.config",
    "EngineCoreOutput": "paged_chat.engine.core.outputs",
    "EngineDeadError": "paged_chat.engine.core.errors",
    "EngineStats": "paged_chat.engine.core.stats",
    "GrammarError": "paged_chat.engine.worker.structured_output",
    "KVTierStats": "paged_chat.engine.core.stats",
    "KVTierWarning": "paged_chat.engine.core.errors",
    "LocalClient": "paged_chat.engine.clients.local",
    "ModelInfo": "paged_chat.engine.core.outputs",
    "ModelLoadError": "paged_chat.engine.core.errors",
    "OutputProcessor": "paged_chat.engine.core.output_processor",
    "PagedChatError": "paged_chat.engine.core.errors",
    "RemoteClient": "paged_chat.engine.clients.remote",
    "RemoteEngineError": "paged_chat.engine.clients.remote",
    "RequestOutput": "paged_chat.engine.core.outputs",
    "SamplingParams": "paged_chat.engine.core.sampling_params",
    "StartingClient": "paged_chat.engine.clients.factory",
    "TokenLogprob": "paged_chat.engine.core.outputs",
    "make_client": "paged_chat.engine.clients.factory",
    "start_client": "paged_chat.engine.clients.factory",
}
__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:
    from paged_chat.engine.clients.client_protocol import ClientCapabilities, EngineClient
    from paged_chat.engine.clients.factory import (
        ClientSpec,
        StartingClient,
        make_client,
        start_client,
    )
    from paged_chat.engine.clients.local import LocalClient
    from paged_chat.engine.clients.remote import RemoteClient, RemoteEngineError
    from paged_chat.engine.core.config import EngineConfig
    from paged_chat.engine.core.engine import Engine
    from paged_chat.engine.core.errors import (
        EngineDeadError,
        KVTierWarning,
        ModelLoadError,
        PagedChatError,
    )
    from paged_chat.engine.core.output_processor import OutputProcessor
    from paged_chat.engine.core.outputs import (
        EngineCoreOutput,
        ModelInfo,
        RequestOutput,
        TokenLogprob,
    )
    from paged_chat.engine.core.sampling_params import SamplingParams
    from paged_chat.engine.core.stats import BlockMap, EngineStats, KVTierStats
    from paged_chat.engine.worker.structured_output import GrammarError


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'paged_chat.engine' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value
