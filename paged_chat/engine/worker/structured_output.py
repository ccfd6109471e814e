"""Constrained decoding: grammars compiled once per model, one matcher per request, and the
step's token bitmask (xgrammar, the backend vLLM and SGLang default to).

A request whose SamplingParams ask for structured output (a JSON schema, any JSON object,
a regex, or one of a list of strings) gets a `GrammarMatcher` when it is added. Each step
`fill_token_bitmask` writes, for the constrained rows only, one bit per vocabulary entry
(set: the grammar allows that token next); the sampler masks those rows' logits with it
(`sampler.apply_token_bitmask`) before anything else looks at them. The engine advances a
matcher only with a token it appends to the request, so a preemption, which recomputes the
KV of tokens already appended, never needs a rollback: the matcher is exactly as far as
`output_token_ids`.

The manager compiles from the tokenizer once (its TokenizerInfo, paid by the first
constrained request) and keeps the last compiled grammars by their spec, so a schema every
request of an agent repeats compiles once.
"""

from __future__ import annotations

import json
import re
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

import torch

from paged_chat.engine.core.sampling_params import SamplingParams, StructuredSpec

if TYPE_CHECKING:
    import xgrammar

# How many compiled grammars the manager keeps (least recently used goes first).
_CACHE_SIZE = 256
# xgrammar's errors start with "[hh:mm:ss] /path/file.cc:line: ": the rest names the problem.
_LOCATION = re.compile(r"^\[[\d:]+\] \S+:\d+: ")


class GrammarError(ValueError):
    """A schema, regex or choice list the grammar library refuses; the message says why."""


class StructuredOutputManager:
    """Compiles grammars for one model's tokenizer and makes per-request matchers.

    `vocab_size` is the model's (its logits' width, which may exceed the tokenizer's);
    `stop_token_ids` end a completed grammar (the engine's EOS ids).
    """

    def __init__(self, tokenizer: object, vocab_size: int, stop_token_ids: Iterable[int]) -> None:
        import xgrammar as xgr

        self._xgr = xgr
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                  stop_token_ids=sorted(stop_token_ids))
        self.vocab_size = vocab_size
        self._compiler = xgr.GrammarCompiler(info, cache_enabled=False)
        self._compiled: OrderedDict[StructuredSpec, xgrammar.CompiledGrammar] = OrderedDict()

    def compile(self, spec: StructuredSpec) -> xgrammar.CompiledGrammar:
        """The compiled grammar of `spec` (see SamplingParams.structured_spec), cached."""
        compiled = self._compiled.get(spec)
        if compiled is not None:
            self._compiled.move_to_end(spec)
            return compiled
        kind, value = spec
        try:
            if kind in ("json_schema", "json_object"):  # an object, as OpenAI's json_object
                # compact separators: a small model given free whitespace may emit it forever
                compiled = self._compiler.compile_json_schema(value or '{"type": "object"}',
                                                              any_whitespace=False)
            elif kind == "regex":
                compiled = self._compiler.compile_regex(value)
            else:
                compiled = self._compiler.compile_grammar(choice_grammar(json.loads(value)))
        except RuntimeError as error:
            raise GrammarError(f"{kind}: {_LOCATION.sub('', str(error)).strip()}") from error
        self._compiled[spec] = compiled
        if len(self._compiled) > _CACHE_SIZE:
            self._compiled.popitem(last=False)
        return compiled

    def new_matcher(self, params: SamplingParams) -> xgrammar.GrammarMatcher | None:
        """A fresh matcher for a request's structured output; None when it asks for none."""
        spec = params.structured_spec
        if spec is None:
            return None
        return self._xgr.GrammarMatcher(self.compile(spec))


def choice_grammar(choices: Sequence[str]) -> str:
    """An EBNF grammar whose only sentences are `choices` (JSON string escapes are EBNF's)."""
    return "root ::= " + " | ".join(json.dumps(choice, ensure_ascii=False) for choice in choices)


def fill_token_bitmask(matchers: Sequence[xgrammar.GrammarMatcher], vocab_size: int,
                       device: torch.device) -> torch.Tensor:
    """The matchers' next-token bitmask, int32 `[len(matchers), ceil(vocab_size / 32)]` on
    `device`: bit j of word w allows token 32 * w + j."""
    import xgrammar as xgr

    bitmask = xgr.allocate_token_bitmask(len(matchers), vocab_size)
    for row, matcher in enumerate(matchers):
        matcher.fill_next_token_bitmask(bitmask, row)
    return bitmask.to(device, non_blocking=True)
