"""Faults and cancel storms: whatever fails or is cancelled, and wherever it is, only that
request ends, nothing leaks, nothing deadlocks, and the engine keeps serving.

Every engine here comes from `make_engine`, which checks at teardown that no block is left
in use and that the pool's invariants hold.
"""

from __future__ import annotations

import asyncio
import contextlib
import random

import pytest
import torch
from helpers import (
    GREEDY,
    client_processor,
    engine_thread_idle,
    generate,
    phase_of,
    random_prompts,
    step_as_a_client,
    wait_until,
)

from paged_chat.engine import (
    ClientSpec,
    Engine,
    EngineDeadError,
    LocalClient,
    PagedChatError,
    SamplingParams,
    make_client,
)
from paged_chat.engine.kv.pool_sizing import KVCacheSpec
from paged_chat.engine.worker.runner import ModelRunner

pytestmark = pytest.mark.timeout(300)

SHORT = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
MARK = 7  # a top_k no other request uses: the sampling fault below picks its row by it


def run_to_end(engine: Engine, check_every_step: bool = True) -> dict:
    """Step until idle; the final output of every request that finished meanwhile."""
    final = {}
    while engine.has_unfinished():
        final.update((out.request_id, out) for out in step_as_a_client(engine) if out.finished)
        if check_every_step:
            engine.kv_cache.check_invariants()
    return final


def fail_one_step(engine: Engine) -> None:
    """Run one step whose forward raises; the runner works again afterwards."""
    execute = engine.runner.execute

    def broken(*args, **kwargs):
        raise RuntimeError("injected forward fault")

    engine.runner.execute = broken
    try:
        with pytest.raises(RuntimeError, match="injected forward fault"):
            engine.step()
    finally:
        engine.runner.execute = execute


def alone(make_engine, prompts, params=GREEDY) -> list[list[int]]:
    engine = make_engine(max_num_seqs=1)
    return [engine.generate([prompt], params)[0].token_ids for prompt in prompts]


def step_until(engine: Engine, condition, limit: int = 500) -> None:
    for _ in range(limit):
        if condition():
            return
        step_as_a_client(engine)
        engine.kv_cache.check_invariants()
    raise AssertionError("the state never came up")


# ---- aborts wherever the request is -------------------------------------------------


def test_abort_mid_chunked_prefill(make_engine):
    engine = make_engine(max_num_batched_tokens=32)
    keep_prompt, long_prompt = random_prompts(2, seed=10, low=20, high=200)
    keep = engine.add_request(keep_prompt, GREEDY)
    drop = engine.add_request(long_prompt + long_prompt, GREEDY)
    step_until(engine, lambda: engine.requests[drop].num_computed_tokens > 0)
    assert phase_of(engine.requests[drop]) == "prefilling"
    engine.abort(drop)
    final = run_to_end(engine)
    assert final[drop].finish_reason == "abort" and final[drop].token_ids == []
    assert final[keep].token_ids == alone(make_engine, [keep_prompt])[0]


def test_abort_while_preempted(make_engine):
    engine = make_engine(num_blocks=24, block_size=8)
    prompts = random_prompts(6, seed=11, low=30, high=60)
    ids = [engine.add_request(prompt, GREEDY) for prompt in prompts]
    preempted = lambda: [r for r in engine.requests.values() if phase_of(r) == "preempted"]  # noqa: E731
    step_until(engine, lambda: preempted())
    victim = preempted()[0].request_id
    engine.abort(victim)
    final = run_to_end(engine)
    assert final[victim].finish_reason == "abort"
    expected = alone(make_engine, prompts)
    for request_id, prompt_expected in zip(ids, expected):
        if request_id != victim:
            assert final[request_id].token_ids == prompt_expected


