"""The block map and the engine panel show the KV tier: blocks read back from it, and its
hits, bytes and state."""

from __future__ import annotations

import dataclasses

import numpy as np
from helpers import snapshot

from paged_chat.engine.core.stats import BlockMap, KVTierStats
from paged_chat.tui.block_map import CACHED, FREE, RESTORED, TAB0, block_codes
from paged_chat.tui.engine_panel import describe_block, format_numbers


def test_cached_blocks_read_back_from_the_tier_have_their_own_code():
    ref = np.array([1, 0, 0, 0], dtype=np.int32)
    cached = np.array([True, True, True, False])
    from_tier = np.array([True, True, False, False])
    blocks = BlockMap.build(ref, cached, {"tab/1": [0]}, {"tab/1": "tab"}, from_tier)
    assert list(block_codes(blocks, {"tab": 0})) == [TAB0, RESTORED, CACHED, FREE]
    assert "read back from the KV tier" in describe_block(1, blocks, 16, {}, None).plain
    assert "read back" not in describe_block(2, blocks, 16, {}, None).plain


def test_the_panel_shows_the_tier_and_why_it_is_off():
    stats = snapshot(0, ["a", "b", "c"])
    assert "tier" not in format_numbers(stats).plain   # no tier configured: no row
    tier = KVTierStats(disk_capacity_bytes=4 * 2**30, disk_bytes=3 * 2**20, hit_blocks=5,
                       hit_tokens=80, miss_blocks=5, miss_tokens=80)
    shown = format_numbers(dataclasses.replace(stats, tier=tier)).plain
    assert "tier   hit 50% (80 tok) · 3/4,096 MiB" in shown
    off = dataclasses.replace(tier, disk_error="the disk is full")
    assert "tier   off: the disk is full" in format_numbers(dataclasses.replace(stats, tier=off)).plain
