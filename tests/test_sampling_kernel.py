"""The sampling kernel (engine/worker/sampling_kernel.py) against the sampler's torch ops,
under TRITON_INTERPRET=1 when there is no GPU: the same token from the same logits and
uniforms, the same set of tokens a truncated row can draw, and draws distributed as the
softmax says.

The interpreter does not catch out-of-bounds loads, so vocabularies are not powers of two
(the last block masked), some tests split the row into several blocks, and the logits are
views whose neighbours in memory are NaN: a load a mask should have stopped makes the row
unsampleable (-1).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("triton", reason="the sampling kernel needs the triton package (extra 'gpu')")

from paged_chat.engine import SamplingParams  # noqa: E402
from paged_chat.engine.worker.sampler import (  # noqa: E402
    SamplingBatch,
    SettingsRows,
    apply_min_p,
    apply_top_k_top_p,
    as_int64,
    sample,
    sampling_columns,
    seed_streams,
)
from paged_chat.engine.worker.sampling_kernel import sample_in_kernel  # noqa: E402
from tests.test_triton_kernels import DEVICE  # noqa: E402

SETTINGS = [SamplingParams(temperature=0.2, top_p=0.9),  # the chat defaults
            SamplingParams(temperature=0.0),
            SamplingParams(temperature=0.7, top_k=5),
            SamplingParams(temperature=1.0, min_p=0.05),
            SamplingParams(temperature=0.8, top_k=50, top_p=0.5),
            SamplingParams(temperature=1.3),
            SamplingParams(temperature=0.5, top_p=0.3, min_p=0.1)]


def settings_rows(params: list[SamplingParams], vocab: int, seeds: list[int],
                  output_indices: list[int]) -> tuple[np.ndarray, SettingsRows]:
    """The rows' settings as SamplingRows keeps them (host columns, and the device tables
    with one row per setting, in shuffled order) for rows that sample `params` in turn."""
    host = sampling_columns(params, vocab)
    order = np.random.default_rng(vocab).permutation(len(params))
    table = np.zeros((len(params) + 3, host.shape[1]), dtype=np.float32)
    table[order] = host
    streams = np.zeros(len(params) + 3, dtype=np.int64)
    streams[order] = seed_streams(np.array([as_int64(s) for s in seeds], dtype=np.int64))
    return host, SettingsRows(torch.from_numpy(table).to(DEVICE),
                              torch.from_numpy(streams).to(DEVICE),
                              torch.from_numpy(order).to(DEVICE),
                              torch.tensor(output_indices, device=DEVICE))


def torch_path(logits: torch.Tensor, host: np.ndarray, settings: SettingsRows) -> SamplingBatch:
    """The torch ops' batch of the same rows (what the device path ran before the kernel)."""
    rows = settings.rows
    return SamplingBatch.from_columns(host, settings.table[rows], settings.streams[rows],
                                      settings.output_indices, logits.shape[-1], host_reads=False)


def poisoned_logits(rows: int, vocab: int, scale: float, dtype: torch.dtype,
                    generator: torch.Generator) -> torch.Tensor:
    """Random logits in a view whose neighbours in memory (and padding columns) are NaN."""
    padded = torch.full((rows + 2, vocab + 5), float("nan"), dtype=dtype)
    padded[1:-1, 2:-3] = (scale * torch.randn(rows, vocab, generator=generator)).to(dtype)
    return padded.to(DEVICE)[1:-1, 2:-3]


