"""ThreadPolicy: its decisions from fed step timings (a fake clock), and that the count it
picks holds on the thread that steps."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from paged_chat.engine import EngineConfig
from paged_chat.engine.worker.threads import (
    MachineLoad,
    StepThreads,
    ThreadPolicy,
    available_cores,
    free_cores,
)


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def run_steps(policy: ThreadPolicy, clock: FakeClock, seconds_per_token: dict[int, float],
              steps: int, tokens: int = 8) -> list[int]:
    """Step `steps` times; a step on n threads takes tokens * seconds_per_token[n]."""
    counts = []
    for _ in range(steps):
        count = policy.next_count()
        elapsed = tokens * seconds_per_token[count]
        clock.now += elapsed
        policy.record(count, tokens, elapsed)
        counts.append(count)
    return counts


def make_policy(max_threads: int = 2, **overrides) -> tuple[ThreadPolicy, FakeClock]:
    clock = FakeClock()
    return ThreadPolicy(max_threads=max_threads, adaptive=True, clock=clock, **overrides), clock


def test_quiet_machine_keeps_every_core():
    policy, clock = make_policy()
    counts = run_steps(policy, clock, {2: 0.001, 1: 0.0018}, steps=100)
    assert counts[:8] == [2, 1] * 4  # the trial alternates its arms
    assert set(counts[8:]) == {2} and policy.count == 2


def test_contended_machine_drops_to_fewer_threads():
    policy, clock = make_policy()
    run_steps(policy, clock, {2: 0.02, 1: 0.002}, steps=8)
    assert policy.count == 1 and not policy.in_trial


def test_a_difference_within_the_margin_changes_nothing():
    policy, clock = make_policy(margin=0.05)
    run_steps(policy, clock, {2: 0.001, 1: 0.00098}, steps=8)
    assert policy.count == 2


def test_rechecks_after_the_interval_and_climbs_back_when_the_load_goes():
    policy, clock = make_policy(recheck_s=5.0, recheck_steps=10_000)
    run_steps(policy, clock, {2: 0.02, 1: 0.002}, steps=8)
    assert policy.count == 1
    # the load goes away: nothing changes until the interval has passed, then 2 wins again
    quiet = {2: 0.001, 1: 0.0018}
    before = run_steps(policy, clock, quiet, steps=5)
    assert before == [1] * 5
    clock.now += 5.0
    after = run_steps(policy, clock, quiet, steps=8)
    assert after == [1, 2] * 4 and policy.count == 2


def test_more_threads_must_win_by_the_wider_margin():
    busy = {2: 0.0011, 1: 0.001}   # 1 thread 10% faster: enough to drop to it
    policy, clock = make_policy(margin=0.05, margin_more=0.15, recheck_s=5.0, recheck_steps=10_000)
    run_steps(policy, clock, busy, steps=8)
    assert policy.count == 1
    clock.now += 5.0
    run_steps(policy, clock, {2: 0.001, 1: 0.0011}, steps=8)   # 2 threads 10% faster: not enough
    assert policy.count == 1
    clock.now += 10.0
    run_steps(policy, clock, {2: 0.001, 1: 0.0013}, steps=8)   # 30% faster: climbs
    assert policy.count == 2


def test_each_losing_trial_of_more_threads_doubles_the_wait_for_the_next():
    contended = {2: 0.02, 1: 0.002}
    policy, clock = make_policy(recheck_s=5.0, recheck_steps=10_000, max_backoff=4)
    run_steps(policy, clock, contended, steps=8)
    assert policy.count == 1
    waits = []
    for _ in range(4):   # each trial of 2 threads loses; time until the next one starts
        started = clock.now
        while not policy.in_trial:
            clock.now += 0.5
            policy.next_count()
        waits.append(round(clock.now - started))
        run_steps(policy, clock, contended, steps=8)
    assert waits == [5, 10, 20, 20] and policy.count == 1


def test_a_trial_of_more_threads_ends_once_it_is_hopeless():
    contended = {2: 0.02, 1: 0.002}
    policy, clock = make_policy(recheck_s=5.0, recheck_steps=10_000)
    run_steps(policy, clock, contended, steps=8)
    assert policy.count == 1
    clock.now += 5.0
    assert run_steps(policy, clock, contended, steps=6) == [1, 2, 1, 2, 1, 1]
    assert policy.count == 1 and not policy.in_trial


def test_a_trial_down_from_every_core_ends_once_the_fewer_threads_run_far_faster():
    """Beside busy processes the first trial, from every core down, would otherwise run
    half its steps on the slow arm."""
    policy, clock = make_policy()
    assert run_steps(policy, clock, {2: 0.02, 1: 0.002}, steps=6) == [2, 1, 2, 1, 1, 1]
    assert policy.count == 1 and not policy.in_trial


def test_rechecks_after_recheck_steps_without_time_passing():
    policy, clock = make_policy(recheck_s=1e9, recheck_steps=20)
    run_steps(policy, clock, {2: 0.0, 1: 0.0}, steps=8)
    assert not policy.in_trial
    run_steps(policy, clock, {2: 0.0, 1: 0.0}, steps=20)
    assert policy.next_count() in (1, 2) and policy.in_trial


def test_many_cores_try_both_neighbours_in_turn():
    policy, clock = make_policy(max_threads=8)
    timing = {8: 0.01, 4: 0.004, 2: 0.003, 1: 0.01}
    run_steps(policy, clock, timing, steps=8)
    assert policy.count == 4
    clock.now += 10
    run_steps(policy, clock, timing, steps=8)  # tries 8 again (the upper neighbour): keeps 4
    assert policy.count == 4
    clock.now += 10
    run_steps(policy, clock, timing, steps=8)  # then 2 (the lower): takes it
    assert policy.count == 2


def test_decode_steps_adapt_while_prefill_steps_keep_every_core(monkeypatch):
    """Beside busy processes decode steps run faster on one thread while a prefill chunk
    still gains from both cores: a trial in the prefill must not decide for the decodes,
    and a prefill step is never a trial's slow arm."""
    monkeypatch.setattr("paged_chat.engine.worker.threads.available_cores", lambda: 2)
    steps = StepThreads.from_setting(None)
    clock = FakeClock()
    steps.decode.clock = clock
    steps.load = FakeMachine(clock).load()   # nothing else runs: the trials alone decide
    prefill = run_steps(steps.for_step(decode_only=False), clock, {2: 0.001, 1: 0.0018}, steps=8)
    run_steps(steps.for_step(decode_only=True), clock, {2: 0.02, 1: 0.004}, steps=8)
    assert prefill == [2] * 8 and steps.decode.count == 1


