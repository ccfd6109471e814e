"""Request priority on a real (tiny) engine: a request added at a higher priority runs
ahead of lower ones already running, preempting one for its seat, and never the reverse;
greedy output does not depend on it; the clients carry the priority to the engine and move
a request in flight."""

from __future__ import annotations

import asyncio
from contextlib import aclosing

import pytest
from helpers import assert_no_leaks, engine_config, wait_until

from paged_chat.engine import ClientSpec, SamplingParams, make_client

LONG = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
SHORT = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


def prompt(seed: int) -> list[int]:
    return [seed + 2, 3 + seed % 5, 7, 11, 13 + seed, 17, 19]


def finished_order(engine, first_outputs: list) -> tuple[list[str], dict[str, list[int]]]:
    """Step until every request finished; their ids in the order they finished, and their
    tokens from `first_outputs` (a step's, already taken) on."""
    order, tokens = [], {}
    outputs = first_outputs
    while True:
        for output in outputs:
            tokens.setdefault(output.request_id, []).extend(output.new_token_ids)
            if output.finished:
                order.append(output.request_id)
        if not engine.has_unfinished():
            return order, tokens
        outputs = engine.step()


def test_a_higher_priority_request_takes_a_seat_from_a_lower_one_and_finishes_first(make_engine):
    engine = make_engine(max_num_seqs=2)
    alone = make_engine(max_num_seqs=2)
    expected = alone.generate([prompt(9)], SHORT)[0].token_ids
    for index in range(2):
        engine.add_request(prompt(index), LONG, f"background-{index}", priority=1)
    engine.step()
    engine.step()
    engine.add_request(prompt(9), SHORT, "shown", priority=0)
    outputs = engine.step()
    assert engine.requests["shown"].num_computed_tokens > 0   # it joined at once
    assert engine.stats().num_preemptions == 1

    order, tokens = finished_order(engine, outputs)
    assert order[0] == "shown"
    assert tokens["shown"] == expected    # greedy output does not depend on the priority
    assert_no_leaks(engine)


def test_a_lower_priority_request_waits_for_a_seat_and_preempts_nobody(make_engine):
    engine = make_engine(max_num_seqs=2)
    for index in range(2):
        engine.add_request(prompt(index), LONG, f"shown-{index}", priority=0)
    engine.step()
    engine.add_request(prompt(9), SHORT, "background", priority=1)
    outputs = engine.step()
    assert engine.requests["background"].num_computed_tokens == 0
    order, _ = finished_order(engine, outputs)
    assert order[-1] == "background" and engine.stats().num_preemptions == 0


def test_engine_refuses_a_priority_that_is_no_integer(make_engine):
    engine = make_engine()
    for bad in (1.5, "1", True):
        with pytest.raises(ValueError, match="priority"):
            engine.add_request(prompt(1), SHORT, priority=bad)
    assert not engine.has_unfinished()


async def test_the_local_client_carries_the_priority_and_moves_a_request_in_flight(make_async_engine):
    client = make_async_engine()
    assert client.capabilities.reprioritize
    engine = client.transport.engine
    params = SamplingParams(temperature=0.0, max_tokens=1000, ignore_eos=True)
    async with aclosing(client.stream(prompt(3), params, request_id="chat/1", priority=3)) as stream:
        reading = asyncio.ensure_future(anext(stream))
        await wait_until(lambda: "chat/1" in engine.requests, what="the request in the engine")
        assert engine.requests["chat/1"].priority == 3
        client.reprioritize("chat/1", -1)
        await wait_until(lambda: "chat/1" not in engine.requests
                         or engine.requests["chat/1"].priority == -1, what="the new priority")
        assert engine.requests["chat/1"].priority == -1
        await reading
    with pytest.raises(ValueError, match="priority"):
        client.reprioritize("chat/1", 0.5)


async def test_a_process_client_carries_priorities_across_the_pipe(chat_model_dir):
    """One seat: a request sent at a higher priority, or raised while it waits, takes the
    seat of the running one in the child and finishes first."""
    client = make_client(ClientSpec("process", engine_config(chat_model_dir, max_num_seqs=1),
                                    stats_interval_s=0.01))
    finished: list[str] = []

    async def run(request_id: str, params: SamplingParams, priority: int) -> None:
        async for _ in client.stream(prompt(len(finished) + 3), params, request_id=request_id,
                                     priority=priority):
            pass
        finished.append(request_id)

    try:
        longest = SamplingParams(temperature=0.0, max_tokens=1000, ignore_eos=True)
        background = asyncio.ensure_future(run("background", longest, 1))
        await wait_until(lambda: client.stats().num_running == 1, what="the background request")
        await asyncio.wait_for(run("shown", SHORT, 0), 60)
        waiting = asyncio.ensure_future(run("waiting", SHORT, 1))
        await asyncio.sleep(0)   # its task sends its Add: the Reprioritize goes after it
        client.reprioritize("waiting", -1)
        await asyncio.wait_for(waiting, 60)
        assert finished == ["shown", "waiting"] and not background.done()
        background.cancel()
        await wait_until(lambda: client.stats().num_running == 0, what="the background aborted")
    finally:
        client.shutdown()
