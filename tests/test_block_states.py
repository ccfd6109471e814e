"""The block map kept incrementally: a snapshot costs the blocks that changed, not the pool's
size, and the map rebuilt from the stream of changes (as the process transport's reader
rebuilds it for the TUI) is the pool's true state."""

from __future__ import annotations

import pickle
import random
import timeit

import numpy as np
import pytest
from tiny_models import build_tiny_model

from paged_chat.engine import EngineConfig, SamplingParams
from paged_chat.engine.clients.process_transport import _Stats
from paged_chat.engine.core.block_states import BlockStates
from paged_chat.engine.core.request import Request
from paged_chat.engine.core.scheduler import Scheduler
from paged_chat.engine.core.stats import BlockMap, StepMetrics, snapshot
from paged_chat.engine.kv.block_pool import BlockPool
from paged_chat.engine.kv.kv_cache_manager import KVCacheManager
from paged_chat.tui.block_map import block_codes

H200_POOL = 350_000     # the default model's blocks on an H200 at 0.9


def true_state(pool: BlockPool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per cell, read off every block: ref counts, hashed, KV read back from the tier."""
    return (np.array([block.ref_count for block in pool.blocks], dtype=np.int32),
            np.array([block.block_hash is not None for block in pool.blocks]),
            np.array([block.from_tier for block in pool.blocks]))


def busy_scheduler(num_blocks: int, num_requests: int = 64, length: int = 1000) -> Scheduler:
    """A scheduler over a pool of `num_blocks` with `num_requests` requests holding their
    prompts' blocks, and one snapshot taken (the stream's first changes are behind it)."""
    kv_cache = KVCacheManager(num_blocks, 16, enable_caching=True)
    scheduler = Scheduler(kv_cache, 256, 8192)
    for index in range(num_requests):
        request = Request(f"r{index}", list(range(index, index + length)), SamplingParams(), 0, 0.0)
        assert kv_cache.allocate(request, length)
        request.num_computed_tokens = length
        scheduler.requests[request.request_id] = request
    snapshot(num_blocks, scheduler, StepMetrics(), 0.0)
    return scheduler


def decode_step(scheduler: Scheduler) -> None:
    """A decode step's bookkeeping: each request one token more."""
    for request in scheduler.requests.values():
        request.all_token_ids.append(7)
        assert scheduler.kv_cache.allocate(request, 1)
        request.num_computed_tokens += 1


def snapshot_cost_s(num_blocks: int) -> float:
    """The least time, over 20 decode steps, of the snapshot after one."""
    scheduler, metrics = busy_scheduler(num_blocks), StepMetrics()
    return min(timeit.repeat(lambda: snapshot(num_blocks, scheduler, metrics, 0.0),
                             setup=lambda: decode_step(scheduler), number=1, repeat=20))


@pytest.mark.perf
def test_stats_of_an_h200_sized_pool_cost_at_most_2_ms(tmp_path, smollm2_source, new_engine):
    """`Engine.stats()` after a decode step of 64 requests, on a pool of 350k blocks (a
    one-layer model with one KV head of 8 dimensions: 1 KiB a block)."""
    folder = tmp_path / "narrow-llama"
    build_tiny_model("llama", folder, num_heads=2, num_kv_heads=1, head_dim=8, num_layers=1)
    smollm2_source.tokenizer.save_pretrained(folder)
    engine = new_engine(EngineConfig(model=str(folder), device="cpu", dtype="float32",
                                     num_blocks=H200_POOL, block_size=16, max_num_seqs=64,
                                     max_num_batched_tokens=8192, attention_backend="torch"))
    for index in range(64):
        engine.add_request(list(range(3 + index, 303 + index)),
                           SamplingParams(temperature=0, max_tokens=100, ignore_eos=True))
    engine.step()   # the prefill
    cost = min(timeit.repeat(engine.stats, setup=engine.step, number=1, repeat=20))
    engine.abort_all()
    assert cost <= 0.002, f"{cost * 1e3:.2f} ms"


