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
request of an agent repeats compiles once. It keeps them per cache salt, as the prefix
cache keeps blocks: a request finds only grammars its own partition compiled, so how fast
a schema compiles tells no caller what another sent. The kept grammars' size is bounded
in bytes, the least recently used going first.

Before compiling, what the grammar library would not enforce is refused
(unenforceable.py): a dropped schema keyword, an ignored regex anchor, a grammar no
output completes.
"""

from __future__ import annotations

import json
import re
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

import torch

from paged_chat.engine.core.sampling_params import SamplingParams, StructuredSpec
from paged_chat.engine.worker.unenforceable import (
    Unenforceable,
    check_json_schema,
    check_regex,
    check_satisfiable,
)

if TYPE_CHECKING:
    import xgrammar

# How many bytes of compiled grammars the manager keeps (a schema's is ~50 KB to a few MB).
CACHE_BYTES = 256 * 2**20
# xgrammar's errors start with "[hh:mm:ss] /path/file.cc:line: ": the rest names the problem.
_LOCATION = re.compile(r"^\[[\d:]+\] \S+:\d+: ")


class GrammarError(ValueError):
    """A schema, regex or choice list the grammar library refuses; the message says why."""


class StructuredOutputManager:
    """Compiles grammars for one model's tokenizer and makes per-request matchers.

    `vocab_size` is the model's (its logits' width, which may exceed the tokenizer's);
    `stop_token_ids` end a completed grammar (the engine's EOS ids); `cache_bytes` bounds
    the compiled grammars kept (one larger than it is compiled for its request, not kept).
    """

    def __init__(self, tokenizer: object, vocab_size: int, stop_token_ids: Iterable[int],
                 cache_bytes: int = CACHE_BYTES) -> None:
        import xgrammar as xgr

        self._xgr = xgr
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                  stop_token_ids=sorted(stop_token_ids))
        self.vocab_size = vocab_size
        self.cache_bytes = cache_bytes
        self._compiler = xgr.GrammarCompiler(info, cache_enabled=False)
        self._compiled: OrderedDict[tuple[str | None, StructuredSpec],
                                    xgrammar.CompiledGrammar] = OrderedDict()
        self._kept_bytes = 0

    @property
    def kept_bytes(self) -> int:
        """The size of the compiled grammars kept, at most `cache_bytes`."""
        return self._kept_bytes

    def compile(self, spec: StructuredSpec, cache_salt: str | None = None) -> xgrammar.CompiledGrammar:
        """The compiled grammar of `spec` (see SamplingParams.structured_spec), cached under
        `cache_salt` (a request's SamplingParams.cache_salt): a grammar compiled under one
        salt is never served under another. Raises GrammarError naming what is refused."""
        key = (cache_salt, spec)
        compiled = self._compiled.get(key)
        if compiled is not None:
            self._compiled.move_to_end(key)
            return compiled
        kind, value = spec
        try:
            compiled = self._compiler.compile_grammar(self._grammar(kind, value))
        except (RuntimeError, Unenforceable) as error:
            raise GrammarError(f"{kind}: {_LOCATION.sub('', str(error)).strip()}") from error
        self._keep(key, compiled)
        return compiled

    def _grammar(self, kind: str, value: str) -> xgrammar.Grammar:
        """The grammar of one spec, refused (Unenforceable) where it would not be enforced."""
        if kind in ("json_schema", "json_object"):  # an object, as OpenAI's json_object
            schema = value or '{"type": "object"}'
            check_json_schema(schema)
            # compact separators: a small model given free whitespace may emit it forever
            grammar = self._xgr.Grammar.from_json_schema(schema, any_whitespace=False)
        elif kind == "regex":
            check_regex(value)
            grammar = self._xgr.Grammar.from_regex(value)
        else:
            grammar = self._xgr.Grammar.from_ebnf(choice_grammar(json.loads(value)))
        check_satisfiable(str(grammar))
        return grammar

    def _keep(self, key: tuple[str | None, StructuredSpec], compiled: xgrammar.CompiledGrammar) -> None:
        size = compiled.memory_size_bytes
        if size > self.cache_bytes:
            return
        self._compiled[key] = compiled
        self._kept_bytes += size
        while self._kept_bytes > self.cache_bytes:
            _, evicted = self._compiled.popitem(last=False)
            self._kept_bytes -= evicted.memory_size_bytes

    def new_matcher(self, params: SamplingParams) -> xgrammar.GrammarMatcher | None:
        """A fresh matcher for a request's structured output, its grammar from the cache of
        the request's cache salt; None when it asks for none."""
        spec = params.structured_spec
        if spec is None:
            return None
        return self._xgr.GrammarMatcher(self.compile(spec, params.cache_salt))


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