def test_leaving_a_core_to_a_ui_starts_decode_steps_lower_and_trials_still_climb(monkeypatch):
    """The app's engine leaves a core to the UI thread; where more threads still run much
    faster (a quiet machine, a UI at rest), the first trial takes them back."""
    monkeypatch.setattr("paged_chat.engine.worker.threads.available_cores", lambda: 2)
    steps = StepThreads.from_setting(None)
    clock = FakeClock()
    steps.decode.clock = clock
    steps.leave_cores(1)
    assert steps.decode.count == 1 and steps.prefill.next_count() == 2
    assert run_steps(steps.decode, clock, {2: 0.001, 1: 0.002}, steps=8)[0] == 1
    assert steps.decode.count == 2
    beside_a_busy_ui = StepThreads.from_setting(None)
    beside_a_busy_ui.decode.clock = clock
    beside_a_busy_ui.leave_cores(1)
    run_steps(beside_a_busy_ui.decode, clock, {2: 0.0011, 1: 0.001}, steps=8)
    assert beside_a_busy_ui.decode.count == 1
    pinned = StepThreads.from_setting(2)
    pinned.leave_cores(1)
    assert pinned.decode.next_count() == 2


class FakeMachine:
    """/proc/stat's busy seconds on our cores and our own CPU seconds, advanced by hand."""

    def __init__(self, clock: FakeClock) -> None:
        self.clock, self.busy, self.own = clock, 0.0, 0.0

    def run(self, seconds: float, ours: float, others: float) -> None:
        """`seconds` pass with `ours` and `others` cores' worth of work on the machine."""
        self.clock.now += seconds
        self.own += ours * seconds
        self.busy += (ours + others) * seconds

    def load(self) -> MachineLoad:
        return MachineLoad(read_busy=lambda: self.busy, read_own=lambda: self.own, clock=self.clock)


