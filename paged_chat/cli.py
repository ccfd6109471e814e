"""The `paged-chat` command line. Heavy imports (torch, transformers) happen inside commands,
so `--help` and `--version` start fast."""

from __future__ import annotations

import sys
import time
from typing import Annotated, Optional

import typer

from paged_chat import __version__

app = typer.Typer(add_completion=False, no_args_is_help=False,
                  context_settings={"help_option_names": ["-h", "--help"]},
                  help="Chat with local LLMs in many tabs on one paged-KV-cache engine.")

DEBUG = {"on": False}


def _version(value: bool) -> None:
    if value:
        typer.echo(f"paged-chat {__version__}")
        raise typer.Exit()


@app.callback(invoke_without_command=True)
def root(ctx: typer.Context,
         version: Annotated[bool, typer.Option("--version", callback=_version, is_eager=True,
                                               help="Print the version and exit.")] = False,
         debug: Annotated[bool, typer.Option("--debug", help="Show tracebacks on errors.")] = False,
         ) -> None:
    DEBUG["on"] = debug
    if ctx.invoked_subcommand is None:
        typer.echo(ctx.get_help())


@app.command()
def ask(prompt: Annotated[Optional[str], typer.Argument(help="The question; stdin is read too.")] = None,
        model: Annotated[str, typer.Option(help="Alias, .gguf path, HF folder or hub id.")] = "smollm2-135m",
        system: Annotated[Optional[str], typer.Option(help="System prompt.")] = None,
        max_tokens: Annotated[int, typer.Option(help="Most tokens to generate.")] = 512,
        temperature: Annotated[float, typer.Option(help="0 is greedy.")] = 0.0,
        seed: Annotated[Optional[int], typer.Option(help="Sampling seed.")] = None,
        device: Annotated[str, typer.Option(help="auto, cpu or cuda.")] = "auto",
        dtype: Annotated[str, typer.Option(help="auto, float32, bfloat16 or float16.")] = "auto",
        ) -> None:
    """Answer one prompt on the default model, streaming the reply to stdout."""
    text = _read_prompt(prompt)
    _run(lambda: _ask(text, model, system, max_tokens, temperature, seed, device, dtype))


def _read_prompt(prompt: str | None) -> str:
    piped = "" if sys.stdin is None or sys.stdin.isatty() else sys.stdin.read()
    text = "\n\n".join(part for part in (piped.strip(), prompt or "") if part)
    if not text.strip():
        typer.echo("Error: no prompt: give one as an argument or on stdin", err=True)
        raise typer.Exit(2)
    return text


def _ask(text: str, model: str, system: str | None, max_tokens: int, temperature: float,
         seed: int | None, device: str, dtype: str) -> None:
    from paged_chat.chat import Conversation
    from paged_chat.engine import Engine, EngineConfig, SamplingParams

    params = SamplingParams(temperature=temperature, max_tokens=max_tokens, seed=seed)
    started = time.perf_counter()
    typer.echo(f"loading {model} ...", err=True)
    engine = Engine(EngineConfig(model=model, device=device, dtype=dtype))
    typer.echo(f"loaded in {time.perf_counter() - started:.1f}s", err=True)
    conversation = Conversation(engine.tokenizer, engine.chat_template, system)
    request_id = engine.add_request(conversation.next_prompt_ids(text), params)
    while engine.has_unfinished():
        for output in engine.step():
            if output.request_id != request_id:
                continue
            sys.stdout.write(output.new_text)
            sys.stdout.flush()
            if output.finished and output.finish_reason == "error":
                raise RuntimeError(output.error)
    sys.stdout.write("\n")


def _run(action) -> None:
    """Run a command; turn any failure into one line on stderr (traceback with --debug)."""
    from paged_chat.engine.errors import PagedChatError

    try:
        action()
    except KeyboardInterrupt:
        sys.stdout.write("\n")
        raise typer.Exit(130)
    except (PagedChatError, ValueError, RuntimeError, OSError) as error:
        if DEBUG["on"]:
            raise
        typer.echo(f"Error: {error}", err=True)
        raise typer.Exit(1)


def main() -> None:
    app()
