"""ThreadPolicy: how many torch threads the engine's steps run on, adapted to a busy machine.

Every parallel region of a step (each matmul, each elementwise op) splits over the
intra-op threads and ends at a barrier that waits for all of them. On a machine where other
processes hold some of the cores, one descheduled thread stalls every region of the step,
hundreds of times per step, and a step at "all cores" can be many times slower than at
fewer. No fixed count is right on every machine at every moment, so the policy measures:

- It starts from the cores this process may run on (`os.sched_getaffinity`).
- At the first step, and again after `recheck_steps` steps or `recheck_s` seconds
  (whichever comes first: the load on a machine changes while the engine runs), it runs a
  trial: `trial_steps` steps alternating between the current count and a neighbouring one (half as many, or back up towards the maximum), so
  both arms see the same mix of prefill and decode work, and keeps whichever produced
  tokens faster by more than `margin` (`margin_more` for more threads). Only steps of one
  size compare (a step of one sequence makes a fraction of the tokens a step of eight
  does in nearly the same time): a step of another size starts the trial over on it, until
  the trial has run `trial_steps` twice over, when it ends undecided.
- The two mistakes do not cost the same. Too few threads on a quiet machine costs at most
  the ratio of the counts; too many on a busy one makes steps many times slower, and so does
  every trial of more threads there. So more threads must win by a wider margin, and each
  trial of more threads that loses doubles the wait before the next one (up to
  `max_backoff` times the recheck interval); a change of count starts over. After
  `decide_after` steps (two on each arm: one step alone is too noisy), a trial also ends
  as soon as one arm has run at under `give_up` of the other's rate: that says enough, and
  each more step on the slow arm costs a lot (on a busy machine the first trial, from
  every core down, would otherwise run half its steps many times slower).
- A fixed `threads` (EngineConfig.threads) turns the trials off.

Only decode-only steps run trials; steps with prompt work run on the cores other processes
leave free, measured (`MachineLoad`), and decode steps run on no more than those either
(`StepThreads` says why).

`torch.set_num_threads` reaches OpenMP per calling thread, so `apply()` sets the count at
the start of every step on the thread that steps (the thread transport's included), not once
at start-up on the thread that built the engine.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

# How much of a core other processes must use for it to count as taken. A bursty load below
# that (an app's UI laying out new turns: ~0.5 of a core in 20 ms bursts) costs a prefill on
# every core less than giving the core up does: 8 prompts at once took 521 ms on 2 threads
# against 751 on 1 beside such a load of 0.5, 671 against 715 at 0.75; beside a whole busy
# core 1 thread wins (759 against 1,001 ms). Rounding took 0.5 as a core, and the TUI's
# engine prefilled its tabs' first turns on one thread.
CORE_TAKEN_AT = 0.8


def free_cores(max_threads: int, others: float) -> int:
    """Of `max_threads` cores, those `others` cores' worth of other processes' work leaves."""
    return max(1, max_threads - math.floor(others + 1 - CORE_TAKEN_AT))


def available_cores() -> int:
    """The cores this process may run on (its CPU affinity), at least 1."""
    return max(1, len(os.sched_getaffinity(0)))


@dataclass(slots=True)
class ThreadPolicy:
    """Chooses the thread count of each step; `record` feeds back what each step did.

    `chosen` is the count the trials settled on (a fixed policy's count); steps run on
    `count`, which is `chosen` under the `ceiling`, so a load that lowered the ceiling and
    went takes the count back where the trials left it.

    Invariant: `1 <= count <= max_threads`; a trial's arms are `count` and `_candidate`,
    which differ; outside a trial `_candidate` is None.
    """

    max_threads: int
    adaptive: bool
    trial_steps: int = 8
    recheck_steps: int = 512
    recheck_s: float = 5.0
    margin: float = 0.05
    margin_more: float = 0.15
    max_backoff: int = 16
    give_up: float = 0.5
    decide_after: int = 4
    clock: Callable[[], float] = time.monotonic
    chosen: int = 0     # 0: max_threads
    ceiling: int = 0    # the most threads trials may try now (0: max_threads); see set_ceiling
    _steps_to_trial: int = 0
    _trial_due: float = 0.0
    _candidate: int | None = None
    _trial_index: int = 0
    _arms: dict[int, list[float]] = field(default_factory=dict)  # count -> [tokens, seconds]
    _trial_tokens: int = 0   # the size of the steps the trial compares (0: none yet)
    _trial_seen: int = 0     # steps the trial ran, of any size
    _tried_lower_last: bool = False
    _backoff: int = 1   # how many recheck intervals before the next trial of more threads

    def __post_init__(self) -> None:
        assert self.max_threads >= 1 and self.trial_steps >= 2 and self.recheck_steps >= 0
        self.chosen = self.chosen or self.max_threads
        self.ceiling = self.ceiling or self.max_threads

    @property
    def count(self) -> int:
        """The count steps run on outside a trial: `chosen`, under the ceiling."""
        return min(self.chosen, self.ceiling)

    @classmethod
    def from_setting(cls, threads: int | str | None) -> "ThreadPolicy":
        """`threads` as EngineConfig takes it: a fixed count, or None / "auto" to adapt."""
        if isinstance(threads, int):
            return cls(max_threads=threads, adaptive=False)
        cores = available_cores()
        return cls(max_threads=cores, adaptive=cores > 1)

    @property
    def in_trial(self) -> bool:
        return self._candidate is not None

    def set_ceiling(self, ceiling: int) -> None:
        """Run on at most `ceiling` threads, and try no more, until it changes (the cores
        other processes leave free): beside busy processes each trial step on more threads
        than that costs many times over, and says only what the load already says."""
        if not self.adaptive:
            return
        self.ceiling = max(1, min(self.max_threads, ceiling))
        if self._candidate is not None and self._candidate > self.ceiling:
            self._candidate = None   # a trial it may no longer run: the next one comes as due

    def next_count(self) -> int:
        """The thread count the next step should run on."""
        if not self.adaptive:
            return self.count
        if self._candidate is None and (self._steps_to_trial <= 0
                                        or self.clock() >= self._trial_due):
            self._start_trial()
        if self._candidate is not None and self._trial_index % 2 == 1:
            return self._candidate
        return self.count

    def apply(self) -> int:
        """Set the next step's count on the calling thread (cheap when unchanged)."""
        count = self.next_count()
        if torch.get_num_threads() != count:
            torch.set_num_threads(count)
        return count

    def record(self, threads: int, num_tokens: int, seconds: float) -> None:
        """What a step that ran on `threads` threads did: `num_tokens` tokens in `seconds`."""
        if not self.adaptive:
            return
        if self._candidate is None:
            self._steps_to_trial -= 1
            return
        self._trial_seen += 1
        if num_tokens != self._trial_tokens:
            if self._trial_tokens and self._trial_seen > 2 * self.trial_steps:
                self._candidate = None
                self._schedule_next_trial(1)
                return
            self._trial_tokens, self._arms, self._trial_index = num_tokens, {}, 0
        arm = self._arms.setdefault(threads, [0.0, 0.0])
        arm[0] += num_tokens
        arm[1] += seconds
        self._trial_index += 1
        rates = [_rate(arm) for arm in self._arms.values()]
        decided = (self._trial_index >= self.decide_after and len(rates) == 2
                   and min(rates) < self.give_up * max(rates))
        if decided or self._trial_index >= self.trial_steps:
            self._finish_trial()

    def _next_candidate(self) -> int | None:
        """The neighbour the next trial tries against `count` (None: one thread, no more
        allowed)."""
        lower = self.count // 2 if self.count > 1 else None
        upper = min(self.ceiling, self.count * 2) if self.count < self.ceiling else None
        if lower is not None and upper is not None:  # both exist: take turns
            return upper if self._tried_lower_last else lower
        return lower if lower is not None else upper

    def _start_trial(self) -> None:
        candidate = self._next_candidate()
        if candidate is None:
            self._schedule_next_trial(1)
            return
        self._tried_lower_last = candidate < self.count
        self._candidate, self._trial_index, self._arms = candidate, 0, {}
        self._trial_tokens = self._trial_seen = 0

    def _finish_trial(self) -> None:
        assert self._candidate is not None
        more = self._candidate > self.count
        current = _rate(self._arms.get(self.count))
        candidate = _rate(self._arms.get(self._candidate))
        if candidate > current * (1 + (self.margin_more if more else self.margin)):
            self.chosen, self._backoff = self._candidate, 1
        elif more:
            self._backoff = min(2 * self._backoff, self.max_backoff)
        self._candidate = None
        following = self._next_candidate()
        more_next = following is not None and following > self.count
        self._schedule_next_trial(self._backoff if more_next else 1)

    def _schedule_next_trial(self, wait: int) -> None:
        self._steps_to_trial = self.recheck_steps * wait
        self._trial_due = self.clock() + self.recheck_s * wait


def _rate(arm: list[float] | None) -> float:
    if not arm or arm[1] <= 0:
        return 0.0
    return arm[0] / arm[1]


@dataclass(slots=True)
class MachineLoad:
    """How many cores' worth of CPU other processes used lately, on the cores this process
    may run on: those cores' busy time (/proc/stat) less this process's own CPU time, over
    windows of at least `min_window_s`. 0 where /proc/stat cannot be read.

    The first window starts when this is made (the engine's start-up), so the first prompt
    already knows the load it starts under.
    """

    read_busy: Callable[[], float | None] = field(
        default=lambda: _busy_seconds(os.sched_getaffinity(0)))
    read_own: Callable[[], float] = time.process_time
    clock: Callable[[], float] = time.monotonic
    min_window_s: float = 0.5
    others: float = 0.0
    _last: tuple[float, float, float] | None = None   # (busy, own, when) at the window's start

    def __post_init__(self) -> None:
        self._mark()

    def update(self) -> float:
        """`others` after the window that ended now, if it is long enough."""
        if self._last is None or self.clock() - self._last[2] >= self.min_window_s:
            last = self._last
            self._mark()
            if last is not None and self._last is not None:
                busy, own, when = (now - then for now, then in zip(self._last, last))
                self.others = max(0.0, busy - own) / when
        return self.others

    def _mark(self) -> None:
        busy = self.read_busy()
        self._last = None if busy is None else (busy, self.read_own(), self.clock())


def _busy_seconds(cores: set[int]) -> float | None:
    """Seconds `cores` have spent on anything but idling, from /proc/stat; None without it."""
    try:
        with open("/proc/stat") as stat:
            lines = [line.split() for line in stat if line.startswith("cpu") and line[3] != " "]
    except OSError:
        return None
    ticks = 0
    for name, *fields in lines:
        if int(name[3:]) in cores:  # user nice system idle iowait irq softirq steal ...
            ticks += sum(map(int, fields[:8])) - int(fields[3]) - int(fields[4])
    return ticks / os.sysconf("SC_CLK_TCK")


@dataclass(slots=True)
class StepThreads:
    """The thread policy of decode-only steps, and the count of steps with prompt work.

    On a busy machine the two want different counts. A decode step is hundreds of small
    ops, each ending at a barrier that one descheduled thread stalls, so it adapts by
    trials. A prefill chunk is a few large matmuls that split well and wait at few barriers,
    and trials on prefill steps would cost more than they find: they are few and large, and
    one on the slow arm costs a whole chunk's time (with one policy for both, a trial that
    fell in the prefill at the start kept every core for the decode steps after it until the
    next recheck; docs/benchmarks.md has the figures). So a prefill step runs on the cores other processes leave free (`MachineLoad`), measured,
    not tried: every core on a quiet machine, fewer beside busy processes, where a prompt on
    every core waited at each barrier for a thread the busy processes had descheduled.
    """

    decode: ThreadPolicy
    prefill: ThreadPolicy
    load: MachineLoad | None = None   # None: a fixed count, prefill steps keep it

    @classmethod
    def from_setting(cls, threads: int | str | None) -> "StepThreads":
        decode = ThreadPolicy.from_setting(threads)
        return cls(decode, ThreadPolicy(max_threads=decode.max_threads, adaptive=False),
                   MachineLoad() if decode.adaptive else None)

    def leave_cores(self, cores: int) -> None:
        """Start decode steps on `cores` fewer threads than every core (something else on
        this machine needs them: an app's UI thread); trials still move up to more threads
        where those run faster. A fixed count is left as it is."""
        if self.decode.adaptive:
            self.decode.chosen = max(1, self.decode.max_threads - cores)

    def for_step(self, decode_only: bool) -> ThreadPolicy:
        if self.load is not None:
            free = free_cores(self.prefill.max_threads, self.load.update())
            self.prefill.chosen = free
            self.decode.set_ceiling(free)
        return self.decode if decode_only else self.prefill
