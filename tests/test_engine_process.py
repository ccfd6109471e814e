"""The process transport: the engine in a child process streams what the engine in this process
generates, aborts what is left, sends its block map over, and every way the child can end
(shutdown, a load error, a kill, its parent gone) ends the streams with one clear line."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import signal
import subprocess
import sys
import time

import pytest
from helpers import engine_config, wait_for, wait_until

from paged_chat.engine import (
    ClientSpec,
    Engine,
    EngineDeadError,
    LocalClient,
    ModelLoadError,
    SamplingParams,
    make_client,
)

LONG = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
SHORT = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def process_engine(chat_model_dir):
    engine = make_client(ClientSpec("process", engine_config(chat_model_dir), stats_interval_s=0.01))
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def spare_process_engines() -> list[LocalClient]:
    """Engines a test left running with no request (a restarted child serves as a new one:
    its own process, its load done): the next test that needs one of its own takes it
    instead of waiting seconds for a child to start."""
    spare: list[LocalClient] = []
    yield spare
    for engine in spare:
        engine.shutdown()


@pytest.fixture
def own_process_engine(chat_model_dir, spare_process_engines):
    """A process engine for this test alone, which it may shut down, restart or kill."""
    if spare_process_engines:
        engine = spare_process_engines.pop()
    else:
        engine = make_client(ClientSpec("process", engine_config(chat_model_dir)))
    yield engine
    if engine.running and engine.last_error is None and settles(engine):
        spare_process_engines.append(engine)
    else:
        engine.shutdown()


def settles(engine: LocalClient, within_s: float = 10.0) -> bool:
    """Whether the child's stats say idle within `within_s` (they arrive a moment after the
    last delta)."""
    deadline = time.monotonic() + within_s
    while not idle(engine):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


async def collect(engine, prompt, params=SHORT, owner=None) -> list:
    return [out async for out in engine.stream(prompt, params, owner=owner)]


def idle(engine: LocalClient) -> bool:
    stats = engine.stats()
    return stats.blocks_in_use == 0 and stats.num_running == 0 and stats.num_waiting == 0


async def test_streams_match_the_engine_in_this_process(process_engine, chat_model_dir):
    assert process_engine.transport.pid != os.getpid()
    capabilities = process_engine.capabilities
    assert capabilities.block_map and capabilities.metrics
    assert capabilities.where == f"in a child process (pid {process_engine.transport.pid})"
    prompts = [[5, 6, 7], "a plain prompt"]
    expected = Engine(engine_config(chat_model_dir)).generate(prompts, SHORT)
    streams = await asyncio.wait_for(asyncio.gather(*(collect(process_engine, p) for p in prompts)), 60)
    for deltas, final in zip(streams, expected):
        assert [t for d in deltas for t in d.new_token_ids] == final.token_ids
        assert "".join(d.new_text for d in deltas) == final.text
        assert deltas[-1].finished and not any(d.finished for d in deltas[:-1])
        # The child sends core outputs only; the parent's output processor builds the reply.
        assert deltas[-1].token_ids == final.token_ids and deltas[-1].text == final.text
        assert deltas[3].token_ids[:4] == final.token_ids[:4]
    assert not len(process_engine._processor)   # nothing kept of a finished request
    assert process_engine.info.tokenizer.decode(expected[0].token_ids) == expected[0].text


async def test_leaving_a_stream_aborts_its_request_in_the_child(process_engine):
    count = 0
    async for _ in process_engine.stream(list(range(3, 50)), LONG):
        count += 1
        if count == 3:
            break
    await wait_until(lambda: idle(process_engine))


async def test_the_block_map_comes_over_with_its_owners(process_engine):
    task = asyncio.create_task(collect(process_engine, list(range(3, 60)), LONG, owner="tab-a"))
    await wait_until(lambda: "tab-a" in process_engine.stats().blocks.request_owners)
    stats = process_engine.stats()
    assert stats.blocks_in_use >= 4 and stats.num_blocks == 512
    index = stats.blocks.request_owners.index("tab-a")
    assert stats.blocks.table_lengths[index] >= 4
    task.cancel()
    await wait_until(lambda: idle(process_engine))


async def test_a_bad_prompt_raises_in_its_stream_only(process_engine):
    with pytest.raises(ValueError, match="empty"):
        await asyncio.wait_for(collect(process_engine, []), 30)
    assert len(await asyncio.wait_for(collect(process_engine, [5, 6]), 30)) == 12


async def test_shutdown_ends_open_streams_and_the_child_exits(own_process_engine):
    stream = own_process_engine.stream([5, 6, 7], LONG)
    await asyncio.wait_for(anext(stream), 60)
    await asyncio.get_running_loop().run_in_executor(None, own_process_engine.shutdown)
    with pytest.raises(EngineDeadError, match="shut down"):
        async for _ in stream:   # the deltas that came before the shutdown, then the error
            pass
    assert own_process_engine.transport._process.exitcode == 0 and not own_process_engine.running
    with pytest.raises(EngineDeadError):
        await collect(own_process_engine, [5, 6])


async def test_restart_serves_again_in_a_new_child(own_process_engine):
    first_child = own_process_engine.transport.pid
    loop = asyncio.get_running_loop()
    await loop.run_in_executor(None, own_process_engine.shutdown)
    assert not own_process_engine.running
    await loop.run_in_executor(None, own_process_engine.restart)
    assert own_process_engine.running and own_process_engine.last_error is None
    assert own_process_engine.transport.pid not in (first_child, os.getpid())
    assert len(await asyncio.wait_for(collect(own_process_engine, [5, 6]), 60)) == 12


async def test_a_killed_child_ends_every_stream_with_its_exit_code(own_process_engine):
    stream = own_process_engine.stream([5, 6, 7], LONG)
    await asyncio.wait_for(anext(stream), 60)
    os.kill(own_process_engine.transport.pid, signal.SIGKILL)
    with pytest.raises(EngineDeadError, match=r"exited unexpectedly \(exit code -9\)"):
        async for _ in stream:
            pass
    assert not own_process_engine.running
    assert "exit code -9" in own_process_engine.last_error
    with pytest.raises(EngineDeadError, match="exit code -9"):
        await collect(own_process_engine, [5, 6])


async def test_a_message_the_parent_cannot_take_ends_the_streams_instead_of_hanging(
        own_process_engine, monkeypatch):
    def unreadable(message):
        raise TypeError("a message from another version")

    monkeypatch.setattr(own_process_engine, "on_outputs", unreadable)
    with pytest.raises(EngineDeadError, match="could not be read .*another version"):
        await asyncio.wait_for(collect(own_process_engine, [5, 6, 7]), 60)
    assert not own_process_engine.running
    own_process_engine.transport._process.join(30)
    assert own_process_engine.transport._process.exitcode == -signal.SIGKILL


# The parent imports what an app would before its engine starts, not the tests' helpers
# (torch and hypothesis: seconds of imports that have nothing to do with being killed).
PARENT_SCRIPT = """
import json
import sys
import time
from paged_chat.engine import ClientSpec, EngineConfig, make_client
if __name__ == "__main__":
    engine = make_client(ClientSpec("process", EngineConfig(**json.loads(sys.argv[1]))))
    print(engine.transport.pid, flush=True)
    time.sleep(600)
