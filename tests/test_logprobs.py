"""Logprobs: the sampled token's log-probability and the top alternatives come from the
logits the sampler used: the tempered and truncated distribution for a sampled request, the
masked one for a constrained one (a greedy request's against transformers is in
test_default_model.py, beside the reference model it loads)."""

from __future__ import annotations

import math

import pytest
import torch

from paged_chat.engine import SamplingParams
from paged_chat.engine.worker.sampler import SamplingBatch, sample


def test_logprobs_are_of_the_distribution_drawn_from() -> None:
    torch.manual_seed(0)
    logits = torch.randn(3, 50)
    params = [SamplingParams(temperature=0), SamplingParams(temperature=0.5, top_k=4, seed=1),
              SamplingParams(temperature=2.0, seed=2)]
    batch = SamplingBatch.build(params, [0, 1, 2], [0] * 3, None, None, 50, torch.device("cpu"))
    batch.logprob_rows, batch.num_top_logprobs = torch.tensor([0, 1, 2]), 5
    tokens = sample(logits.clone(), batch)
    greedy, top_k, hot = batch.logprobs
    plain = logits[0].log_softmax(-1)
    assert greedy.logprob == pytest.approx(plain.max().item(), abs=1e-5)
    assert greedy.top_token_ids == plain.topk(5).indices.tolist()
    # top-k 4 renormalises over its four tokens: the fifth is impossible
    kept = (logits[1] / 0.5).topk(4).values.log_softmax(-1)
    assert top_k.top_logprobs[:4] == pytest.approx(kept.tolist(), abs=1e-5)
    assert top_k.top_logprobs[4] == -math.inf
    assert hot.logprob == pytest.approx((logits[2] / 2).log_softmax(-1)[tokens[2]].item(), abs=1e-5)
    for entry in batch.logprobs:
        assert sum(math.exp(lp) for lp in entry.top_logprobs) <= 1 + 1e-5


def test_only_the_rows_that_ask_get_logprobs(make_engine) -> None:
    engine = make_engine()
    asked, silent = engine.generate([[1, 2, 3], [4, 5]], [
        SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, top_logprobs=3),
        SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)])
    assert silent.logprobs is None
    assert len(asked.logprobs) == len(asked.token_ids) == 6
    for token, entry in zip(asked.token_ids, asked.logprobs):
        assert entry.top_token_ids[0] == token and entry.top_logprobs[0] == entry.logprob


def test_a_constrained_rows_logprobs_are_over_the_allowed_tokens(make_engine) -> None:
    engine = make_engine()
    out = engine.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=4, choice=["ab", "cd"],
                                                      logprobs=True, top_logprobs=2))[0]
    assert out.text in ("ab", "cd")
    first = out.logprobs[0]
    # only the tokens that start "ab" or "cd" are possible: their probabilities sum to 1
    assert math.isfinite(first.logprob) and first.logprob <= 0
    assert sum(math.exp(lp) for lp in first.top_logprobs) <= 1 + 1e-5