def test_abort_while_waiting_and_odd_aborts(make_engine):
    engine = make_engine(max_num_seqs=1)
    first, waiting, later = (engine.add_request([5 + i, 6, 7], SHORT) for i in range(3))
    engine.abort(later)  # before any step
    final = {out.request_id: out for out in step_as_a_client(engine) if out.finished}
    assert phase_of(engine.requests[waiting]) == "waiting"
    assert engine.kv_cache.block_ids(waiting) == []
    engine.abort(waiting)
    engine.abort(waiting)  # twice: ignored
    final.update(run_to_end(engine))
    assert [final[r].finish_reason for r in (first, waiting, later)] == ["length", "abort", "abort"]
    engine.abort(first)  # finished: ignored
    assert not engine.has_unfinished() and engine.stats().blocks_in_use == 0


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_abort_storm(make_engine, seed):
    """Aborts rain on a small pool with chunked prefill and shared prefixes; every phase is
    hit, the pool is consistent after every step, and the survivors' greedy replies are
    those of the same requests run alone."""
    rng = random.Random(seed)
    engine = make_engine(num_blocks=40, block_size=8, max_num_batched_tokens=24)
    system = random_prompts(1, seed=seed, low=40, high=41)[0]
    prompts = [system + p for p in random_prompts(24, seed=seed + 100, low=3, high=100)]
    ids = {engine.add_request(prompt, GREEDY): prompt for prompt in prompts}
    aborted_in: dict[str, str] = {}
    final = {}
    while engine.has_unfinished():
        for request_id, request in list(engine.requests.items()):
            if rng.random() < 0.05:
                aborted_in[request_id] = phase_of(request)
                engine.abort(request_id)
        final.update((out.request_id, out) for out in step_as_a_client(engine) if out.finished)
        engine.kv_cache.check_invariants()
    assert {"waiting", "prefilling", "decoding"} <= set(aborted_in.values())
    survivors = [rid for rid in ids if rid not in aborted_in]
    assert all(final[rid].finish_reason == "abort" for rid in aborted_in)
    expected = alone(make_engine, [ids[rid] for rid in survivors])
    assert [final[rid].token_ids for rid in survivors] == expected


def test_aborts_land_while_preempted_in_a_storm(make_engine):
    """The preempted phase is the rarest one: abort every request as soon as it is preempted."""
    engine = make_engine(num_blocks=24, block_size=8)
    ids = [engine.add_request(p, GREEDY) for p in random_prompts(10, seed=12, low=30, high=60)]
    aborted = []
    while engine.has_unfinished():
        for request in list(engine.requests.values()):
            if phase_of(request) == "preempted":
                aborted.append(request.request_id)
                engine.abort(request.request_id)
        step_as_a_client(engine)
        engine.kv_cache.check_invariants()
    assert len(aborted) >= 2 and set(aborted) <= set(ids)


# ---- cancel storms through a thread client ------------------------------------------


@pytest.fixture
def storm_engine(make_engine):
    engine = make_client(ClientSpec(engine=make_engine(num_blocks=32, block_size=8, max_num_batched_tokens=48),
                         stats_interval_s=0.01))
    yield engine
    engine.shutdown()


async def wait_idle(engine: LocalClient, timeout_s: float = 60) -> None:
    """Until every cancellation is applied; then nothing may be held."""
    await wait_until(lambda: engine_thread_idle(engine), timeout_s)
    assert not engine.transport.engine.requests and engine.transport.engine.stats().blocks_in_use == 0
    engine.transport.engine.kv_cache.check_invariants()


async def test_async_cancel_storm(storm_engine):
    """Forty streams, each cancelled at a random moment (some before the engine thread has
    even added them, some waiting, prefilling, preempted or decoding) or closed after a few
    tokens; then the engine is idle with nothing held, and serves the next stream."""
    rng = random.Random(0)
    prompts = random_prompts(40, seed=13, low=10, high=120)

    async def consume(prompt, stop_after: int) -> None:
        async with contextlib.aclosing(storm_engine.stream(prompt, GREEDY)) as stream:
            async for out in stream:
                if len(out.token_ids) >= stop_after:
                    return

    tasks = [asyncio.create_task(consume(p, rng.randrange(1, 30))) for p in prompts]
    for task in tasks:
        if rng.random() < 0.7:
            asyncio.get_running_loop().call_later(rng.uniform(0, 0.5), task.cancel)
    await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 120)
    await wait_idle(storm_engine)
    assert not storm_engine._streams
    final = await asyncio.wait_for(generate(storm_engine, [5, 6, 7], SHORT), 60)
    assert final.finish_reason == "length" and len(final.token_ids) == 8


