"""A reply's tokens/s (after its first token) with and without drafts from the chat's own history (prompt lookup), on
two single chats: one asked to edit a 150-line code file it was given (its reply copies
most of the file: drafts pay) and one free-form chat (little to copy: drafting must cost
next to nothing). Greedy, so both runs of a chat must give the same tokens (checked).

    python -m benchmarks.drafts_speedup [--model smollm2-135m] [--max-tokens 512]
        [--speculative-tokens 4] [--lines 150] [--weights quantized|dequantize]
        [--dtype auto]

Each run builds its engine and generates on a thread of its own (bench.own_thread). Needs a
quiet machine: one run each, ratios to compare, no pass or fail.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass

from paged_chat.bench.own_thread import on_own_thread
from paged_chat.engine import Engine, EngineConfig, SamplingParams
from paged_chat.engine.models.loader import ModelSource, load_model_source

FREE_FORM = "Tell me a story about a lighthouse keeper who finds a message in a bottle."


def code_file(lines: int) -> str:
    """A Python module of about `lines` lines: small functions over rows of a table."""
    out = ['"""Rows of a ledger: parse, check and total them."""', "", "import csv", ""]
    index = 0
    while len(out) < lines:
        out += [f"def parse_row_{index}(row):",
                f'    """Parse row {index} of the ledger into (name, amount)."""',
                "    name, amount = row[0].strip(), row[1].strip()",
                f"    if not name:\n        raise ValueError('row {index}: no name')",
                f"    return name, float(amount) * {index + 1}", ""]
        index += 1
    return "\n".join(out[:lines])


def code_edit_prompt(lines: int) -> str:
    return ("Here is a file:\n\n```python\n" + code_file(lines) + "\n```\n\nRename every "
            "`parse_row_` function to `read_row_` and give me the whole file back.")


@dataclass(frozen=True)
class Run:
    token_ids: list[int]
    reply_seconds: float     # from the first token to the last
    drafted: int
    accepted: int

    @property
    def tokens_per_s(self) -> float:
        """The reply's rate after its first token (the prompt's prefill left out)."""
        return (len(self.token_ids) - 1) / self.reply_seconds


def generate(source: ModelSource, options: argparse.Namespace, prompt: list[int],
             speculative_tokens: int) -> Run:
    engine = Engine(EngineConfig(model=options.model, device="cpu", weights=options.weights,
                                 dtype=options.dtype,
                                 num_speculative_tokens=speculative_tokens), source=source)
    try:
        engine.generate([prompt[:8]], SamplingParams(temperature=0.0, max_tokens=2))  # warm-up
        engine.add_request(prompt, SamplingParams(temperature=0.0,
                                                  max_tokens=options.max_tokens))
        token_ids: list[int] = []
        first_token_at = 0.0
        while engine.has_unfinished():
            for output in engine.step():
                if output.new_token_ids and not token_ids:
                    first_token_at = time.perf_counter()
                token_ids += output.new_token_ids
        stats = engine.stats()
        return Run(token_ids, time.perf_counter() - first_token_at, stats.draft_tokens_total,
                   stats.accepted_draft_tokens_total)
    finally:
        engine.close()


def compare(source: ModelSource, options: argparse.Namespace, label: str, text: str) -> str:
    tokenizer = source.tokenizer
    chat = tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                         add_generation_prompt=True, tokenize=False)
    prompt = tokenizer.encode(chat, add_special_tokens=False)
    plain = on_own_thread(lambda: generate(source, options, prompt, 0))
    drafting = on_own_thread(lambda: generate(source, options, prompt,
                                              options.speculative_tokens))
    same = "same tokens" if plain.token_ids == drafting.token_ids else "TOKENS DIFFER"
    rate_plain, rate_drafting = plain.tokens_per_s, drafting.tokens_per_s
    accepted = drafting.accepted / drafting.drafted if drafting.drafted else 0.0
    return (f"{label:<10} {len(prompt):5} prompt tok, {len(plain.token_ids):4} out: "
            f"{rate_plain:6.1f} tok/s without drafts, {rate_drafting:6.1f} with "
            f"({rate_drafting / rate_plain:4.2f}x; {drafting.accepted}/{drafting.drafted} "
            f"drafted accepted, {accepted:.0%}; {same})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--max-tokens", type=int, default=512)
    parser.add_argument("--speculative-tokens", type=int, default=4)
    parser.add_argument("--lines", type=int, default=150)
    parser.add_argument("--weights", default="quantized", choices=("quantized", "dequantize"))
    parser.add_argument("--dtype", default="auto")
    args = parser.parse_args()
    source = load_model_source(args.model)
    print(f"{args.model} ({args.weights} weights, dtype {args.dtype}): greedy, one chat at a "
          f"time, drafts of up to {args.speculative_tokens} tokens")
    for label, text in (("code edit", code_edit_prompt(args.lines)), ("free-form", FREE_FORM)):
        print(compare(source, args, label, text))


if __name__ == "__main__":
    main()
