"""The Triton kernels against the torch backend, under TRITON_INTERPRET=1 when there is no GPU.

The interpreter does not catch out-of-bounds loads, so every input is poisoned around what
a kernel may read: cache slots outside the live contexts, the padding block of the block
tables, and the borders of strided query/key/value views hold NaN. A load that a mask
should have stopped shows up as NaN in the output. Shapes are ragged on purpose: contexts
that end mid-block, chunks whose cached prefix ends mid-block, GQA groups of 1, 3 and 7,
head dims that are not powers of two, shuffled block tables, tiles that span blocks.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

triton = pytest.importorskip("triton", reason="the Triton kernels need the triton package "
                             "(extra 'gpu')")
import triton.language as tl  # noqa: E402

from paged_chat.engine import PagedChatError, SamplingParams
from paged_chat.engine.attention import triton_backend  # noqa: E402
from paged_chat.engine.attention.cpu_backend import CpuAttention, cpu_kernels_available
from paged_chat.engine.attention.metadata import AttentionMetadata
from paged_chat.engine.attention.torch_backend import TorchAttention
from paged_chat.engine.attention.triton_backend import SHARED_MEMORY_BYTES, TritonAttention
from paged_chat.engine.attention.triton_paged_attention import (  # noqa: E402
    MAX_SPLITS,
    cache_offsets,
    choose_num_splits,
    paged_attention,
    store_kv,
)

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
# Reference in fp32 on the same (rounded) inputs; ours rounds P (fp16) and the output, and
# the interpreter casts fp32 to bf16 by truncation (one bf16 ulp, 1/64 at |x| near 3).
TOLERANCE = {torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}


def poisoned(shape: tuple[int, ...], dtype: torch.dtype,
             generator: torch.Generator) -> torch.Tensor:
    """Random values in a non-contiguous view whose neighbours in memory are NaN."""
    padded = torch.full([n + 2 for n in shape], float("nan"), dtype=dtype)
    inner = padded[tuple(slice(1, n + 1) for n in shape)]
    inner.copy_(torch.randn(shape, generator=generator))
    return padded.to(DEVICE)[tuple(slice(1, n + 1) for n in shape)]


class Batch:
    """One step's flat batch: sequences given as (cached prefix length, new tokens), decodes first.

    Blocks are handed out in shuffled order; block 0 pads the tables (as the runner does)
    and, like every slot no sequence owns, holds NaN.
    """

    def __init__(self, seqs: list[tuple[int, int]], *, num_heads: int, num_kv_heads: int,
                 head_dim: int, block_size: int, dtype: torch.dtype, seed: int = 0) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.dtype = dtype
        seq_lens = [prefix + new for prefix, new in seqs]
        blocks_per_seq = [-(-n // block_size) for n in seq_lens]
        num_blocks = 1 + sum(blocks_per_seq) + 3          # and three blocks nobody owns
        order = (1 + torch.randperm(num_blocks - 1, generator=generator)).tolist()
        width = max(blocks_per_seq) + 2                   # padded, as a longer neighbour would
        tables, cursor = [], 0
        for count in blocks_per_seq:
            tables.append(order[cursor:cursor + count] + [0] * (width - count))
            cursor += count
        self.block_tables = torch.tensor(tables, dtype=torch.int32)

        shape = (num_kv_heads, num_blocks, block_size, head_dim)
        self.key_cache = torch.full(shape, float("nan"), dtype=dtype)
        self.value_cache = torch.full(shape, float("nan"), dtype=dtype)
        slots, starts = [], [0]
        for seq, (prefix, new) in enumerate(seqs):
            positions = torch.arange(prefix + new)
            seq_slots = self.block_tables[seq, positions // block_size].long() * block_size \
                + positions % block_size
            for cache in (self.key_cache, self.value_cache):
                cache.view(num_kv_heads, -1, head_dim)[:, seq_slots[:prefix]] = torch.randn(
                    num_kv_heads, prefix, head_dim, generator=generator).to(dtype)
            slots.append(seq_slots[prefix:])
            starts.append(starts[-1] + new)
        num_tokens = starts[-1]
        self.query = poisoned((num_tokens, num_heads, head_dim), dtype, generator)
        self.key = poisoned((num_tokens, num_kv_heads, head_dim), dtype, generator)
        self.value = poisoned((num_tokens, num_kv_heads, head_dim), dtype, generator)
        self.meta = AttentionMetadata.build([new for _, new in seqs], seq_lens,
                                            self.block_tables, block_size, DEVICE,
                                            slot_mapping=torch.cat(slots))
        self.key_cache, self.value_cache = self.key_cache.to(DEVICE), self.value_cache.to(DEVICE)

    def reference(self, num_heads: int, num_kv_heads: int,
                  head_dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(output, key cache, value cache) as the torch backend makes them: the caches in
        this batch's dtype (still NaN where nothing was stored), the output in fp32 from
        NaN-free copies of them."""
        caches = [c.clone() for c in (self.key_cache, self.value_cache)]
        for cache, new in zip(caches, (self.key, self.value)):
            cache.view(cache.shape[0], -1, cache.shape[-1])[:, self.meta.slot_mapping] = \
                new.transpose(0, 1)
        clean = [c.float().nan_to_num(0.0) for c in caches]
        attention = TorchAttention(num_heads, num_kv_heads, head_dim, scale=head_dim ** -0.5)
        out = attention(self.query.float(), self.key.float(), self.value.float(), *clean, self.meta)
        return out, *caches

    def check_caches(self, expected_k: torch.Tensor, expected_v: torch.Tensor) -> None:
        """Every new token landed in its slot, and nothing else changed."""
        for ours, expected in ((self.key_cache, expected_k), (self.value_cache, expected_v)):
            torch.testing.assert_close(ours, expected, atol=0, rtol=0, equal_nan=True)


