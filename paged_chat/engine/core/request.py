"""Request: one sequence's life in the engine, and its status."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from paged_chat.engine.core.ngram_proposer import DraftState
from paged_chat.engine.core.outputs import FinishReason
from paged_chat.engine.core.sampling_params import SamplingParams

if TYPE_CHECKING:
    from xgrammar import GrammarMatcher

    from paged_chat.engine.worker.structured_output import PendingGrammar


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    WAITING_FOR_GRAMMAR = "waiting for its grammar"  # compiling off the engine loop, no blocks
    WAITING_FOR_KV = "waiting for KV"   # holds its blocks while a KV tier read fills them
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(slots=True, eq=False)
class Request:
    """One sequence's life in the engine.

    `all_token_ids` is prompt + generated so far; `output_token_ids` the generated ones
    alone. `num_computed_tokens` counts the leading tokens whose K/V are in the cache
    (prefix hits included); the scheduler advances it.
    `block_hashes[i]` is the prefix hash of full block `i` of `all_token_ids`, filled in
    as blocks fill up (the tokens never change, so it survives preemption).
    `priority`: vLLM's convention, the lower value is served first (0 by default); the
    scheduler orders by it, then by `arrival_time`.
    """

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    sampling_seed: int
    arrival_time: float
    all_token_ids: list[int] = field(default_factory=list)
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    block_hashes: list[bytes] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    error: str | None = None
    num_cached_prompt_tokens: int = 0
    num_tier_cached_tokens: int = 0     # of num_cached_prompt_tokens, read back from a KV tier
    num_preemptions: int = 0
    first_token_time: float | None = None
    owner: str | None = None
    priority: int = 0
    # What the engine ends it on after each token, set when it is added: its own stop ids
    # and the model's EOS unless ignore_eos; max_tokens or max_model_len, prompt included.
    stop_token_ids: frozenset[int] = frozenset()
    max_num_tokens: int = 0
    # Its structured output's matcher, as far as output_token_ids (structured_output.py).
    grammar: GrammarMatcher | None = None
    # Its grammar's compile, while it waits for it (WAITING_FOR_GRAMMAR).
    pending_grammar: PendingGrammar | None = None
    # How its drafts have fared (ngram_proposer.py): whether it proposes any.
    drafts: DraftState = field(default_factory=DraftState)

    def __post_init__(self) -> None:
        if not self.all_token_ids:
            self.all_token_ids = list(self.prompt_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED


def check_priority(priority: object) -> None:
    """Raise ValueError, naming the field, unless `priority` is an int (a bool is none)."""
    if not isinstance(priority, int) or isinstance(priority, bool):
        raise ValueError(f"priority={priority!r} is invalid: expected an integer")