async def test_streams_of_a_closed_event_loop_are_aborted(storm_engine):
    """An app that exits mid-stream never runs its streams' cleanup: the engine aborts what
    their closed loop left behind instead of generating for nobody."""
    def open_and_abandon():
        loop = asyncio.new_event_loop()
        stream = storm_engine.stream([5, 6, 7], SamplingParams(max_tokens=400, ignore_eos=True))
        loop.run_until_complete(stream.__anext__())
        loop.close()
        return stream  # kept alive: no finalizer may clean up behind the engine's back

    abandoned = await asyncio.get_running_loop().run_in_executor(None, open_and_abandon)
    await wait_idle(storm_engine)
    assert not storm_engine._streams
    del abandoned


# ---- one request's fault ends that request alone ------------------------------------


def test_sampling_fault_fails_only_that_request(make_engine, monkeypatch):
    import paged_chat.engine.worker.runner as runner

    sample = runner.sample

    def faulty_sample(logits, batch):
        if batch.top_k is not None and bool((batch.top_k == MARK).any()):
            raise RuntimeError("injected sampling fault")
        return sample(logits, batch)

    monkeypatch.setattr(runner, "sample", faulty_sample)
    engine = make_engine()
    prompts = random_prompts(5, seed=14)
    ids = [engine.add_request(p, GREEDY) for p in prompts]
    bad = engine.add_request([5, 6, 7], SamplingParams(top_k=MARK, seed=1))
    final = run_to_end(engine)
    assert final[bad].finish_reason == "error" and "injected sampling fault" in final[bad].error
    assert [final[rid].token_ids for rid in ids] == alone(make_engine, prompts)


@pytest.mark.parametrize("sampling_kernel", [False, True], ids=["torch", "kernel"])
@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_non_finite_logits_fail_only_that_request(make_engine, monkeypatch, value,
                                                  sampling_kernel):
    """NaN probabilities would draw an id past the vocabulary, and the next forward of the
    whole batch would fail on it: the row is failed instead, greedy or sampled, by the
    torch ops on the host or the sampling kernel on the device path."""
    bad_ids: set[str] = set()
    original = ModelRunner._sample

    def poisoned(self, logits, samplers):
        rows = [i for i, item in enumerate(samplers) if item.request.request_id in bad_ids]
        logits = logits.clone()
        logits[rows] = value
        return original(self, logits, samplers)

    monkeypatch.setattr(ModelRunner, "_sample", poisoned)
    engine = make_engine()
    if sampling_kernel:
        pytest.importorskip("triton", reason="the sampling kernel needs the triton package")
        engine.runner.sample_on_host = False
        engine.runner.sampling_kernel = True
    prompts = random_prompts(4, seed=15)
    ids = [engine.add_request(p, GREEDY) for p in prompts]
    bad_ids.update((engine.add_request([5, 6, 7], GREEDY),
                    engine.add_request([8, 9], SamplingParams(temperature=1.0, seed=3))))
    final = run_to_end(engine)
    for request_id in bad_ids:
        assert final[request_id].finish_reason == "error"
        assert "not finite" in final[request_id].error
    assert [final[rid].token_ids for rid in ids] == alone(make_engine, prompts)


def test_detokenizer_fault_fails_only_that_request(make_engine):
    engine = make_engine()
    prompts = random_prompts(4, seed=16)
    ids = [engine.add_request(p, GREEDY) for p in prompts]
    bad = engine.add_request([5, 6, 7], GREEDY)
    first = {out.request_id: out for out in step_as_a_client(engine)}
    fed = len(first[bad].token_ids) if bad in first else 0
    detokenizer = client_processor(engine)._states[bad].detokenizer
    add_token = detokenizer.add_token
    calls = []

    def faulty(token_id):
        calls.append(token_id)
        if fed + len(calls) == 3:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected detokenizer fault")
        return add_token(token_id)

    detokenizer.add_token = faulty
    final = first | run_to_end(engine)
    assert final[bad].finish_reason == "error" and "injected detokenizer fault" in final[bad].error
    assert len(final[bad].token_ids) == 3
    assert [final[rid].token_ids for rid in ids] == alone(make_engine, prompts)


