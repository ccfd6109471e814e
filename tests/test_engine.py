"""The paged engine end to end on tiny random models: batching, prefix caching, chunked
prefill and preemption never change greedy output, and the pool never leaks."""

from __future__ import annotations

import pytest
import torch
from helpers import GREEDY, holders_of, owners_of, random_prompts
from transformers import GenerationConfig

from paged_chat.engine import EngineConfig, SamplingParams
from paged_chat.engine.kv.block_pool import NULL_BLOCK

# The reference's counterpart of ignore_eos: no end token at all (min_new_tokens would
# instead mask the end token's logit and change which token wins).
NO_EOS = GenerationConfig(max_new_tokens=24, do_sample=False, eos_token_id=None, pad_token_id=0)


def test_generate_contract(make_engine):
    engine = make_engine()
    outputs = engine.generate([[5, 6, 7], [9, 10, 11, 12]], GREEDY)
    assert [len(o.token_ids) for o in outputs] == [24, 24]
    assert all(o.finished and o.finish_reason == "length" for o in outputs)
    assert outputs[0].text == engine.tokenizer.decode(outputs[0].token_ids, skip_special_tokens=True)
    assert not engine.has_unfinished()


def test_greedy_matches_transformers(make_engine, tiny_reference):
    prompts = random_prompts(6, seed=1)
    outputs = make_engine().generate(prompts, GREEDY)
    for prompt, output in zip(prompts, outputs):
        with torch.inference_mode():
            expected = tiny_reference.generate(torch.tensor([prompt]), generation_config=NO_EOS,
                                               output_logits=True, return_dict_in_generate=True)
        tokens = expected.sequences[0, len(prompt):].tolist()
        for step, (ours, theirs) in enumerate(zip(output.token_ids, tokens)):
            if ours != theirs:
                top2 = expected.logits[step][0].topk(2).values
                assert top2[0] - top2[1] < 1e-3 * top2[0].abs(), f"diverged at step {step}"
                break


def test_greedy_output_does_not_depend_on_the_batch(make_engine):
    prompts = random_prompts(32, seed=2, high=120)
    alone = make_engine(max_num_seqs=1)
    expected = [alone.generate([p], GREEDY)[0].token_ids for p in prompts]
    variants = {
        "batched": make_engine(),
        "no prefix caching": make_engine(enable_prefix_caching=False),
        "chunked prefill": make_engine(max_num_batched_tokens=40),
        "preemption": make_engine(num_blocks=24, block_size=8),
    }
    for name, engine in variants.items():
        outputs = engine.generate(prompts, GREEDY)
        assert [o.token_ids for o in outputs] == expected, name
    assert variants["preemption"].stats().num_preemptions > 0
    assert variants["chunked prefill"].stats().batch_tokens <= 40


def test_one_long_chat_among_short_ones_decodes_as_it_would_alone(make_engine, monkeypatch):
    """The torch backend attends the long chat's decodes apart from the short ones' (which
    are not padded to its length), with the same greedy tokens as each chat alone."""
    from paged_chat.engine.attention import torch_backend

    group_counts = []

    def recorded(unique_blocks):
        groups = length_groups(unique_blocks)
        group_counts.append(len(groups))
        return groups

    length_groups = torch_backend._length_groups
    monkeypatch.setattr(torch_backend, "_length_groups", recorded)
    prompts = random_prompts(1, seed=5, low=900, high=901) + random_prompts(7, seed=6, high=30)
    alone = make_engine(max_num_seqs=1, attention_backend="torch")
    expected = [alone.generate([p], GREEDY)[0].token_ids for p in prompts]
    group_counts.clear()
    outputs = make_engine(attention_backend="torch").generate(prompts, GREEDY)
    assert [o.token_ids for o in outputs] == expected
    assert max(group_counts) == 2


def test_shared_system_prompt_is_computed_once(make_engine):
    engine = make_engine(num_blocks=256, block_size=16)
    system = random_prompts(1, seed=3, low=300, high=301)[0]
    first_prompt = system + [7, 8]
    first = engine.generate([first_prompt], GREEDY)[0]
    assert first.num_cached_tokens == 0
    questions = [system + q for q in random_prompts(7, seed=4, low=5, high=20)]
    outputs = engine.generate(questions, GREEDY)
    shared_full_blocks = 300 // 16 * 16
    assert all(o.num_cached_tokens == shared_full_blocks for o in outputs)
    stats = engine.stats()
    assert stats.prefix_cache_hit_tokens == 7 * shared_full_blocks
    assert stats.prefix_cache_queried_tokens == len(first_prompt) + sum(map(len, questions))


def test_second_turn_prefills_only_new_tokens(make_engine):
    engine = make_engine(block_size=16)
    prompt = random_prompts(1, seed=5, low=70, high=71)[0]
    first = engine.generate([prompt], GREEDY)[0]
    history = prompt + first.token_ids
    second_prompt = history + [11, 12, 13, 14, 15]
    second = engine.generate([second_prompt], GREEDY)[0]
    newly_computed = len(second_prompt) - second.num_cached_tokens
    assert newly_computed <= 5 + 16


