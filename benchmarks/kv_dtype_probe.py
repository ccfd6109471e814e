#!/usr/bin/env python3
"""A batch of decodes' attention by the CPU kernel (attention/cpu_backend.py) over a float32,
bfloat16 and int8 KV cache (`EngineConfig.kv_cache_dtype`), on SmolLM2-135M's attention
shapes (9 query / 3 KV heads, head_dim 64, 30 layers, each its own cache, so a step reads
every layer's K/V from memory as an engine's does). The dtypes alternate sample by sample
(a change in the machine's load hits each); medians of wall and process CPU time per
30-layer step are printed as JSON.

    HF_HUB_OFFLINE=1 python -m benchmarks.kv_dtype_probe [--seqs 32] [--context 420]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from paged_chat.engine.attention.cpu_backend import CpuAttention  # noqa: E402
from paged_chat.engine.attention.kv_rows import to_cache_rows  # noqa: E402
from paged_chat.engine.attention.metadata import AttentionMetadata  # noqa: E402

HEADS, KV_HEADS, DIM, BLOCK, LAYERS = 9, 3, 64, 16, 30
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "int8": torch.int8}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seqs", type=int, default=32)
    parser.add_argument("--context", type=int, default=420)
    parser.add_argument("--samples", type=int, default=9)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    generator = torch.Generator().manual_seed(0)
    blocks_per_seq = -(-args.context // BLOCK)
    num_blocks = args.seqs * blocks_per_seq + 1
    order = (torch.randperm(num_blocks - 1, generator=generator) + 1).view(args.seqs, -1)
    meta = AttentionMetadata.build([1] * args.seqs, [args.context] * args.seqs, order.tolist(),
                                   BLOCK, torch.device("cpu"))
    query = torch.randn(args.seqs, HEADS, DIM, generator=generator)
    key = torch.randn(args.seqs, KV_HEADS, DIM, generator=generator)
    value = torch.randn(args.seqs, KV_HEADS, DIM, generator=generator)
    floats = [torch.randn(2, KV_HEADS, num_blocks, BLOCK, DIM, generator=generator)
              for _ in range(LAYERS)]
    caches = {name: [to_cache_rows(layer, dtype) for layer in floats]
              for name, dtype in DTYPES.items()}
    del floats
    attention = CpuAttention(HEADS, KV_HEADS, DIM, DIM ** -0.5)
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in DTYPES}
    for _ in range(args.samples):
        for name, layers in caches.items():
            wall, cpu = time.perf_counter(), time.process_time()
            for layer in layers:
                attention(query, key, value, layer[0], layer[1], meta)
            times[name].append((time.perf_counter() - wall, time.process_time() - cpu))
    kv_mb = {name: sum(layer.nbytes for layer in layers) / 1e6 for name, layers in caches.items()}
    print(json.dumps({name: {"kv_mb": round(kv_mb[name]),
                             "wall_ms": round(1e3 * statistics.median(t[0] for t in samples), 2),
                             "cpu_ms": round(1e3 * statistics.median(t[1] for t in samples), 2)}
                      for name, samples in times.items()}, indent=1))


if __name__ == "__main__":
    main()
