"""Priority scheduling (vLLM's convention: the lower value first), with no model: the
scheduler and a KV manager alone. Requests join, run and are preempted by priority, then
arrival; a request is never preempted for one of lower priority."""

from __future__ import annotations

from paged_chat.engine.core.outputs import ModelRunnerOutput
from paged_chat.engine.core.request import Request, RequestStatus
from paged_chat.engine.core.sampling_params import SamplingParams
from paged_chat.engine.core.scheduler import Scheduler, SchedulerOutput
from paged_chat.engine.kv.kv_cache_manager import KVCacheManager

BLOCK = 4
TOKEN = 11   # every sampled token: never a stop id


def make_scheduler(num_blocks: int = 32, max_num_seqs: int = 8) -> Scheduler:
    return Scheduler(KVCacheManager(num_blocks, BLOCK, enable_caching=True), max_num_seqs,
                     max_num_batched_tokens=64)


def make_request(request_id: str, num_prompt_tokens: int, priority: int, arrival: float
                 ) -> Request:
    # Prompts differ from their first token on: no request hits another's prefix.
    prompt = [100 + len(request_id) * 7 + ord(request_id[0])] + list(range(1, num_prompt_tokens))
    return Request(request_id, prompt, SamplingParams(), 0, arrival, priority=priority,
                   max_num_tokens=1000)


def step(scheduler: Scheduler) -> SchedulerOutput:
    """One schedule, and the update of a forward whose every sampling item drew TOKEN."""
    schedule = scheduler.schedule()
    scheduler.update_from_output(schedule, ModelRunnerOutput(
        [TOKEN for item in schedule.scheduled if item.samples]))
    return schedule


def ids(requests: list[Request]) -> list[str]:
    return [request.request_id for request in requests]


def scheduled_ids(schedule: SchedulerOutput) -> list[str]:
    return sorted(item.request.request_id for item in schedule.scheduled)


def test_requests_are_admitted_by_priority_then_arrival() -> None:
    scheduler = make_scheduler(max_num_seqs=1)
    for request in (make_request("low-first", 4, 1, 0.0), make_request("high-second", 4, 0, 1.0),
                    make_request("high-third", 4, 0, 2.0), make_request("low-fourth", 4, 1, 3.0),
                    make_request("top-last", 4, -5, 4.0)):
        scheduler.add(request)
    admitted = []
    while scheduler.has_unfinished():
        schedule = step(scheduler)
        assert not schedule.preempted   # nothing of lower priority ever runs while one waits
        (item,) = schedule.scheduled
        admitted.append(item.request.request_id)
        scheduler.finish_request(item.request, "stop")
    assert admitted == ["top-last", "high-second", "high-third", "low-first", "low-fourth"]


def test_running_requests_take_the_budget_by_priority_before_later_admissions_of_lower() -> None:
    scheduler = make_scheduler()
    background = make_request("background", 8, 1, 0.0)
    scheduler.add(background)
    step(scheduler)
    shown = make_request("shown", 200, 0, 1.0)   # more than a step's budget of 64
    scheduler.add(shown)
    schedule = step(scheduler)
    # The higher-priority prompt joined first and took the whole budget: the background
    # decode waits for a step with budget left.
    assert ids(scheduler.running) == ["shown", "background"]
    assert [(item.request.request_id, item.num_new_tokens) for item in schedule.scheduled] == [
        ("shown", 64)]


def test_a_high_priority_request_preempts_a_low_one_for_blocks_and_not_the_reverse() -> None:
    scheduler = make_scheduler(num_blocks=4)
    low = make_request("low", 16, 1, 0.0)      # the whole pool
    scheduler.add(low)
    step(scheduler)
    high = make_request("high", 4, 0, 1.0)
    scheduler.add(high)
    schedule = step(scheduler)
    assert ids(schedule.preempted) == ["low"] and scheduled_ids(schedule) == ["high"]
    assert low.status is RequestStatus.WAITING and low.num_preemptions == 1
    assert ids(scheduler.waiting) == ["low"]

    scheduler = make_scheduler(num_blocks=5)
    high = make_request("high", 16, 0, 0.0)    # four of the five blocks, and its fifth next
    scheduler.add(high)
    step(scheduler)
    low = make_request("low", 4, 1, 1.0)
    scheduler.add(low)
    for _ in range(3):
        schedule = step(scheduler)
        assert not schedule.preempted and scheduled_ids(schedule) == ["high"]
    assert high.num_preemptions == 0 and ids(scheduler.waiting) == ["low"]


def test_a_high_priority_request_preempts_a_low_one_for_a_seat_and_not_the_reverse() -> None:
    scheduler = make_scheduler(max_num_seqs=1)
    low, high = make_request("low", 4, 1, 0.0), make_request("high", 4, 0, 1.0)
    scheduler.add(low)
    step(scheduler)
    scheduler.add(high)
    schedule = step(scheduler)
    assert ids(schedule.preempted) == ["low"] and ids(scheduler.running) == ["high"]

    scheduler = make_scheduler(max_num_seqs=1)
    high, low = make_request("high", 4, 0, 0.0), make_request("low", 4, 1, 1.0)
    scheduler.add(high)
    step(scheduler)
    scheduler.add(low)
    schedule = step(scheduler)
    assert not schedule.preempted and ids(scheduler.running) == ["high"]
    assert ids(scheduler.waiting) == ["low"]


def test_a_growing_table_preempts_the_lowest_priority_whatever_came_first() -> None:
    # Two of four blocks each; the next token needs a third block of one or both of them.
    scheduler = make_scheduler(num_blocks=4)
    low, high = make_request("low", 8, 1, 0.0), make_request("high", 8, 0, 1.0)
    scheduler.add(low)
    scheduler.add(high)
    step(scheduler)
    schedule = step(scheduler)     # both need a block: the high one takes the low one's
    assert ids(schedule.preempted) == ["low"] and scheduled_ids(schedule) == ["high"]
    assert high.num_preemptions == 0

    scheduler = make_scheduler(num_blocks=4)
    low, high = make_request("low", 8, 1, 0.0), make_request("high", 7, 0, 1.0)
    scheduler.add(low)
    scheduler.add(high)
    step(scheduler)
    schedule = step(scheduler)     # only the low one needs a block: it goes, not the high one
    assert ids(schedule.preempted) == ["low"] and scheduled_ids(schedule) == ["high"]
    assert high.num_preemptions == 0


def test_reprioritize_moves_a_request_within_its_queue() -> None:
    scheduler = make_scheduler(max_num_seqs=2)
    first, second = make_request("first", 4, 1, 0.0), make_request("second", 4, 1, 1.0)
    third = make_request("third", 4, 1, 2.0)
    for request in (first, second, third):
        scheduler.add(request)
    scheduler.reprioritize(third, 0)
    assert ids(scheduler.waiting) == ["third", "first", "second"]
    step(scheduler)
    assert ids(scheduler.running) == ["third", "first"]
    scheduler.reprioritize(first, -1)
    assert ids(scheduler.running) == ["first", "third"]
    scheduler.reprioritize(second, -2)   # waiting, and now above both running: it takes a seat
    schedule = step(scheduler)
    assert ids(schedule.preempted) == ["third"] and ids(scheduler.running) == ["second", "first"]
