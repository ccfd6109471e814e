#!/usr/bin/env python3
"""The CPU paged-attention kernel (attention/cpu_backend.py) against the torch reference's
gather + bmm it replaces, on SmolLM2-135M's attention shapes (9 query / 3 KV heads,
head_dim 64), float32, one layer's call timed `--layers` times per sample.

Cases: decode batches at a context length (every sequence its own random blocks), and a
prefill chunk over a cached prefix. The two paths alternate sample by sample (A/B
interleaved, so a change in the machine's load hits both); medians are printed as JSON.

    HF_HUB_OFFLINE=1 python -m benchmarks.cpu_attention_probe [--samples 9] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from paged_chat.engine.attention.cpu_backend import CpuAttention  # noqa: E402
from paged_chat.engine.attention.metadata import AttentionMetadata  # noqa: E402
from paged_chat.engine.attention.torch_backend import TorchAttention  # noqa: E402

HEADS, KV_HEADS, DIM, BLOCK = 9, 3, 64, 16


def make_step(query_lens: list[int], seq_lens: list[int], generator: torch.Generator):
    blocks_needed = sum(-(-n // BLOCK) for n in seq_lens)
    num_blocks = blocks_needed + 1
    order = (torch.randperm(blocks_needed, generator=generator) + 1).tolist()
    tables = []
    for length in seq_lens:
        count = -(-length // BLOCK)
        tables.append(order[:count])
        order = order[count:]
    shape = (KV_HEADS, num_blocks, BLOCK, DIM)
    caches = torch.randn(shape, generator=generator), torch.randn(shape, generator=generator)
    total = sum(query_lens)
    qkv = torch.randn(total, (HEADS + 2 * KV_HEADS) * DIM, generator=generator)
    q, k, v = qkv.split((HEADS * DIM, KV_HEADS * DIM, KV_HEADS * DIM), dim=-1)
    query = q.reshape(total, HEADS, DIM)  # a copy, as RoPE makes it
    key, value = k.view(total, KV_HEADS, DIM), v.view(total, KV_HEADS, DIM)
    meta = AttentionMetadata.build(query_lens, seq_lens, tables, BLOCK, torch.device("cpu"))
    return query, key, value, caches, meta


def time_layers(attention, step, layers: int) -> tuple[float, float]:
    """Wall and process CPU seconds (all threads): on a loaded machine CPU time is the
    steadier of the two."""
    query, key, value, (key_cache, value_cache), meta = step
    meta.per_step.clear()  # what the reference derives once per step is part of its cost
    wall, cpu = time.perf_counter(), time.process_time()
    for _ in range(layers):
        attention(query, key, value, key_cache, value_cache, meta)
    return time.perf_counter() - wall, time.process_time() - cpu


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--samples", type=int, default=9)
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    generator = torch.Generator().manual_seed(0)
    cases = {f"decode batch {b} x {n} tokens": ([1] * b, [n] * b)
             for b, n in ((1, 400), (1, 2000), (8, 400), (32, 400), (32, 1000))}
    cases["decode batch 32, ragged 50-1500 tokens"] = (
        [1] * 32, torch.randint(50, 1500, (32,), generator=generator).tolist())
    cases["prefill 256 new over 256 cached"] = ([256], [512])
    cases["prefill 16 new over 400 cached"] = ([16], [416])
    scale = DIM ** -0.5
    paths = {"gather_bmm": TorchAttention(HEADS, KV_HEADS, DIM, scale),
             "cpu_kernel": CpuAttention(HEADS, KV_HEADS, DIM, scale, prefill_in_kernel=True)}
    report = {"threads": args.threads, "layers": args.layers, "samples": args.samples,
              "load": os.getloadavg()[0], "cases": {}}
    for name, (query_lens, seq_lens) in cases.items():
        step = make_step(query_lens, seq_lens, generator)
        expected = paths["gather_bmm"](*step[:3], *step[3], step[4])
        torch.testing.assert_close(paths["cpu_kernel"](*step[:3], *step[3], step[4]), expected,
                                   rtol=1e-4, atol=1e-5)
        times: dict[str, list[tuple[float, float]]] = {path: [] for path in paths}
        for _ in range(args.samples):
            for path, attention in paths.items():
                times[path].append(time_layers(attention, step, args.layers))
        case = {}
        for clock, column in (("wall", 0), ("cpu", 1)):
            medians = {path: statistics.median(t[column] for t in samples) * 1e3
                       for path, samples in times.items()}
            case.update({f"{path}_{clock}_ms": round(m, 2) for path, m in medians.items()})
            case[f"{clock}_speedup"] = round(medians["gather_bmm"] / medians["cpu_kernel"], 2)
        report["cases"][name] = case
        print(name, report["cases"][name], file=sys.stderr)
    report["load_after"] = os.getloadavg()[0]
    print(json.dumps(report))


if __name__ == "__main__":
    main()
