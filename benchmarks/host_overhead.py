"""The engine's own time per step, with the model taken away.

On a GPU the forward of a small model takes a few milliseconds, so every millisecond the
engine spends on the host per step (scheduling, block tables, the step's input tensors,
sampling, detokenizing, stats) is throughput lost. This scenario runs the real scheduler,
KV manager, runner preparation, sampler, the client's output processor (detokenizing) and
stats over a stub forward that
returns logits in zero time (views into one random buffer), at several batch sizes with
long contexts that share a prefix, and reports the engine's time per decode step and per
token. The model keeps the real vocabulary and tokenizer; it keeps one layer only, so the
KV pool (never read: the forward is stubbed) stays small.

The sampler's math runs on the CPU here; on a GPU it runs on the device. The runner times it
inside each step (`sample_ms`), and the host part proper is what is left (`host_ms`). It
still counts here in one way: its 50 MB read of the logits at batch 256 leaves the caches
cold for the rest of the step, which a GPU's host would not see.

Times are the stepping thread's CPU time (`time.thread_time`) with torch on that one thread:
on a machine other processes keep busy, wall time measures the load, not the engine. The
wall time of a step is reported too (`step_wall_ms`).

From the repository root (`-h` for the options):

    python -m benchmarks.host_overhead [--model smollm2-135m] [--batch-sizes 32,128,256]
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import statistics
import time

import torch

from paged_chat.engine import Engine, EngineConfig, OutputProcessor, SamplingParams
from paged_chat.engine.models.loader import ModelSource, load_model_source

_PREFILL_BUDGET = 16384  # tokens per step while the contexts fill: the stub makes them free


class StubForward:
    """Stands in for the model's forward: logits for the rows asked, in no time.

    Consecutive calls return different rows (a rotating view into one random buffer), so
    greedy sampling does not pick the same token forever.
    """

    def __init__(self, max_rows: int, vocab_size: int, seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        self._buffer = torch.randn(max_rows + 97, vocab_size, generator=generator)
        self._offset = 0

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor,
                 meta: object, attention: object, logits_indices: torch.Tensor) -> torch.Tensor:
        rows = len(logits_indices)
        self._offset = (self._offset + 1) % (len(self._buffer) - rows + 1)
        return self._buffer[self._offset:self._offset + rows]


def host_overhead(source: ModelSource, batch_sizes: tuple[int, ...] = (32, 128, 256),
                  context_len: int = 2048, shared_len: int = 1536, decode_steps: int = 16,
                  block_size: int = 16, seed: int = 0) -> list[dict]:
    """Per batch size: median engine CPU time per decode step and per token, the sampler's
    part, and one `Engine.stats()` snapshot's, over `decode_steps` steps at full batch."""
    one_layer = dataclasses.replace(source, config=dataclasses.replace(source.config, num_layers=1))
    vocab = source.config.vocab_size
    rng = random.Random(seed)
    shared = [rng.randrange(vocab) for _ in range(shared_len)]
    rows = []
    for batch in batch_sizes:
        # Early requests decode while later ones still prefill: room for those steps too.
        max_tokens = decode_steps + -(-batch * context_len // _PREFILL_BUDGET) + 1
        prompt_len = context_len - max_tokens
        blocks = batch * -(-(context_len - shared_len) // block_size) + shared_len // block_size
        engine = Engine(EngineConfig(
            model=source.name, device="cpu", dtype="bfloat16", block_size=block_size,
            num_blocks=blocks + batch, max_model_len=context_len, max_num_seqs=batch,
            max_num_batched_tokens=_PREFILL_BUDGET, seed=seed, threads=1), source=one_layer)
        engine.use_forward(StubForward(batch, vocab, seed))
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        processor = OutputProcessor(engine.tokenizer)  # the client's part of a step: the text
        for _ in range(batch):
            processor.add_request(engine.add_request(
                shared + [rng.randrange(vocab) for _ in range(prompt_len - shared_len)], params),
                params)
        wall, cpu, sampler_cpu, stats_cpu = [], [], [], []
        while len(cpu) < decode_steps:
            started, started_cpu = time.perf_counter(), time.thread_time()
            processor.process(engine.step())
            elapsed, elapsed_cpu = time.perf_counter() - started, time.thread_time() - started_cpu
            started_cpu = time.thread_time()
            stats = engine.stats()
            if stats.batch_size == batch and stats.batch_tokens == batch:
                wall.append(elapsed)
                cpu.append(elapsed_cpu)
                sampler_cpu.append(engine.runner.last_sample_cpu_s)
                stats_cpu.append(time.thread_time() - started_cpu)
        engine.abort_all()
        host = statistics.median(step - sampling for step, sampling in zip(cpu, sampler_cpu))
        rows.append({"batch_size": batch, "context_len": context_len, "shared_len": shared_len,
                     "decode_steps": len(cpu), "host_ms": 1e3 * host,
                     "host_per_token_us": 1e6 * host / batch,
                     "sample_ms": 1e3 * statistics.median(sampler_cpu),
                     "step_ms": 1e3 * statistics.median(cpu),
                     "step_wall_ms": 1e3 * statistics.median(wall),
                     "stats_ms": 1e3 * statistics.median(stats_cpu)})
    return rows


def format_host_overhead(rows: list[dict]) -> str:
    lines = [f"host overhead (stub forward, {rows[0]['context_len']}-token contexts, "
             f"{rows[0]['shared_len']} shared):"] if rows else []
    lines += [f"  batch {row['batch_size']}: host {row['host_ms']:.2f} ms CPU per step "
              f"({row['host_per_token_us']:.1f} us per token), and sampler math "
              f"{row['sample_ms']:.2f} ms (device work on a GPU); stats() {row['stats_ms']:.2f} ms; "
              f"step wall {row['step_wall_ms']:.2f} ms" for row in rows]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.host_overhead",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--batch-sizes", default="32,128,256", help="comma-separated")
    parser.add_argument("--decode-steps", type=int, default=16)
    args = parser.parse_args()
    rows = host_overhead(load_model_source(args.model),
                         batch_sizes=tuple(int(size) for size in args.batch_sizes.split(",")),
                         decode_steps=args.decode_steps)
    print(format_host_overhead(rows))


if __name__ == "__main__":
    main()
