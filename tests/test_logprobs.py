"""Logprobs are the model's own: the log-softmax of its logits before penalties, the grammar
mask, temperature and top-k/top-p (OpenAI's and vLLM's default), so no sampling setting
changes them and none is a padding value; each token reports its own bytes, and the
completions API's text_offset indexes the text (a greedy request's against transformers is
in test_default_model.py, beside the reference model it loads)."""

from __future__ import annotations

import math

import openai
import pytest
import torch
from helpers import wait_for

from paged_chat.engine import SamplingParams
from paged_chat.engine.core.detokenizer import IncrementalDetokenizer
from paged_chat.engine.core.outputs import TokenLogprob
from paged_chat.engine.worker.sampler import SamplingBatch, logprob_entries, sample
from paged_chat.server.structured_request import chat_logprobs, completion_logprobs


def test_logprobs_are_the_model_s_own_whatever_the_sampling() -> None:
    torch.manual_seed(0)
    logits = torch.randn(4, 50)
    params = [SamplingParams(temperature=0), SamplingParams(temperature=0.5, top_k=4, seed=1),
              SamplingParams(temperature=0.2, top_p=0.9, seed=2),
              SamplingParams(temperature=2.0, repetition_penalty=1.5, presence_penalty=1.0, seed=3)]
    batch = SamplingBatch.build(params, [0, 1, 2, 3], [1] * 4, [[7, 8]] * 4, [1] * 4, 50,
                                torch.device("cpu"))
    batch.logprob_rows, batch.num_top_logprobs = torch.tensor([0, 1, 2, 3]), 5
    tokens = sample(logits.clone(), batch)
    for row, entry in enumerate(logprob_entries(*(part.numpy() for part in batch.logprobs))):
        own = logits[row].log_softmax(-1)
        assert entry.logprob == pytest.approx(own[tokens[row]].item(), abs=1e-5)
        assert entry.top_token_ids == own.topk(5).indices.tolist()
        assert entry.top_logprobs == pytest.approx(own.topk(5).values.tolist(), abs=1e-5)


def test_only_the_rows_that_ask_get_logprobs(make_engine) -> None:
    engine = make_engine()
    asked, silent = engine.generate([[1, 2, 3], [4, 5]], [
        SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, top_logprobs=3),
        SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)])
    assert silent.logprobs is None
    assert len(asked.logprobs) == len(asked.token_ids) == 6
    for token, entry in zip(asked.token_ids, asked.logprobs):
        assert entry.top_token_ids[0] == token and entry.top_logprobs[0] == entry.logprob


def test_a_constrained_rows_logprobs_are_the_model_s_own_too(make_engine) -> None:
    engine = make_engine()
    free, constrained = engine.generate([[1, 2, 3], [1, 2, 3]], [
        SamplingParams(temperature=0, max_tokens=1, logprobs=True, top_logprobs=5),
        SamplingParams(temperature=0, max_tokens=4, choice=["ab", "cd"], logprobs=True,
                       top_logprobs=5)])
    assert constrained.text in ("ab", "cd")
    first = constrained.logprobs[0]
    assert first.top_token_ids == free.logprobs[0].top_token_ids
    assert first.top_logprobs == pytest.approx(free.logprobs[0].top_logprobs, abs=1e-5)
    assert all(math.isfinite(lp) and lp <= 0 for lp in [first.logprob, *first.top_logprobs])


# "😀你好 Paris" in the default model's byte-level BPE: the emoji is three tokens, each CJK
# character two, none a whole character on its own.
SPLIT_TEXT = "😀你好 Paris"


def test_each_token_reports_its_own_bytes_and_indexes_the_text(smollm2_source) -> None:
    tokenizer = smollm2_source.tokenizer
    ids = tokenizer.encode(SPLIT_TEXT, add_special_tokens=False)
    assert len(ids) == 8
    logprobs = [TokenLogprob(-1.0, [], [])] * len(ids)
    content = chat_logprobs(tokenizer, ids, logprobs, 0)["content"]
    pieces = [bytes(item["bytes"]) for item in content]
    assert b"".join(pieces) == SPLIT_TEXT.encode()
    assert pieces[:3] == [b"\xf0\x9f", b"\x98", b"\x80"]
    reader = IncrementalDetokenizer(tokenizer, [])
    completion = completion_logprobs(tokenizer, ids, logprobs, 0, reader)
    assert reader.text == SPLIT_TEXT
    # each token starts where its character does in the 8-character text
    assert completion["text_offset"] == [0, 0, 0, 1, 1, 2, 2, 3]
    # split across two calls (two streamed deltas), the offsets go on from the first
    reader = IncrementalDetokenizer(tokenizer, [])
    head = completion_logprobs(tokenizer, ids[:4], logprobs[:4], 0, reader)
    tail = completion_logprobs(tokenizer, ids[4:], logprobs[4:], 0, reader)
    assert head["text_offset"] + tail["text_offset"] == completion["text_offset"]


@pytest.fixture
def client(default_api):
    yield openai.OpenAI(base_url=default_api.url, api_key="unused", max_retries=0)
    wait_for(lambda: default_api.client.stats().blocks_in_use == 0, what="every block back")


@pytest.mark.slow
def test_the_api_s_logprobs_do_not_depend_on_the_sampling(client) -> None:
    """The issue's case: at the server's default sampling (temperature 0.2, top-p 0.9) the
    first token read 0.0 and its alternatives -9999.0, at temperature 0 -1.46."""
    request = {"model": "smollm2-135m", "max_tokens": 1, "logprobs": True, "top_logprobs": 3,
               "seed": 1,
               "messages": [{"role": "user", "content": "What is the capital of France?"}]}
    [default] = client.chat.completions.create(**request).choices[0].logprobs.content
    [greedy] = client.chat.completions.create(**request, temperature=0).choices[0].logprobs.content
    model_s = {top.token: top.logprob for top in greedy.top_logprobs}
    assert default.logprob == pytest.approx(model_s[default.token], abs=1e-4)
    assert default.logprob < 0
    assert [(top.token, top.logprob) for top in default.top_logprobs] == [
        (top.token, pytest.approx(top.logprob, abs=1e-4)) for top in greedy.top_logprobs]
    assert all(-100 < top.logprob < 0 for top in default.top_logprobs)

    completion = client.completions.create(model="smollm2-135m", prompt="The capital of France is",
                                           max_tokens=3, logprobs=2).choices[0]
    logprobs = completion.logprobs
    assert all(-100 < lp < 0 for top in logprobs.top_logprobs for lp in top.values())
    assert any(lp < 0 for lp in logprobs.token_logprobs)
    for token, offset in zip(logprobs.tokens, logprobs.text_offset):
        assert completion.text[offset:offset + len(token)] == token