def test_a_snapshot_costs_about_the_same_whatever_the_pools_size():
    """A decode step's snapshot of 350k blocks against one of 7,000 (the same requests): it
    walked every block before (50x), now it copies three arrays (~0.03 ms at 350k)."""
    small, large = snapshot_cost_s(H200_POOL // 50), snapshot_cost_s(H200_POOL)
    assert large <= 3 * small + 0.001, f"{large * 1e3:.2f} ms at 350k, {small * 1e3:.2f} ms at 7k"


def test_a_snapshot_carries_only_the_blocks_that_changed():
    scheduler = busy_scheduler(H200_POOL, num_requests=8, length=32)   # 2 full blocks each
    decode_step(scheduler)   # the 33rd token: a third block each
    stats = snapshot(H200_POOL, scheduler, StepMetrics(), 0.0)
    assert len(stats.block_changes) == 8
    assert stats.blocks_in_use == 24 and stats.blocks_cached == 0


def rebuilt_over_the_pipe(stats, states: BlockStates):
    """The snapshot as the process transport's reader rebuilds it from what crosses."""
    sent = pickle.loads(pickle.dumps(_Stats.of(stats)))
    assert len(sent.stats.blocks.ref_counts) == 0, "the per-block arrays crossed the pipe"
    return sent.restore(states)


def test_the_map_rebuilt_from_the_stream_is_the_pools_true_state(make_engine):
    """Allocations, frees, prefix hits, evictions, preemptions and blocks read back from the
    host tier, step by step: after each snapshot the map rebuilt from the changes alone has
    the pool's state and draws as the engine's own map draws."""
    engine = make_engine(num_blocks=24, block_size=8, max_num_seqs=8,
                         kv_tier_host_bytes="1MiB", kv_tier_disk_bytes=0)
    pool = engine.kv_cache.pool
    states = BlockStates(engine.num_blocks)
    rng = random.Random(3)
    shared = [rng.randrange(3, 512) for _ in range(40)]
    prompts = [shared + [rng.randrange(3, 512) for _ in range(rng.randrange(1, 30))]
               for _ in range(6)] + [[rng.randrange(3, 512) for _ in range(60)] for _ in range(4)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    seen = set()

    def check() -> None:
        stats = engine.stats()
        rebuilt = rebuilt_over_the_pipe(stats, states)
        ref, cached, from_tier = true_state(pool)
        blocks = rebuilt.blocks
        assert np.array_equal(blocks.ref_counts, ref)
        assert np.array_equal(blocks.cached, cached)
        assert np.array_equal(blocks.from_tier, from_tier)
        assert rebuilt.blocks_in_use == np.count_nonzero(ref) == blocks.num_in_use
        assert rebuilt.blocks_cached == np.count_nonzero(cached & (ref == 0)) == blocks.num_cached
        tables = {rid: [block.block_id - 1 for block in table]
                  for rid, table in engine.kv_cache.tables.items()}
        truth = BlockMap.build(ref, cached, tables,
                               {rid: engine.requests[rid].owner for rid in tables}, from_tier,
                               engine.kv_cache.num_released)
        owners = {f"tab{index}": index for index in range(3)}
        assert np.array_equal(block_codes(blocks, owners), block_codes(truth, owners))
        cells, first_holder, count = blocks.first_holders()
        holder_count = np.diff(blocks.holder_ptr)
        assert np.array_equal(cells, np.flatnonzero(holder_count))
        assert np.array_equal(count, holder_count[cells])
        assert np.array_equal(first_holder, blocks.holders[blocks.holder_ptr[cells]])
        seen.update(name for name, happened in (
            ("evictions", stats.num_evictions), ("preemptions", stats.num_preemptions),
            ("prefix hits", stats.prefix_cache_hit_tokens), ("tier reads", stats.tier.hit_blocks),
            ("shared", (ref > 1).any())) if happened)

    check()
    for round_prompts in (prompts[:6], prompts[6:], prompts[:3]):
        for index, prompt in enumerate(round_prompts):
            engine.add_request(prompt, params, owner=f"tab{index % 3}")
        while engine.has_unfinished():
            engine.step()
            check()
    engine.abort_all()
    check()
    assert seen == {"evictions", "preemptions", "prefix hits", "tier reads", "shared"}
