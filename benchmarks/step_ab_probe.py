#!/usr/bin/env python3
"""One engine step on the reference path (torch attention, torch ops) against the default
path (the CPU attention kernel and the fused C ops), or, with `--kv-cache-dtypes A,B`, the
default path over two KV cache dtypes, on the same model in one process, A/B interleaved
round by round so that the machine's load hits both alike.

Per round and path: a prefill of `--batch` prompts of `--prompt` tokens, then `--decode`
decode steps of the whole batch; it reports the median prefill time and decode step time
(ms) over the rounds, the decode tokens/s they imply, the load average, and whether
both paths sampled the same greedy tokens.

    HF_HUB_OFFLINE=1 python -m benchmarks.step_ab_probe [--batch 1] [--prompt 200] [--rounds 5]
        [--kv-cache-dtypes auto,bfloat16]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from paged_chat.engine import Engine, EngineConfig, SamplingParams  # noqa: E402

# The speedups are the first path's times over the second's.
PATHS = {"reference": dict(attention_backend="torch", fused_ops=False), "fused": {}}


def run_round(engine: Engine, batch: int, prompt: int, decode: int) -> tuple[float, list[float],
                                                                                list[list[int]]]:
    params = SamplingParams(temperature=0.0, max_tokens=decode + 1, ignore_eos=True)
    ids = [engine.add_request([(17 * i + 3 * j) % 4000 + 10 for j in range(prompt)], params)
           for i in range(batch)]
    tokens: dict[str, list[int]] = {rid: [] for rid in ids}
    started = time.perf_counter()
    while not all(tokens.values()):  # the prefill steps, up to every first token
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
    prefill = time.perf_counter() - started
    steps = []
    while engine.has_unfinished():
        started = time.perf_counter()
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
        steps.append(time.perf_counter() - started)
    return prefill, steps, [tokens[rid] for rid in ids]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--prompt", type=int, default=200)
    parser.add_argument("--decode", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--kv-cache-dtypes", help="two, comma-separated: compare these")
    args = parser.parse_args()
    paths = PATHS if args.kv_cache_dtypes is None else {
        f"kv {name}": dict(kv_cache_dtype=name) for name in args.kv_cache_dtypes.split(",")}
    engines = {name: Engine(EngineConfig(model=args.model, device="cpu", dtype="float32",
                                         threads=args.threads, enable_prefix_caching=False,
                                         kv_cache_memory="1GiB", **overrides))
               for name, overrides in paths.items()}
    load = os.getloadavg()[0]
    prefills: dict[str, list[float]] = {name: [] for name in engines}
    decodes: dict[str, list[float]] = {name: [] for name in engines}
    outputs: dict[str, list[list[int]]] = {}
    for _ in range(args.rounds):
        for name, engine in engines.items():
            prefill, steps, outputs[name] = run_round(engine, args.batch, args.prompt,
                                                      args.decode)
            prefills[name].append(prefill)
            decodes[name].append(statistics.median(steps))
    first, second = engines
    report = {"batch": args.batch, "prompt": args.prompt, "decode_steps": args.decode,
              "rounds": args.rounds, "threads": args.threads, "load_before": load,
              "load_after": os.getloadavg()[0],
              "same_greedy_tokens": outputs[first] == outputs[second]}
    for name in engines:
        step = statistics.median(decodes[name])
        report[name] = {"prefill_ms": round(statistics.median(prefills[name]) * 1e3, 1),
                        "decode_step_ms": round(step * 1e3, 2),
                        "decode_tokens_per_s": round(args.batch / step, 1)}
    report["decode_speedup"] = round(report[first]["decode_step_ms"]
                                     / report[second]["decode_step_ms"], 2)
    report["prefill_speedup"] = round(report[first]["prefill_ms"]
                                      / report[second]["prefill_ms"], 2)
    print(json.dumps(report))


if __name__ == "__main__":
    main()
