"""Drafts from a request's own history (prompt lookup): proposing, verifying in one forward,
greedy output unchanged, and no prefix hash on a block holding rejected drafts."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from engine_fixtures import MISTRAL_WINDOW
from helpers import random_prompts
from safetensors.torch import load_file, save_file

from benchmarks.drafts_speedup import code_edit_prompt
from paged_chat.engine import Engine, EngineConfig, SamplingParams
from paged_chat.engine.core.ngram_proposer import DraftState, propose_ngram
from paged_chat.engine.kv.kv_cache_manager import hash_block, salt_root
from paged_chat.engine.worker.rejection_sampler import rejection_sample
from paged_chat.tui.engine_panel import format_numbers

GREEDY = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
DRAFTS = {"num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


def quiet_attention_copy(source: Path, folder: Path) -> Path:
    """`source`'s tiny model with its attention outputs scaled down: its next token depends
    mostly on the last one, so its greedy replies fall into cycles that drafts from its
    history match, while attention (and so every KV slot) still moves its logits."""
    shutil.copytree(source, folder)
    weights = load_file(source / "model.safetensors")
    weights = {name: tensor * 0.01 if "o_proj" in name else tensor
               for name, tensor in weights.items()}
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


@pytest.fixture(scope="module")
def cycling_dirs(tmp_path_factory, tiny_model_dir, mistral_dir) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("cycling")
    return {"llama": quiet_attention_copy(tiny_model_dir, root / "llama"),
            "mistral": quiet_attention_copy(mistral_dir, root / "mistral")}


def test_the_longest_earlier_suffix_proposes_what_followed_its_last_occurrence():
    tokens = np.array([1, 2, 3, 4, 9, 2, 3, 5, 6, 1, 2, 3], dtype=np.int64)
    assert propose_ngram(tokens, 1, 3, 2).tolist() == [4, 9]        # [1, 2, 3] at 0
    assert propose_ngram(tokens, 1, 2, 2).tolist() == [5, 6]        # [2, 3] last at 5
    assert propose_ngram(tokens, 1, 2, 9).tolist() == [5, 6, 1, 2, 3]
    assert propose_ngram(np.array([4, 5, 6], dtype=np.int64), 1, 3, 4).tolist() == []


def steps_paused(state: DraftState) -> int:
    paused = 0
    while not state.may_propose():
        paused += 1
        assert paused < 1000
    return paused


def test_drafting_pauses_while_acceptance_is_low_longer_each_time_it_fails_again():
    state = DraftState()
    state.record(num_drafted=4, num_accepted=4)
    assert steps_paused(state) == 0
    for _ in range(2):
        state.record(num_drafted=4, num_accepted=0)
    first = steps_paused(state)
    state.record(num_drafted=4, num_accepted=0)
    second = steps_paused(state)
    assert 0 < first < second
    state.record(num_drafted=4, num_accepted=4)
    assert steps_paused(state) == 0
    state.record(num_drafted=4, num_accepted=0)
    state.record(num_drafted=4, num_accepted=0)
    assert steps_paused(state) == first     # an accepted step starts the pauses over


@pytest.mark.parametrize("batch", [1, 8])
@pytest.mark.parametrize("model", ["llama", "mistral"])
def test_greedy_output_is_the_same_with_drafts(make_engine, cycling_dirs, batch, model):
    prompts = random_prompts(8, seed=batch)
    model_dir = str(cycling_dirs[model])
    plain = make_engine(model=model_dir, max_num_seqs=batch).generate(prompts, GREEDY)
    drafting = make_engine(model=model_dir, max_num_seqs=batch, **DRAFTS)
    outputs = drafting.generate(prompts, GREEDY)
    assert [o.token_ids for o in outputs] == [o.token_ids for o in plain]
    assert drafting.scheduler.num_accepted_draft_tokens > 0
    if model == "mistral":
        assert max(len(p) for p in prompts) + GREEDY.max_tokens > MISTRAL_WINDOW


def test_greedy_output_is_the_same_with_drafts_under_preemption_and_chunked_prefill(
        make_engine, cycling_dirs):
    prompts = random_prompts(8, seed=11)
    model = str(cycling_dirs["llama"])
    expected = [o.token_ids for o in make_engine(model=model).generate(prompts, GREEDY)]
    small_pool = make_engine(model=model, num_blocks=24, block_size=8,
                             max_num_batched_tokens=40, **DRAFTS)
    assert [o.token_ids for o in small_pool.generate(prompts, GREEDY)] == expected
    assert small_pool.stats().num_preemptions > 0
    assert small_pool.scheduler.num_accepted_draft_tokens > 0


def test_a_block_holding_rejected_drafts_gets_no_prefix_hash(make_engine, cycling_dirs):
    engine = make_engine(model=str(cycling_dirs["llama"]), block_size=8, **DRAFTS)
    prompt = random_prompts(1, seed=5)[0]
    request_id = engine.add_request(prompt, GREEDY)
    request = engine.requests[request_id]
    checked = 0
    while engine.has_unfinished() and checked < 200:
        engine.step()
        if request_id not in engine.requests:
            break
        tokens, table = request.all_token_ids, engine.kv_cache.tables[request_id]
        parent = salt_root(None)
        for index, block in enumerate(table):
            full = tokens[index * 8:(index + 1) * 8]
            if len(full) < 8:   # past the request's tokens: only drafts, never hashed
                assert block.block_hash is None
                continue
            parent = hash_block(parent, full)
            assert block.block_hash in (None, parent)
        checked += 1
    assert engine.scheduler.num_draft_tokens > engine.scheduler.num_accepted_draft_tokens


def test_the_rejection_rule_emits_tokens_distributed_as_the_model_says():
    probs = torch.tensor([[0.5, 0.2, 0.2, 0.1], [0.1, 0.6, 0.0, 0.3], [0.25, 0.25, 0.25, 0.25]])
    draft = torch.tensor([1, 1])
    generator = torch.Generator().manual_seed(7)
    draws = 20000
    first, second_after_kept = np.zeros(4), np.zeros(4)
    for _ in range(draws):
        uniforms = torch.rand(3, 2, generator=generator, dtype=torch.float64)
        tokens = rejection_sample(probs, draft, uniforms)
        first[tokens[0]] += 1
        if tokens[0] == draft[0] and len(tokens) > 1:
            second_after_kept[tokens[1]] += 1
        assert len(tokens) >= 1 and all(t == d for t, d in zip(tokens[:-1], draft.tolist()))
    assert np.abs(first / draws - probs[0].numpy()).max() < 0.015
    kept = second_after_kept.sum()
    assert kept == pytest.approx(draws * 0.2, rel=0.1)
    assert np.abs(second_after_kept / kept - probs[1].numpy()).max() < 0.03
    assert second_after_kept[2] == 0     # a token of probability 0 is never drawn


def test_the_stats_and_the_engine_panel_count_drafts(make_engine, cycling_dirs):
    plain = make_engine(model=str(cycling_dirs["llama"]))
    plain.generate(random_prompts(4, seed=3), GREEDY)
    assert "drafts" not in format_numbers(plain.stats()).plain    # drafting off: no row
    engine = make_engine(model=str(cycling_dirs["llama"]), **DRAFTS)
    outputs = engine.generate(random_prompts(4, seed=3), GREEDY)
    stats = engine.stats()
    assert stats.generation_tokens_total == sum(len(o.token_ids) for o in outputs)
    assert stats.draft_tokens_total == engine.scheduler.num_draft_tokens > 0
    assert stats.accepted_draft_tokens_total == engine.scheduler.num_accepted_draft_tokens > 0
    accepted = f"{stats.draft_acceptance_rate:.0%}"
    assert (f"drafts accepted {accepted} ({stats.accepted_draft_tokens_total}/"
            f"{stats.draft_tokens_total} tok)") in format_numbers(stats).plain


@pytest.mark.slow
def test_the_default_model_edits_code_with_drafts_as_it_does_without(smollm2_source):
    tokenizer = smollm2_source.tokenizer
    chat = tokenizer.apply_chat_template(
        [{"role": "user", "content": code_edit_prompt(40)}], add_generation_prompt=True,
        tokenize=False)
    prompt = tokenizer.encode(chat, add_special_tokens=False)
    params = SamplingParams(temperature=0.0, max_tokens=96)
    outputs = []
    for speculative_tokens in (0, 4):
        engine = Engine(EngineConfig(device="cpu", dtype="float32", num_blocks=128,
                                     num_speculative_tokens=speculative_tokens),
                        source=smollm2_source)
        outputs.append(engine.generate([prompt], params)[0].token_ids)
        accepted = engine.stats().accepted_draft_tokens_total
        engine.close()
    assert outputs[0] == outputs[1]
    assert accepted > 0


def test_sampled_requests_verify_their_drafts_by_the_rejection_rule(make_engine, cycling_dirs):
    engine = make_engine(model=str(cycling_dirs["llama"]), **DRAFTS)
    params = SamplingParams(temperature=0.2, seed=3, max_tokens=40, ignore_eos=True)
    outputs = engine.generate(random_prompts(8, seed=4), params)
    assert all(o.finish_reason == "length" and len(o.token_ids) == 40 for o in outputs)
    assert engine.scheduler.num_accepted_draft_tokens > 0
    filtered = SamplingParams(temperature=0.2, top_k=5, max_tokens=8, ignore_eos=True)
    before = engine.scheduler.num_draft_tokens
    engine.generate(random_prompts(2, seed=4), filtered)
    assert engine.scheduler.num_draft_tokens == before   # top-k: no drafts


def test_a_stop_inside_the_accepted_drafts_ends_the_reply_there(make_engine, cycling_dirs):
    model = str(cycling_dirs["llama"])
    prompts = random_prompts(8, seed=1)
    plain = make_engine(model=model)
    drafting = make_engine(model=model, **DRAFTS)
    full = plain.generate(prompts, GREEDY)
    stop_ids = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True,
                              stop_token_ids=[full[0].token_ids[30]])
    stop_text = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True,
                               stop=[plain.tokenizer.decode(full[1].token_ids[28:31])])
    for params in (stop_ids, stop_text):
        expected = plain.generate(prompts, params)
        ours = drafting.generate(prompts, params)
        assert [(o.token_ids, o.text, o.finish_reason) for o in ours] == [
            (o.token_ids, o.text, o.finish_reason) for o in expected]
        assert any(o.finish_reason == "stop" for o in ours)
    assert drafting.scheduler.num_accepted_draft_tokens > 0


def test_a_constrained_request_drafts_nothing_and_keeps_its_grammar(make_engine, cycling_dirs):
    model = str(cycling_dirs["llama"])
    params = SamplingParams(temperature=0.0, max_tokens=40, regex=r"(ab|cd){12}")
    prompts = random_prompts(2, seed=6)
    expected = [o.text for o in make_engine(model=model).generate(prompts, params)]
    drafting = make_engine(model=model, **DRAFTS)
    assert [o.text for o in drafting.generate(prompts, params)] == expected
    assert drafting.scheduler.num_draft_tokens == 0


def test_greedy_output_is_the_same_with_drafts_over_the_kv_tier(make_engine, cycling_dirs):
    prompts = random_prompts(8, seed=13)
    model = str(cycling_dirs["llama"])
    expected = [o.token_ids for o in make_engine(model=model).generate(prompts, GREEDY)]
    tiered = make_engine(model=model, num_blocks=24, block_size=8, kv_tier_host_bytes="16MiB",
                         **DRAFTS)
    assert [o.token_ids for o in tiered.generate(prompts, GREEDY)] == expected
    again = tiered.generate(prompts[:2], GREEDY)
    assert [o.token_ids for o in again] == expected[:2]
    assert tiered.stats().tier.hit_tokens > 0
    assert tiered.scheduler.num_accepted_draft_tokens > 0


def test_a_step_with_drafts_samples_its_other_requests_with_their_logprobs(make_engine,
                                                                        cycling_dirs):
    model = str(cycling_dirs["llama"])
    prompts = random_prompts(6, seed=1)
    wanting = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, logprobs=True,
                             top_logprobs=2)
    params = [GREEDY] * 5 + [wanting]
    expected = make_engine(model=model).generate(prompts, params)
    drafting = make_engine(model=model, **DRAFTS)
    outputs = drafting.generate(prompts, params)
    assert [o.token_ids for o in outputs] == [o.token_ids for o in expected]
    ours, theirs = outputs[-1].logprobs, expected[-1].logprobs
    assert [e.top_token_ids for e in ours] == [e.top_token_ids for e in theirs]
    assert [e.logprob for e in ours] == pytest.approx([e.logprob for e in theirs], abs=1e-4)
    assert drafting.scheduler.num_accepted_draft_tokens > 0
