"""Constrained decoding: grammars compiled once per model, one matcher per request, and the
step's token bitmask (xgrammar, the backend vLLM and SGLang default to).

A request whose SamplingParams ask for structured output (a JSON schema, any JSON object,
a regex, or one of a list of strings) gets a `GrammarMatcher`: at once when its grammar
is cached, else once its grammar has compiled off the engine loop (`start_compile`, then
`take`; a huge schema compiles for minutes, and the other requests keep stepping). What
the grammar library refuses is refused synchronously, before the compile starts. Each step
`fill_token_bitmask` writes, for the constrained rows only, one bit per vocabulary entry
(set: the grammar allows that token next); the sampler masks those rows' logits with it
(`sampler.apply_token_bitmask`) before anything else looks at them. The engine advances a
matcher only with a token it appends to the request, so a preemption, which recomputes the
KV of tokens already appended, never needs a rollback: the matcher is exactly as far as
`output_token_ids`.

A grammar not cached first compiles in a child process (grammar_trial.py), its memory
bounded by COMPILE_MEMORY_BYTES and the child killed when nobody waits for the compile any
more (its requests aborted, or past COMPILE_TIMEOUT_S); only a grammar that passed there is
compiled again for the matchers, on a compile thread of the engine's process.

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
import queue
import re
import threading
import time
import weakref
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import CancelledError, Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from paged_chat.engine.core.sampling_params import SamplingParams, StructuredSpec
from paged_chat.engine.worker.grammar_trial import (
    TrialCompiler,
    TrialEnded,
    TrialFailed,
    TrialOutOfMemory,
)
from paged_chat.engine.worker.unenforceable import (
    Unenforceable,
    check_json_schema,
    check_regex,
    check_satisfiable,
)

if TYPE_CHECKING:  # torch too: the server imports REFUSED without loading either
    import torch
    import xgrammar

# How many bytes of compiled grammars the manager keeps (a schema's is ~50 KB to a few MB).
CACHE_BYTES = 256 * 2**20
# How long a request waits for its grammar to compile before it fails with an error naming
# this limit (an anyOf of thousands of patterns compiles for minutes).
COMPILE_TIMEOUT_S = 30.0
# How much a grammar's compile may grow its (trial) process's address space before it fails
# its request with an error naming this limit (a hostile schema took gigabytes).
COMPILE_MEMORY_BYTES = 2**30
# Grammars compiling at once. The compile in the engine's process, after the trial, cannot
# be stopped: one that no request waits for any more runs to its end on its thread (no
# longer than its trial did), so more than one thread keeps the next going.
COMPILE_THREADS = 2
# What the error of a request whose structured output was refused after add_request
# returned starts with (its compile failed or passed COMPILE_TIMEOUT_S or
# COMPILE_MEMORY_BYTES): the caller's fault, not the engine's (the server answers it with a
# 400).
REFUSED = "structured output refused: "
# xgrammar's errors start with "[hh:mm:ss] /path/file.cc:line: ": the rest names the problem.
_LOCATION = re.compile(r"^\[[\d:]+\] \S+:\d+: ")


class GrammarError(ValueError):
    """A schema, regex or choice list the grammar library refuses; the message says why."""


GrammarKey = tuple[str | None, StructuredSpec]  # (cache salt, spec)


@dataclass(slots=True, eq=False)
class GrammarCompile:
    """One grammar compiling off the engine loop: its trial in a child, then the compile
    for its matchers; `stop` ends the trial (the compile after it runs to its end)."""

    grammar: xgrammar.Grammar
    memory_bytes: int
    future: Future = field(default_factory=Future)
    trial: TrialCompiler | None = None  # while its trial runs
    stopped: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)

    def stop(self) -> None:
        self.future.cancel()
        with self.lock:
            self.stopped, trial = True, self.trial
        if trial is not None:
            trial.kill()


@dataclass(slots=True, eq=False)
class PendingGrammar:
    """One request's wait for a grammar compiling off the engine loop (`start_compile`);
    requests waiting for the same grammar share its compile."""

    key: GrammarKey
    compile: GrammarCompile
    started: float  # time.monotonic() when the request began to wait

    @property
    def future(self) -> Future:
        """Done once the compile is (its result the CompiledGrammar)."""
        return self.compile.future


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
        self._compiled: OrderedDict[GrammarKey, xgrammar.CompiledGrammar] = OrderedDict()
        self._kept_bytes = 0
        self._compiling: dict[GrammarKey, GrammarCompile] = {}
        self._waiters: Counter[GrammarKey] = Counter()
        self._compile_threads = _DaemonThreads(COMPILE_THREADS, "grammar-compile")
        self._tokenizer_info_json = info.serialize_json()
        self._idle_trials: list[TrialCompiler] = []
        self._trials_lock = threading.Lock()
        weakref.finalize(self, _close_all, self._idle_trials)

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
        try:
            compiled = self._compiler.compile_grammar(self._grammar(spec))
        except RuntimeError as error:
            raise GrammarError(_problem(spec[0], error)) from error
        self._keep(key, compiled)
        return compiled

    def cached_matcher(self, params: SamplingParams) -> xgrammar.GrammarMatcher | None:
        """A fresh matcher for `params`' structured output when its partition's cache holds
        the grammar (see `compile`), else None."""
        key = (params.cache_salt, params.structured_spec)
        compiled = self._compiled.get(key)
        if compiled is None:
            return None
        self._compiled.move_to_end(key)
        return self._xgr.GrammarMatcher(compiled)

    def start_compile(self, params: SamplingParams) -> PendingGrammar:
        """Compile `params`' grammar off the caller's thread (joining a compile of the same
        grammar under the same salt in progress); `take` the matcher once it is done, or
        `drop` the wait. What the grammar library refuses raises GrammarError here, at once."""
        spec = params.structured_spec
        assert spec is not None
        key = (params.cache_salt, spec)
        compiling = self._compiling.get(key)
        if compiling is None:
            compiling = GrammarCompile(self._grammar(spec), COMPILE_MEMORY_BYTES)
            self._compile_threads.run(compiling.future, self._compile_bounded, compiling)
            self._compiling[key] = compiling
        self._waiters[key] += 1
        return PendingGrammar(key, compiling, time.monotonic())

    def take(self, pending: PendingGrammar) -> xgrammar.GrammarMatcher | None:
        """The request's matcher once its grammar has compiled (the grammar kept in the
        cache), else None. Raises GrammarError, the wait over, when the compile failed or
        has run longer than COMPILE_TIMEOUT_S; its message starts with REFUSED."""
        if not pending.future.done():
            if time.monotonic() - pending.started <= COMPILE_TIMEOUT_S:
                return None
            self.drop(pending)
            raise GrammarError(f"{REFUSED}{pending.key[1][0]}: its grammar did not compile "
                               f"within {COMPILE_TIMEOUT_S:g} s, the limit on a grammar's compile")
        self._leave(pending)
        kind = pending.key[1][0]
        try:
            compiled = pending.future.result()
        except TrialOutOfMemory as error:
            raise GrammarError(
                f"{REFUSED}{kind}: its grammar's compile needs more than "
                f"{_mib(pending.compile.memory_bytes)}, the limit on a grammar's compile "
                "memory") from error
        except TrialEnded as error:
            raise GrammarError(f"{REFUSED}{kind}: its grammar's compile failed: {error}") from error
        except (RuntimeError, TrialFailed) as error:
            raise GrammarError(REFUSED + _problem(kind, error)) from error
        if pending.key not in self._compiled:
            self._keep(pending.key, compiled)
        return self._xgr.GrammarMatcher(compiled)

    def drop(self, pending: PendingGrammar) -> None:
        """The request no longer waits: the compile is stopped when nobody else waits for
        it (its trial's child killed; past its trial, it runs to its end, not kept)."""
        if self._leave(pending):
            pending.compile.stop()

    def _compile_bounded(self, compiling: GrammarCompile) -> xgrammar.CompiledGrammar:
        """On a compile thread: the trial in a child, then the compile for the matchers."""
        try:
            self._trial(compiling)
        except TrialEnded as ended:
            if not ended.idle:
                raise
            self._trial(compiling)  # its child had left idle: once more, in a new one
        return self._compiler.compile_grammar(compiling.grammar)

    def _trial(self, compiling: GrammarCompile) -> None:
        trial = self._take_trial()
        with compiling.lock:
            if compiling.stopped:
                self._give_back(trial)
                raise CancelledError
            compiling.trial = trial
        try:
            trial.trial(compiling.grammar.serialize_json(), compiling.memory_bytes)
        finally:
            with compiling.lock:
                compiling.trial = None
            self._give_back(trial)

    def _take_trial(self) -> TrialCompiler:
        """An idle trial child, else a new one (started on this compile thread: it ends
        with the thread that started it)."""
        with self._trials_lock:
            while self._idle_trials:
                trial = self._idle_trials.pop()
                if trial.alive:
                    return trial
        return TrialCompiler(self._tokenizer_info_json)

    def _give_back(self, trial: TrialCompiler) -> None:
        if trial.alive:
            with self._trials_lock:
                self._idle_trials.append(trial)

    def _leave(self, pending: PendingGrammar) -> bool:
        """One waiter fewer; True when it was the last."""
        self._waiters[pending.key] -= 1
        if self._waiters[pending.key]:
            return False
        del self._waiters[pending.key]
        del self._compiling[pending.key]
        return True

    def _grammar(self, spec: StructuredSpec) -> xgrammar.Grammar:
        """The grammar of one spec; GrammarError where the library refuses it or would not
        enforce it (unenforceable.py)."""
        try:
            return self._checked_grammar(*spec)
        except (RuntimeError, Unenforceable) as error:
            raise GrammarError(_problem(spec[0], error)) from error

    def _checked_grammar(self, kind: str, value: str) -> xgrammar.Grammar:
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

    def _keep(self, key: GrammarKey, compiled: xgrammar.CompiledGrammar) -> None:
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


def _mib(size: int) -> str:
    return f"{size / 2**20:g} MiB"


def _close_all(trials: list[TrialCompiler]) -> None:
    for trial in trials:
        trial.close()


def _problem(kind: str, error: Exception) -> str:
    """What the grammar library's `error` says is wrong with a `kind` spec."""
    return f"{kind}: {_LOCATION.sub('', str(error)).strip()}"


class _DaemonThreads:
    """A few daemon threads running submitted calls: unlike a ThreadPoolExecutor's, which
    interpreter exit joins, a compile still running never holds the process's exit."""

    def __init__(self, count: int, name: str) -> None:
        self._count, self._name = count, name
        self._calls: queue.SimpleQueue[tuple[Future, Callable, tuple]] = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []

    def run(self, future: Future, call: Callable, *args: object) -> None:
        """`call(*args)` on one of the threads (started on first use), its result or
        exception set on `future` (unless it is cancelled before the call starts)."""
        if not self._threads:
            self._threads = [threading.Thread(target=self._run, name=f"{self._name}-{n}",
                                              daemon=True) for n in range(self._count)]
            for thread in self._threads:
                thread.start()
        self._calls.put((future, call, args))

    def _run(self) -> None:
        while True:
            future, call, args = self._calls.get()
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(call(*args))
            except BaseException as error:  # the waiter's to raise
                future.set_exception(error)


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
