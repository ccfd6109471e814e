"""Scheduler.update_from_output: the runner's sampled tokens advance, stop or fail each
request on its own, with no model (the scheduler and a KV manager alone)."""

from __future__ import annotations

from paged_chat.engine.core.outputs import ModelRunnerOutput
from paged_chat.engine.core.request import Request, RequestStatus
from paged_chat.engine.core.sampling_params import SamplingParams
from paged_chat.engine.core.scheduler import Scheduler
from paged_chat.engine.kv.kv_cache_manager import KVCacheManager

STOP = 2


def scheduler_with(*requests: Request) -> Scheduler:
    scheduler = Scheduler(KVCacheManager(32, 4, enable_caching=True), max_num_seqs=8,
                          max_num_batched_tokens=64)
    for request in requests:
        scheduler.add(request)
    return scheduler


def request(request_id: str, prompt: list[int], max_num_tokens: int = 100) -> Request:
    return Request(request_id, prompt, SamplingParams(), 0, 0.0,
                   stop_token_ids=frozenset({STOP}), max_num_tokens=max_num_tokens)


def test_each_sampled_token_continues_stops_or_fails_its_own_request() -> None:
    going, stopping = request("going", [5, 6, 7]), request("stopping", [5, 6])
    longest, failing = request("longest", [8, 9], max_num_tokens=3), request("failing", [9])
    scheduler = scheduler_with(going, stopping, longest, failing)
    schedule = scheduler.schedule()
    assert all(item.samples for item in schedule.scheduled)
    tokens = {"going": 11, "stopping": STOP, "longest": 12,
              "failing": RuntimeError("logits not finite")}
    order = [item.request.request_id for item in schedule.scheduled]

    update = scheduler.update_from_output(
        schedule, ModelRunnerOutput([tokens[request_id] for request_id in order]))

    assert update.num_prompt_tokens == 8
    outputs = {out.request_id: out for out in update.outputs}
    assert (outputs["going"].finished, outputs["going"].new_token_ids) == (False, [11])
    assert (outputs["stopping"].finish_reason, outputs["stopping"].new_token_ids) == ("stop", [STOP])
    assert outputs["longest"].finish_reason == "length"
    assert outputs["failing"].finish_reason == "error"
    assert outputs["failing"].error == "RuntimeError: logits not finite"
    assert list(scheduler.requests) == ["going"] and scheduler.running == [going]
    assert going.output_token_ids == [11] and going.num_computed_tokens == 3
    assert stopping.status is RequestStatus.FINISHED
    assert set(scheduler.kv_cache.tables) == {"going"}
    assert scheduler.prompt_tokens_total == 3 + 2 + 2


def test_finish_request_takes_a_waiting_request_out_of_the_queue() -> None:
    waiting = request("waiting", [5, 6])
    scheduler = scheduler_with(waiting)
    out = scheduler.finish_request(waiting, "abort")
    assert (out.finished, out.finish_reason, out.new_token_ids) == (True, "abort", [])
    assert not scheduler.has_unfinished() and not scheduler.requests