@pytest.mark.parametrize("vocab,block", [(100, None), (257, 64)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_kernel_picks_the_torch_ops_token(vocab, block, dtype):
    """Mixed settings (greedy, the chat defaults, top-k, min-p, both), flat to peaked logits:
    given the same uniforms, the same token in every row."""
    generator = torch.Generator().manual_seed(vocab)
    for trial in range(4):
        params = SETTINGS[trial % 2:] + SETTINGS[:trial % 2]
        host, settings = settings_rows(params, vocab, list(range(10 * trial, 10 * trial + 7)),
                                       [trial, 0, 3, 9, 1, trial, 2])
        logits = poisoned_logits(len(params), vocab, (0.3, 1.0, 3.0, 8.0)[trial], dtype,
                                 generator)
        expected = sample(logits, torch_path(logits, host, settings))
        assert torch.equal(sample_in_kernel(logits, settings, block), expected), trial
        assert (expected >= 0).all()


def test_greedy_rows_take_the_first_argmax_and_unsampleable_rows_get_minus_one():
    vocab = 100
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.2, top_p=0.9)] * 3
    _, settings = settings_rows(params, vocab, list(range(6)), [0] * 6)
    logits = torch.randn(6, vocab, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    logits[0, [7, 61]] = 9.0  # a tie: the first wins
    logits[1, [7, 61]] = 40.0  # one of the two, whatever the uniform
    logits[2, 30] = float("nan")
    logits[3, 12] = float("inf")
    logits[4] = float("-inf")
    logits[5, 99] = float("-inf")
    tokens = sample_in_kernel(logits, settings).tolist()
    assert tokens[0] == 7 and tokens[1] in (7, 61)
    assert tokens[2:5] == [-1, -1, -1] and tokens[5] not in (-1, 99)


@pytest.mark.parametrize("vocab", [100, 257])
def test_a_truncated_row_draws_exactly_the_tokens_the_torch_ops_keep(vocab):
    """Sixteen tokens close together on top, so each kept one is drawn often: over many
    draws the tokens drawn are the torch ops' kept set (top-k, top-p and min-p cut through
    the sixteen), none missing and none extra."""
    generator = torch.Generator().manual_seed(vocab)
    row = 0.5 * torch.randn(vocab, generator=generator) - 4.0
    top = torch.randperm(vocab, generator=generator)[:16]
    row[top] = 2.0 + 0.2 * torch.rand(16, generator=generator)
    kinds = [SamplingParams(top_p=0.6), SamplingParams(top_k=9),
             SamplingParams(top_k=12, top_p=0.5), SamplingParams(min_p=0.9, top_p=0.95)]
    draws = 100
    params = [kind for kind in kinds for _ in range(draws)]
    host, settings = settings_rows(params, vocab, [3] * len(params),
                                   list(range(draws)) * len(kinds))
    logits = row.expand(len(params), -1).contiguous().to(DEVICE)
    tokens = sample_in_kernel(logits, settings).view(len(kinds), draws)
    batch = torch_path(logits, host, settings)
    kept = apply_top_k_top_p(apply_min_p(logits / batch.temperature[:, None], batch), batch)
    for index, kind in enumerate(kinds):
        expected = set(kept[index * draws].isfinite().nonzero().flatten().tolist())
        assert 1 < len(expected) < 16, kind
        assert set(tokens[index].tolist()) == expected, kind


def test_draws_follow_the_truncated_softmax():
    """Chi-square goodness of fit of a top-k row at temperature 0.5 against the softmax of
    its top 6 over temperature; the same statistic against the softmax at temperature 1
    must be far off, so the test can fail."""
    logits = torch.tensor([1.0, 0.7, 0.4, 0.1, -0.2, -0.5, -0.8, -1.1])
    draws = 800
    params = [SamplingParams(temperature=0.5, top_k=6)] * draws
    _, settings = settings_rows(params, len(logits), [11] * draws, list(range(draws)))
    tokens = sample_in_kernel(logits.expand(draws, -1).contiguous().to(DEVICE), settings)
    counts = torch.bincount(tokens.cpu(), minlength=len(logits)).double()
    assert counts[6:].sum() == 0

    def chi2(scaled: torch.Tensor) -> float:
        expected = scaled[:6].double().softmax(-1) * draws
        return float(((counts[:6] - expected) ** 2 / expected).sum())

    critical = 20.5  # chi-square, 5 degrees of freedom, p = 0.001
    assert chi2(logits / 0.5) < critical
    assert chi2(logits) > 5 * critical


# Compiles the kernel as the JIT would for these launches, for each arch, and prints what
# ptxas reports of each variant (JSON lines). Run without TRITON_INTERPRET: the kernel is
# defined for the interpreter when it is set.
_COMPILE = """
import json, torch, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from benchmarks.device_check import ptxas_usage, specialise
from paged_chat.engine.worker import sampling_kernel
from paged_chat.engine.worker.sampler import SettingsRows

kernel = sampling_kernel._sample_kernel
launches = []
class Recorder:
    def __getitem__(self, grid):
        def record(*args, num_warps, **constexprs):
            launches.append((dict(zip(kernel.arg_names, args)) | constexprs, num_warps))
        return record
sampling_kernel._sample_kernel = Recorder()
settings = SettingsRows(torch.empty(8, 9), torch.empty(8, dtype=torch.int64),
                        torch.empty(4, dtype=torch.int64), torch.empty(4, dtype=torch.int64))
for dtype in (torch.bfloat16, torch.float32):
    for vocab in (49152, 151936):
        sampling_kernel.sample_in_kernel(torch.empty(4, vocab, dtype=dtype), settings)
for arch in (80, 89, 90):
    for named, num_warps in launches:
        compiled = triton.compile(ASTSource(kernel, *specialise(kernel, named)),
                                  target=GPUTarget("cuda", arch, 32),
                                  options={"num_warps": num_warps})
        usage = ptxas_usage(compiled.asm["ptx"], f"sm_{arch}a" if arch >= 90 else f"sm_{arch}")
        print(json.dumps({"arch": arch, "vocab": named["VOCAB"]} | usage))
"""


@pytest.mark.perf
def test_the_kernel_compiles_without_spills():
    """The interpreter never lowers the kernel; triton's compiler does, without a GPU: for
    sm_80, sm_89 and sm_90, bf16 and fp32 logits, the default model's vocabulary and a
    152k one, with no register spill (~30 s). Run it with the GPU image's Triton first on
    PYTHONPATH too: the kernel must compile under every Triton the project meets."""
    env = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-c", _COMPILE], env=env, capture_output=True,
                            text=True, timeout=600, check=False, cwd=Path(__file__).resolve().parent.parent)
    assert result.returncode == 0, result.stderr[-3000:]
    compiled = [json.loads(line) for line in result.stdout.splitlines()]
    assert len(compiled) == 3 * 2 * 2
    assert all(variant["spill_bytes"] == 0 for variant in compiled), compiled
