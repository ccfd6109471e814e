"""The CPU paged-attention kernel against the torch reference backend, on ragged steps:
decodes of different lengths, prefill chunks longer than a query tile that start
mid-sequence, shared blocks, sliding windows, and released table entries."""

from __future__ import annotations

import pytest
import torch

from paged_chat.engine import SamplingParams
from paged_chat.engine.attention.cpu_backend import CpuAttention, cpu_kernels_available
from paged_chat.engine.attention.metadata import AttentionMetadata
from paged_chat.engine.attention.torch_backend import TorchAttention
from paged_chat.engine.core.errors import PagedChatError

pytestmark = pytest.mark.skipif(not cpu_kernels_available(), reason="no C compiler")

BLOCK = 4
NUM_BLOCKS = 160


def random_step(generator, heads, kv_heads, dim, seq_lens, new_tokens, shared_blocks=0,
                block=BLOCK):
    """Caches of random K/V, tables of distinct random blocks (block 0 never used), and the
    step's new q/k/v and metadata."""
    shape = (kv_heads, NUM_BLOCKS, block, dim)
    key_cache = torch.randn(shape, generator=generator)
    value_cache = torch.randn(shape, generator=generator)
    free = (torch.randperm(NUM_BLOCKS - 1, generator=generator) + 1).tolist()
    shared = [free.pop() for _ in range(shared_blocks)]
    tables = [shared + [free.pop() for _ in range(-(-length // block) - shared_blocks)]
              for length in seq_lens]
    total = sum(new_tokens)
    query = torch.randn(total, heads, dim, generator=generator)
    # K and V as views of one fused projection, as the model passes them.
    fused = torch.randn(total, 2 * kv_heads * dim + 3, generator=generator)
    key = fused[:, :kv_heads * dim].view(total, kv_heads, dim)
    value = fused[:, kv_heads * dim:2 * kv_heads * dim].view(total, kv_heads, dim)
    meta = AttentionMetadata.build(new_tokens, seq_lens, tables, block, torch.device("cpu"))
    return query, key, value, key_cache, value_cache, meta


def run_both(step, heads, kv_heads, dim, window, prefill_in_kernel=True):
    query, key, value, key_cache, value_cache, meta = step
    reference_caches = key_cache.clone(), value_cache.clone()
    scale = dim ** -0.5
    expected = TorchAttention(heads, kv_heads, dim, scale)(
        query, key, value, *reference_caches, meta, sliding_window=window)
    got = CpuAttention(heads, kv_heads, dim, scale, prefill_in_kernel)(
        query, key, value, key_cache, value_cache, meta, sliding_window=window)
    assert torch.equal(key_cache, reference_caches[0]), "K stored in the same slots"
    assert torch.equal(value_cache, reference_caches[1]), "V stored in the same slots"
    return got, expected


# (decode contexts, prefill chunks as (context after the step, new tokens))
STEPS = {
    "decodes_alike": ((5, 9, 14, 3), ()),
    "one_long_decode": ((5, 300, 14, 3), ()),
    "block_edges": ((4, 8, 1, 16), ()),
    "prefills_only": ((), ((11, 6), (40, 40), (57, 23))),
    "mixed": ((7, 130, 2), ((37, 17), (16, 1 + 15))),
}


@pytest.mark.parametrize("prefill_in_kernel", [True, False])
@pytest.mark.parametrize("block", [BLOCK, 16])
@pytest.mark.parametrize("step", STEPS)
@pytest.mark.parametrize("window", [None, 7, 64])
@pytest.mark.parametrize("heads,kv_heads,dim", [(6, 2, 8), (9, 3, 64), (4, 4, 16), (8, 2, 32)])
def test_cpu_attention_matches_torch_reference(prefill_in_kernel, block, step, window, heads,
                                               kv_heads, dim):
    """Block size 16 (the default) takes the kernel's register-tiled paths; prefill chunks
    in the kernel or by the reference's path beside the kernel's decodes."""
    generator = torch.Generator().manual_seed(len(step) * 7 + (window or 0) + heads)
    decodes, prefills = STEPS[step]
    seq_lens = [*decodes, *(length for length, _ in prefills)]
    new_tokens = [*[1] * len(decodes), *(count for _, count in prefills)]
    step = random_step(generator, heads, kv_heads, dim, seq_lens, new_tokens, block=block)
    got, expected = run_both(step, heads, kv_heads, dim, window, prefill_in_kernel)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_shared_prefix_decodes_match():
    """Decodes sharing their first blocks (a system prompt): the reference's cascade path."""
    generator = torch.Generator().manual_seed(3)
    step = random_step(generator, 6, 2, 8, [21, 30, 45, 24], [1, 1, 1, 1], shared_blocks=4)
    got, expected = run_both(step, 6, 2, 8, None)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_released_blocks_are_never_read():
    """Table entries behind the window point at the null block 0, filled with NaN here:
    the output stays finite and matches the reference run over the tables before release."""
    heads, kv_heads, dim, window = 6, 2, 8, 9
    generator = torch.Generator().manual_seed(5)
    seq_lens, new_tokens = [50, 33, 61], [1, 1, 20]
    query, key, value, key_cache, value_cache, meta = random_step(
        generator, heads, kv_heads, dim, seq_lens, new_tokens)
    attention = CpuAttention(heads, kv_heads, dim, dim ** -0.5, prefill_in_kernel=True)
    expected = TorchAttention(heads, kv_heads, dim, dim ** -0.5)(
        query, key, value, key_cache.clone(), value_cache.clone(), meta, sliding_window=window)
    tables = meta.block_tables.clone()
    for seq, (length, count) in enumerate(zip(seq_lens, new_tokens)):
        first_seen = max(0, length - count - window + 1)
        tables[seq, :first_seen // BLOCK] = 0
    key_cache[:, 0], value_cache[:, 0] = float("nan"), float("nan")
    released = AttentionMetadata.build(new_tokens, seq_lens, tables, BLOCK, torch.device("cpu"))
    assert (released.block_tables == 0).sum() >= 8
    got = attention(query, key, value, key_cache, value_cache, released, sliding_window=window)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_engine_picks_the_cpu_kernel_for_float32_only(make_engine):
    assert isinstance(make_engine().runner.attention, CpuAttention)
    assert isinstance(make_engine(dtype="bfloat16").runner.attention, TorchAttention)
    with pytest.raises(PagedChatError, match="runs float32 on the CPU"):
        make_engine(dtype="bfloat16", attention_backend="cpu")


def test_engine_greedy_tokens_match_torch_backend(make_engine):
    """Decodes, chunked prefills (a 512-token budget over longer prompts) and prefix hits."""
    prompts = [[5 + i % 200 for i in range(n)] for n in (3, 40, 700, 130, 40)]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    expected = make_engine(attention_backend="torch").generate(prompts, params)
    got = make_engine(attention_backend="cpu").generate(prompts, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in expected]


@pytest.mark.parametrize("window", [None, 300])
def test_long_contexts_on_threads_match(window):
    """Enough keys for the kernel to split its work over threads (PARALLEL_MIN_KEYS)."""
    generator = torch.Generator().manual_seed(11)
    step = random_step(generator, 8, 4, 16, [1500, 900, 37], [1, 1, 20], block=16)
    got, expected = run_both(step, 8, 4, 16, window)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
