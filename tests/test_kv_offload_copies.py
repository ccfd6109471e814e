"""The KV tier's copies out of the pool, off the step: on CUDA each is a non-blocking copy
into pinned memory, done when its event passes. Here, on the CPU, a copy is held in flight
(its host buffer NaN, its event not passed) until the test lets it land, as a device's
would: the tier never serves a block before its copy has landed, a block reused meanwhile
reaches the tier as it was when it left the pool, a drop meanwhile keeps it out, and no
step waits for a copy."""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest
import torch

from paged_chat.engine import Engine, SamplingParams
from paged_chat.engine.clients.engine_loop import Add, Shutdown, serve_engine
from paged_chat.engine.kv import transfer
from paged_chat.engine.kv.transfer import HostCopy

GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


class HeldEvent:
    """A copy's event that passes when the test lets it; the copy lands when it passes."""

    def __init__(self, copy_in: HostCopy) -> None:
        self.copy_in = copy_in
        self.passed = False
        self.waited = 0

    def land(self) -> None:
        if not self.passed:
            self.copy_in.kv.copy_(self.copy_in.source)
            self.copy_in.finite.copy_(torch.isfinite(self.copy_in.source).flatten(1).all(1))
            self.passed = True

    def query(self) -> bool:
        return self.passed

    def synchronize(self) -> None:
        self.waited += 1
        self.land()


@dataclass
class Held:
    """A copy out of the pool held in flight, and the KV it read out of the pool when issued."""

    block_hashes: list[bytes]
    event: HeldEvent
    issued_kv: torch.Tensor


@pytest.fixture
def held_copies(monkeypatch) -> list[Held]:
    """Every copy out of the pool, held in flight until its event lands it."""
    copies: list[Held] = []

    def held(block_hashes: list[bytes], kv: torch.Tensor) -> HostCopy:
        copy = HostCopy(block_hashes, torch.full_like(kv, float("nan")),
                        torch.zeros(len(kv), dtype=torch.bool), source=kv)
        copy.event = HeldEvent(copy)
        copies.append(Held(block_hashes, copy.event, kv.clone()))
        return copy

    monkeypatch.setattr(transfer, "start_host_copy", held)
    return copies


def prompt(seed: int, length: int = 150) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 512) for _ in range(length)]


def tier_of(engine: Engine):
    return engine.kv_cache.tier


def test_a_block_is_not_in_the_tier_before_its_copy_lands(make_engine, held_copies):
    engine = make_engine(num_blocks=64, kv_tier_host_bytes="1MiB", kv_tier_disk_bytes=0)
    engine.generate([prompt(1)], GREEDY)
    [copy] = held_copies     # the finished request's full blocks, at the end of its last step
    assert len(copy.block_hashes) == 150 // 16
    tier = tier_of(engine)
    engine.kv_transfer.offload()
    assert not any(block_hash in tier for block_hash in copy.block_hashes)
    assert tier.load(copy.block_hashes) == [], "served before its copy landed"
    copy.event.land()
    engine.kv_transfer.offload()
    assert all(block_hash in tier for block_hash in copy.block_hashes)
    loaded = tier.load(copy.block_hashes)
    assert torch.equal(torch.stack(loaded), copy.issued_kv)
    assert copy.event.waited == 0, "a step waited for a copy"


def test_a_block_reused_before_its_copy_lands_reaches_the_tier_as_it_left(make_engine,
                                                                           held_copies):
    """A pool of 12 blocks holds one prompt at a time: the second prompt evicts the first's
    blocks and its forwards overwrite them while the first's copy is still in flight."""
    engine = make_engine(num_blocks=12, kv_tier_host_bytes="1MiB", kv_tier_disk_bytes=0)
    first = prompt(1)
    engine.generate([first], GREEDY)
    [copy] = held_copies
    cached = engine.kv_cache.pool.cached_blocks
    block_ids = [cached[block_hash].block_id for block_hash in copy.block_hashes]
    engine.generate([prompt(2)], GREEDY)
    evicted = [index for index, block_hash in enumerate(copy.block_hashes)
               if block_hash not in cached]
    assert evicted
    reused = engine.runner.read_blocks([block_ids[index] for index in evicted])
    assert not torch.equal(reused, copy.issued_kv[evicted]), "no block was written again"
    assert all(held.event.waited == 0 for held in held_copies), "a step waited for a copy"
    engine.settle()     # the loop going idle: every copy lands and goes to the tier
    assert torch.equal(torch.stack(tier_of(engine).load(copy.block_hashes)), copy.issued_kv)
    again = engine.generate([first + [7, 8, 9]], GREEDY)[0]
    assert again.num_tier_cached_tokens > 0
    fresh = make_engine(num_blocks=12)
    assert again.token_ids == fresh.generate([first + [7, 8, 9]], GREEDY)[0].token_ids


