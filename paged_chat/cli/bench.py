"""`paged-chat bench`: one seeded chat workload through paged-chat and its baselines
(paged_chat.bench); the harnesses of the TUI, contention and host overhead are under
benchmarks/ in the repository."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

if TYPE_CHECKING:
    from paged_chat.cli.state import CliState


def bench(ctx: typer.Context,
          model: Annotated[str, typer.Option(help="Alias, .gguf, HF folder or hub id.")] = "smollm2-135m",
          chats: Annotated[int, typer.Option("--chats", min=1, help="Concurrent chats.")] = 32,
          min_output: Annotated[int, typer.Option(min=1, help="Shortest reply, tokens.")] = 32,
          max_output: Annotated[int, typer.Option(min=1, help="Longest reply, tokens.")] = 256,
          dtype: Annotated[str, typer.Option(
              help="paged-chat's: auto (as it ships), float32, bfloat16 or float16.")] = "auto",
          baseline_dtype: Annotated[str | None, typer.Option(
              help="The HF baselines' (default: --dtype; auto: bfloat16 where the CPU has bf16 "
                   "dot products, else float32).")] = None,
          threads: Annotated[int, typer.Option(min=1, help="torch threads for every system.")] = 2,
          block_size: Annotated[int, typer.Option(help="KV block size, tokens (paged-chat and hf-cb).")] = 16,
          systems: Annotated[str, typer.Option(
              show_default=False,
              help="Comma-separated, of paged-chat, hf-seq, hf-static, hf-cb (default: these "
                   "four) and openai:URL (any OpenAI-compatible server, e.g. llama-server).")
          ] = "paged-chat,hf-seq,hf-static,hf-cb",
          quick: Annotated[bool, typer.Option(
              "--quick", help="8 chats, replies of 16-48 tokens, hf-seq on 2 of them (the others "
                             "extrapolated).")] = False,
          scenarios: Annotated[bool, typer.Option(help="Run the memory scenarios too.")] = True,
          roofline: Annotated[bool, typer.Option(
              "--roofline", help="Measure bandwidth and matmul peak; compare a decode step.")] = False,
          json_path: Annotated[Path | None, typer.Option("--json", help="Write the report here.")] = None,
          plot_path: Annotated[Path | None, typer.Option("--plot", help="Draw a PNG here.")] = None,
          seed: Annotated[int, typer.Option(help="Workload seed.")] = 0,
          engine_threads: Annotated[int | None, typer.Option(
              min=1, help="paged-chat's threads (default: adapt to the machine).")] = None,
          weights: Annotated[str, typer.Option(
              help="paged-chat's GGUF weights: quantized or dequantize.")] = "quantized",
          kv_cache_dtype: Annotated[str | None, typer.Option(
              help="paged-chat's KV cache: auto (the model's dtype), bfloat16 or int8 (default: as "
                   "it ships).")] = None,
          ) -> None:
    """Run one seeded chat workload through paged-chat and the Hugging Face baselines, side
    by side in one process, and print absolute figures and ratios."""
    from paged_chat.bench import BenchOptions, run_bench
    from paged_chat.bench.report import format_report, plot, write_json

    state: CliState = ctx.obj
    with state.reported():
        sizes = (dict(num_chats=8, min_output=16, max_output=48, hf_seq_requests=2) if quick else
                 dict(num_chats=chats, min_output=min_output, max_output=max_output))
        if sizes["min_output"] > sizes["max_output"]:
            raise typer.BadParameter("must not exceed --max-output", param_hint="--min-output")
        options = BenchOptions(model=model, dtype=dtype, baseline_dtype=baseline_dtype,
                               threads=threads, seed=seed, block_size=block_size, scenarios=scenarios, roofline=roofline,
                               systems=tuple(name.strip() for name in systems.split(",") if name.strip()),
                               engine_threads=engine_threads, weights=weights,
                               kv_cache_dtype=kv_cache_dtype, **sizes)
        report = run_bench(options, log=lambda line: typer.echo(line, err=True))
        typer.echo(format_report(report))
        if json_path is not None:
            write_json(report, str(json_path))
        if plot_path is not None:
            plot(report, str(plot_path))