# ---- a failed step ------------------------------------------------------------------


def test_failed_forward_leaves_the_engine_consistent_and_a_retry_completes(make_engine):
    """The scheduler indexes blocks before the forward writes them: after a failed forward
    that index is dropped, the requests keep their places, and stepping again finishes them
    with the replies they would have had."""
    engine = make_engine(max_num_batched_tokens=64)
    system = random_prompts(1, seed=17, low=60, high=61)[0]
    prompts = [system + p for p in random_prompts(4, seed=18)]
    ids = [engine.add_request(p, GREEDY) for p in prompts]
    step_as_a_client(engine)
    fail_one_step(engine)
    assert not engine.kv_cache.pool.cached_blocks
    engine.kv_cache.check_invariants()
    final = run_to_end(engine)
    assert [final[rid].token_ids for rid in ids] == alone(make_engine, prompts)


async def test_failed_step_ends_streams_in_every_phase_and_serving_resumes(make_engine):
    engine = make_client(ClientSpec(engine=make_engine(max_num_seqs=2, max_num_batched_tokens=32),
                         stats_interval_s=0.01))
    try:
        runner = engine.transport.engine.runner
        execute = runner.execute
        calls = 0

        def fails_on_the_fourth_step(*args, **kwargs):
            nonlocal calls
            calls += 1
            if calls == 4:
                raise RuntimeError("injected forward fault")
            return execute(*args, **kwargs)

        runner.execute = fails_on_the_fourth_step
        prompts = random_prompts(5, seed=19, low=60, high=120)  # decoding, prefilling, waiting
        results = await asyncio.wait_for(asyncio.gather(
            *(generate(engine, p, GREEDY) for p in prompts), return_exceptions=True), 60)
        assert all(isinstance(r, EngineDeadError) and "injected forward fault" in str(r)
                   for r in results)
        await wait_idle(engine)
        assert engine.running and "injected forward fault" in engine.last_error
        runner.execute = execute
        expected = alone(make_engine, prompts[:2])
        finals = await asyncio.wait_for(asyncio.gather(
            *(generate(engine, p, GREEDY) for p in prompts[:2])), 60)
        assert [f.token_ids for f in finals] == expected
    finally:
        engine.shutdown()


# ---- restart ------------------------------------------------------------------------


async def test_a_crashed_engine_thread_says_so_and_restarts(make_engine):
    """An error outside a step (an engine bug) stops the thread, loudly: open streams end,
    new ones are refused with the reason, and restart() serves again on the same engine."""
    engine = make_client(ClientSpec(engine=make_engine(), stats_interval_s=0.01))
    try:
        core = engine.transport.engine
        stats = core.stats
        crash = True

        def crashing_stats():
            if crash:
                raise RuntimeError("injected engine bug")
            return stats()

        core.stats = crashing_stats
        with pytest.raises(EngineDeadError, match="internal error.*injected engine bug"):
            await asyncio.wait_for(generate(engine, [5, 6, 7], GREEDY), 30)
        assert not engine.running
        with pytest.raises(EngineDeadError, match="injected engine bug"):
            await generate(engine, [5, 6, 7], GREEDY)
        crash = False
        await asyncio.get_running_loop().run_in_executor(None, engine.restart)
        assert engine.running and engine.transport.engine is core and engine.last_error is None
        final = await asyncio.wait_for(generate(engine, [5, 6, 7], SHORT), 30)
        assert final.finish_reason == "length"
    finally:
        engine.shutdown()


