"""The paged-chat engine: paged KV cache, prefix caching, continuous batching.

Nothing in this package imports the TUI or the CLI.
"""

from paged_chat.engine.async_engine import AsyncEngine
from paged_chat.engine.config import EngineConfig
from paged_chat.engine.engine import Engine
from paged_chat.engine.errors import EngineDeadError, ModelLoadError, PagedChatError
from paged_chat.engine.request import RequestOutput, SamplingParams
from paged_chat.engine.stats import BlockMap, EngineStats

__all__ = ["AsyncEngine", "BlockMap", "Engine", "EngineConfig", "EngineDeadError", "EngineStats",
           "ModelLoadError", "PagedChatError", "RequestOutput", "SamplingParams"]
