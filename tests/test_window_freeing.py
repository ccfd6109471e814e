"""Blocks behind a sliding window go back to the pool when every layer is windowed (Mistral):
the pool then holds a window per request however long its context, greedy tokens still
equal transformers', and the prefix cache, the KV tier and preemption keep working over
the released entries. With any global layer nothing is released."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from engine_fixtures import MISTRAL_WINDOW
from helpers import assert_no_leaks, blocks_owned, step_as_a_client
from hypothesis import given, settings
from hypothesis import strategies as st
from tiny_models import build_tiny_model
from transformers import AutoModelForCausalLM
from typer.testing import CliRunner

from paged_chat.cli.main import app
from paged_chat.cli.state import CliState
from paged_chat.engine import Engine, EngineConfig, SamplingParams
from paged_chat.engine.core.request import Request
from paged_chat.engine.kv.block_pool import NULL_BLOCK
from paged_chat.engine.kv.kv_cache_manager import (
    KVCacheManager,
    TierRead,
    TierReadState,
    hash_block,
)
from paged_chat.tui.engine_panel import format_numbers

WINDOW = MISTRAL_WINDOW
BLOCK_SIZE = 8
CHUNK = 16        # max_num_batched_tokens: prompts prefill in chunks
# What one request holds at most: its window and the chunk, plus a block for the boundaries.
LIVE_BLOCKS = -(-(WINDOW - 1 + CHUNK) // BLOCK_SIZE) + 1
DECODE_BLOCKS = -(-WINDOW // BLOCK_SIZE) + 2
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def reference(mistral_dir):
    return AutoModelForCausalLM.from_pretrained(mistral_dir, dtype=torch.float32).eval()


@pytest.fixture
def windowed_engine(new_engine):
    """An engine on `folder` in small blocks, prefilling in chunks."""
    def make(folder: Path, **overrides) -> Engine:
        config = dict(model=str(folder), device="cpu", dtype="float32", num_blocks=64,
                      block_size=BLOCK_SIZE, max_num_batched_tokens=CHUNK,
                      kv_cache_dtype="auto") | overrides
        return new_engine(EngineConfig(**config))
    return make


def prompt_of(seed: int, length: int = 5 * WINDOW) -> list[int]:
    return torch.randint(3, 512, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def transformers_greedy(reference, prompt: list[int], output: list[int]) -> list[int]:
    with torch.inference_mode():
        logits = reference(torch.tensor([prompt + output])).logits[0]
    return logits[len(prompt) - 1:-1].argmax(-1).tolist()


def run(engine: Engine, prompts: list[list[int]], params: SamplingParams = GREEDY
        ) -> tuple[list[list[int]], int]:
    """Greedy replies, and the most blocks in use after any step; checks the invariants
    (and the block map's accounting of released entries) at every step."""
    ids = [engine.add_request(prompt, params) for prompt in prompts]
    replies: dict[str, list[int]] = {rid: [] for rid in ids}
    most_in_use = 0
    while engine.has_unfinished():
        for out in engine.step():
            replies[out.request_id] += out.new_token_ids
        engine.kv_cache.check_invariants()
        stats = engine.stats()
        most_in_use = max(most_in_use, stats.blocks_in_use)
        assert len(stats.blocks.holders) == stats.blocks.ref_counts.sum(), (
            "the block map names a holder of a released entry")
    assert_no_leaks(engine)
    return [replies[rid] for rid in ids], most_in_use


def test_a_long_context_holds_only_its_window_and_matches_transformers(windowed_engine, mistral_dir,
                                                                       reference):
    engine = windowed_engine(mistral_dir)
    prompt = prompt_of(0)
    (reply,), most_in_use = run(engine, [prompt])
    assert reply == transformers_greedy(reference, prompt, reply)
    context_blocks = -(-(len(prompt) + len(reply)) // BLOCK_SIZE)
    assert most_in_use <= LIVE_BLOCKS < context_blocks
    # The last step computed position len - 2 (the last token is sampled, never computed):
    # every block ending at or before (len - 2) - WINDOW was released.
    last_query = len(prompt) + len(reply) - 2
    freed = engine.stats().blocks_freed_by_window
    assert freed == (last_query - WINDOW + 1) // BLOCK_SIZE
    assert f"window freed {freed} blocks behind it" in format_numbers(engine.stats()).plain


def test_decode_holds_at_most_the_window_plus_two_blocks(windowed_engine, mistral_dir):
    engine = windowed_engine(mistral_dir)
    engine.add_request(prompt_of(1), GREEDY)
    decoding = []
    while engine.has_unfinished():
        engine.step()
        request = next(iter(engine.requests.values()), None)
        if request is not None and request.num_computed_tokens >= request.num_prompt_tokens:
            decoding.append(engine.stats().blocks_in_use)
    assert len(decoding) == GREEDY.max_tokens - 1
    assert max(decoding) <= DECODE_BLOCKS


def test_the_block_map_holds_no_released_entry(windowed_engine, mistral_dir):
    engine = windowed_engine(mistral_dir)
    engine.add_request(prompt_of(2), GREEDY, owner="tab")
    for _ in range(8):
        engine.step()
    stats = engine.stats()
    request = next(iter(engine.requests.values()))
    released = engine.kv_cache.num_released[request.request_id]
    table = engine.kv_cache.tables[request.request_id]
    assert released and table[:released] == [NULL_BLOCK] * released
    held = sorted(block.block_id for block in table[released:])
    assert blocks_owned(stats, "tab").tolist() == held
    assert stats.blocks_in_use == len(held)
    engine.abort(request.request_id)
    assert_no_leaks(engine)


def test_a_second_request_hits_the_prefix_cache_past_released_blocks(windowed_engine, mistral_dir,
                                                                     reference):
    engine = windowed_engine(mistral_dir)
    prompt = prompt_of(3)
    (first,), _ = run(engine, [prompt])
    freed = engine.stats().blocks_freed_by_window
    second_id = engine.add_request(prompt, GREEDY)
    outputs = []
    while engine.has_unfinished():
        outputs += [out for out in step_as_a_client(engine) if out.finished]
        engine.kv_cache.check_invariants()
    (second,) = outputs
    assert second.request_id == second_id
    assert second.num_cached_tokens == (len(prompt) - 1) // BLOCK_SIZE * BLOCK_SIZE
    assert second.token_ids == first == transformers_greedy(reference, prompt, first)
    # The hit's blocks behind the window were never taken, so never released again: only
    # those between that window and the window of its last step were.
    behind_first = (second.num_cached_tokens - WINDOW + 1) // BLOCK_SIZE
    behind_last = (len(prompt) + len(first) - 2 - WINDOW + 1) // BLOCK_SIZE
    assert engine.stats().blocks_freed_by_window - freed == behind_last - behind_first
    assert_no_leaks(engine)


def test_a_history_whose_oldest_blocks_were_evicted_still_hits_its_window(windowed_engine, mistral_dir,
                                                                          reference):
    """Released blocks are the first the pool evicts; the next turn of a chat needs only
    the blocks within its window."""
    engine = windowed_engine(mistral_dir, num_blocks=8)
    history = prompt_of(11)
    (reply,), _ = run(engine, [history])
    prompt = history + reply + prompt_of(12, 5)
    assert engine.kv_cache.pool.lookup(hash_block(b"", history[:BLOCK_SIZE])) is None
    (second,) = engine.generate([prompt], GREEDY)
    assert second.num_cached_tokens == (len(prompt) - 1) // BLOCK_SIZE * BLOCK_SIZE
    assert second.token_ids == transformers_greedy(reference, prompt, second.token_ids)
    assert_no_leaks(engine)


def test_contexts_longer_than_the_pool_preempt_and_stay_exact(windowed_engine, mistral_dir, reference):
    """A pool of 8 blocks (64 tokens) runs three 89-token sequences: each fits once its
    window has released what is behind it; they preempt each other and recompute."""
    engine = windowed_engine(mistral_dir, num_blocks=8)
    assert engine.max_model_len > 8 * BLOCK_SIZE
    prompts = [prompt_of(seed) for seed in (4, 5, 6)]
    replies, most_in_use = run(engine, prompts)
    assert engine.stats().num_preemptions > 0
    assert most_in_use <= 8
    for prompt, reply in zip(prompts, replies):
        assert reply == transformers_greedy(reference, prompt, reply)


def test_the_host_tier_serves_a_history_from_its_window_alone(windowed_engine, mistral_dir, reference):
    """A host tier of 4 blocks keeps the newest blocks of a history; the next turn needs
    only those the window of its first new token sees, and reads no other."""
    engine = windowed_engine(mistral_dir, kv_tier_host_bytes="16KiB", kv_tier_disk_bytes=0)
    assert engine.kv_cache.tier.host.capacity_blocks == 4
    history = prompt_of(7)
    (reply,), _ = run(engine, [history])
    engine.reset_prefix_cache()
    assert hash_block(b"", history[:BLOCK_SIZE]) not in engine.kv_cache.tier
    prompt = history + reply + prompt_of(13, 5)
    misses = engine.stats().tier.miss_blocks
    (second,), _ = run(engine, [prompt])
    assert second == transformers_greedy(reference, prompt, second)
    num_full = (len(prompt) - 1) // BLOCK_SIZE
    behind_window = (num_full * BLOCK_SIZE - WINDOW + 1) // BLOCK_SIZE
    assert engine.stats().tier.hit_blocks == num_full - behind_window
    assert engine.stats().tier.miss_blocks == misses


def test_the_triton_kernels_read_past_released_entries(windowed_engine, mistral_dir):
    """Under the interpreter: decodes and chunked prefills whose tables start with released
    entries (block 0 stands in for them) give the torch backend's tokens."""
    pytest.importorskip("triton")
    # The first prompt's third chunk starts at 32, past two released blocks.
    prompts = [prompt_of(9, 2 * WINDOW + 9), prompt_of(10, 2 * WINDOW)]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    expected, _ = run(windowed_engine(mistral_dir), prompts, params)
    engine = windowed_engine(mistral_dir, attention_backend="triton")
    replies, _ = run(engine, prompts, params)
    assert replies == expected
    assert engine.stats().blocks_freed_by_window > 0


def test_a_model_with_a_global_layer_releases_nothing(windowed_engine, tmp_path, smollm2_source):
    build_tiny_model("qwen2", tmp_path, use_sliding_window=True, sliding_window=WINDOW,
                     max_window_layers=1)
    smollm2_source.tokenizer.save_pretrained(tmp_path)
    engine = windowed_engine(tmp_path)
    assert engine.model_config.layer_windows == (None, WINDOW)
    prompt = prompt_of(8)
    (reply,), most_in_use = run(engine, [prompt])
    assert most_in_use == -(-(len(prompt) + len(reply) - 1) // BLOCK_SIZE)
    assert engine.stats().blocks_freed_by_window == 0
    assert "window" not in format_numbers(engine.stats()).plain
    assert engine.max_model_len == 64 * BLOCK_SIZE


SMALL_BLOCK = 4   # the manager alone takes any block size


class StubTier:
    """Holds every hash but those a load found `bad` (then forgotten, as the disk tier
    forgets an entry it rejects); `load` serves blocks up to the first bad one."""

    def __init__(self) -> None:
        self.bad: set[bytes] = set()
        self.forgotten: set[bytes] = set()
        self.asked: list[int] = []
        self.misses = 0

    def __contains__(self, block_hash: bytes) -> bool:
        return block_hash not in self.forgotten

    def load(self, block_hashes: list[bytes]) -> list[torch.Tensor]:
        self.asked.append(len(block_hashes))
        served = []
        for block_hash in block_hashes:
            if block_hash in self.bad:
                self.forgotten.add(block_hash)
                break
            served.append(torch.zeros(1))
        return served

    def record_misses(self, num_blocks: int) -> None:
        self.misses += num_blocks


def read_from_tier(manager: KVCacheManager, tier: StubTier, request: Request,
                   expected_blocks: int) -> TierRead:
    """Plan, issue and finish one tier read of the request, as scheduler and engine would."""
    cached = manager.find_cached_prefix(request)
    assert cached == []
    assert manager.tier_blocks_to_read(request, cached, budget=8) == expected_blocks
    manager.start_tier_read(request, cached, expected_blocks)
    (read,) = manager.take_new_tier_reads()
    assert all(block.block_hash is None for block in read.blocks), "indexed before its KV is in"
    manager.check_invariants()
    kv = tier.load(read.block_hashes)
    manager.finish_tier_read(read, complete=len(kv) == len(read.blocks))
    return read


@pytest.mark.parametrize("bad", [None, 8])
def test_the_tier_reads_only_the_window_and_a_cut_run_starts_over(bad):
    """Window 6, blocks of 4: of a 40-token prompt's 9 full blocks the first new token's
    window sees blocks 7 and 8 alone, and only they are read, into fresh blocks (the 7
    before them are NULL_BLOCK). When block 8 fails to load, a run ending at 8 would need
    block 6, never read: the request gives its blocks back and starts over, and the run
    ending at block 8 reads blocks 6 and 7."""
    tier = StubTier()
    manager = KVCacheManager(num_blocks=16, block_size=SMALL_BLOCK, enable_caching=True,
                             tier=tier, sliding_window=6)
    request = make_request("r", list(range(40)))
    manager.find_cached_prefix(request)
    if bad is not None:
        tier.bad.add(request.block_hashes[bad])
    read = read_from_tier(manager, tier, request, 9)
    assert len(read.blocks) == 2 and manager.tables["r"] == [NULL_BLOCK] * 7 + read.blocks
    if bad is not None:
        assert read.state is TierReadState.SHORT
        manager.free(request)
        manager.check_invariants()
        assert manager.pool.num_free_blocks == 16, "a short read leaked a block"
        read = read_from_tier(manager, tier, request, 8)
        assert tier.asked == [2, 2]
    assert read.state is TierReadState.DONE and all(block.from_tier for block in read.blocks)
    assert manager.admit_tier_read(request) is read
    num_read = 9 if bad is None else 8
    assert read.num_cached_tokens == read.num_tier_tokens == num_read * SMALL_BLOCK
    request.num_computed_tokens = read.num_cached_tokens
    assert manager.allocate(request, 40 - read.num_cached_tokens)
    manager.record_tier_misses(request, read.num_cached_tokens)
    assert tier.misses == 9 - num_read
    table = manager.tables["r"]
    assert table.count(NULL_BLOCK) == manager.num_released["r"] == num_read - 2
    assert len(table) == 10
    manager.check_invariants()


def test_ask_stats_says_how_many_blocks_the_window_freed(tmp_path, monkeypatch, smollm2_source):
    folder = tmp_path / "model"
    build_tiny_model("mistral", folder, vocab_size=len(smollm2_source.tokenizer),
                     tie_word_embeddings=True, sliding_window=WINDOW)
    smollm2_source.tokenizer.save_pretrained(folder)
    monkeypatch.setenv("PAGED_CHAT_DATA_DIR", str(tmp_path / "data"))
    config = tmp_path / "config.toml"
    config.write_text(f'[engine]\nmodel = "{folder}"\ndevice = "cpu"\ndtype = "float32"\n'
                      'block_size = 8\nnum_blocks = 64\n')
    engines: list[Engine] = []
    result = CliRunner().invoke(
        app, ["--config", str(config), "ask", "--stats", "--no-save", "--temperature", "0",
              "--max-tokens", "40", "Hi"],
        obj=CliState(engine_factory=lambda config: engines.append(Engine(config)) or engines[-1]))
    assert result.exit_code == 0, result.stderr
    # The line reads the snapshot the engine thread published last: maybe a step early.
    (shown,) = [int(line.split()[0]) for line in result.stderr.splitlines()
                if line.endswith("KV blocks freed behind the sliding window")]
    assert 0 < shown <= engines[0].stats().blocks_freed_by_window


def make_request(request_id: str, tokens: list[int]) -> Request:
    return Request(request_id, list(tokens), SamplingParams(), 0, 0.0)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["add", "grow", "free"]), st.integers(0, 5),
                          st.integers(1, 9)), max_size=50),
       st.integers(1, 11), st.booleans())
