"""Block pool and KV cache manager: invariants under random operations, LRU eviction."""

from __future__ import annotations

from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st

from paged_chat.engine.core.block_states import BlockStates
from paged_chat.engine.core.request import Request
from paged_chat.engine.core.sampling_params import SamplingParams
from paged_chat.engine.kv.block_pool import NULL_BLOCK, BlockPool
from paged_chat.engine.kv.kv_cache_manager import KVCacheManager

BLOCK_SIZE = 4


def make_request(request_id: str, tokens: list[int]) -> Request:
    return Request(request_id, list(tokens), SamplingParams(), 0, 0.0)


def check(manager: KVCacheManager, live: dict[str, Request]) -> None:
    pool = manager.pool
    pool.check_invariants()
    holders = Counter(block.block_id for table in manager.tables.values() for block in table)
    for block in pool.blocks:
        assert block.ref_count == holders[block.block_id], "ref count != tables holding it"
    for request_id, table in manager.tables.items():
        request = live[request_id]
        assert len(table) == manager.blocks_needed(request.num_computed_tokens)
        for index, block in enumerate(table):
            full = (index + 1) * BLOCK_SIZE <= request.num_computed_tokens
            if block.block_hash is not None:
                assert full, "only full blocks carry a hash"
                assert block.block_hash == request.block_hashes[index]


def check_block_states(manager: KVCacheManager, states: BlockStates) -> None:
    """The pool's changes since the last check, applied, give its state block by block."""
    states.apply(manager.pool.take_changes())
    blocks = manager.pool.blocks
    assert states.ref_counts.tolist() == [block.ref_count for block in blocks]
    assert states.cached.tolist() == [block.block_hash is not None for block in blocks]
    assert states.from_tier.tolist() == [block.from_tier for block in blocks]
    assert states.num_in_use == sum(block.ref_count > 0 for block in blocks)
    assert states.num_cached == sum(block.ref_count == 0 and block.block_hash is not None
                                    for block in blocks)


operations = st.lists(st.tuples(
    st.sampled_from(["add", "append", "fork", "free", "reset"]),
    st.integers(0, 7),
    st.lists(st.integers(0, 3), min_size=1, max_size=9)), max_size=60)


@settings(max_examples=150, deadline=None)
@given(operations, st.booleans())
def test_random_operations_keep_the_invariants(ops, caching):
    manager = KVCacheManager(num_blocks=12, block_size=BLOCK_SIZE, enable_caching=caching)
    states = BlockStates(12)
    live: dict[str, Request] = {}
    counter = 0

    def admit(request: Request) -> None:
        prefix = manager.find_cached_prefix(request)
        cached = len(prefix) * BLOCK_SIZE
        if manager.allocate(request, request.num_tokens - cached, prefix):
            request.num_computed_tokens = request.num_tokens
            live[request.request_id] = request

    for op, pick, tokens in ops:
        names = sorted(live)
        if op == "add":
            counter += 1
            admit(make_request(f"r{counter}", tokens))
        elif op == "fork" and names:
            counter += 1
            parent = live[names[pick % len(names)]]
            admit(make_request(f"r{counter}", parent.all_token_ids))
        elif op == "append" and names:
            request = live[names[pick % len(names)]]
            request.all_token_ids.extend(tokens)
            if manager.allocate(request, len(tokens)):
                request.num_computed_tokens = request.num_tokens
            else:
                del request.all_token_ids[request.num_computed_tokens:]
        elif op == "free" and names:
            manager.free(live.pop(names[pick % len(names)]))
        elif op == "reset":
            manager.reset_prefix_cache()
        check(manager, live)
        if pick % 2:   # a snapshot now and then: the changes add up over several operations
            check_block_states(manager, states)
    for request in list(live.values()):
        manager.free(request)
    check(manager, {})
    check_block_states(manager, states)
    assert manager.pool.num_free_blocks == 12, "a block leaked"


