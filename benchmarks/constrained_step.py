"""What constrained decoding costs per step: a decode batch of 32 with 8 JSON-schema
requests, beside the same batch unconstrained, in one run; and the compile time of a
typical schema.

    python -m benchmarks.constrained_step [--model smollm2-135m] [--device cpu] [--steps 24]

Only decode steps with all 32 requests running count (prefill and the tail are left out).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from paged_chat.engine import Engine, EngineConfig, SamplingParams
from paged_chat.engine.worker.sampler import apply_token_bitmask
from paged_chat.engine.worker.structured_output import StructuredOutputManager, fill_token_bitmask

BATCH, CONSTRAINED = 32, 8
SCHEMA = {"type": "object", "additionalProperties": False,
          "required": ["name", "age", "city", "tags"],
          "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                         "city": {"type": "string"},
                         "tags": {"type": "array", "items": {"type": "string"}}}}


def step_times(engine: Engine, params: list[SamplingParams], steps: int) -> list[float]:
    """The times of the first `steps` decode steps that run the whole batch."""
    for index, p in enumerate(params):
        engine.add_request(f"Describe person number {index} as JSON.", p)
    times: list[float] = []
    while engine.has_unfinished():
        full = len(engine.scheduler.running) == BATCH and not engine.scheduler.waiting
        started = time.perf_counter()
        engine.step()
        if full and engine.stats().batch_tokens == BATCH and len(times) < steps:
            times.append(time.perf_counter() - started)
    return times


def mask_step_time(manager: StructuredOutputManager, device: torch.device, repeats: int = 50
                   ) -> float:
    """The mask step alone (fill the 8 rows' bitmask, mask their logits in a batch of 32),
    median seconds, with the matchers at the start of the schema."""
    params = SamplingParams(json_schema=SCHEMA)
    matchers = [manager.new_matcher(params) for _ in range(CONSTRAINED)]
    logits = torch.randn(BATCH, manager.vocab_size, device=device)
    rows = torch.arange(CONSTRAINED, device=device)
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        apply_token_bitmask(logits, fill_token_bitmask(matchers, manager.vocab_size, device), rows)
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--steps", type=int, default=24)
    args = parser.parse_args()
    engine = Engine(EngineConfig(model=args.model, device=args.device, max_num_seqs=BATCH,
                                 num_blocks=1024))
    started = time.perf_counter()
    manager = StructuredOutputManager(engine.tokenizer, engine.model_config.vocab_size,
                                      engine.eos_token_ids)
    setup_s = time.perf_counter() - started
    started = time.perf_counter()
    manager.compile(SamplingParams(json_schema=SCHEMA).structured_spec)
    compile_s = time.perf_counter() - started
    engine._structured_output = manager
    length = args.steps + 8
    plain = SamplingParams(temperature=0.8, seed=0, max_tokens=length, ignore_eos=True)
    constrained = SamplingParams(temperature=0.8, seed=0, max_tokens=length, ignore_eos=True,
                                 json_schema=SCHEMA)
    step_times(engine, [plain] * BATCH, 2)  # warm-up
    unconstrained = step_times(engine, [plain] * BATCH, args.steps)
    mixed = step_times(engine, [constrained] * CONSTRAINED + [plain] * (BATCH - CONSTRAINED),
                       args.steps)
    base, cost = statistics.median(unconstrained), statistics.median(mixed)
    print(f"{engine.model_name} on {engine.device}: median decode step at batch {BATCH}")
    print(f"  unconstrained:           {base * 1e3:8.2f} ms  ({len(unconstrained)} steps)")
    print(f"  {CONSTRAINED} JSON-schema rows:      {cost * 1e3:8.2f} ms  ({len(mixed)} steps)"
          f"  {100 * (cost / base - 1):+.1f} %")
    print(f"  the mask step alone (fill 8 bitmasks, mask 8 of 32 rows): "
          f"{mask_step_time(manager, engine.device) * 1e3:.2f} ms")
    print(f"grammar set-up for the tokenizer: {setup_s * 1e3:.0f} ms; "
          f"compiling a typical schema: {compile_s * 1e3:.1f} ms")


if __name__ == "__main__":
    main()
