"""What one `Engine.stats()` costs after a decode step, by the pool's size: the engine thread
takes a snapshot at the panel's rate, so its cost must not grow with the pool (issue 44:
an H200 at 0.9 gives the default model ~350k blocks).

    python -m benchmarks.stats_cost [--blocks 7000,350000] [--requests 64]

A one-layer model with one KV head of 8 dimensions (1 KiB a block) and the default
model's tokenizer; the least time of 20 snapshots, each after a decode step.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import timeit
from pathlib import Path

from paged_chat.engine import Engine, EngineConfig, SamplingParams
from paged_chat.engine.models.loader import load_model_source, resolve_alias_path

REPO = Path(__file__).resolve().parents[1]


def narrow_model(folder: Path) -> Path:
    sys.path.insert(0, str(REPO / "tests"))
    from tiny_models import build_tiny_model

    build_tiny_model("llama", folder, num_heads=2, num_kv_heads=1, head_dim=8, num_layers=1)
    load_model_source(str(resolve_alias_path("smollm2-135m"))).tokenizer.save_pretrained(folder)
    return folder


def stats_cost_s(model: Path, num_blocks: int, num_requests: int) -> float:
    engine = Engine(EngineConfig(model=str(model), device="cpu", dtype="float32",
                                 num_blocks=num_blocks, block_size=16, max_num_seqs=num_requests,
                                 max_num_batched_tokens=8192, attention_backend="torch"))
    try:
        for index in range(num_requests):
            engine.add_request(list(range(3 + index, 303 + index)),
                               SamplingParams(temperature=0, max_tokens=100, ignore_eos=True))
        engine.step()   # the prefill
        return min(timeit.repeat(engine.stats, setup=engine.step, number=1, repeat=20))
    finally:
        engine.abort_all()
        engine.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--blocks", default="7000,350000",
                        help="pool sizes, comma-separated (default: 7000,350000)")
    parser.add_argument("--requests", type=int, default=64, help="requests decoding (default: 64)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        model = narrow_model(Path(scratch) / "narrow-llama")
        for blocks in (int(b) for b in args.blocks.split(",")):
            cost = stats_cost_s(model, blocks, args.requests)
            print(f"stats() after a decode step of {args.requests} requests, {blocks:,} blocks: "
                  f"{cost * 1e3:.3f} ms")


if __name__ == "__main__":
    main()
