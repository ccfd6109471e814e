"""Paged attention on Triton kernels: the CUDA path (and, under TRITON_INTERPRET=1, CPU tests).

Same contract as `TorchAttention`: store the step's K/V by slot mapping, then attend. The
flat batch is split where the metadata already splits it: the decodes (one query token
each, first) run as one launch with small query tiles and flash-decoding when the batch is
too small to fill the GPU; the prefill chunks run as a second launch with larger query
tiles, reading their cached prefix from the blocks.

Tiles, warps and pipeline stages are a function of (kind, head dim, dtype, GPU
architecture): `tile_config`. Every choice it makes compiles without register spills and
within the architecture's shared memory on sm_80, sm_86, sm_89 and sm_90, at head dims 64,
80, 96, 128 and 256 in fp16, bf16 and fp32 (`benchmarks/device_check.py --compile-only`
checks the whole matrix; CI a part of it).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton

from paged_chat.engine.attention.backend import AttentionBackend
from paged_chat.engine.attention.metadata import AttentionMetadata
from paged_chat.engine.attention.triton_paged_attention import (
    choose_num_splits,
    paged_attention,
    split_workspace,
    store_kv,
)

KINDS = ("decode", "prefill")
# Shared memory one block may use (the opt-in maximum), by compute capability.
SHARED_MEMORY_BYTES = {80: 163 * 1024, 86: 99 * 1024, 89: 99 * 1024, 90: 227 * 1024}
# What the interpreter (no GPU) plans for; it has no limits of its own.
DEFAULT_ARCH = 90


@dataclass(frozen=True, slots=True)
class TileConfig:
    """One program's work and resources: `rows` query rows (tokens x the padded group of
    query heads), `tile_n` keys per loop step, and the launch's warps and pipeline stages."""

    rows: int
    tile_n: int
    num_warps: int
    num_stages: int


def tile_config(kind: str, head_dim: int, dtype: torch.dtype, arch: int) -> TileConfig:
    """The tiles of a "decode" or "prefill" launch at this head dim, cache dtype and
    compute capability (80, 86, 89, 90; others take the nearest lower one's limits).

    A decode has one token: its rows are the group, padded to tl.dot's minimum of 16.
    Registers bound the tile: the fp32 accumulator is rows x head_dim and the scores rows x
    tile_n per program, so wide heads and fp32 (exact fp32 dots, no tensor cores) take fewer
    rows and keys or more warps, chosen so that ptxas reports no register spills. Shared
    memory bounds the stages: each holds a K and a V tile, and sm_86/sm_89 have 99 KB where
    sm_80 has 163 KB and sm_90 227 KB.
    """
    assert kind in KINDS
    dim_pad = max(16, triton.next_power_of_2(head_dim))
    if dtype == torch.float32:
        rows, tile_n, num_warps = {
            ("decode", 16): (16, 32, 4), ("decode", 32): (16, 32, 4), ("decode", 64): (16, 32, 4),
            ("decode", 128): (16, 32, 8), ("decode", 256): (16, 16, 8),
            ("prefill", 16): (32, 32, 4), ("prefill", 32): (32, 32, 4),
            ("prefill", 64): (32, 32, 8), ("prefill", 128): (32, 16, 8),
            ("prefill", 256): (16, 16, 8)}[kind, dim_pad]
    else:
        wide = dim_pad > 128
        rows = 16 if kind == "decode" else 32 if wide else 64
        tile_n = 32 if wide else 64
        num_warps = 4
    stage_bytes = 2 * tile_n * dim_pad * dtype.itemsize
    small_shared = _limits_arch(arch) in (86, 89)
    deep = not (small_shared or dtype == torch.float32 or stage_bytes >= 32 * 1024)
    return TileConfig(rows, tile_n, num_warps, 3 if deep else 2)


def _limits_arch(arch: int) -> int:
    return max((known for known in SHARED_MEMORY_BYTES if known <= arch), default=80)


@functools.cache
def device_arch(device: torch.device) -> int:
    """Compute capability as 80, 86, 89, 90...; the interpreter (CPU) plans for DEFAULT_ARCH."""
    if device.type != "cuda":
        return DEFAULT_ARCH
    major, minor = torch.cuda.get_device_capability(device)
    return 10 * major + minor


