"""Token-budget scheduler: priorities, decode first, chunked prefill, preemption by recompute.

Requests are served by priority (vLLM's convention: the lower value first), then arrival.
`running` is kept in that order (priority, then admission), `waiting` by priority, then
arrival. Each step has one budget of `max_num_batched_tokens` shared by every kind of work,
given out in priority order:

1. Running requests each take the tokens they still need: one for a decode, the rest of
   the prompt (capped by the budget) for a prefill in chunks. When the pool cannot grow a
   table, the request of lowest priority is preempted: among equals one waiting for KV if
   there is one, else the most recently admitted running request; never one of higher
   priority than the request that needs the room (it preempts itself first). Its blocks go
   back (their content stays cached, so the recompute is mostly prefix hits) and it returns
   to the waiting queue, ahead of every later arrival of its priority.
2. Requests whose KV tier read is done, then waiting requests, join while budget,
   `max_num_seqs` and blocks last; a request of higher priority than a running one joins
   before it, and when there is no room for it (a seat or blocks), requests of lower
   priority are preempted for it. A waiting request first takes over its cached prefix from
   the pool. When the KV tier holds blocks past it, the request takes blocks for them and
   waits for KV (`loading`, not scheduled) while the engine reads them back off the step;
   it joins once they are in, counting them as cached, as it would the pool's. Then each
   prefills what is left, chunked.

With a `proposer` (EngineConfig.num_speculative_tokens), a decode may carry drafts from the
request's own history (ngram_proposer): it is scheduled as 1 + k tokens when the budget,
its token limit and the pool leave room (no request is preempted for a draft), and after
the forward it keeps the drafts the runner accepted and the model's next token; the
rejected drafts' slots count as not computed again (later tokens overwrite them).

A request whose grammar compiles off the engine loop (WAITING_FOR_GRAMMAR) holds nothing
and is never scheduled: it joins the waiting queue when the engine has its matcher
(`grammar_ready`).

The scheduler does no I/O: a tier read is only issued here (see kv_cache_manager); the
engine runs it and completes it between steps, so no step waits on a disk.

Within a priority nothing waits behind a long prompt: decodes are scheduled before it every
step, and it only gets what budget is left. A preempted request goes back ahead of later
arrivals of its priority, and no waiting request is admitted in a step whose running
requests needed a preemption, so nobody starves among equals; a request of lower priority
waits while those above it take the budget or the pool.

After the forward, `update_from_output` takes the runner's output: it advances each
scheduled request, appends the sampled tokens (advancing a request's grammar matcher with
each), and ends a request on its stop ids, a completed grammar or its length limit
(`check_stop`). The scheduler holds every unfinished request (`requests`) until it ends.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Sequence
from dataclasses import dataclass
from operator import attrgetter
from typing import NamedTuple

from paged_chat.engine.core.ngram_proposer import NgramProposer
from paged_chat.engine.core.outputs import (
    EngineCoreOutput,
    FinishReason,
    ModelRunnerOutput,
    TokenLogprob,
)
from paged_chat.engine.core.request import Request, RequestStatus
from paged_chat.engine.kv.block_pool import KVBlock
from paged_chat.engine.kv.kv_cache_manager import KVCacheManager, TierReadState


@dataclass(slots=True)
class ScheduledRequest:
    request: Request
    num_new_tokens: int
    # True when this step computes the request's last known token, so it yields logits;
    # set once at scheduling (the engine, the runner and the stats each read it).
    samples: bool
    # Drafted tokens fed after the request's last token (a decode that verifies them):
    # num_new_tokens is 1 + their count, and the runner returns the accepted ones and the
    # model's next token.
    draft_token_ids: Sequence[int] = ()


@dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[ScheduledRequest]
    preempted: list[Request]
    num_tokens: int  # of all the scheduled items together


class StepUpdate(NamedTuple):
    """What `update_from_output` made of a step: one output per sampled request (none for a
    request sent back to be recomputed) and how many prompt tokens the step computed."""

    outputs: list[EngineCoreOutput]
    num_prompt_tokens: int


class Scheduler:
    def __init__(self, kv_cache: KVCacheManager, max_num_seqs: int,
                 max_num_batched_tokens: int, proposer: NgramProposer | None = None) -> None:
        """`proposer`: drafts for decodes to verify (None: no drafting)."""
        self.kv_cache = kv_cache
        self.proposer = proposer
        self.num_draft_tokens = 0           # drafted and verified, ever
        self.num_accepted_draft_tokens = 0  # of those, accepted
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: list[Request] = []    # by priority, then arrival
        self.running: list[Request] = []    # by priority, then admission
        self.loading: list[Request] = []    # WAITING_FOR_KV, in the order their reads were issued
        self.compiling: list[Request] = []  # WAITING_FOR_GRAMMAR
        self.num_preemptions = 0
        self.recomputed_after_fault: set[str] = set()   # request ids, until they finish
        self.prefix_cache_queried_tokens = 0
        self.prefix_cache_hit_tokens = 0
        self.prompt_tokens_total = 0        # of requests that have sampled their first token
        self.requests: dict[str, Request] = {}  # every unfinished request, by id

    def add(self, request: Request) -> None:
        """Queue a request (its id not in `requests`) in the waiting queue, by its priority
        and arrival, or, one WAITING_FOR_GRAMMAR, aside until `grammar_ready`."""
        self.requests[request.request_id] = request
        if request.status is RequestStatus.WAITING_FOR_GRAMMAR:
            self.compiling.append(request)
        else:
            bisect.insort_right(self.waiting, request, key=_waiting_order)

    def grammar_ready(self, request: Request) -> None:
        """A request that waited for its grammar (now in `request.grammar`) joins the waiting
        queue."""
        self.compiling.remove(request)
        request.status = RequestStatus.WAITING
        bisect.insort_right(self.waiting, request, key=_waiting_order)

    def reprioritize(self, request: Request, priority: int) -> None:
        """Serve an unfinished request at `priority` from the next step on: it moves to its
        place in its queue (a running one after the running requests of that priority)."""
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
            request.priority = priority
            bisect.insort_right(self.running, request, key=_priority)
        elif request.status is RequestStatus.WAITING:
            self.waiting.remove(request)
            request.priority = priority
            bisect.insort_right(self.waiting, request, key=_waiting_order)
        else:
            request.priority = priority

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.loading or self.compiling)

    def schedule(self) -> SchedulerOutput:
        budget = self.max_num_batched_tokens
        scheduled: list[ScheduledRequest] = []
        preempted: list[Request] = []
        index = 0  # self.running[:index] is scheduled
        candidate = self._next_to_admit()
        while budget > 0:
            running = self.running[index] if index < len(self.running) else None
            if candidate is not None and not preempted and (
                    running is None or candidate.priority < running.priority):
                num_new = self._admit(candidate, budget, scheduled, preempted)
                if num_new is None:
                    candidate = None  # no room for it: none for those behind it either
                    continue
                if num_new:  # it joined `running` at `index` (nothing of lower priority is before it)
                    budget -= num_new
                    index += 1
                candidate = self._next_to_admit()
            elif running is not None:
                num_new = self._schedule_running(running, budget, scheduled, preempted)
                if num_new:  # else it was preempted, the last of `running`
                    budget -= num_new
                    index += 1
            else:
                break

        # Decodes first: attention backends batch the single-token queries together.
        scheduled.sort(key=_not_a_decode)
        return SchedulerOutput(scheduled, preempted, self.max_num_batched_tokens - budget)

    def _schedule_running(self, request: Request, budget: int, scheduled: list[ScheduledRequest],
                          preempted: list[Request]) -> int:
        """Schedule the next tokens of a running request: one for a decode, the rest of its
        prompt up to `budget` for a prefill. While the pool cannot grow its table, the
        request to preempt first (`_victim`, never one of higher priority: it comes last
        itself) is preempted. Returns the tokens scheduled, 0 when it was preempted."""
        num_left = len(request.all_token_ids) - request.num_computed_tokens
        if num_left == 1 and self.proposer is not None and (
                num_new := self._schedule_drafts(request, budget, scheduled)):
            return num_new
        num_new = num_left if num_left < budget else budget
        while not self.kv_cache.allocate(request, num_new):
            victim = self._victim()
            assert victim is not None and victim.priority >= request.priority
            self._preempt(victim)
            preempted.append(victim)
            if victim is request:
                return 0
        scheduled.append(ScheduledRequest(request, num_new, num_new == num_left))
        return num_new

    def _schedule_drafts(self, request: Request, budget: int,
                         scheduled: list[ScheduledRequest]) -> int:
        """Schedule a decode with the proposer's drafts after it, as many as the budget, the
        request's token limit and the pool leave room for (no request is preempted for a
        draft). Returns the tokens scheduled, 0 when there are no drafts or no room."""
        limit = min(budget, request.max_num_tokens - request.num_tokens) - 1
        drafts = self.proposer.propose(request, limit)
        if not drafts or not self.kv_cache.allocate(request, 1 + len(drafts)):
            return 0
        scheduled.append(ScheduledRequest(request, 1 + len(drafts), True, drafts))
        return 1 + len(drafts)

    def _admit(self, request: Request, budget: int, scheduled: list[ScheduledRequest],
               preempted: list[Request]) -> int | None:
        """Admit the next request to admit with a first chunk of up to `budget` tokens,
        preempting requests of lower priority while there is no room for it (a seat under
        `max_num_seqs`, blocks for its chunk or its tier read). Returns the tokens
        scheduled; 0 when it now waits for a tier read instead; None when there is no room
        and nothing of lower priority holds any."""
        while (num_new := self._try_admit(request, budget, scheduled)) is None:
            victim = self._victim()
            if victim is None or victim.priority <= request.priority:
                return None
            self._preempt(victim)
            preempted.append(victim)
        return num_new

    def _try_admit(self, request: Request, budget: int, scheduled: list[ScheduledRequest]
                   ) -> int | None:
        """`_admit` without preempting: None, changing nothing, when there is no room."""
        if request.status is RequestStatus.WAITING_FOR_KV:   # its prefix is in its table
            read = self.kv_cache.tier_reads[request.request_id]
            cached_prefix: list[KVBlock] = []
            num_cached, num_tier_cached = read.num_cached_tokens, read.num_tier_tokens
            request.num_computed_tokens = num_cached
        else:
            if len(self.running) + len(self.loading) >= self.max_num_seqs:
                return None
            cached_prefix = self.kv_cache.find_cached_prefix(request)
            num_tier_blocks = self.kv_cache.tier_blocks_to_read(request, cached_prefix, budget)
            if num_tier_blocks is None:
                return None
            if num_tier_blocks:
                self.kv_cache.start_tier_read(request, cached_prefix, num_tier_blocks)
                self.waiting.remove(request)
                request.status = RequestStatus.WAITING_FOR_KV
                self.loading.append(request)
                return 0
            num_cached, num_tier_cached = len(cached_prefix) * self.kv_cache.block_size, 0
        num_left = request.num_tokens - num_cached
        num_new = min(num_left, budget)
        if not self.kv_cache.allocate(request, num_new, cached_prefix):
            return None
        if request.status is RequestStatus.WAITING_FOR_KV:
            self.loading.remove(request)
            self.kv_cache.admit_tier_read(request)
        else:
            self.waiting.remove(request)
        self.kv_cache.record_tier_misses(request, num_cached)
        self.prefix_cache_queried_tokens += request.num_tokens
        self.prefix_cache_hit_tokens += num_cached
        if request.num_preemptions == 0:
            request.num_cached_prompt_tokens = num_cached
            request.num_tier_cached_tokens = num_tier_cached
        request.num_computed_tokens = num_cached
        request.status = RequestStatus.RUNNING
        bisect.insort_right(self.running, request, key=_priority)
        scheduled.append(ScheduledRequest(request, num_new, num_new == num_left))
        return num_new

    def _next_to_admit(self) -> Request | None:
        """The request to admit next: of those whose tier read is done (they hold their
        blocks: among equals they go first, in the order their reads were issued) and the
        head of the waiting queue, the one of highest priority. A request whose read came
        back short starts over in the waiting queue."""
        for request in [r for r in self.loading if self.kv_cache.tier_read_state(r)
                        is TierReadState.SHORT]:
            self._preempt(request, count=False)
        loaded = min((r for r in self.loading
                      if self.kv_cache.tier_read_state(r) is TierReadState.DONE),
                     key=_priority, default=None)
        head = self.waiting[0] if self.waiting else None
        if loaded is not None and (head is None or loaded.priority <= head.priority):
            return loaded
        return head

    def _victim(self) -> Request | None:
        """The request to preempt first: the lowest priority; among equals one waiting for
        KV (it holds blocks and has computed nothing), the latest read first, else the
        running request admitted last."""
        loading = max(reversed(self.loading), key=_priority, default=None)
        running = self.running[-1] if self.running else None
        if loading is not None and (running is None or loading.priority >= running.priority):
            return loading
        return running

    def update_from_output(self, output: SchedulerOutput, runner_output: ModelRunnerOutput
                           ) -> StepUpdate:
        """Advance each scheduled request past the tokens this step computed, then append
        each sampling item's token (`runner_output.sampled`, in the order of the items that
        sample) and check whether it ends the request. A row whose sampling failed is
        recomputed once when KV the tier restored may be why (see recompute_after_fault),
        else finished with an error; so is a token the request's grammar refuses. One
        request's fault never reaches the others."""
        prompt_tokens = 0
        for item in output.scheduled:
            request, start = item.request, item.request.num_computed_tokens
            request.num_computed_tokens = end = start + item.num_new_tokens
            if start < (num_prompt := len(request.prompt_token_ids)):
                prompt_tokens += min(end, num_prompt) - start
        outputs: list[EngineCoreOutput] = []
        now = time.monotonic()
        samplers = [item for item in output.scheduled if item.samples]
        logprobs = runner_output.logprobs or [None] * len(samplers)
        for item, token, logprob in zip(samplers, runner_output.sampled, logprobs):
            request = item.request
            if isinstance(token, Exception):
                if not self.recompute_after_fault(request):
                    outputs.append(self.finish_request(request, "error",
                                                       f"{type(token).__name__}: {token}"))
                continue
            if item.draft_token_ids:
                tokens = token  # the accepted drafts, then the model's next token
                self._count_drafts(item, len(tokens) - 1)
            else:
                tokens = [token]
            try:
                outputs.append(self._append_tokens(request, tokens, now, logprob))
            except Exception as error:  # the grammar library's, for this request alone
                outputs.append(self.finish_request(request, "error",
                                                   f"{type(error).__name__}: {error}"))
        return StepUpdate(outputs, prompt_tokens)

    def _count_drafts(self, item: ScheduledRequest, num_accepted: int) -> None:
        """A verified item's rejected drafts' slots count as not computed (later tokens
        overwrite them, and no block holding them is hashed before they are); the request's
        and the engine's counts of drafts take the step's."""
        request, num_drafted = item.request, len(item.draft_token_ids)
        request.num_computed_tokens -= num_drafted - num_accepted
        request.drafts.record(num_drafted, num_accepted)
        self.num_draft_tokens += num_drafted
        self.num_accepted_draft_tokens += num_accepted

    def _append_tokens(self, request: Request, token_ids: list[int], now: float,
                       logprob: TokenLogprob | None) -> EngineCoreOutput:
        """Append a step's tokens (one, or the accepted drafts and the next token), each
        checked by the grammar and `check_stop`: the first that ends the request is its last."""
        if request.first_token_time is None:
            request.first_token_time = now
            self.prompt_tokens_total += request.num_prompt_tokens
        new_logprobs = None if logprob is None else [logprob]
        grammar = request.grammar
        for count, token_id in enumerate(token_ids, 1):
            request.all_token_ids.append(token_id)
            request.output_token_ids.append(token_id)
            if grammar is not None and not grammar.accept_token(token_id):
                return self.finish_request(request, "error",
                                           f"the grammar refused the sampled token {token_id}",
                                           token_ids[:count], new_logprobs)
            reason = check_stop(request)
            if reason is not None:
                return self.finish_request(request, reason, None, token_ids[:count],
                                           new_logprobs)
        # EngineCoreOutput's fields in order: one per running request (its docstring)
        return EngineCoreOutput(request.request_id, token_ids, False, None,
                                len(request.prompt_token_ids), request.num_cached_prompt_tokens,
                                request.num_tier_cached_tokens, None, new_logprobs)

    def finish_request(self, request: Request, reason: FinishReason, error: str | None = None,
                       new_token_ids: list[int] | None = None,
                       new_logprobs: list[TokenLogprob] | None = None) -> EngineCoreOutput:
        """End an unfinished request for `reason` (any, abort and error included): out of
        `requests` and the queues, its blocks back (a failed request's KV is not kept); its
        final output, carrying `new_token_ids` and `new_logprobs` when a token ended it."""
        request.finish_reason = reason
        request.error = error
        del self.requests[request.request_id]
        self.recomputed_after_fault.discard(request.request_id)
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        elif request.status is RequestStatus.WAITING_FOR_KV:
            self.loading.remove(request)
        elif request.status is RequestStatus.WAITING_FOR_GRAMMAR:
            self.compiling.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        request.status = RequestStatus.FINISHED
        self.kv_cache.free(request, keep_kv=reason != "error")
        return EngineCoreOutput(request.request_id, new_token_ids or [], True, reason,
                                request.num_prompt_tokens, request.num_cached_prompt_tokens,
                                request.num_tier_cached_tokens, error, new_logprobs)

    def recompute_after_fault(self, request: Request) -> bool:
        """A running request's logits were not finite. When KV read back from the KV tier is
        in its blocks, that KV may be why: the tier forgets the request's prefix and the
        request is recomputed from its tokens, once. False (it fails) otherwise."""
        if (request.request_id in self.recomputed_after_fault
                or not self.kv_cache.drop_restored_kv(request)):
            return False
        self.recomputed_after_fault.add(request.request_id)
        self._preempt(request, count=False, keep_kv=False)
        return True

    def _preempt(self, request: Request, count: bool = True, keep_kv: bool = True) -> None:
        """Take a running request, or one waiting for KV, out of its queue, free its blocks
        and put it back in the waiting queue ahead of the later arrivals of its priority;
        `count`: as a preemption (not for a tier read that came back short or a recompute
        after a fault); `keep_kv`: see KVCacheManager.free."""
        if request.status is RequestStatus.WAITING_FOR_KV:
            self.loading.remove(request)
        else:
            self.running.remove(request)
        self.kv_cache.free(request, keep_kv)
        request.num_computed_tokens = 0
        request.status = RequestStatus.WAITING
        bisect.insort_left(self.waiting, request, key=_waiting_order)
        if count:
            request.num_preemptions += 1
            self.num_preemptions += 1


def check_stop(request: Request) -> FinishReason | None:
    """Why the token just appended ends `request`, or None: one of its stop ids (the model's
    EOS among them unless ignore_eos) or a completed grammar is "stop"; reaching its
    `max_num_tokens` (max_tokens or max_model_len, prompt included) is "length"."""
    token_id = request.all_token_ids[-1]
    if token_id in request.stop_token_ids or (request.grammar is not None
                                              and request.grammar.is_terminated()):
        return "stop"
    if len(request.all_token_ids) >= request.max_num_tokens:
        return "length"
    return None


def _not_a_decode(item: ScheduledRequest) -> bool:
    return item.num_new_tokens != 1


_priority = attrgetter("priority")
_waiting_order = attrgetter("priority", "arrival_time")