async def test_restart_ends_open_streams_and_rebuilds_an_engine_it_cannot_reset(make_engine):
    engine = make_client(ClientSpec(engine=make_engine(), stats_interval_s=0.01))
    try:
        old = engine.transport.engine
        task = asyncio.create_task(generate(engine, [5, 6, 7], SamplingParams(max_tokens=1000,
                                                                             ignore_eos=True)))
        while engine.stats().num_running == 0:
            await asyncio.sleep(0.01)

        def cannot_reset():
            raise AssertionError("injected inconsistency")

        reset = old.reset
        old.reset = cannot_reset  # the engine thread's own reset on shutdown fails too
        await asyncio.get_running_loop().run_in_executor(None, engine.restart)
        with pytest.raises(EngineDeadError):
            await asyncio.wait_for(task, 30)
        assert engine.running and engine.transport.engine is not old
        final = await asyncio.wait_for(generate(engine, [5, 6, 7], SHORT), 30)
        assert final.finish_reason == "length"
        reset()  # leave the old engine clean for make_engine's teardown check
    finally:
        engine.shutdown()


async def test_restart_after_shutdown(make_engine):
    engine = make_client(ClientSpec(engine=make_engine()))
    engine.shutdown()
    with pytest.raises(EngineDeadError, match="shut down"):
        await generate(engine, [5], SHORT)
    await asyncio.get_running_loop().run_in_executor(None, engine.restart)
    assert (await asyncio.wait_for(generate(engine, [5, 6], SHORT), 30)).finish_reason == "length"
    engine.shutdown()


# ---- memory -------------------------------------------------------------------------


@pytest.mark.parametrize("budget", [200_000, "1MiB", "3MB"])
def test_the_kv_cache_stays_within_its_budget(make_engine, budget):
    engine = make_engine(num_blocks=None, kv_cache_memory=budget)
    limit = engine.config.kv_cache_memory
    per_block = KVCacheSpec(engine.model_config.num_layers, engine.block_size,
                            engine.runner.attention, engine.dtype, engine.device).bytes_per_block
    kv_cache = engine.runner.kv_cache
    assert limit - per_block < kv_cache.nbytes <= limit
    assert kv_cache.nbytes == (engine.num_blocks + 1) * per_block  # and the null block
    engine.generate(random_prompts(8, seed=20), GREEDY)
    assert engine.runner.kv_cache is kv_cache  # allocated once, never grown


def test_out_of_memory_at_start_up_names_the_setting_to_lower(make_engine, monkeypatch):
    def out_of_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")

    with monkeypatch.context() as patch:
        patch.setattr("paged_chat.engine.worker.model_loading.load_model", out_of_memory)
        with pytest.raises(PagedChatError, match="loading the weights.*smaller model or dtype"):
            make_engine()
    with monkeypatch.context() as patch:
        patch.setattr("paged_chat.engine.worker.runner.size_kv_pool", out_of_memory)
        with pytest.raises(PagedChatError, match="lower max_num_batched_tokens"):
            make_engine(num_blocks=None)
    def kv_out_of_memory(nbytes):   # what mapping the CPU pool raises when the kernel refuses
        raise MemoryError(f"cannot map {nbytes} bytes: Cannot allocate memory")

    with monkeypatch.context() as patch:
        patch.setattr("paged_chat.engine.kv.pool_sizing.zeroed_host_memory", kv_out_of_memory)
        with pytest.raises(PagedChatError, match="allocating the KV cache.*lower num_blocks"):
            make_engine(num_blocks=64)
        with pytest.raises(PagedChatError, match="lower kv_cache_memory"):
            make_engine(num_blocks=None, kv_cache_memory="1MiB")


def test_a_kv_cache_larger_than_the_machine_is_refused(make_engine):
    with pytest.raises(PagedChatError, match="larger than this machine's.*lower num_blocks"):
        make_engine(num_blocks=10**9)


def test_outputs_due_before_a_failed_step_are_still_delivered(make_engine):
    engine = make_engine()
    dropped = engine.add_request([5, 6, 7], SamplingParams(temperature=0, max_tokens=8))
    kept = engine.add_request([8, 9], SamplingParams(temperature=0, max_tokens=8))
    step_as_a_client(engine)
    engine.abort(dropped)
    fail_one_step(engine)
    finished = run_to_end(engine)
    assert {rid: out.finish_reason for rid, out in finished.items()} == {dropped: "abort", kept: "length"}