@functools.cache
def _num_sms(device: torch.device) -> int:
    """Streaming multiprocessors to fill; the interpreter (CPU) runs one program at a time."""
    if device.type != "cuda":
        return 1
    return torch.cuda.get_device_properties(device).multi_processor_count


@dataclass(frozen=True, slots=True)
class Launch:
    """One attention launch of a step: the same for every layer."""

    seqs: range
    block_q: int
    tiles: TileConfig
    num_splits: int
    workspace: tuple[torch.Tensor, torch.Tensor] | None


class TritonAttention(AttentionBackend):
    """Paged attention on Triton kernels, with the torch backend's cache layout and call."""

    compiles_kernels = True
    attends_stored_kv = True

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float) -> None:
        super().__init__(num_heads, num_kv_heads, head_dim, scale)
        self._group_pad = triton.next_power_of_2(self.group_size)

    def tile(self, kind: str, dtype: torch.dtype, arch: int = DEFAULT_ARCH
             ) -> tuple[int, TileConfig]:
        """(query tokens per program, tiles) of a "decode" or "prefill" launch."""
        tiles = tile_config(kind, self.head_dim, dtype, arch)
        return max(1, tiles.rows // self._group_pad), tiles

    def __call__(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 key_cache: torch.Tensor, value_cache: torch.Tensor,
                 meta: AttentionMetadata, sliding_window: int | None = None) -> torch.Tensor:
        store_kv(key, value, key_cache, value_cache, meta.slot_mapping)
        return self.attend(query, key_cache, value_cache, meta, sliding_window)

    def attend(self, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
               meta: AttentionMetadata, sliding_window: int | None = None) -> torch.Tensor:
        """Attention alone, the step's K/V already in their slots (stored by the model's
        fused RoPE-and-store kernel): `query` [T, heads, dim] (any strides) -> [T, heads, dim]."""
        output = torch.empty(query.shape, dtype=query.dtype, device=query.device)
        for launch in self._launches(meta, key_cache):
            paged_attention(query, key_cache, value_cache, output, meta, launch.seqs, self.scale,
                            block_q=launch.block_q, tile_n=launch.tiles.tile_n,
                            num_splits=launch.num_splits, num_warps=launch.tiles.num_warps,
                            num_stages=launch.tiles.num_stages, sliding_window=sliding_window,
                            workspace=launch.workspace)
        return output

    def plan_graph(self, meta: AttentionMetadata, cache: torch.Tensor, longest: int) -> None:
        """Fix the launches of a decode step about to be captured in a CUDA graph, splits
        planned for `longest`, the longest context a replay may have: a graph replays the
        grid it was captured with, and a shorter context leaves the extra splits empty (they
        weigh 0 in the merge)."""
        assert "triton_launches" not in meta.per_step and meta.num_decodes == meta.num_seqs
        self._launches(meta, cache, longest)

    def _launches(self, meta: AttentionMetadata, cache: torch.Tensor,
                  longest: int | None = None) -> list[Launch]:
        """The decode and the prefill launch; the same for every layer, so worked out (and
        their split workspaces allocated) once per step."""
        launches = meta.per_step.get("triton_launches")
        if launches is None:
            launches = []
            starts, num_sms = meta.query_start_loc_list, _num_sms(cache.device)
            for kind, seqs in zip(KINDS, (range(meta.num_decodes),
                                          range(meta.num_decodes, meta.num_seqs))):
                if not seqs:
                    continue
                block_q, tiles = self.tile(kind, cache.dtype, device_arch(cache.device))
                q_tiles = sum(triton.cdiv(starts[s + 1] - starts[s], block_q) for s in seqs)
                splits = choose_num_splits(
                    q_tiles * self.num_kv_heads,
                    longest or max(meta.seq_lens_list[seqs.start:seqs.stop]), num_sms)
                workspace = split_workspace(
                    starts[seqs.stop] - starts[seqs.start], self.num_heads, self.head_dim,
                    splits, cache.device) if splits > 1 else None
                launches.append(Launch(seqs, block_q, tiles, splits, workspace))
            meta.per_step["triton_launches"] = launches
        return launches
