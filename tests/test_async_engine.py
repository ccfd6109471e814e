"""The thread client (LocalClient over ThreadTransport): streaming, cancellation, errors
reaching every stream, stats that never block."""

from __future__ import annotations

import asyncio
import sys
import threading

import pytest
from helpers import wait_until

from paged_chat.engine import ClientSpec, EngineDeadError, LocalClient, SamplingParams, make_client
from paged_chat.engine.clients.engine_loop import Add, Shutdown, serve_engine
from paged_chat.engine.clients.thread_transport import GIL_SWITCH_INTERVAL_S

LONG = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
SHORT = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.fixture
def async_engine(make_engine):
    engine = make_client(ClientSpec(engine=make_engine(), stats_interval_s=0.01))
    yield engine
    engine.shutdown()


async def collect(engine: LocalClient, prompt, params=SHORT, owner=None) -> list:
    return [out async for out in engine.stream(prompt, params, owner=owner)]


async def test_stream_matches_the_sync_engine(async_engine, make_engine):
    expected = make_engine().generate([[5, 6, 7], [8, 9]], SHORT)
    streams = await asyncio.wait_for(asyncio.gather(
        collect(async_engine, [5, 6, 7]), collect(async_engine, [8, 9])), 60)
    for deltas, final in zip(streams, expected):
        assert [t for d in deltas for t in d.new_token_ids] == final.token_ids
        assert "".join(d.new_text for d in deltas) == final.text
        assert deltas[-1].finished and not any(d.finished for d in deltas[:-1])


async def test_cancelling_the_consumer_aborts_and_frees(async_engine):
    async def consume_a_few():
        count = 0
        async for _ in async_engine.stream(list(range(3, 50)), LONG):
            count += 1
            if count == 3:
                break

    await asyncio.wait_for(consume_a_few(), 60)
    task = asyncio.create_task(collect(async_engine, [5, 6, 7], LONG))
    await asyncio.sleep(0.2)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await wait_until(lambda: async_engine.stats().blocks_in_use == 0
                     and async_engine.stats().num_running == 0)


async def test_bad_prompt_raises_in_the_stream(async_engine):
    with pytest.raises(ValueError, match="empty"):
        await asyncio.wait_for(collect(async_engine, []), 30)
    assert len(await asyncio.wait_for(collect(async_engine, [5, 6]), 30)) == 12


async def test_step_failure_reaches_every_stream_and_the_engine_recovers(async_engine):
    runner = async_engine.transport.engine.runner
    original = runner.execute

    def broken(*args, **kwargs):
        raise RuntimeError("injected fault")

    runner.execute = broken
    results = await asyncio.wait_for(asyncio.gather(
        collect(async_engine, [5, 6, 7]), collect(async_engine, [8, 9]),
        return_exceptions=True), 30)
    assert all(isinstance(r, EngineDeadError) and "injected fault" in str(r) for r in results)
    assert "injected fault" in async_engine.last_error
    runner.execute = original
    assert len(await asyncio.wait_for(collect(async_engine, [5, 6]), 30)) == 12
    await wait_until(lambda: async_engine.stats().blocks_in_use == 0)


async def test_stats_are_published_while_running(async_engine):
    task = asyncio.create_task(collect(async_engine, list(range(3, 40)), LONG, owner="tab"))
    await wait_until(lambda: async_engine.stats().num_running == 1)
    stats = async_engine.stats()
    assert stats.blocks_in_use > 0 and "tab" in stats.blocks.request_owners
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_shutdown_ends_open_streams(make_engine):
    engine = make_client(ClientSpec(engine=make_engine()))
    task = asyncio.create_task(collect(engine, [5, 6, 7], LONG))
    await wait_until(lambda: engine.stats().num_running == 1)
    await asyncio.get_running_loop().run_in_executor(None, engine.shutdown)
    with pytest.raises(EngineDeadError):
        await asyncio.wait_for(task, 30)
    with pytest.raises(EngineDeadError):
        await collect(engine, [5])


def test_requests_that_come_together_start_in_one_step(make_engine):
    """Tabs that send at once reach an idle engine ms apart (each encodes and stores its
    prompt first). The loop gathers them into its first step, one prefill for them all; it
    stepped on the first alone, and the others waited for that whole step."""
    engine = make_engine()
    arriving = [[Add(f"r{index}", [5 + index, 6, 7, 8], SHORT, None)] for index in range(1, 4)]
    first_step: list[list[str]] = []

    def receive(block: bool) -> list:
        if block:
            return [Shutdown("done")] if first_step else [Add("r0", [5, 6, 7, 8], SHORT, None)]
        return arriving.pop(0) if arriving else []

    class Events:
        def on_outputs(self, outputs) -> None:
            if not first_step:
                first_step.append(sorted(output.request_id for output in outputs))

        def on_stats(self, stats) -> None:
            pass

    assert serve_engine(engine, receive, Events(), stats_interval_s=1.0) == "done"
    assert first_step == [["r0", "r1", "r2", "r3"]]


def test_the_engine_thread_wins_the_gil_back_quickly(make_engine):
    """Python's default switch interval (5 ms) would let a busy event loop hold the engine
    thread off that long after every torch op; the engine lowers it, and never raises it."""
    default = sys.getswitchinterval()
    try:
        sys.setswitchinterval(0.005)
        engine = make_client(ClientSpec(engine=make_engine()))
        assert sys.getswitchinterval() == pytest.approx(GIL_SWITCH_INTERVAL_S)
        engine.shutdown()
        sys.setswitchinterval(GIL_SWITCH_INTERVAL_S / 2)
        engine.restart()
        assert sys.getswitchinterval() == pytest.approx(GIL_SWITCH_INTERVAL_S / 2)
        engine.shutdown()
    finally:
        sys.setswitchinterval(default)


async def test_a_builder_builds_the_engine_on_the_engine_thread(make_engine):
    """The engine's torch work all runs on the thread that steps it: a load on the caller's
    thread would leave an OpenMP pool there that slows every step (the module's docstring)."""
    built_on = []

    def build():
        built_on.append(threading.current_thread())
        return make_engine()

    engine = make_client(ClientSpec(engine=build))
    try:
        assert built_on[0].name == "paged-chat-engine" and built_on[0] is not threading.current_thread()
        assert (await asyncio.wait_for(collect(engine, [5, 6, 7]), 30))[-1].finished
    finally:
        engine.shutdown()


def test_a_builders_error_is_raised_to_the_caller():
    def build():
        raise FileNotFoundError("no model at /nowhere")

    with pytest.raises(FileNotFoundError, match="no model at /nowhere"):
        make_client(ClientSpec(engine=build))