def test_prefix_hit_reuses_blocks_and_always_leaves_the_last_token():
    manager = KVCacheManager(num_blocks=16, block_size=BLOCK_SIZE, enable_caching=True)
    first = make_request("a", list(range(12)))
    assert manager.allocate(first, 12)
    first.num_computed_tokens = 12
    manager.free(first)
    same = make_request("b", list(range(12)))
    hits = manager.find_cached_prefix(same)
    assert len(hits) == 2, "a fully cached prompt still recomputes its last token"
    longer = make_request("c", list(range(12)) + [99])
    assert manager.find_cached_prefix(longer)[:2] == hits
    assert len(manager.find_cached_prefix(longer)) == 3
    other = make_request("d", [5] + list(range(1, 12)))
    assert manager.find_cached_prefix(other) == [], "hashes cover the whole prefix"


def test_the_null_block_is_reserved():
    """Block 0 is never handed out nor counted: a pool of 4 gives blocks 1..4."""
    pool = BlockPool(num_blocks=4, enable_caching=True)
    assert pool.num_free_blocks == 4
    blocks = pool.allocate(4)
    assert sorted(block.block_id for block in blocks) == [1, 2, 3, 4]
    assert NULL_BLOCK not in blocks and pool.num_free_blocks == 0
    pool.free(blocks)
    assert [block.ref_count for block in pool.blocks] == [0] * 4
    assert not pool.cached_blocks and all(block.block_hash is None for block in pool.blocks)
    pool.check_invariants()


def test_eviction_is_lru_and_lazy():
    pool = BlockPool(num_blocks=4, enable_caching=True)
    blocks = pool.allocate(4)
    for index, block in enumerate(blocks):
        pool.cache(block, bytes([index]) * 16)
    pool.free([blocks[2], blocks[0], blocks[3], blocks[1]])
    assert pool.num_free_blocks == 4 and len(pool.cached_blocks) == 4, "freeing keeps content"
    pool.touch([blocks[0]])                          # a hit revives blocks[0] from the middle
    assert pool.allocate(2) == [blocks[2], blocks[3]], "least recently freed first"
    assert pool.num_evictions == 2 and pool.lookup(bytes([1]) * 16) is blocks[1]
    pool.check_invariants()


def test_disabled_caching_never_hits():
    manager = KVCacheManager(num_blocks=8, block_size=BLOCK_SIZE, enable_caching=False)
    first = make_request("a", list(range(9)))
    assert manager.allocate(first, 9)
    manager.free(first)
    assert manager.find_cached_prefix(make_request("b", list(range(9)))) == []
    assert manager.pool.cached_blocks == {}


def test_allocate_fails_cleanly_when_the_pool_is_short():
    manager = KVCacheManager(num_blocks=2, block_size=BLOCK_SIZE, enable_caching=True)
    request = make_request("a", list(range(9)))
    assert not manager.allocate(request, 9)
    assert manager.tables == {} and manager.pool.num_free_blocks == 2


def test_block_id_rows_follow_the_tables_as_they_grow_and_go():
    """More requests than the first array has rows, tables longer than its width: each
    row holds its table's ids, zero past them, and a freed row comes back cleared."""
    manager = KVCacheManager(num_blocks=1024, block_size=BLOCK_SIZE, enable_caching=False)
    rows = manager.block_id_rows
    requests = [make_request(f"r{i}", list(range(4))) for i in range(20)]
    early = None
    for step in range(40):  # past the first width (16 blocks) and the second
        for request in requests:
            assert manager.allocate(request, BLOCK_SIZE)
            request.num_computed_tokens += BLOCK_SIZE
        if step == 5:
            early, early_ids = rows.of("r3"), manager.block_ids("r3")
    assert early.tolist() == early_ids, "a view keeps its ids when the array grows"
    for request in requests:
        assert rows.of(request.request_id).tolist() == manager.block_ids(request.request_id)
    manager.check_invariants()
    short = make_request("short", list(range(4)))
    manager.free(requests[0])
    assert manager.allocate(short, 2 * BLOCK_SIZE)
    array = rows.array(["short", "r1"])
    assert array.shape == (2, len(manager.block_ids("r1")))
    assert array[0].tolist() == manager.block_ids("short") + [0] * (array.shape[1] - 2)
    assert array[1].tolist() == manager.block_ids("r1")
    assert rows.of("r0").tolist() == [] and rows.of("nobody").tolist() == []
    manager.check_invariants()