"""The KV tier under the prefix cache: a chat's history survives eviction and a new Engine.

Engines here share one cache dir per test; a new Engine over it is what a new process
sees. Every reply is compared, token for token (greedy), with an engine without a tier.
"""

from __future__ import annotations

import errno
import json
import os
import random
import shutil
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path

import pytest
import torch
from helpers import assert_no_leaks, step_as_a_client
from soak import run_soak, soak_config
from tiny_models import build_tiny_model

import paged_chat.engine.worker.model_loading as model_loading
from paged_chat.engine import Engine, KVTierWarning, SamplingParams
from paged_chat.engine.core.request import RequestStatus
from paged_chat.engine.core.scheduler import Scheduler
from paged_chat.engine.kv.kv_cache_manager import hash_block
from paged_chat.engine.kv.tier import (
    ENTRY_SUFFIX,
    TIER_DIR,
    DiskTier,
    KVTier,
    TierLayout,
    clear_disk_tier,
)
from paged_chat.engine.worker.runner import ModelRunner

BLOCK = 16
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
NEW_MESSAGE = [7, 8, 9, 10, 11]


@pytest.fixture
def tier_engine(make_engine, tmp_path):
    """Engines over one cache dir (tmp_path/cache), closed (their writes finished) at the end."""
    engines: list[Engine] = []

    def make(**overrides) -> Engine:
        engine = make_engine(**{"cache_dir": str(tmp_path / "cache"), **overrides})
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        engine.close()


def tier_dir(tmp_path: Path) -> Path:
    return tmp_path / "cache" / TIER_DIR


def entries(directory: Path) -> list[Path]:
    return sorted(directory.glob(f"*{ENTRY_SUFFIX}"))


def history(seed: int = 0, length: int = 150) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 512) for _ in range(length)]


def first_turn(engine: Engine, prompt: list[int]) -> list[int]:
    """Run a chat's first turn and wait for its blocks to be on disk; the next turn's prompt."""
    reply = engine.generate([prompt], GREEDY)[0].token_ids
    assert engine.kv_cache.tier.flush()
    return prompt + reply + NEW_MESSAGE


def history_blocks(follow_up: list[int]) -> int:
    """Full blocks the first turn computed (its last sampled token never was)."""
    return (len(follow_up) - len(NEW_MESSAGE) - 1) // BLOCK


def block_hashes(tokens: list[int]) -> list[bytes]:
    hashes = [b""]
    for start in range(0, len(tokens) - BLOCK + 1, BLOCK):
        hashes.append(hash_block(hashes[-1], tokens[start:start + BLOCK]))
    return hashes[1:]


def expected_reply(make_engine, prompt: list[int], **overrides) -> list[int]:
    """The reply of an engine without a KV tier."""
    return make_engine(**overrides).generate([prompt], GREEDY)[0].token_ids


def test_a_new_engine_prefills_only_the_new_tokens(tier_engine, make_engine):
    first = tier_engine()
    follow_up = first_turn(first, history())
    first.close()

    second = tier_engine()  # as a new process would: nothing in its pool
    out = second.generate([follow_up], GREEDY)[0]
    stats = second.stats()

    num_blocks = history_blocks(follow_up)
    assert out.num_tier_cached_tokens == out.num_cached_tokens == num_blocks * BLOCK
    assert len(follow_up) - out.num_cached_tokens <= BLOCK + len(NEW_MESSAGE)
    assert stats.tier.disk_hit_blocks == stats.tier.hit_blocks == num_blocks
    assert stats.tier.bytes_read == num_blocks * stats.tier.disk_bytes // stats.tier.disk_blocks
    assert stats.blocks.from_tier.sum() == num_blocks
    assert out.token_ids == expected_reply(make_engine, follow_up)


_FIRST_TURN_IN_A_PROCESS = """
import json, sys
from paged_chat.engine import Engine, EngineConfig, SamplingParams
model, cache_dir, prompt = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
engine = Engine(EngineConfig(model=model, device="cpu", dtype="float32", num_blocks=256,
                             cache_dir=cache_dir, kv_cache_dtype="auto"))
out = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0]
print(json.dumps(out.token_ids))
"""