def test_steps_run_on_no_more_cores_than_other_processes_leave_free(monkeypatch):
    """Prefill steps take the free cores as they are; decode steps drop to them at once and
    try no more while the load lasts (each trial step on more would cost many times over),
    and go back to the count the trials chose once it is gone."""
    monkeypatch.setattr("paged_chat.engine.worker.threads.available_cores", lambda: 2)
    clock = FakeClock()
    machine = FakeMachine(clock)
    steps = StepThreads.from_setting(None)
    steps.load = machine.load()
    steps.decode.clock = clock
    machine.run(5.0, ours=1.0, others=0.1)         # loading the model on a quiet machine
    assert steps.for_step(decode_only=False).next_count() == 2
    machine.run(1.0, ours=1.0, others=0.6)         # an app's UI lays out its tabs' new turns
    assert steps.for_step(decode_only=False).next_count() == 2
    machine.run(2.0, ours=1.0, others=1.3)         # two busy processes start
    assert steps.for_step(decode_only=False).next_count() == 1
    assert steps.load.others == pytest.approx(1.3)
    decode = steps.for_step(decode_only=True)
    assert decode.count == 1 and {decode.next_count() for _ in range(20)} == {1}
    machine.run(0.1, ours=1.0, others=0.0)         # too short a window to say: keep the estimate
    assert steps.for_step(decode_only=False).next_count() == 1
    machine.run(1.0, ours=2.0, others=0.0)         # they stopped
    assert steps.for_step(decode_only=False).next_count() == 2
    assert steps.decode.count == 2                 # no trial needed to get back
    clock.now += steps.decode.recheck_s
    run_steps(steps.for_step(decode_only=True), clock, {2: 0.001, 1: 0.002}, steps=8)
    assert steps.decode.count == 2


def test_a_core_counts_as_taken_from_four_fifths_of_it_used():
    """A bursty load of half a core (an app's UI) leaves every core to a prefill, which runs
    faster on them than without the one it shares (perf: CORE_TAKEN_AT)."""
    assert [free_cores(2, others) for others in (0.0, 0.5, 0.79, 0.8, 1.3, 1.8, 2.5)] == [
        2, 2, 2, 1, 1, 1, 1]
    assert [free_cores(16, others) for others in (0.7, 3.5, 3.9, 15.0)] == [16, 13, 12, 1]


def test_a_trial_compares_only_steps_of_one_size():
    """Steps of one sequence make an eighth of the tokens of steps of eight in about the same
    time. A trial whose arms got different sizes (the batch changed at every step, in time
    with the arms) compared those and dropped to one thread beside an app whose tabs were
    starting and finishing turns; now it starts over at each new size and ends undecided."""
    policy, clock = make_policy()
    step_seconds = {2: 0.05, 1: 0.06}          # two threads are faster at any batch
    for size in [1, 8] * 20:                   # the batch changes in time with the arms
        count = policy.next_count()
        clock.now += step_seconds[count]
        policy.record(count, size, step_seconds[count])
    assert policy.count == 2
    clock.now += policy.recheck_s
    run_steps(policy, clock, {2: 0.05 / 8, 1: 0.06 / 8}, steps=8)   # a batch of 8 throughout
    assert policy.count == 2 and not policy.in_trial


def test_no_proc_stat_means_no_load_and_a_fixed_count_means_no_measuring():
    assert MachineLoad(read_busy=lambda: None).update() == 0.0
    assert StepThreads.from_setting(3).load is None


def test_busy_processes_show_up_as_load_on_this_machine():
    """The real /proc/stat: two spinning processes on our cores while this one sleeps."""
    from benchmarks.contention import busy_processes

    load = MachineLoad()
    with busy_processes(2, bound_s=30):
        time.sleep(1.5)   # the measured window itself, not a wait for a condition
        others = load.update()
    assert others >= min(1.2, 0.6 * available_cores())


def test_a_fixed_count_never_trials():
    policy = ThreadPolicy.from_setting(3)
    assert not policy.adaptive
    assert {policy.next_count() for _ in range(50)} == {3}


def test_auto_starts_from_the_affinity():
    assert ThreadPolicy.from_setting("auto").max_threads == available_cores()
    assert ThreadPolicy.from_setting(None).count == available_cores()


@pytest.mark.parametrize("bad", [0, -1, "two", 1.5, True])
def test_config_rejects_bad_threads(bad):
    with pytest.raises(ValueError, match="threads"):
        EngineConfig(threads=bad)


def test_the_count_holds_on_the_thread_that_steps(make_engine):
    """torch.set_num_threads reaches OpenMP per thread: a count set on the main thread
    must not be what an engine stepping on another thread runs with."""
    engine = make_engine(threads=1)
    torch.set_num_threads(2)
    seen = []

    def step_on_a_thread() -> None:
        engine.add_request([1, 2, 3], None)
        while engine.has_unfinished():
            engine.step()
            seen.append(torch.get_num_threads())

    worker = threading.Thread(target=step_on_a_thread)
    worker.start()
    worker.join(timeout=120)
    assert seen and set(seen) == {1}
