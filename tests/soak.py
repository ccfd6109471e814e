"""Soak: many concurrent multi-turn chats on a KV pool far too small for them, checked.

Why: a paged engine's worst bugs live in the interleavings of its paths, not in any one of
them: a block leaked when an abort lands on a preempted request, a request that is never
admitted again, a greedy reply that changes because of what else shared its batch.
Unit tests walk each path once; a soak walks their combinations thousands of times.

What a chat does, as in the app: each turn's prompt is the chat's history ids (every
earlier prompt and reply) plus the new user message, so the prefix cache serves the
history and only the message is new. Chats open on one of a few shared system prompts
(blocks shared between chats), run 3 to 10 turns, and pause between turns. Each request
draws its own settings: greedy or seeded sampling (temperature, top-p, top-k, min-p,
penalties), a reply length, sometimes stop strings or stop ids. One in ten is aborted at a
random moment (waiting, mid-prefill, preempted, decoding) and its chat carries on with
the partial reply, as a user who pressed Esc would. While the time lasts, a chat that has
run its turns makes way for a new one; then every open chat finishes its turns.

At the end it checks: every request finished, with a finish reason its output explains;
nothing waited without bound (the worst wait to a first token is reported); no block is in
use and the pool's invariants hold (they are also checked after every step when driving
the Engine directly); greedy replies equal the same requests run alone. Everything is
drawn from one seeded RNG: driving the Engine directly, a seed replays the same soak.

    report = run_soak(soak_config("smollm2-135m"), duration_s=600)
    print(report.summary())
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import random
import time
from collections import Counter
from dataclasses import dataclass, field

from helpers import engine_thread_idle, phase_of, step_as_a_client

from paged_chat.engine import (
    ClientSpec,
    Engine,
    EngineConfig,
    LocalClient,
    RequestOutput,
    SamplingParams,
    make_client,
)
from paged_chat.engine.core.request import Request
from paged_chat.engine.models.loader import ModelSource, load_model_source

_NUM_SYSTEM_PROMPTS = 4
_MAX_MESSAGE = 40
_MAX_REPLY = 48
_MAX_PROBLEMS = 20  # a broken engine fails every request alike: the first few say it all
# Driving the Engine, an abort targets a phase (time spent waiting would otherwise soak up
# nearly all of them): a waiting request within this many steps, a prefilling or preempted
# one when first seen so, a decoding one after a random part of its max_tokens.
_ABORT_PHASES = ("waiting", "prefilling", "preempted", "decoding")
_ABORT_WAITING_STEPS = 40
# Through a thread client a stream is cancelled after a random delay up to this, or after the
# same fraction of its max_tokens, whichever comes first.
_ABORT_WITHIN_S = 0.4


def soak_config(model: str, **overrides: object) -> EngineConfig:
    """An engine for soaking: a pool of 96 blocks of 16 tokens against 32 running chats of up
    to 512 tokens each, so preemption and eviction never stop; fp32 on the CPU, so greedy
    replies can be compared token for token with the same requests run alone."""
    settings: dict[str, object] = dict(
        model=model, device="cpu", dtype="float32", block_size=16, num_blocks=96,
        max_model_len=512, max_num_seqs=32, max_num_batched_tokens=256)
    return EngineConfig(**{**settings, **overrides})


@dataclass(slots=True)
class SoakReport:
    """What a soak did and what it found; `problems` is empty when every check held."""

    mode: str  # "engine" (Engine.step driven directly) or "async" (a thread client's streams)
    duration_s: float
    num_chats: int
    requests: int = 0
    finish_reasons: Counter = field(default_factory=Counter)
    aborts: int = 0
    aborts_by_state: Counter = field(default_factory=Counter)  # where each abort landed
    preemptions: int = 0
    evictions: int = 0
    prefix_cache_hit_rate: float = 0.0
    steps: int | None = None  # engine steps (engine mode only)
    worst_wait_s: float = 0.0  # arrival to first token
    worst_wait_steps: int | None = None  # the same in engine steps (engine mode only)
    leaked_blocks: int = 0
    tier_hit_blocks: int = 0  # blocks the KV tier read back (when the config has one)
    greedy_checked: int = 0
    greedy_mismatches: int = 0
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def problem(self, message: str) -> None:
        if len(self.problems) < _MAX_PROBLEMS:
            self.problems.append(message)

    def summary(self) -> str:
        """The figures, one per line, then the problems (if any)."""
        reasons = ", ".join(f"{reason} {count}" for reason, count in sorted(self.finish_reasons.items()))
        where = ", ".join(f"{state} {count}" for state, count in sorted(self.aborts_by_state.items()))
        steps = f" / {self.worst_wait_steps} steps" if self.worst_wait_steps is not None else ""
        lines = [
            f"soak ({self.mode}): {self.num_chats} chats for {self.duration_s:.0f} s"
            + (f", {self.steps} steps" if self.steps is not None else ""),
            f"requests      {self.requests} ({reasons})",
            f"aborts        {self.aborts}" + (f" ({where})" if where else ""),
            f"preemptions   {self.preemptions}",
            f"evictions     {self.evictions}",
            f"prefix hits   {self.prefix_cache_hit_rate:.0%} of prompt tokens",
            f"worst wait    {self.worst_wait_s:.2f} s{steps} to a first token",
            f"leaked blocks {self.leaked_blocks}",
            f"greedy alone  {self.greedy_checked - self.greedy_mismatches}/{self.greedy_checked}"
            " equal",
            "OK" if self.ok else f"{len(self.problems)} problem(s):",
            *(f"  - {problem}" for problem in self.problems),
        ]
        return "\n".join(lines)


def run_soak(config: EngineConfig, duration_s: float = 600.0, num_chats: int = 64,
             seed: int = 0, *, use_async: bool = False, abort_rate: float = 0.1,
             verify_greedy: int = 200) -> SoakReport:
    """Soak an engine built from `config` (see `soak_config`) and report.

    `num_chats` chats run at once; each runs all its turns, and until `duration_s` has
    passed a finished chat is replaced by a new one (`duration_s=0`: each chat runs once).
    `use_async` drives a thread client with one asyncio task per chat instead of stepping
    the Engine. Up to `verify_greedy` greedy replies are rerun alone and compared.
    """
    source = load_model_source(config.model)
    engine = Engine(config, source)
    report = SoakReport("async" if use_async else "engine", duration_s, num_chats)
    workload = _Workload(random.Random(seed), engine, abort_rate)
    started = time.monotonic()
    if use_async:
        asyncio.run(_drive_async(engine, workload, report, started + duration_s))
    else:
        _drive_engine(engine, workload, report, started + duration_s)
    report.duration_s = time.monotonic() - started
    stats = engine.stats()
    report.preemptions, report.evictions = stats.num_preemptions, stats.num_evictions
    report.prefix_cache_hit_rate = stats.prefix_cache_hit_rate
    report.leaked_blocks = stats.blocks_in_use
    report.tier_hit_blocks = stats.tier.hit_blocks
    engine.close()
    if engine.has_unfinished() or engine.requests:
        report.problem(f"{len(engine.requests)} request(s) never finished")
    if report.leaked_blocks:
        report.problem(f"{report.leaked_blocks} block(s) still in use with no request left")
    try:
        engine.kv_cache.check_invariants()
    except AssertionError as error:
        report.problem(f"block pool invariant broken at the end: {error}")
    _verify_greedy(engine, source, workload.greedy, verify_greedy, workload.rng, report)
    return report


@dataclass(slots=True)
class _Chat:
    history: list[int]
    turns_left: int
    ready_step: int = 0  # engine mode: the step after which the user sends the next message


@dataclass(slots=True)
class _Turn:
    """One request in flight, and what its deltas added up to."""

    chat: _Chat
    prompt: list[int]
    params: SamplingParams
    abort_at: float | None  # in [0, 1): when the user aborts it (see _ABORT_PHASES)
    added_step: int
    added_at: float
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    got_first_token: bool = False
    finished: bool = False


class _Workload:
    """Draws chats and requests from one RNG and checks what comes back, into one report."""

    def __init__(self, rng: random.Random, engine: Engine, abort_rate: float) -> None:
        self.rng = rng
        self.engine = engine
        self.abort_rate = abort_rate
        self.vocab_size = engine.model_config.vocab_size
        self.system_prompts = [self._ids(rng.randint(20, 150)) for _ in range(_NUM_SYSTEM_PROMPTS)]
        pieces = (engine.tokenizer.decode([i], skip_special_tokens=True)
                  for i in rng.sample(range(self.vocab_size), min(200, self.vocab_size)))
        self.stop_pool = sorted({piece for piece in pieces if piece.strip()})
        self.greedy: list[tuple[list[int], SamplingParams, list[int]]] = []

    def _ids(self, count: int) -> list[int]:
        return [self.rng.randrange(3, self.vocab_size) for _ in range(count)]

    def new_chat(self, step: int = 0) -> _Chat:
        return _Chat(list(self.rng.choice(self.system_prompts)), self.rng.randint(3, 10),
                     step + self.rng.randint(0, 20))

    def next_turn(self, chat: _Chat, step: int = 0) -> _Turn | None:
        """The chat's next request, or None when it has run its turns or its context is full
        (the app would open a new chat)."""
        message = self._ids(self.rng.randint(4, _MAX_MESSAGE))
        if chat.turns_left == 0 or (len(chat.history) + len(message) + _MAX_REPLY
                                    > self.engine.max_model_len):
            return None
        chat.turns_left -= 1
        rng = self.rng
        common = dict(
            max_tokens=rng.randint(4, _MAX_REPLY), ignore_eos=rng.random() < 0.5,
            stop=rng.sample(self.stop_pool, rng.randint(1, 2)) if rng.random() < 0.3 else [],
            stop_token_ids=[rng.randrange(3, self.vocab_size)] if rng.random() < 0.1 else [])
        if rng.random() < 0.5:
            params = SamplingParams(temperature=0.0, **common)
        else:
            params = SamplingParams(
                temperature=rng.uniform(0.3, 1.5), top_p=rng.choice([1.0, 0.9, 0.5]),
                top_k=rng.choice([0, 0, 20, 100]), min_p=rng.choice([0.0, 0.05]),
                repetition_penalty=rng.choice([1.0, 1.0, 1.2]), seed=rng.getrandbits(32),
                **common)
        abort_at = rng.random() if rng.random() < self.abort_rate else None
        return _Turn(chat, chat.history + message, params, abort_at, step, time.monotonic())

    def on_output(self, turn: _Turn, out: RequestOutput, step: int | None,
                  report: SoakReport) -> None:
        """Add a delta to its turn: track the first-token wait, and check a finished one."""
        turn.token_ids += out.new_token_ids
        turn.text += out.new_text
        if out.new_token_ids and not turn.got_first_token:
            turn.got_first_token = True
            report.worst_wait_s = max(report.worst_wait_s, time.monotonic() - turn.added_at)
            if step is not None:
                report.worst_wait_steps = max(report.worst_wait_steps or 0, step - turn.added_step)
        if out.finished:
            turn.finished = True
            self._check_finished(turn, out, report)

    def end_turn(self, turn: _Turn, report: SoakReport) -> None:
        """Count the request (aborted unless it finished) and add its reply to the chat's
        history, cut or whole, as the app keeps it."""
        report.requests += 1
        if not turn.finished:
            report.aborts += 1
            report.finish_reasons["abort"] += 1
        turn.chat.history = turn.prompt + turn.token_ids

    def _check_finished(self, turn: _Turn, out: RequestOutput, report: SoakReport) -> None:
        params, reason = turn.params, out.finish_reason
        report.finish_reasons[reason] += 1
        name = f"{out.request_id} ({reason})"
        if turn.token_ids != out.token_ids or turn.text != out.text:
            report.problem(f"{name}: the deltas do not add up to the final output")
        if len(out.token_ids) > params.max_tokens:
            report.problem(f"{name}: {len(out.token_ids)} tokens, max_tokens {params.max_tokens}")
        if reason == "length":
            explained = (len(out.token_ids) == params.max_tokens
                         or len(turn.prompt) + len(out.token_ids) >= self.engine.max_model_len)
        elif reason == "stop":
            last = out.token_ids[-1] if out.token_ids else None
            ends = set(params.stop_token_ids) | (set() if params.ignore_eos
                                                 else self.engine.eos_token_ids)
            full = self.engine.tokenizer.decode(out.token_ids, skip_special_tokens=True)
            explained = last in ends or any(stop in full for stop in params.stop)
        else:  # "abort" comes only from end_turn; "error" has no place in a soak
            explained = False
        if not explained:
            report.problem(f"{name}: finish reason not explained by the output "
                           f"({len(out.token_ids)} tokens; {out.error or 'no error'})")
        elif params.greedy and reason in ("stop", "length"):
            self.greedy.append((turn.prompt, params, out.token_ids))


def _aborts_now(turn: _Turn, request: Request, step: int) -> bool:
    if turn.abort_at is None:
        return False
    scaled = turn.abort_at * len(_ABORT_PHASES)
    phase, fraction = _ABORT_PHASES[int(scaled)], scaled % 1
    if phase_of(request) != phase:
        return False
    if phase == "waiting":
        return step - turn.added_step >= fraction * _ABORT_WAITING_STEPS
    if phase == "decoding":
        return request.num_output_tokens >= fraction * turn.params.max_tokens
    return True


def _drive_engine(engine: Engine, workload: _Workload, report: SoakReport,
                  deadline: float) -> None:
    """Step the Engine; users act between steps; the pool is checked after every step."""
    chats = [workload.new_chat() for _ in range(report.num_chats)]
    in_flight: dict[str, _Turn] = {}
    busy: set[int] = set()  # ids of the chats with a request in flight
    step, broken = 0, False
    while chats:
        for chat in list(chats):
            if id(chat) in busy or chat.ready_step > step:
                continue
            turn = workload.next_turn(chat, step)
            if turn is None:
                chats.remove(chat)
                if time.monotonic() < deadline:
                    chats.append(workload.new_chat(step))
                continue
            in_flight[engine.add_request(turn.prompt, turn.params)] = turn
            busy.add(id(chat))
        for request_id, turn in in_flight.items():
            request = engine.requests.get(request_id)
            if request is not None and _aborts_now(turn, request, step):
                report.aborts_by_state[phase_of(request)] += 1
                engine.abort(request_id)
        outputs = step_as_a_client(engine)
        step += 1
        for out in outputs:
            turn = in_flight[out.request_id]
            if out.finish_reason != "abort":
                workload.on_output(turn, out, step, report)
            if not out.finished:
                continue
            workload.end_turn(turn, report)
            del in_flight[out.request_id]
            busy.discard(id(turn.chat))
            turn.chat.ready_step = step + workload.rng.randint(0, 10)
        try:
            engine.kv_cache.check_invariants()
        except AssertionError as error:
            if not broken:  # the first break says it; the run goes on to show the damage
                report.problem(f"after step {step}: {error}")
            broken = True
    report.steps = step


async def _drive_async(engine: Engine, workload: _Workload, report: SoakReport,
                       deadline: float) -> None:
    """One asyncio task per chat slot streams from a thread client; aborts are cancellations
    after a random delay (in seconds here), wherever the request then is."""
    async_engine = make_client(ClientSpec(engine=engine, stats_interval_s=0.02))

    async def run_turn(turn: _Turn) -> None:
        stop_at = (turn.abort_at * turn.params.max_tokens if turn.abort_at is not None
                   else float("inf"))
        async with contextlib.aclosing(async_engine.stream(turn.prompt, turn.params)) as stream:
            async for out in stream:
                workload.on_output(turn, out, None, report)
                if len(turn.token_ids) >= stop_at and not out.finished:
                    return  # the user pressed Esc; closing the stream aborts the request

    async def chat_slot() -> None:
        chat = workload.new_chat()
        while True:
            await asyncio.sleep(workload.rng.uniform(0, 0.05))
            turn = workload.next_turn(chat)
            if turn is None:
                if time.monotonic() >= deadline:
                    return
                chat = workload.new_chat()
                continue
            timeout = turn.abort_at * _ABORT_WITHIN_S if turn.abort_at is not None else None
            try:
                await asyncio.wait_for(run_turn(turn), timeout)
            except TimeoutError:  # the user pressed Esc before the reply got that far
                pass
            if not turn.finished:
                report.aborts_by_state["streaming" if turn.got_first_token
                                       else "before a first token"] += 1
            workload.end_turn(turn, report)

    try:
        await asyncio.gather(*(chat_slot() for _ in range(report.num_chats)))
        await _until_idle(async_engine, report)
    finally:
        await asyncio.get_running_loop().run_in_executor(None, async_engine.shutdown)


async def _until_idle(async_engine: LocalClient, report: SoakReport, timeout_s: float = 60) -> None:
    """Wait until the engine thread has applied every cancellation it was sent: with every
    stream closed, nothing may stay running or waiting."""
    give_up = time.monotonic() + timeout_s
    while not engine_thread_idle(async_engine):
        if time.monotonic() > give_up:
            report.problem(f"the engine did not go idle within {timeout_s} s of the last "
                           f"stream closing ({len(async_engine.transport.engine.requests)} requests left)")
            return
        await asyncio.sleep(0.02)


def _verify_greedy(engine: Engine, source: ModelSource,
                   greedy: list[tuple[list[int], SamplingParams, list[int]]], limit: int,
                   rng: random.Random, report: SoakReport) -> None:
    """Rerun a sample of the greedy requests alone (one at a time, no prefix cache, a pool
    with room to spare) and compare: batching, chunking, preemption and prefix hits must
    never change a greedy reply."""
    if not greedy or limit <= 0:
        return
    alone = Engine(dataclasses.replace(
        engine.config, max_num_seqs=1, enable_prefix_caching=False,
        max_model_len=engine.max_model_len,
        num_blocks=-(-engine.max_model_len // engine.block_size) + 1), source)
    for prompt, params, token_ids in rng.sample(greedy, min(limit, len(greedy))):
        expected = alone.generate([prompt], params)[0].token_ids
        report.greedy_checked += 1
        if expected != token_ids:
            report.greedy_mismatches += 1
            first = next(i for i, pair in enumerate(zip(expected + [-1], token_ids + [-1]))
                         if pair[0] != pair[1])
            report.problem(f"a greedy reply ({len(prompt)}-token prompt) differs from the same "
                           f"request run alone from token {first} on")