"""

BUSY_PARENT_SCRIPT = """
import json
import sys
import time
from paged_chat.engine import ClientSpec, EngineConfig, make_client
from paged_chat.engine.clients import engine_loop
engine_loop.serve_engine = lambda *args: time.sleep(600)
if __name__ == "__main__":
    engine = make_client(ClientSpec("process", EngineConfig(**json.loads(sys.argv[1])),
                                    fork_if_safe=True))
    print(engine.transport.pid, flush=True)
    time.sleep(600)
"""


@pytest.mark.parametrize("parent_script", [PARENT_SCRIPT, BUSY_PARENT_SCRIPT], ids=["idle", "busy"])
def test_the_child_exits_when_its_parent_is_killed(chat_model_dir, parent_script):
    """A parent killed outright runs no clean-up; its end of the pipe closes with it, and the
    child must not linger holding the model and the KV pool. A busy child (its main thread
    in a long step, a grammar that compiles for minutes, reads no pipe) must end with its
    parent too: BUSY_PARENT_SCRIPT forks it with its engine loop replaced by a step that
    never ends."""
    config = json.dumps(dataclasses.asdict(engine_config(chat_model_dir)))
    parent = subprocess.Popen(
        [sys.executable, "-c", parent_script, config], stdout=subprocess.PIPE,
        text=True, env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    try:
        child_pid = int(parent.stdout.readline())
        assert child_alive(child_pid)
    finally:
        parent.kill()
        parent.wait(30)
    try:
        wait_for(lambda: not child_alive(child_pid), timeout=30,
                 what="the engine process to exit with its parent")
    finally:
        if child_alive(child_pid):
            os.kill(child_pid, signal.SIGKILL)


def child_alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie nobody reaped yet has exited)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_a_load_error_is_raised_from_the_constructor(tmp_path):
    with pytest.raises(ModelLoadError, match="missing"):
        make_client(ClientSpec("process", engine_config(tmp_path / "missing")))
