"""EngineClient: the one surface the app (chat sessions, the TUI, `ask`, the server) uses to
talk to an engine, whatever runs it and wherever.

Implementations (this folder): LocalClient (local.py) over an Engine on a thread of this
process or in a child process (its transport), and RemoteClient (remote.py) over an
OpenAI-compatible server. `make_client` (factory.py) builds one. The app never reaches
behind this surface (no `.engine`, `.kv_cache`, `.runner`, `.scheduler`): what a front end
may use beyond the common part is stated in `capabilities`, never guessed from sentinels.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from paged_chat.engine.core.outputs import ModelInfo, RequestOutput
from paged_chat.engine.core.sampling_params import SamplingParams
from paged_chat.engine.core.stats import EngineStats


@dataclass(slots=True, frozen=True)
class ClientCapabilities:
    """What a front end may use of a client beyond the common surface.

    `block_map`: stats() describes a pool (num_blocks, the block map, block counts) and
    `info` gives its size; False for a server whose pool is its own. `metrics`: stats()
    carries the engine's numbers (queues, rates, prefix hits); False for a server whose
    /metrics did not answer with vLLM's names, where only a client's own timings say
    anything. `where`: one line for a status bar on where the engine runs. `restart`: the
    client runs its engine itself: `restart(timeout_s)` serves again after it stopped, and
    `responding` is False while its process is stopped or hung. `reprioritize`:
    `reprioritize(request_id, priority)` moves a request in flight to another priority.
    """

    block_map: bool
    metrics: bool
    where: str
    restart: bool = False
    reprioritize: bool = False


@runtime_checkable
class EngineClient(Protocol):
    """Submit prompts, stream their deltas, abort them, read the engine's stats."""

    @property
    def info(self) -> ModelInfo: ...

    @property
    def capabilities(self) -> ClientCapabilities: ...

    @property
    def last_error(self) -> str | None:
        """Why the last step failed, if one did; None otherwise."""

    @property
    def running(self) -> bool:
        """Whether it serves requests: False after shutdown, or once its engine died."""

    def stream(self, prompt: str | Sequence[int], params: SamplingParams | None = None,
               request_id: str | None = None, owner: str | None = None, priority: int = 0
               ) -> AsyncIterator[RequestOutput]:
        """The request's deltas until it finishes; leaving the iteration early aborts it.
        `owner` tags the request's blocks (the block map colours them by owner).
        `priority`: vLLM's, the lower served first (the engine's scheduler orders by it)."""

    def abort(self, request_id: str) -> None:
        """Stop a request now; its stream ends with finish_reason "abort"."""

    def stats(self) -> EngineStats:
        """The latest snapshot; never blocks on the engine."""

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix (the next prompts are computed in full)."""

    def shutdown(self) -> None:
        """Abort everything and stop serving."""