def test_random_windowed_operations_keep_the_invariants(ops, window, caching):
    """Requests share prefixes, grow in chunks and leave in any order; the tables keep a
    leading run of released entries that ends where the window starts."""
    manager = KVCacheManager(num_blocks=16, block_size=SMALL_BLOCK, enable_caching=caching,
                             sliding_window=window)
    live: dict[str, Request] = {}
    first_query: dict[str, int] = {}     # of each request's last allocate
    for count, (op, pick, size) in enumerate(ops):
        names = sorted(live)
        if op == "add":
            request = make_request(f"r{count}", [pick % 2] * (4 * size))
            prefix = manager.find_cached_prefix(request)
            cached = len(prefix) * SMALL_BLOCK
            if manager.allocate(request, request.num_tokens - cached, prefix):
                request.num_computed_tokens = request.num_tokens
                live[request.request_id], first_query[request.request_id] = request, cached
        elif op == "grow" and names:
            request = live[names[pick % len(names)]]
            first_query[request.request_id] = request.num_computed_tokens
            request.all_token_ids += [pick] * size
            if manager.allocate(request, size):
                request.num_computed_tokens = request.num_tokens
            else:
                request.all_token_ids = request.all_token_ids[:request.num_computed_tokens]
        elif op == "free" and names:
            manager.free(live.pop(names[pick % len(names)]))
        manager.check_invariants()
        for request_id in live:
            expected = max(0, first_query[request_id] - window + 1) // SMALL_BLOCK
            assert manager.num_released.get(request_id, 0) == expected
    for request in live.values():
        manager.free(request)
    manager.check_invariants()
    assert manager.pool.num_free_blocks == 16
