"""Token-budget scheduler: decode first, chunked prefill, preemption by recompute.

Each step has one budget of `max_num_batched_tokens` shared by every kind of work:

1. Running requests, oldest first, each take the tokens they still need: one for a
   decode, the rest of the prompt (capped by the budget) for a prefill in chunks. When the
   pool cannot grow a table, the most recently admitted running request is preempted: its
   blocks go back (their content stays cached, so the recompute is mostly prefix hits)
   and it returns to the head of the waiting queue.
2. Waiting requests, in arrival order, join while budget, `max_num_seqs` and blocks last.
   Each first takes over its cached prefix (the pool's blocks, then what the KV tier reads
   back into fresh blocks, both counted as cached), then prefills what is left, chunked.

Nothing waits behind a long prompt: decodes are scheduled before it every step, and it
only gets what budget is left. A preempted request goes back to the head of the queue, and
no waiting request is admitted in a step that preempted, so nobody starves.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from paged_chat.engine.kv_cache_manager import KVCacheManager
from paged_chat.engine.request import Request, RequestStatus


@dataclass(slots=True)
class ScheduledRequest:
    request: Request
    num_new_tokens: int
    # True when this step computes the request's last known token, so it yields logits;
    # set once at scheduling (the engine, the runner and the stats each read it).
    samples: bool


@dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[ScheduledRequest]
    preempted: list[Request]
    num_tokens: int  # of all the scheduled items together


class Scheduler:
    def __init__(self, kv_cache: KVCacheManager, max_num_seqs: int,
                 max_num_batched_tokens: int) -> None:
        self.kv_cache = kv_cache
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        self.prefix_cache_queried_tokens = 0
        self.prefix_cache_hit_tokens = 0

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        budget = self.max_num_batched_tokens
        scheduled: list[ScheduledRequest] = []
        preempted: list[Request] = []

        allocate = self.kv_cache.allocate
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            num_left = len(request.all_token_ids) - request.num_computed_tokens
            num_new = num_left if num_left < budget else budget
            while not allocate(request, num_new):
                victim = self.running.pop()
                self._preempt(victim)
                preempted.append(victim)
                if victim is request:
                    break
            else:
                scheduled.append(ScheduledRequest(request, num_new, num_new == num_left))
                budget -= num_new
                index += 1

        while (self.waiting and budget > 0 and not preempted
               and len(self.running) < self.max_num_seqs):
            request = self.waiting[0]
            cached_prefix = self.kv_cache.find_cached_prefix(request)
            tier_kv = self.kv_cache.read_tier_prefix(request, cached_prefix, budget)
            if tier_kv is None:
                break
            num_tier_cached = len(tier_kv) * self.kv_cache.block_size
            num_cached = len(cached_prefix) * self.kv_cache.block_size + num_tier_cached
            num_left = request.num_tokens - num_cached
            num_new = min(num_left, budget)
            if not self.kv_cache.allocate(request, num_new, cached_prefix, tier_kv):
                break
            self.waiting.popleft()
            self.prefix_cache_queried_tokens += request.num_tokens
            self.prefix_cache_hit_tokens += num_cached
            if request.num_preemptions == 0:
                request.num_cached_prompt_tokens = num_cached
                request.num_tier_cached_tokens = num_tier_cached
            request.num_computed_tokens = num_cached
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            scheduled.append(ScheduledRequest(request, num_new, num_new == num_left))
            budget -= num_new

        # Decodes first: attention backends batch the single-token queries together.
        scheduled.sort(key=_not_a_decode)
        return SchedulerOutput(scheduled, preempted, self.max_num_batched_tokens - budget)

    def update(self, output: SchedulerOutput) -> int:
        """Advance each scheduled request past the tokens this step computed; return how
        many of those were prompt tokens (the rest are its output, fed back)."""
        prompt_tokens = 0
        for item in output.scheduled:
            request, start = item.request, item.request.num_computed_tokens
            request.num_computed_tokens = end = start + item.num_new_tokens
            if start < (num_prompt := len(request.prompt_token_ids)):
                prompt_tokens += min(end, num_prompt) - start
        return prompt_tokens

    def finish(self, request: Request) -> None:
        """Take a request out of the queues and give its blocks back (any finish reason)."""
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        request.status = RequestStatus.FINISHED
        self.kv_cache.free(request)

    def _preempt(self, request: Request) -> None:
        self.kv_cache.free(request)
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        request.status = RequestStatus.WAITING
        self.waiting.appendleft(request)
        self.num_preemptions += 1


def _not_a_decode(item: ScheduledRequest) -> bool:
    return item.num_new_tokens != 1