def test_a_process_that_exits_leaves_its_blocks_on_disk(tier_engine, make_engine, tiny_model_dir,
                                                        tmp_path):
    """The first turn runs in a process that exits without closing its engine (as `ask`
    does): its queued writes are finished at exit, and the next process reads them."""
    prompt = history()
    process = subprocess.run(
        [sys.executable, "-c", _FIRST_TURN_IN_A_PROCESS, str(tiny_model_dir),
         str(tmp_path / "cache"), json.dumps(prompt)],
        capture_output=True, text=True, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    follow_up = prompt + json.loads(process.stdout) + NEW_MESSAGE
    out = tier_engine().generate([follow_up], GREEDY)[0]
    assert out.num_tier_cached_tokens == history_blocks(follow_up) * BLOCK
    assert out.token_ids == expected_reply(make_engine, follow_up)


def test_a_slow_tier_read_holds_back_only_its_own_request(tier_engine, make_engine, monkeypatch):
    """A tier read that takes 2 s (and is held until the other chats are done) holds back
    only the request waiting for it: the chats already running keep stepping and finish
    while it runs, and the request then prefills only its new tokens."""
    writer = tier_engine()
    follow_up = first_turn(writer, history())
    writer.close()
    engine = tier_engine()
    read_started, others_done = threading.Event(), threading.Event()
    load = KVTier.load

    def slow_load(tier: KVTier, block_hashes: list[bytes]) -> list[torch.Tensor]:
        began = time.monotonic()
        read_started.set()
        others_done.wait(timeout=120)
        time.sleep(max(0.0, 2.0 - (time.monotonic() - began)))  # the slow disk itself
        return load(tier, block_hashes)

    monkeypatch.setattr(KVTier, "load", slow_load)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    others = [engine.add_request(history(seed, 40), params) for seed in (5, 6, 7)]
    step_as_a_client(engine)
    cold = engine.add_request(follow_up, GREEDY)
    finished: dict[str, object] = {}
    give_up = time.monotonic() + 120
    while not all(rid in finished for rid in others):
        assert time.monotonic() < give_up, "the running chats stopped stepping"
        finished.update((out.request_id, out) for out in step_as_a_client(engine) if out.finished)
        assert cold not in finished
        assert engine.requests[cold].status is RequestStatus.WAITING_FOR_KV
    assert read_started.is_set() and engine.requests[cold].num_computed_tokens == 0
    others_done.set()
    while cold not in finished:
        assert time.monotonic() < give_up, "the read never completed"
        finished.update((out.request_id, out) for out in step_as_a_client(engine) if out.finished)
    out = finished[cold]
    assert out.num_tier_cached_tokens == out.num_cached_tokens == history_blocks(follow_up) * BLOCK
    assert out.token_ids == expected_reply(make_engine, follow_up)
    assert_no_leaks(engine)


def test_scheduling_does_no_io(make_engine, monkeypatch):
    """Eviction into the host tier and hits read back from it, in a pool that holds one
    prompt at a time: no tier read, disk read or block copy runs inside `schedule`."""
    scheduling = threading.local()
    schedule = Scheduler.schedule

    def watched_schedule(self: Scheduler) -> object:
        scheduling.now = True
        try:
            return schedule(self)
        finally:
            scheduling.now = False

    def forbidden(original):
        def wrapper(*args, **kwargs):
            assert not getattr(scheduling, "now", False), f"{original.__name__} in schedule()"
            return original(*args, **kwargs)
        return wrapper

    monkeypatch.setattr(Scheduler, "schedule", watched_schedule)
    for owner, name in ((KVTier, "load"), (DiskTier, "read"), (ModelRunner, "read_blocks"),
                        (ModelRunner, "write_blocks")):
        monkeypatch.setattr(owner, name, forbidden(getattr(owner, name)))
    engine = make_engine(num_blocks=12, kv_tier_host_bytes="1MiB", kv_tier_disk_bytes=0)
    outputs = [engine.generate([history(seed, 150)], GREEDY)[0] for seed in (1, 2, 1)]
    assert outputs[2].num_tier_cached_tokens > 0 and engine.stats().num_evictions > 0


def test_preempting_or_aborting_a_request_while_its_tier_read_runs_frees_everything(
        tier_engine, monkeypatch):
    """A request waiting for KV is aborted, or preempted by a running chat that needs its
    blocks: every block goes back, nothing of the read is indexed, and the read's late end
    changes nothing."""
    writer = tier_engine()
    follow_up = first_turn(writer, history())
    writer.close()
    engine = tier_engine(num_blocks=14)
    release = threading.Event()
    load = KVTier.load

    def held_load(tier: KVTier, block_hashes: list[bytes]) -> list[torch.Tensor]:
        release.wait(timeout=120)
        return load(tier, block_hashes)

    monkeypatch.setattr(KVTier, "load", held_load)
    cold = engine.add_request(follow_up, GREEDY)
    engine.step()
    assert engine.requests[cold].status is RequestStatus.WAITING_FOR_KV
    assert engine.stats().blocks_in_use == history_blocks(follow_up)
    engine.abort(cold)
    engine.step()
    assert engine.stats().blocks_in_use == 0 and not engine.kv_cache.pool.cached_blocks
    assert_no_leaks(engine)
    # Preempted: a running chat grows into the blocks the read holds.
    cold = engine.add_request(follow_up, GREEDY)
    engine.step()
    assert engine.requests[cold].status is RequestStatus.WAITING_FOR_KV
    grower = engine.add_request(history(9, 20), SamplingParams(temperature=0, max_tokens=80,
                                                               ignore_eos=True))
    give_up = time.monotonic() + 120
    while engine.requests[cold].status is RequestStatus.WAITING_FOR_KV:
        assert time.monotonic() < give_up, "the running chat never needed the read's blocks"
        engine.step()
        engine.kv_cache.check_invariants()
    assert engine.stats().num_preemptions >= 1
    release.set()
    while engine.has_unfinished():
        assert time.monotonic() < give_up
        engine.step()
        engine.kv_cache.check_invariants()
    assert grower not in engine.requests and cold not in engine.requests
    assert_no_leaks(engine)


def test_no_disk_tier_without_a_cache_dir_or_bytes(make_engine, tmp_path):
    assert make_engine().kv_cache.tier is None
    assert make_engine(cache_dir=str(tmp_path), kv_tier_disk_bytes=0).kv_cache.tier is None
    assert not tier_dir(tmp_path).exists()


def test_the_host_tier_serves_what_eviction_dropped(make_engine):
    """A pool that holds one prompt at a time: each prompt evicts the other, and the host
    tier (RAM, no disk) gives it back."""
    engine = make_engine(num_blocks=12, kv_tier_host_bytes="1MiB", kv_tier_disk_bytes=0)
    baseline = make_engine(num_blocks=12)
    prompts = [history(seed, 150) for seed in (1, 2, 1, 2)]
    outputs = [engine.generate([prompt], GREEDY)[0] for prompt in prompts]
    tier_tokens = [o.num_tier_cached_tokens for o in outputs]
    assert [o.num_cached_tokens for o in outputs] == [0, 0, 144, 144]
    assert tier_tokens[:2] == [0, 0] and min(tier_tokens[2:]) > 0
    assert engine.stats().tier.host_hit_blocks * BLOCK == sum(tier_tokens)
    expected = baseline.generate(prompts, GREEDY)
    assert [o.token_ids for o in outputs] == [o.token_ids for o in expected]


@pytest.mark.timeout(600)
def test_constant_eviction_with_the_tier_keeps_replies_and_blocks(tiny_model_dir, tmp_path):
    """The soak's shape (a pool far too small, preemption and eviction all the time) with
    the disk tier on and bounded small: greedy replies equal the same requests run alone,
    no block leaks, the tier serves hits and stays within its bound."""
    bound = 60 * 8_300  # about 60 blocks of the tiny model
    config = soak_config(str(tiny_model_dir), cache_dir=str(tmp_path / "cache"),
                         kv_tier_disk_bytes=bound)
    report = run_soak(config, duration_s=0, num_chats=8, seed=3, verify_greedy=20)
    print(report.summary())
    assert report.ok, report.summary()
    assert report.leaked_blocks == 0 and report.evictions > 0
    assert report.greedy_checked > 0 and report.greedy_mismatches == 0
    assert report.tier_hit_blocks > 0
    sizes = [path.stat().st_size for path in entries(tier_dir(tmp_path))]
    assert 0 < sum(sizes) <= bound


# ---- faults: each is ignored with at most one warning, and the reply does not change ----

def damage_one_block(directory: Path, name: str, how: str) -> None:
    path = directory / name
    data = bytearray(path.read_bytes())
    if how == "corrupt":
        data[len(data) // 2] ^= 0xFF
    else:
        del data[len(data) - 100:]
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("fault", ["corrupt", "truncate", "other model", "other dtype"])
def test_a_bad_entry_is_deleted_never_loaded(fault, tier_engine, make_engine, tmp_path,
                                             smollm2_source):
    """The history's blocks are on disk under the names the reading engine looks up, but
    one (or, from another model or dtype, every one) does not match: the run of hits ends
    there and the rest is prefilled."""
    writer_settings = {}
    if fault == "other model":
        other = tmp_path / "other-model"
        build_tiny_model("llama", other, seed=1)
        smollm2_source.tokenizer.save_pretrained(other)
        writer_settings = {"model": str(other)}
    elif fault == "other dtype":
        writer_settings = {"dtype": "bfloat16"}
    writer = tier_engine(**writer_settings)
    follow_up = first_turn(writer, history())
    writer.close()
    reader_layout = tier_engine().kv_cache.tier.layout
    hashes = block_hashes(follow_up)[:history_blocks(follow_up)]
    directory = tier_dir(tmp_path)
    for block_hash in hashes:  # the writer's entries, under the names the reader looks up
        (directory / writer.kv_cache.tier.layout.entry_name(block_hash)).rename(
            directory / reader_layout.entry_name(block_hash))
    bad = 3 if fault in ("corrupt", "truncate") else 0
    if bad:
        damage_one_block(directory, reader_layout.entry_name(hashes[bad]), fault)
    reader = tier_engine()

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = reader.generate([follow_up], GREEDY)[0]
    assert not [w for w in caught if issubclass(w.category, KVTierWarning)]
    assert out.num_tier_cached_tokens == bad * BLOCK
    assert reader.stats().tier.entries_rejected == 1
    reader.close()  # the block was prefilled and went down again: a sound entry replaced it
    path = directory / reader_layout.entry_name(hashes[bad])
    assert reader_layout.decode(hashes[bad], bytearray(path.read_bytes())) is not None
    assert out.token_ids == expected_reply(make_engine, follow_up)


def test_a_tier_dir_removed_mid_run_turns_the_tier_off_once(tier_engine, make_engine, tmp_path):
    engine = tier_engine()
    prompts = [history(seed) for seed in range(4)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        outputs = [engine.generate([prompts[0]], GREEDY)[0]]
        assert engine.kv_cache.tier.flush() and entries(tier_dir(tmp_path))
        shutil.rmtree(tier_dir(tmp_path))
        outputs += [engine.generate([prompt], GREEDY)[0] for prompt in prompts[1:]]
        assert engine.kv_cache.tier.flush()
    assert len([w for w in caught if issubclass(w.category, KVTierWarning)]) == 1
    assert "is off" in engine.stats().tier.disk_error
    assert [o.token_ids for o in outputs] == [
        o.token_ids for o in make_engine().generate(prompts, GREEDY)]


@pytest.mark.parametrize("fault", ["read-only", "full"])
def test_an_unwritable_tier_dir_turns_the_tier_off_once(fault, tier_engine, make_engine, tmp_path,
                                                         monkeypatch):
    """A read-only directory (chmod; as root, where chmod binds nobody, the writer's open
    fails as it would) or a full disk (ENOSPC from the writer's writes): what is there
    still serves, the first write turns the tier off."""
    writer = tier_engine()
    follow_up = first_turn(writer, history())
    writer.close()
    if fault == "read-only":
        tier_dir(tmp_path).chmod(0o555)
        failing, code = "open", errno.EACCES
    else:
        failing, code = "write", errno.ENOSPC
    if fault == "full" or os.access(tier_dir(tmp_path), os.W_OK):
        real = getattr(os, failing)

        def fail_in_the_writer(*args, **kwargs):
            if threading.current_thread().name == "kv-tier-writer":
                raise OSError(code, os.strerror(code))
            return real(*args, **kwargs)
        monkeypatch.setattr(os, failing, fail_in_the_writer)

    engine = tier_engine()
    prompts = [follow_up, history(seed=1), history(seed=2)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        outputs = [engine.generate([prompt], GREEDY)[0] for prompt in prompts]
        engine.kv_cache.tier.flush()
    tier_dir(tmp_path).chmod(0o755)
    assert len([w for w in caught if issubclass(w.category, KVTierWarning)]) == 1
    assert engine.stats().tier.disk_error
    assert outputs[0].num_tier_cached_tokens == history_blocks(follow_up) * BLOCK
    assert len(entries(tier_dir(tmp_path))) == history_blocks(follow_up)  # nothing new
    assert [o.token_ids for o in outputs] == [
        o.token_ids for o in make_engine().generate(prompts, GREEDY)]


# ---- the disk tier on its own ----

LAYOUT = TierLayout(bytes(16), torch.float32, (2, 2, 2, 4, 8))


def block(value: float) -> torch.Tensor:
    return torch.full(LAYOUT.block_shape, value)


def test_a_full_queue_drops_writes_and_never_blocks(tmp_path, monkeypatch):
    """With the writer stuck, submits beyond the queue's bound return at once, dropped."""
    release = threading.Event()
    write = DiskTier._write

    def stuck_write(self, item):
        release.wait(timeout=60)
        write(self, item)
    monkeypatch.setattr(DiskTier, "_write", stuck_write)
    disk = DiskTier(tmp_path, 2**20, LAYOUT, max_pending_bytes=3 * LAYOUT.block_nbytes)
    accepted = [disk.submit(bytes([i]) * 16, block(float(i))) for i in range(10)]
    assert accepted == [True] * 3 + [False] * 7
    assert disk.writes_dropped == 7 and disk.room() == 0
    assert bytes([1]) * 16 in disk and bytes([5]) * 16 not in disk  # queued ones are found
    release.set()
    assert disk.flush()
    assert len(entries(tmp_path)) == 3 and disk.room() == 3
    disk.close()


def test_the_disk_tier_is_lru_within_its_bytes(tmp_path):
    entry_bytes = LAYOUT.entry_nbytes
    disk = DiskTier(tmp_path, 3 * entry_bytes, LAYOUT)
    keys = [bytes([i]) * 16 for i in range(5)]
    for key in keys[:3]:
        disk.submit(key, block(float(key[0])))
    assert disk.flush()
    assert torch.equal(disk.read(keys[0]), block(0.0))  # now the most recently used
    for key in keys[3:]:
        disk.submit(key, block(float(key[0])))
    assert disk.flush()
    assert [key in disk for key in keys] == [True, False, False, True, True]
    assert len(entries(tmp_path)) == 3 and disk.nbytes <= 3 * entry_bytes
    disk.close()

    reopened = DiskTier(tmp_path, 3 * entry_bytes, LAYOUT)  # a new process finds them
    assert torch.equal(reopened.read(keys[4]), block(4.0))
    reopened.close()


def fill_disk_tier(cache_dir: Path, count: int) -> None:
    disk = DiskTier(cache_dir / TIER_DIR, 2**20, LAYOUT)
    for i in range(count):
        disk.submit(bytes([i]) * 16, block(float(i)))
    disk.close()


def test_clear_disk_tier_deletes_the_entries(tmp_path):
    fill_disk_tier(tmp_path, 3)
    size = sum(path.stat().st_size for path in entries(tmp_path / TIER_DIR))
    assert clear_disk_tier(tmp_path) == (3, size)
    assert not entries(tmp_path / TIER_DIR)
    assert clear_disk_tier(tmp_path / "nowhere") == (0, 0)


def test_cache_clear_command(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from paged_chat.cli.main import app

    monkeypatch.setenv("PAGED_CHAT_CACHE_DIR", str(tmp_path))
    fill_disk_tier(tmp_path, 2)
    result = CliRunner().invoke(app, ["cache", "clear"])
    assert result.exit_code == 0, result.output
    assert "(2 KV blocks)" in result.stdout and str(tmp_path / TIER_DIR) in result.stdout
    assert not entries(tmp_path / TIER_DIR)


# ---- a failed forward never poisons the tier (issue 31, item 2) ----

def poison_weights(monkeypatch, token_id: int) -> None:
    """Engines built under it load weights whose embedding of `token_id` holds a NaN, in an
    element the model fingerprint does not sample: every logit after that token is NaN, as
    in a forward that overflowed once, and the tier's layout is the healthy model's."""
    real_load = model_loading.load_model

    def load_poisoned(*args, **kwargs):
        model = real_load(*args, **kwargs)
        embedding = next(p for name, p in model.named_parameters() if "embed" in name)
        step = max(1, embedding.numel() // 4096)
        flat_index = token_id * embedding.shape[1] + 1
        assert flat_index % step, "the fingerprint would see the poisoned element"
        with torch.no_grad():
            embedding[token_id, 1] = float("nan")
        return model
    monkeypatch.setattr(model_loading, "load_model", load_poisoned)


def test_a_failed_forward_leaves_nothing_in_the_tier(tier_engine, make_engine, monkeypatch,
                                                     tmp_path):
    """The issue's user: a chat whose forward produced NaN failed; a new engine (the weights
    sound again) on the same cache dir resumed it and failed too, on the NaN KV the first
    one had written to the tier, in every later process."""
    prompt = history()
    with monkeypatch.context() as patch:
        poison_weights(patch, prompt[0])
        sick = tier_engine()
    out = sick.generate([prompt], GREEDY)[0]
    assert out.finish_reason == "error" and "not finite" in out.error
    sick.close()
    written_by_the_sick_engine = entries(tier_dir(tmp_path))

    healthy = tier_engine()
    assert healthy.kv_cache.tier.layout == sick.kv_cache.tier.layout
    follow_up = prompt + NEW_MESSAGE
    out = healthy.generate([follow_up], GREEDY)[0]
    assert out.finish_reason == "length", out.error
    assert out.num_tier_cached_tokens == 0
    assert out.token_ids == expected_reply(make_engine, follow_up)
    assert not sick.kv_cache.pool.cached_blocks  # nothing of it was hit in its process either
    assert not written_by_the_sick_engine


def test_a_block_that_is_not_finite_is_never_stored(tmp_path):
    tier = KVTier(LAYOUT, 0, tmp_path, 2**20)
    kv = torch.stack([block(1.0), block(2.0), block(3.0)])
    kv[1, 0, 0, 0, 0, 0] = float("inf")
    kv[2, 1, 1, 1, 1, 1] = float("nan")
    keys = [bytes([i]) * 16 for i in range(3)]
    tier.store(keys, kv)
    assert tier.flush()
    assert [key in tier for key in keys] == [True, False, False]
    assert len(entries(tmp_path)) == 1 and tier.stats().blocks_not_finite == 2
    tier.close()


def overwrite_entries(directory: Path, layout: TierLayout, hashes: list[bytes]) -> None:
    """Rewrite entries, checksums and all, with KV that is finite (every check passes) but
    so large that a forward over it overflows, as KV from a fault outside the checks."""
    for block_hash in hashes:
        path = directory / layout.entry_name(block_hash)
        kv = layout.decode(block_hash, bytearray(path.read_bytes())).clone().fill_(3e38)
        path.write_bytes(b"".join(bytes(part) for part in layout.encode(block_hash, kv)))


def test_kv_restored_from_the_tier_that_fails_a_request_is_dropped_and_recomputed(
        tier_engine, make_engine, tmp_path, monkeypatch):
    """The entries are deleted between steps (KVTransfer), never inside the scheduler."""
    writer = tier_engine()
    follow_up = first_turn(writer, history())
    writer.close()
    layout = writer.kv_cache.tier.layout
    hashes = block_hashes(follow_up)[:history_blocks(follow_up)]
    overwrite_entries(tier_dir(tmp_path), layout, hashes)
    in_scheduler, drops = threading.local(), []
    recompute, drop = Scheduler.recompute_after_fault, KVTier.drop

    def watched_recompute(self: Scheduler, request) -> bool:
        in_scheduler.now = True
        try:
            return recompute(self, request)
        finally:
            in_scheduler.now = False

    def watched_drop(self: KVTier, block_hashes: list[bytes]) -> None:
        assert not getattr(in_scheduler, "now", False), "the scheduler deleted tier entries"
        drops.append(len(block_hashes))
        drop(self, block_hashes)

    monkeypatch.setattr(Scheduler, "recompute_after_fault", watched_recompute)
    monkeypatch.setattr(KVTier, "drop", watched_drop)

    reader = tier_engine()
    out = reader.generate([follow_up], GREEDY)[0]
    stats = reader.stats().tier
    assert out.finish_reason == "length", out.error
    assert out.token_ids == expected_reply(make_engine, follow_up)
    assert stats.disk_hit_blocks == len(hashes) and stats.blocks_dropped >= len(hashes)
    assert out.num_tier_cached_tokens == 0  # recomputed
    assert sum(drops) >= len(hashes)
    reader.close()  # the recomputed blocks went down: the tier holds sound KV again

    out = tier_engine().generate([follow_up], GREEDY)[0]
    assert out.num_tier_cached_tokens >= len(hashes) * BLOCK
    assert out.token_ids == expected_reply(make_engine, follow_up)


@pytest.mark.parametrize("directory", ["writable", "read-only"])
def test_a_request_that_fails_without_the_tier_too_is_recomputed_once(
        directory, tier_engine, tmp_path, monkeypatch):
    """The model fails on the new message whatever the history's KV: recomputed once without
    the tier, the request fails with the model's error, which says nothing of the cache.
    Only a tier that cannot delete the entries says how to (`paged-chat cache clear`)."""
    writer = tier_engine()
    follow_up = first_turn(writer, history())
    writer.close()
    with monkeypatch.context() as patch:
        poison_weights(patch, NEW_MESSAGE[0])
        reader = tier_engine()
    if directory == "read-only":
        monkeypatch.setattr(DiskTier, "_unlink", lambda self, name: False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = reader.generate([follow_up], GREEDY)[0]
    tier_warnings = [str(w.message) for w in caught if issubclass(w.category, KVTierWarning)]
    assert out.finish_reason == "error" and "not finite" in out.error
    assert "cache clear" not in out.error
    assert reader.stats().tier.disk_hit_blocks == history_blocks(follow_up)  # read once
    if directory == "read-only":
        assert len(tier_warnings) == 1 and "`paged-chat cache clear`" in tier_warnings[0]
    else:
        assert not tier_warnings and not entries(tier_dir(tmp_path))


# ---- what is not a regular file in the tier directory (issue 31, items 3 and 6) ----

def write_entries(directory: Path, count: int) -> list[bytes]:
    keys = [bytes([i]) * 16 for i in range(count)]
    disk = DiskTier(directory, 2**20, LAYOUT)
    for key in keys:
        disk.submit(key, block(float(key[0])))
    disk.close()
    return keys


def test_links_in_the_tier_dir_are_skipped_never_followed(tmp_path):
    """A dangling link, and a link (under an entry's name) to a sound entry elsewhere: both
    skipped and counted; the tier stays on and serves its own entries."""
    directory, elsewhere = tmp_path / TIER_DIR, tmp_path / "elsewhere"
    keys = write_entries(directory, 2)
    outside_key = bytes([9]) * 16
    outside = DiskTier(elsewhere, 2**20, LAYOUT)
    outside.submit(outside_key, block(9.0))
    outside.close()
    (directory / "dangling.kv").symlink_to(tmp_path / "nowhere.kv")
    (directory / LAYOUT.entry_name(outside_key)).symlink_to(elsewhere / LAYOUT.entry_name(outside_key))

    disk = DiskTier(directory, 2**20, LAYOUT)
    assert disk.enabled, disk.error
    assert disk.entries_skipped == 2 and len(disk.index) == 2
    assert outside_key not in disk and disk.read(outside_key) is None
    assert torch.equal(disk.read(keys[1]), block(1.0))
    disk.close()


def test_a_directory_named_like_an_entry_never_turns_the_tier_off(tmp_path):
    directory = tmp_path / TIER_DIR
    (directory / "not-an-entry.kv").mkdir(parents=True)
    disk = DiskTier(directory, 2 * LAYOUT.entry_nbytes, LAYOUT)
    for i in range(4):  # past the bound: eviction runs
        disk.submit(bytes([i]) * 16, block(float(i)))
    assert disk.flush()
    assert disk.enabled, disk.error
    assert disk.entries_skipped == 1 and len(entries(directory)) == 3  # the directory and 2
    assert (directory / "not-an-entry.kv").is_dir()
    disk.close()


def test_a_huge_sparse_entry_does_not_evict_the_real_ones(tmp_path):
    """Sized by st_size, a 50 GiB sparse file made the scan evict every entry; sized by its
    header (it has none) it is rejected, alone."""
    directory = tmp_path / TIER_DIR
    keys = write_entries(directory, 3)
    with open(directory / "sparse.kv", "wb") as file:
        file.truncate(50 * 2**30)
    disk = DiskTier(directory, 2**20, LAYOUT)
    assert all(key in disk and torch.equal(disk.read(key), block(float(key[0]))) for key in keys)
    assert disk.entries_rejected == 1 and not (directory / "sparse.kv").exists()
    assert disk.nbytes == 3 * LAYOUT.entry_nbytes
    disk.close()


def test_a_linked_tier_dir_is_not_used(tmp_path):
    target = tmp_path / "somewhere-else"
    target.mkdir()
    (tmp_path / TIER_DIR).symlink_to(target)
    with pytest.warns(KVTierWarning, match="link"):
        disk = DiskTier(tmp_path / TIER_DIR, 2**20, LAYOUT)
    assert not disk.enabled and not disk.submit(bytes(16), block(0.0))
    assert not list(target.iterdir())
    assert clear_disk_tier(tmp_path) == (0, 0)


def test_a_fifo_in_place_of_an_entry_never_blocks(tmp_path):
    """A FIFO under an entry's name, there at the scan or put there after it: the read
    returns at once (a miss), the FIFO is skipped and counted, and left alone."""
    directory = tmp_path / TIER_DIR
    keys = write_entries(directory, 2)
    os.mkfifo(directory / "fifo.kv")
    disk = DiskTier(directory, 2**20, LAYOUT)
    path = directory / LAYOUT.entry_name(keys[0])
    path.unlink()
    os.mkfifo(path)
    reads: list[torch.Tensor | None] = []
    reader = threading.Thread(target=lambda: reads.append(disk.read(keys[0])), daemon=True)
    reader.start()
    reader.join(timeout=30)
    if reader.is_alive():  # unblock the stuck open, so the test process can end
        os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
        pytest.fail("reading a FIFO entry blocked")
    assert reads == [None] and keys[0] not in disk
    assert disk.entries_skipped == 2  # the FIFO at the scan, and the one in place of keys[0]
    assert torch.equal(disk.read(keys[1]), block(1.0))
    assert path.is_fifo()
    disk.close()