def test_copies_reach_the_tier_in_the_order_they_were_issued(make_engine, held_copies):
    engine = make_engine(num_blocks=64, kv_tier_host_bytes="1MiB", kv_tier_disk_bytes=0)
    engine.generate([prompt(1)], GREEDY)
    engine.generate([prompt(2)], GREEDY)
    older, newer = held_copies
    tier = tier_of(engine)
    newer.event.land()
    engine.kv_transfer.offload()
    assert not any(block_hash in tier for block_hash in older.block_hashes + newer.block_hashes)
    older.event.land()
    engine.kv_transfer.offload()
    assert all(block_hash in tier for block_hash in older.block_hashes + newer.block_hashes)


def test_a_block_dropped_while_its_copy_runs_is_never_stored(make_engine, held_copies):
    """KV that made a request fail is dropped from the tier; one on its way there is too."""
    engine = make_engine(num_blocks=64, kv_tier_host_bytes="1MiB", kv_tier_disk_bytes=0)
    engine.generate([prompt(1)], GREEDY)
    [copy] = held_copies
    dropped, kept = copy.block_hashes[:3], copy.block_hashes[3:]
    engine.kv_cache.tier_drops += dropped
    engine.kv_transfer.offload()
    engine.settle()
    tier = tier_of(engine)
    assert not any(block_hash in tier for block_hash in dropped)
    assert all(block_hash in tier for block_hash in kept)
    assert torch.equal(torch.stack(tier.load(kept)), copy.issued_kv[3:])


def test_a_block_on_its_way_is_not_copied_again(make_engine, held_copies):
    """A block freed (copy issued) and then evicted is listed twice: one copy."""
    engine = make_engine(num_blocks=12, kv_tier_host_bytes="1MiB", kv_tier_disk_bytes=0)
    engine.generate([prompt(1)], GREEDY)
    engine.generate([prompt(2)], GREEDY)    # evicts the first's blocks, copies in flight
    first, *rest = held_copies
    assert not any(set(first.block_hashes) & set(other.block_hashes) for other in rest)


def test_the_loop_going_idle_lands_the_copies_in_flight(make_engine, held_copies):
    """Copies still in flight when the last request finishes land once the loop has nothing
    to step, before it waits for commands (its idle snapshot shows them in the tier)."""
    engine = make_engine(num_blocks=64, kv_tier_host_bytes="1MiB", kv_tier_disk_bytes=0)
    sent: list[str] = []
    waited_in_steps: list[int] = []
    idle_host_blocks: list[int] = []

    def receive(block: bool) -> list:
        if not block:
            return []
        sent.append("request" if not sent else "shutdown")
        return [Add("r", prompt(1), GREEDY, None)] if len(sent) == 1 else [Shutdown("done")]

    class Events:
        def on_outputs(self, outputs) -> None:
            waited_in_steps.extend(held.event.waited for held in held_copies)

        def on_stats(self, stats) -> None:
            if not engine.has_unfinished():
                idle_host_blocks.append(stats.tier.host_blocks)

    assert serve_engine(engine, receive, Events(), stats_interval_s=1.0) == "done"
    assert not any(waited_in_steps), "a step waited for a copy"
    [copy] = held_copies
    assert copy.event.waited == 1
    assert idle_host_blocks[:2] == [0, len(copy.block_hashes)]
