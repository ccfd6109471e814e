"""Drafts from a request's own history (prompt lookup, vLLM's n-gram proposer).

The last n tokens of a request (prompt and output) are looked up earlier in the same
tokens; where they occurred before, the tokens that followed then are proposed as the
next ones. The longest n in [min_n, max_n] with an earlier occurrence wins, and of its
occurrences the last one: a chat asked to edit a file it was given repeats long runs of
it, and the latest copy is the one most likely being rewritten.

Each request also keeps how well its drafts have been doing (`DraftState`): when the
share of drafted tokens accepted falls under a threshold, it stops proposing for a while,
twice as long each time it fails again straight after, so a free-form reply pays for few
drafts that keep failing (a step that verifies drafts costs several decodes on the CPU).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

if TYPE_CHECKING:
    from paged_chat.engine.core.request import Request

# The acceptance share below which a request stops proposing (a new request starts at
# twice it: two steps of rejected drafts stop it), the weight a step's share gets in the
# running average, and how many steps a stopped request first waits before trying again
# (starting again from the threshold, so one bad step stops it again, for twice as long,
# up to _MAX_PAUSE_STEPS).
_MIN_ACCEPTANCE = 0.25
_EMA_WEIGHT = 0.5
_PAUSE_STEPS = 8
_MAX_PAUSE_STEPS = 128


def propose_ngram(token_ids: np.ndarray, min_n: int, max_n: int, k: int) -> np.ndarray:
    """Up to `k` tokens that followed the last occurrence, before the end, of the longest
    suffix of `token_ids` of length in [min_n, max_n] that occurred earlier; empty when
    none did. `token_ids` is 1-D int64."""
    length = len(token_ids)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = token_ids[length - n:]
        # Windows that start before the suffix itself and have a token after them.
        windows = sliding_window_view(token_ids[:length - 1], n)
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if len(hits):
            start = int(hits[-1]) + n
            return token_ids[start:start + k]
    return token_ids[:0]


@dataclass(slots=True)
class DraftState:
    """A request's drafting: whether it proposes this step, from how its drafts fared."""

    acceptance: float = 2 * _MIN_ACCEPTANCE  # running average of the share accepted
    paused_steps: int = 0      # steps left without proposing
    next_pause: int = _PAUSE_STEPS

    def may_propose(self) -> bool:
        """Whether to propose this step (a paused request counts one step down)."""
        if self.paused_steps:
            self.paused_steps -= 1
            if not self.paused_steps:
                self.acceptance = _MIN_ACCEPTANCE
            return False
        return True

    def record(self, num_drafted: int, num_accepted: int) -> None:
        """Fold in a verified step's drafts; pause proposing when the average is too low."""
        share = num_accepted / num_drafted
        self.acceptance += _EMA_WEIGHT * (share - self.acceptance)
        if self.acceptance < _MIN_ACCEPTANCE:
            self.paused_steps = self.next_pause
            self.next_pause = min(2 * self.next_pause, _MAX_PAUSE_STEPS)
        elif num_accepted:
            self.next_pause = _PAUSE_STEPS


def verifiable(request: Request) -> bool:
    """Whether the runner can verify drafts of `request` (rejection_sampler): greedy or
    temperature alone (no top-k, top-p or min-p), without penalties (a draft's counts would
    shift them), a grammar or logprobs."""
    params = request.params
    return ((params.greedy or (params.top_k == 0 and params.top_p == 1 and params.min_p == 0))
            and not params.uses_penalties and not params.wants_logprobs
            and request.grammar is None)


class NgramProposer:
    """Proposes each verifiable request's drafts (`propose_ngram`) under EngineConfig's
    `num_speculative_tokens`, `prompt_lookup_min` and `prompt_lookup_max`."""

    def __init__(self, num_speculative_tokens: int, min_n: int, max_n: int) -> None:
        self.num_speculative_tokens = num_speculative_tokens
        self.min_n = min_n
        self.max_n = max_n

    def propose(self, request: Request, limit: int) -> list[int]:
        """At most `limit` drafts to follow `request`'s tokens (none when it is not
        verifiable or its drafts have been failing: `DraftState`)."""
        if limit <= 0 or not verifiable(request) or not request.drafts.may_propose():
            return []
        tokens = np.fromiter(request.all_token_ids, dtype=np.int64, count=request.num_tokens)
        return propose_ngram(tokens, self.min_n, self.max_n,
                             min(limit, self.num_speculative_tokens)).tolist()
