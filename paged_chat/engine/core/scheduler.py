"""Token-budget scheduler: decode first, chunked prefill, preemption by recompute.

Each step has one budget of `max_num_batched_tokens` shared by every kind of work:

1. Running requests, oldest first, each take the tokens they still need: one for a
   decode, the rest of the prompt (capped by the budget) for a prefill in chunks. When the
   pool cannot grow a table, a request is preempted: one waiting for KV if there is one,
   else the most recently admitted running request. Its blocks go back (their content
   stays cached, so the recompute is mostly prefix hits) and it returns to the head of
   the waiting queue.
2. Requests whose KV tier read is done, then waiting requests in arrival order, join
   while budget, `max_num_seqs` and blocks last. A waiting request first takes over its
   cached prefix from the pool. When the KV tier holds blocks past it, the request takes
   blocks for them and waits for KV (`loading`, not scheduled) while the engine reads them
   back off the step; it joins once they are in, counting them as cached, as it would the
   pool's. Then each prefills what is left, chunked.

The scheduler does no I/O: a tier read is only issued here (see kv_cache_manager); the
engine runs it and completes it between steps, so no step waits on a disk.

Nothing waits behind a long prompt: decodes are scheduled before it every step, and it
only gets what budget is left. A preempted request goes back to the head of the queue, and
no waiting request is admitted in a step that preempted, so nobody starves.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from paged_chat.engine.kv.block_pool import KVBlock
from paged_chat.engine.kv.kv_cache_manager import KVCacheManager, TierReadState
from paged_chat.engine.core.request import Request, RequestStatus


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
        self.loading: list[Request] = []    # WAITING_FOR_KV, in the order their reads were issued
        self.num_preemptions = 0
        self.recomputed_after_fault: set[str] = set()   # request ids, until they finish
        self.prefix_cache_queried_tokens = 0
        self.prefix_cache_hit_tokens = 0

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.loading)

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
                # One waiting for KV has computed nothing, and holds blocks: it goes first.
                victim = self.loading[-1] if self.loading else self.running.pop()
                self._preempt(victim)
                preempted.append(victim)
                if victim is request:
                    break
            else:
                scheduled.append(ScheduledRequest(request, num_new, num_new == num_left))
                budget -= num_new
                index += 1

        while budget > 0 and not preempted and (request := self._next_to_admit()) is not None:
            if request.status is RequestStatus.WAITING_FOR_KV:   # its prefix is in its table
                read = self.kv_cache.tier_reads[request.request_id]
                cached_prefix: list[KVBlock] = []
                num_cached, num_tier_cached = read.num_cached_tokens, read.num_tier_tokens
                request.num_computed_tokens = num_cached
            else:
                cached_prefix = self.kv_cache.find_cached_prefix(request)
                num_tier_blocks = self.kv_cache.tier_blocks_to_read(request, cached_prefix, budget)
                if num_tier_blocks is None:
                    break
                if num_tier_blocks:
                    self.kv_cache.start_tier_read(request, cached_prefix, num_tier_blocks)
                    self.waiting.popleft()
                    request.status = RequestStatus.WAITING_FOR_KV
                    self.loading.append(request)
                    continue
                num_cached, num_tier_cached = len(cached_prefix) * self.kv_cache.block_size, 0
            num_left = request.num_tokens - num_cached
            num_new = min(num_left, budget)
            if not self.kv_cache.allocate(request, num_new, cached_prefix):
                break
            if request.status is RequestStatus.WAITING_FOR_KV:
                self.loading.remove(request)
                self.kv_cache.admit_tier_read(request)
            else:
                self.waiting.popleft()
            self.kv_cache.record_tier_misses(request, num_cached)
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

    def _next_to_admit(self) -> Request | None:
        """The first request whose tier read is done (it holds its blocks: it goes first),
        else the head of the waiting queue while `max_num_seqs` allows one more. A request
        whose read came back short starts over at the head of the waiting queue."""
        for request in [r for r in self.loading if self.kv_cache.tier_read_state(r)
                        is TierReadState.SHORT]:
            self._preempt(request, count=False)
        for request in self.loading:
            if self.kv_cache.tier_read_state(request) is TierReadState.DONE:
                return request
        if self.waiting and len(self.running) + len(self.loading) < self.max_num_seqs:
            return self.waiting[0]
        return None

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
        """Take a request out of the queues and give its blocks back (any finish reason; its
        `finish_reason` is set: a failed request's KV is not kept)."""
        self.recomputed_after_fault.discard(request.request_id)
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        elif request.status is RequestStatus.WAITING_FOR_KV:
            self.loading.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        request.status = RequestStatus.FINISHED
        self.kv_cache.free(request, keep_kv=request.finish_reason != "error")

    def recompute_after_fault(self, request: Request) -> bool:
        """A running request's logits were not finite. When KV read back from the KV tier is
        in its blocks, that KV may be why: the tier forgets the request's prefix and the
        request is recomputed from its tokens, once. False (it fails) otherwise."""
        if (request.request_id in self.recomputed_after_fault
                or not self.kv_cache.drop_restored_kv(request)):
            return False
        self.recomputed_after_fault.add(request.request_id)
        self.running.remove(request)
        self._preempt(request, count=False, keep_kv=False)
        return True

    def _preempt(self, request: Request, count: bool = True, keep_kv: bool = True) -> None:
        """Free the request's blocks and put it back at the head of the waiting queue;
        `count`: as a preemption (not for a tier read that came back short or a recompute
        after a fault); `keep_kv`: see KVCacheManager.free."""
        if request.status is RequestStatus.WAITING_FOR_KV:
            self.loading.remove(request)
        self.kv_cache.free(request, keep_kv)
        request.num_computed_tokens = 0
        request.status = RequestStatus.WAITING
        self.waiting.appendleft(request)
        if count:
            request.num_preemptions += 1
            self.num_preemptions += 1


def _not_a_decode(item: ScheduledRequest) -> bool:
    return item.num_new_tokens != 1
