"""EngineClient: the one surface the app (chat sessions, the TUI, `ask`) uses to talk to an
engine, whatever runs it.

The in-process `AsyncEngine` is the first implementation; an engine behind an HTTP API
(vLLM, llama.cpp's server, another paged-chat) can be a second one without the app
changing. The app never reaches behind this surface (no `.engine`, `.kv_cache`,
`.runner`, `.scheduler`).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from paged_chat.engine.request import RequestOutput, SamplingParams
from paged_chat.engine.stats import EngineStats


@dataclass(slots=True, frozen=True)
class ModelInfo:
    """What the app needs to know of the model an engine serves. `tokenizer` and
    `chat_template` build prompts; `num_blocks` is 0 where the engine shows no pool
    (a remote server); `weights` says what the weights are held as ("Q4_1+Q8_0, 0.12 GB
    of weights"; "" where unknown), `weight_bytes` the bytes they take (0 where unknown)."""

    name: str
    tokenizer: Any
    chat_template: str
    device: str
    dtype: str
    num_blocks: int
    block_size: int
    max_model_len: int
    num_parameters: int
    weights: str = ""
    weight_bytes: int = 0


@runtime_checkable
class EngineClient(Protocol):
    """Submit prompts, stream their deltas, abort them, read the engine's stats."""

    @property
    def info(self) -> ModelInfo: ...

    @property
    def last_error(self) -> str | None:
        """Why the last step failed, if one did; None otherwise."""

    @property
    def running(self) -> bool:
        """Whether it serves requests: False after shutdown, or once its engine died."""

    def stream(self, prompt: str | Sequence[int], params: SamplingParams | None = None,
               request_id: str | None = None, owner: str | None = None
               ) -> AsyncIterator[RequestOutput]:
        """The request's deltas until it finishes; leaving the iteration early aborts it.
        `owner` tags the request's blocks (the block map colours them by owner)."""

    def abort(self, request_id: str) -> None:
        """Stop a request now; its stream ends with finish_reason "abort"."""

    def stats(self) -> EngineStats:
        """The latest snapshot; never blocks on the engine."""

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix (the next prompts are computed in full)."""

    def shutdown(self) -> None:
        """Abort everything and stop serving."""