def test_prompt_that_can_never_fit_errors_alone(make_engine):
    engine = make_engine(num_blocks=8, block_size=8)
    outputs = engine.generate([list(range(3, 100)), [5, 6, 7]], GREEDY)
    assert outputs[0].finish_reason == "error" and "max_model_len" in outputs[0].error
    assert outputs[1].finish_reason == "length" and len(outputs[1].token_ids) == 24


def test_reply_is_capped_by_max_model_len(make_engine):
    engine = make_engine(max_model_len=20)
    output = engine.generate([[5] * 10], SamplingParams(temperature=0, max_tokens=100,
                                                        ignore_eos=True))[0]
    assert output.finish_reason == "length" and len(output.token_ids) == 10


def test_abort_mid_stream_frees_blocks(make_engine):
    engine = make_engine()
    keep = engine.add_request([5, 6, 7], GREEDY)
    drop = engine.add_request(list(range(3, 60)), GREEDY)
    for _ in range(3):
        engine.step()
    engine.abort(drop)
    finished = {}
    while engine.has_unfinished():
        finished.update((o.request_id, o) for o in engine.step() if o.finished)
    assert finished[drop].finish_reason == "abort"
    assert finished[keep].finish_reason == "length"
    engine.abort("no-such-request")


def test_bad_prompts_and_params_are_value_errors(make_engine):
    engine = make_engine()
    with pytest.raises(ValueError, match="empty"):
        engine.add_request([], GREEDY)
    with pytest.raises(ValueError, match="vocabulary"):
        engine.add_request([10**6], GREEDY)
    for field, value in [("temperature", -1.0), ("top_p", 0.0), ("top_p", 1.5),
                         ("max_tokens", 0), ("top_k", -1)]:
        with pytest.raises(ValueError, match=field):
            SamplingParams(**{field: value})
    with pytest.raises(ValueError, match="block_size"):
        EngineConfig(block_size=7)


def test_stop_token_ids_and_eos(make_engine):
    engine = make_engine()
    free_run = engine.generate([[5, 6, 7]], GREEDY)[0].token_ids
    stop_at = free_run[4]
    output = engine.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=24,
                                                         stop_token_ids=[stop_at]))[0]
    assert output.finish_reason == "stop"
    assert output.token_ids == free_run[:free_run.index(stop_at) + 1]


def test_seeded_sampling_is_reproducible_across_batches(make_engine):
    engine = make_engine()
    params = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=16, seed=42, ignore_eos=True)
    alone = engine.generate([[5, 6, 7]], params)[0].token_ids
    crowd = engine.generate([[5, 6, 7]] + random_prompts(5, seed=6),
                            [params] + [SamplingParams(temperature=1.0, max_tokens=16)] * 5)
    assert crowd[0].token_ids == alone


def test_stats_snapshot(make_engine):
    engine = make_engine(num_blocks=64, block_size=8)
    request = engine.add_request(list(range(3, 40)), GREEDY, owner="tab-1")
    engine.step()
    stats = engine.stats()
    assert stats.num_blocks == 64 and stats.block_size == 8
    assert stats.blocks_in_use == 5 and stats.num_running == 1
    assert stats.blocks_in_use + stats.blocks_cached + stats.blocks_free == 64
    assert stats.batch_size == 1 and stats.batch_tokens == 37
    holders = [holders_of(stats.blocks, b) for b in range(64)]
    assert sum(h == [request] for h in holders) == 5
    assert {owners_of(stats.blocks, b)[0] for b in range(64) if holders[b]} == {"tab-1"}
    table = engine.kv_cache.block_ids(request)
    assert NULL_BLOCK.block_id not in table and len(stats.blocks.ref_counts) == 64
    held = [b for b in range(64) if holders[b]]
    positions = {b: int(stats.blocks.holder_positions[stats.blocks.holder_ptr[b]]) for b in held}
    assert [table[positions[b]] - 1 for b in held] == held, (
        "a holder position indexes its table (cell b is block b + 1)")
    assert 0 < stats.kv_waste < 1
    engine.abort(request)
    engine.step()
    after = engine.stats()
    assert after.blocks_in_use == 0 and after.blocks_cached == 4  # four full blocks stay cached


def test_long_prompt_is_chunked_and_never_stalls_decoding(make_engine):
    engine = make_engine(max_num_batched_tokens=64, max_model_len=1024)
    decoding = engine.add_request([5, 6, 7], SamplingParams(temperature=0, max_tokens=30,
                                                           ignore_eos=True))
    engine.step()
    engine.add_request(random_prompts(1, seed=7, low=600, high=601)[0], GREEDY)
    for _ in range(9):  # the 600-token prompt needs ten 63-token chunks
        outputs = {o.request_id: o for o in engine.step()}
        assert decoding in outputs, "the decode waited behind a prefill"
        assert engine.stats().batch_tokens == 64
    while engine.has_unfinished():
        engine.step()
