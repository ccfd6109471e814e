"""What tests ask of an engine that the product never does: where a request is, who holds
a block, whether anything leaked. Kept here so the package holds product code only."""

from __future__ import annotations

import weakref
from collections.abc import Sequence

import numpy as np

from paged_chat.engine import Engine, EngineClient, OutputProcessor, RequestOutput, SamplingParams
from paged_chat.engine.request import Request, RequestStatus
from paged_chat.engine.stats import BlockMap, EngineStats


def phase_of(request: Request) -> str:
    """Where the request is, finer than its status: "waiting" (never scheduled), "preempted"
    (waiting to recompute), "prefilling" (its known tokens are not all computed yet),
    "decoding" or "finished". Aborts and faults must be safe in each."""
    if request.status is RequestStatus.WAITING_FOR_KV:
        return "waiting for KV"
    if request.status is RequestStatus.WAITING:
        return "preempted" if request.num_preemptions else "waiting"
    if request.status is RequestStatus.RUNNING:
        return "prefilling" if request.num_computed_tokens < request.num_tokens - 1 else "decoding"
    return "finished"


def holders_of(blocks: BlockMap, block_id: int) -> list[str]:
    start, end = blocks.holder_ptr[block_id], blocks.holder_ptr[block_id + 1]
    return [blocks.request_ids[i] for i in blocks.holders[start:end]]


def owners_of(blocks: BlockMap, block_id: int) -> list[str | None]:
    start, end = blocks.holder_ptr[block_id], blocks.holder_ptr[block_id + 1]
    return [blocks.request_owners[i] for i in blocks.holders[start:end]]


def blocks_owned(stats: EngineStats, owner: str) -> np.ndarray:
    """Ids of the blocks held by a request of `owner` (the map's cell i is block i + 1)."""
    blocks = stats.blocks
    request_of = np.asarray([o == owner for o in blocks.request_owners], dtype=bool)
    if not request_of.any():
        return np.zeros(0, dtype=np.int64)
    ptr = np.asarray(blocks.holder_ptr)
    block_of_entry = np.repeat(np.arange(len(ptr) - 1), np.diff(ptr))
    return np.unique(block_of_entry[request_of[np.asarray(blocks.holders)]]) + 1


async def generate(client: EngineClient, prompt: str | Sequence[int],
                   params: SamplingParams | None = None, owner: str | None = None) -> RequestOutput:
    """The final output of one streamed request."""
    last = None
    async for last in client.stream(prompt, params, owner=owner):
        pass
    return last


def assert_no_leaks(engine: Engine) -> None:
    """The pool's and the KV manager's invariants hold, and an engine with no request
    left holds no block."""
    engine.kv_cache.check_invariants()
    if not engine.has_unfinished():
        assert engine.stats().blocks_in_use == 0, "a block leaked"
        assert not engine.kv_cache.tables, "a block table outlived its request"


def engine_thread_idle(async_engine) -> bool:
    """No request in the engine and no command waiting for its thread. Once every stream is
    closed, this turning True means every cancellation has been applied: the thread sleeps,
    and a test may look at the engine and find nothing held."""
    transport = async_engine.transport
    return transport._commands.empty() and not transport.engine.has_unfinished()


# per Engine stepped through step_as_a_client: its processor, and the requests it tracks
_client_sides: weakref.WeakKeyDictionary[Engine, tuple[OutputProcessor, set[str]]] = (
    weakref.WeakKeyDictionary())


def step_as_a_client(engine: Engine) -> list[RequestOutput]:
    """`engine.step()` with a client's output processor after it: RequestOutputs (new text,
    the reply so far), and what a stop string ended aborted in the core, as a client does.
    Step an engine this way throughout (or not at all) so each reply is whole."""
    processor, tracked = _client_side(engine)
    params = {rid: request.params for rid, request in engine.requests.items() if rid not in tracked}
    core_outputs = engine.step()
    for core in core_outputs:
        if core.request_id not in tracked:
            processor.add_request(core.request_id, params.get(core.request_id))
            tracked.add(core.request_id)
    processed = processor.process(core_outputs)
    for request_id in processed.to_abort:
        engine.abort(request_id)
    tracked.difference_update(core.request_id for core in core_outputs if core.finished)
    return processed.outputs


def client_processor(engine: Engine) -> OutputProcessor:
    """The output processor `step_as_a_client` runs `engine`'s outputs through."""
    return _client_side(engine)[0]


def _client_side(engine: Engine) -> tuple[OutputProcessor, set[str]]:
    return _client_sides.setdefault(engine, (OutputProcessor(engine.tokenizer), set()))