def check_output(ours: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    assert not ours.isnan().any(), "a masked-off load reached the output"
    torch.testing.assert_close(ours.float(), expected, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


def run_kernel(batch: Batch, seqs: range, num_heads: int, *, block_q: int, tile_n: int,
               num_splits: int) -> torch.Tensor:
    """Store the new K/V, then attend only `seqs`; rows of other sequences stay NaN."""
    store_kv(batch.key, batch.value, batch.key_cache, batch.value_cache, batch.meta.slot_mapping)
    output = torch.full(batch.query.shape, float("nan"), dtype=batch.dtype, device=DEVICE)
    head_dim = batch.query.shape[-1]
    paged_attention(batch.query, batch.key_cache, batch.value_cache, output, batch.meta, seqs,
                    head_dim ** -0.5, block_q=block_q, tile_n=tile_n, num_splits=num_splits)
    return output


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("num_kv_heads,head_dim", [(3, 80), (2, 16)])
def test_store_kv_writes_slots_and_skips_minus_one(dtype, num_kv_heads, head_dim):
    generator = torch.Generator().manual_seed(1)
    shape = (num_kv_heads, 6, 16, head_dim)
    key_cache = torch.randn(shape, generator=generator).to(dtype).to(DEVICE)
    value_cache = torch.randn(shape, generator=generator).to(dtype).to(DEVICE)
    key = poisoned((5, num_kv_heads, head_dim), dtype, generator)
    value = poisoned((5, num_kv_heads, head_dim), dtype, generator)
    slots = torch.tensor([17, -1, 95, 3, -1], device=DEVICE)
    expected_k, expected_v = key_cache.clone(), value_cache.clone()
    kept = slots >= 0
    expected_k.view(num_kv_heads, -1, head_dim)[:, slots[kept]] = key[kept].transpose(0, 1)
    expected_v.view(num_kv_heads, -1, head_dim)[:, slots[kept]] = value[kept].transpose(0, 1)

    store_kv(key, value, key_cache, value_cache, slots)
    assert torch.equal(key_cache, expected_k)
    assert torch.equal(value_cache, expected_v)


# (prefix, new) per sequence: contexts ending mid-block, one exactly at a block boundary,
# one of a single token.
DECODE_SEQS = [(36, 1), (15, 1), (63, 1), (0, 1)]


@pytest.mark.parametrize("group", [1, 3, 7])
@pytest.mark.parametrize("num_splits", [1, 4])
def test_decode_matches_torch(group, num_splits):
    num_kv_heads, head_dim, dtype = 2, 32, torch.float16
    batch = Batch(DECODE_SEQS, num_heads=group * num_kv_heads, num_kv_heads=num_kv_heads,
                  head_dim=head_dim, block_size=16, dtype=dtype, seed=group)
    expected, expected_k, expected_v = batch.reference(group * num_kv_heads, num_kv_heads, head_dim)
    ours = run_kernel(batch, range(len(DECODE_SEQS)), group * num_kv_heads,
                      block_q=max(1, 16 // triton.next_power_of_2(group)), tile_n=16,
                      num_splits=num_splits)
    check_output(ours, expected, dtype)
    batch.check_caches(expected_k, expected_v)


@pytest.mark.parametrize("head_dim,block_size,tile_n", [(80, 16, 32), (96, 32, 16), (64, 32, 64),
                                                         (128, 16, 16)])
def test_decode_head_dims_and_tiles(head_dim, block_size, tile_n):
    """Non-power-of-two head dims; tiles spanning blocks (32 keys over 16-row blocks) and
    blocks spanning tiles; three splits' worth of keys over four splits."""
    batch = Batch([(40, 1), (9, 1)], num_heads=3, num_kv_heads=1, head_dim=head_dim,
                  block_size=block_size, dtype=torch.float16, seed=head_dim)
    expected, *_ = batch.reference(3, 1, head_dim)
    ours = run_kernel(batch, range(2), 3, block_q=4, tile_n=tile_n, num_splits=4)
    check_output(ours, expected, torch.float16)


# A chunk whose cached prefix ends mid-block, a fresh prompt, one whose prefix ends on a
# block boundary, and a two-token chunk, after two decodes.
MIXED_SEQS = [(20, 1), (33, 1), (21, 19), (0, 13), (32, 5), (7, 2)]


@pytest.mark.parametrize("group", [1, 3, 7])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_prefill_matches_torch(group, dtype):
    num_kv_heads, head_dim = 1 if group == 7 else 2, 16
    num_heads = group * num_kv_heads
    batch = Batch(MIXED_SEQS, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                  block_size=16, dtype=dtype, seed=10 + group)
    expected, *_ = batch.reference(num_heads, num_kv_heads, head_dim)
    prefills = range(2, len(MIXED_SEQS))
    ours = run_kernel(batch, prefills, num_heads,
                      block_q=max(1, 16 // triton.next_power_of_2(group)), tile_n=16, num_splits=1)
    rows = slice(batch.meta.query_start_loc_list[2], None)
    check_output(ours[rows], expected[rows], dtype)
    assert ours[:rows.start].isnan().all(), "wrote rows of sequences outside the launch"


def test_prefill_with_splits_and_block_32():
    """A short chunk over a long cached prefix: the case a chat turn makes, split four ways."""
    batch = Batch([(70, 6), (45, 3)], num_heads=6, num_kv_heads=2, head_dim=80, block_size=32,
                  dtype=torch.float16, seed=3)
    expected, *_ = batch.reference(6, 2, 80)
    ours = run_kernel(batch, range(2), 6, block_q=4, tile_n=16, num_splits=4)
    check_output(ours, expected, torch.float16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_backend_matches_torch_on_a_mixed_batch(dtype):
    """TritonAttention end to end (store, decode launch, prefill launch) with its own tiles."""
    batch = Batch(MIXED_SEQS, num_heads=6, num_kv_heads=2, head_dim=16, block_size=16,
                  dtype=dtype, seed=4)
    expected, expected_k, expected_v = batch.reference(6, 2, 16)
    ours = TritonAttention(6, 2, 16, scale=16 ** -0.5)(
        batch.query, batch.key, batch.value, batch.key_cache, batch.value_cache, batch.meta)
    check_output(ours, expected, dtype)
    batch.check_caches(expected_k, expected_v)


def test_num_splits_follow_batch_and_context():
    assert choose_num_splits(num_programs=8, max_seq_len=32768, num_sms=132) == MAX_SPLITS
    assert choose_num_splits(num_programs=8, max_seq_len=2048, num_sms=132) == 8
    assert choose_num_splits(num_programs=8, max_seq_len=2047, num_sms=132) == 4
    assert choose_num_splits(num_programs=40, max_seq_len=32768, num_sms=132) == 4
    assert choose_num_splits(num_programs=8, max_seq_len=300, num_sms=132) == 1
    assert choose_num_splits(num_programs=256, max_seq_len=32768, num_sms=132) == 1
    for programs in (1, 3, 40, 100):
        for length in (1, 700, 5000, 100000):
            splits = choose_num_splits(programs, length, 132)
            assert splits & (splits - 1) == 0 and 1 <= splits <= MAX_SPLITS
            assert splits == 1 or length >= splits * 256


def test_engine_greedy_tokens_match_torch_backend(make_engine):
    """A few engine steps on the tiny model: decodes, chunked prefill that ends mid-block,
    and a prompt whose first block is a prefix-cache hit."""
    shared = list(range(3, 23))
    prompts = [shared + [40, 41, 42], list(range(100, 131)), shared + [50, 51]]
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    settings = dict(device=DEVICE.type, max_num_batched_tokens=24, num_blocks=32)
    expected = make_engine(attention_backend="torch", **settings).generate(prompts, params)
    engine = make_engine(attention_backend="triton", **settings)
    assert isinstance(engine.runner.attention, TritonAttention)
    outputs = engine.generate(prompts, params)
    assert [o.token_ids for o in outputs] == [o.token_ids for o in expected]
    assert engine.stats().prefix_cache_hit_tokens > 0


@pytest.mark.perf
def test_kernels_compile_clean_on_the_archs_with_least_room(tmp_path):
    """The interpreter never lowers the kernels; triton's compiler does, without a GPU.

    CI runs the corner of the compile matrix that was hardest to fit (the full matrix,
    `device_check.py --compile-only`, is ~4 minutes, and a padded head dim such as 80 is
    in it): sm_80 (where fp32 with three stages and bf16 at head dim 256 with eight warps
    spilled) and sm_89 (99 KB of shared memory, where bf16 prefill at head dim 256 used not
    to fit), at head dim 256, in bf16 and fp32, and the quantized linear layers' GEMV and
    dot kernels in both layouts. Every variant must compile with no spills and within the
    arch's shared memory."""
    env = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
    summary = tmp_path / "device_check.json"
    result = subprocess.run([sys.executable, "-m", "benchmarks.device_check", "--compile-only", "--arch", "80,89",
                             "--head-dims", "256", "--dtypes", "bf16,fp32",
                             "--out", str(summary)], env=env, capture_output=True, text=True,
                            timeout=600, cwd=Path(__file__).resolve().parent.parent)
    compiled = json.loads(summary.read_text())["compile"]
    assert {(c["arch"], c["head_dim"], c["dtype"]) for c in compiled} == {
        (arch, dim, dtype) for arch in (80, 89) for dim in (256, None)
        for dtype in ("bf16", "fp32")}
    assert {c["kernel"] for c in compiled} == {
        "_store_kv_kernel", "_paged_attention_kernel", "_merge_splits_kernel",
        "_gemv_kernel", "_dot_kernel"}
    for variant in compiled:
        assert variant["spill_bytes"] == 0, variant
        assert variant["shared_bytes"] <= SHARED_MEMORY_BYTES[variant["arch"]], variant
    assert result.returncode == 0, result.stderr[-3000:]


def test_engine_picks_the_backend(make_engine, monkeypatch):
    on_cpu = CpuAttention if cpu_kernels_available() else TorchAttention
    assert isinstance(make_engine(attention_backend="auto").runner.attention,
                      TritonAttention if DEVICE.type == "cuda" else on_cpu)
    if DEVICE.type == "cpu":
        monkeypatch.delenv("TRITON_INTERPRET")
        with pytest.raises(PagedChatError, match="runs on CUDA"):
            make_engine(attention_backend="triton")


def _device_check():
    """benchmarks/device_check.py (its checks are tested here, on the CPU)."""
    from benchmarks import device_check

    return device_check


def test_device_check_catches_a_dropped_split():
    """The device check's row check passes the kernels' 4-way split and merge, and fails
    when one split is left out of the merge (before, a max-error bound of 2e-2 let a lost
    split through at long contexts)."""
    device_check = _device_check()
    shape = device_check.Shape("tiny-d80-gqa3", 6, 2, 80, 16)
    result = device_check.drop_split_self_test(shape, [(70, 1), (45, 1)], torch.float16, DEVICE)
    assert result["clean_ok"], result
    assert not result["dropped_ok"] and result["dropped_bad_rows"] > 0, result
    assert result["ok"]


@triton.jit
def _cache_offsets_probe(blocks_ptr, heads_ptr, out_ptr, stride_cb, stride_cs, stride_ch,
                         stride_cd, N: tl.constexpr):
    index = tl.arange(0, N)
    block = tl.load(blocks_ptr + index)
    head = tl.load(heads_ptr + index)
    offsets = cache_offsets(block, index % 16, head, index, stride_cb, stride_cs, stride_ch,
                             stride_cd)
    tl.store(out_ptr + index, offsets)


def test_cache_offsets_do_not_overflow_past_2_31_elements():
    """The kernels' cache address arithmetic for a head-major pool of 2**31+ elements: int32
    block ids and heads whose offsets pass 2**31 (the interpreter wraps int32 like a GPU)."""
    num_kv_heads, num_blocks, block_size, head_dim = 4, 2**21 + 5, 16, 128
    strides = (block_size * head_dim, head_dim, num_blocks * block_size * head_dim, 1)
    assert num_kv_heads * strides[2] > 2**31
    blocks = torch.tensor([0, 1, 2**20, num_blocks - 1] * 4, dtype=torch.int32)
    heads = torch.tensor([0] * 4 + [1] * 4 + [2] * 4 + [3] * 4, dtype=torch.int32)
    out = torch.zeros(16, dtype=torch.int64)
    _cache_offsets_probe[(1,)](blocks, heads, out, *strides, N=16)
    expected = [b * strides[0] + (i % 16) * strides[1] + h * strides[2] + i * strides[3]
                for i, (b, h) in enumerate(zip(blocks.tolist(), heads.tolist()))]
    assert max(expected) > 2**31
    assert out.tolist() == expected


def dense_windowed_reference(batch: Batch, caches: tuple[torch.Tensor, torch.Tensor],
                             num_heads: int, window: int) -> torch.Tensor:
    """Attention of every query token over its own sequence's keys k with
    position - window < k <= position (transformers' sliding window), dense, in fp32."""
    meta, block_size = batch.meta, batch.meta.block_size
    keys_cache, values_cache = (c.float().nan_to_num(0.0) for c in caches)
    num_kv_heads, head_dim = keys_cache.shape[0], keys_cache.shape[-1]
    out = torch.zeros(batch.query.shape, dtype=torch.float32)
    for seq, seq_len in enumerate(meta.seq_lens_list):
        start, end = meta.query_start_loc_list[seq], meta.query_start_loc_list[seq + 1]
        positions = torch.arange(seq_len)
        slots = batch.block_tables[seq, positions // block_size].long() * block_size \
            + positions % block_size
        keys = keys_cache.view(num_kv_heads, -1, head_dim)[:, slots].cpu()
        values = values_cache.view(num_kv_heads, -1, head_dim)[:, slots].cpu()
        group = num_heads // num_kv_heads
        keys, values = keys.repeat_interleave(group, 0), values.repeat_interleave(group, 0)
        query = batch.query[start:end].float().cpu().transpose(0, 1)       # [heads, q, dim]
        query_pos = torch.arange(seq_len - (end - start), seq_len)[:, None]
        visible = (positions[None, :] <= query_pos) & (positions[None, :] > query_pos - window)
        scores = (query @ keys.transpose(1, 2)) * head_dim ** -0.5
        probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
        out[start:end] = (probs @ values).transpose(0, 1)
    return out.to(DEVICE)


# (prefix, new): decodes past and within the window, a chunk mid-block, a fresh prompt
# (ending mid-block and mid query block; its length multiplies the interpreter's work).
WINDOW_SEQS = [(100, 1), (7, 1), (37, 1), (21, 19), (0, 23), (45, 3)]


@pytest.mark.parametrize("window", [1, 10, 13, 20, 500])
@pytest.mark.parametrize("num_splits", [1, 4])
def test_sliding_window_matches_dense_reference(window, num_splits):
    """Windows shorter than a block, not a multiple of the block size (16), and longer than
    every sequence; decode and prefill launches (a prefill chunk that starts mid-block)."""
    num_heads, num_kv_heads, head_dim = 6, 2, 16
    batch = Batch(WINDOW_SEQS, num_heads=num_heads, num_kv_heads=num_kv_heads,
                  head_dim=head_dim, block_size=16, dtype=torch.float32, seed=window)
    _, *caches = batch.reference(num_heads, num_kv_heads, head_dim)
    expected = dense_windowed_reference(batch, caches, num_heads, window)
    store_kv(batch.key, batch.value, batch.key_cache, batch.value_cache, batch.meta.slot_mapping)
    output = torch.full(batch.query.shape, float("nan"), device=DEVICE)
    for seqs, block_q in ((range(3), 4), (range(3, len(WINDOW_SEQS)), 8)):
        paged_attention(batch.query, batch.key_cache, batch.value_cache, output, batch.meta,
                        seqs, head_dim ** -0.5, block_q=block_q, tile_n=16,
                        num_splits=num_splits, sliding_window=window)
    check_output(output, expected, torch.float32)


def test_sliding_window_never_reads_tiles_before_the_window():
    """Keys in tiles wholly before every row's window are NaN: a kernel that loaded them
    would put NaN into the output (0 * NaN in P @ V)."""
    num_heads, num_kv_heads, head_dim, window = 4, 2, 16, 20
    batch = Batch([(100, 1), (60, 4)], num_heads=num_heads, num_kv_heads=num_kv_heads,
                  head_dim=head_dim, block_size=16, dtype=torch.float32, seed=5)
    _, *caches = batch.reference(num_heads, num_kv_heads, head_dim)
    expected = dense_windowed_reference(batch, caches, num_heads, window)
    backend = TritonAttention(num_heads, num_kv_heads, head_dim, scale=head_dim ** -0.5)
    # The decode at 100 sees keys 81..100; the chunk at 60..63 sees 41..63.
    for seq, kind, first_key in ((0, "decode", 81), (1, "prefill", 41)):
        tile_n = backend.tile(kind, torch.float32)[1].tile_n
        stale = torch.arange(first_key // tile_n * tile_n)
        assert len(stale) >= 32
        slots = batch.block_tables[seq, stale // 16].long() * 16 + stale % 16
        for cache in (batch.key_cache, batch.value_cache):
            cache.view(num_kv_heads, -1, head_dim)[:, slots.to(DEVICE)] = float("nan")
    ours = backend(batch.query, batch.key, batch.value, batch.key_cache, batch.value_cache,
                   batch.meta, sliding_window=window)
    check_output(ours, expected, torch.float32)


def test_warm_up_leaves_no_kernel_variant_to_compile(make_engine, monkeypatch):
    """After `ModelRunner.warm_up` (which a CUDA engine runs before it serves), a generation that
    grows contexts past the split threshold, mixes decodes with chunked prefills and ends
    chunks mid-block launches no kernel variant the warm-up did not: nothing compiles mid-chat.
    Splits are planned as for a 132-SM GPU (the interpreter would never split), from 32
    keys on (not 512), to keep the interpreter's work small."""
    from paged_chat.engine.attention import triton_paged_attention as triton_kernels

    monkeypatch.setattr(triton_backend, "_num_sms", lambda device: 132)
    monkeypatch.setattr(triton_kernels, "MIN_KEYS_PER_SPLIT", 16)
    engine = make_engine(attention_backend="triton", max_model_len=160,
                         max_num_batched_tokens=24, num_blocks=64)
    reports: list[tuple[str, int, int]] = []
    device_check = _device_check()
    with device_check.captured_launches(forward=True) as launches:
        engine.runner.warm_up(lambda *report: reports.append(report))
        warmed = {device_check.variant_key(*launch) for launch in launches}
        launches.clear()
        # Chunks of 24 of 40 tokens end mid-block; the 13-token prompt decodes while the
        # 29-token one is still in prefill; contexts reach 46 keys (split two ways, and the
        # split count is a run-time argument, not part of a variant).
        prompts = [list(range(3, 43)), list(range(40, 53)), list(range(7, 36))]
        engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
        seen = {device_check.variant_key(*launch) for launch in launches}
    # On CUDA the model's RoPE-and-store kernel stores the K/V (test_triton_fused_ops.py
    # checks its variants); on the CPU the backend's store does.
    stores = {"_store_kv_kernel"} if engine.runner.model.triton_ops is None else set()
    assert {variant[0] for variant in warmed} == {
        "_paged_attention_kernel", "_merge_splits_kernel"} | stores
    assert seen <= warmed, seen - warmed
    assert seen == warmed, "the generation did not reach every variant the warm-up compiled"
    assert reports == [("compiling kernels", done, 2) for done in range(3)]
