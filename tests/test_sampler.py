"""Sampler: greedy, penalties against a plain reference, filters, seeded reproducibility,
and the sampled distribution itself."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from paged_chat.engine.core.sampling_params import SamplingParams
from paged_chat.engine.worker.sampler import (
    SamplingBatch,
    apply_min_p,
    apply_penalties,
    apply_top_k_top_p,
    counter_uniforms,
    greedy_tokens,
    sample,
)

CPU = torch.device("cpu")


def build(params: list[SamplingParams], logits: torch.Tensor, seeds: list[int] | None = None,
          output_indices: list[int] | None = None, histories: list[list[int]] | None = None,
          prompt_lens: list[int] | None = None) -> SamplingBatch:
    n = len(params)
    return SamplingBatch.build(params, seeds or list(range(n)), output_indices or [0] * n,
                               histories, prompt_lens, logits.shape[-1], CPU)


def splitmix64_reference(x: int) -> int:
    mask = (1 << 64) - 1
    z = (x + 0x9E3779B97F4A7C15) & mask
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
    return z ^ (z >> 31)


def test_counter_uniforms_match_unsigned_splitmix64() -> None:
    seeds = [0, 1, 12345, 2**63 - 1, 2**63, 2**64 - 1]
    indices = [0, 7, 3, 1, 2, 100]
    as_int64 = [s - 2**64 if s >= 2**63 else s for s in seeds]
    got = counter_uniforms(torch.tensor(as_int64), torch.tensor(indices)).tolist()
    for seed, index, u in zip(seeds, indices, got):
        bits = splitmix64_reference((splitmix64_reference(seed) + index) & (2**64 - 1)) >> 12
        assert u == (bits + 0.5) / 2**52
        assert 0 < u < 1


def test_greedy_is_argmax_for_any_dtype() -> None:
    torch.manual_seed(0)
    logits = torch.randn(5, 300)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        batch = build([SamplingParams(temperature=0)] * 5, logits)
        assert batch.all_greedy
        tokens = sample(logits.to(dtype), batch)
        assert tokens.dtype == torch.int64
        assert torch.equal(tokens, logits.to(dtype).float().argmax(-1))


def test_greedy_tokens_pick_as_torch_argmax_on_ties_nan_and_inf() -> None:
    torch.manual_seed(2)
    logits = torch.randn(6, 300)
    logits[0, [7, 9]] = 50.0                       # a tie: the first wins
    logits[1, [3, 200]] = float("nan")             # NaN counts as the maximum, the first one
    logits[2] = float("-inf")
    logits[3, [11, 12]] = float("inf")
    logits[4, 5], logits[4, 6] = float("inf"), float("nan")
    tokens = greedy_tokens(logits)
    assert tokens.dtype == torch.int64
    assert torch.equal(tokens, logits.argmax(-1))
    assert tokens[:2].tolist() == [7, 3]
    assert torch.equal(greedy_tokens(logits[:, ::2]), logits[:, ::2].argmax(-1))  # strided


def test_greedy_rows_in_a_mixed_batch_stay_argmax() -> None:
    torch.manual_seed(1)
    logits = torch.randn(6, 300)
    params = [SamplingParams(temperature=0), SamplingParams(temperature=1.5, top_p=0.5)] * 3
    batch = build(params, logits)
    assert not batch.all_greedy
    tokens = sample(logits, batch)
    assert torch.equal(tokens[::2], logits[::2].argmax(-1))


def reference_penalties(logits: list[float], history: list[int], prompt_len: int,
                        p: SamplingParams) -> list[float]:
    out = list(logits)
    output = history[prompt_len:]
    for token in set(history):
        out[token] = (out[token] / p.repetition_penalty if out[token] > 0
                      else out[token] * p.repetition_penalty)
    for token in set(output):
        out[token] -= p.frequency_penalty * output.count(token) + p.presence_penalty
    return out


def test_penalties_match_a_plain_reference() -> None:
    gen = torch.Generator().manual_seed(2)
    vocab = 50
    logits = torch.randn(4, vocab, generator=gen) * 3
    params = [SamplingParams(repetition_penalty=1.3, frequency_penalty=0.5, presence_penalty=0.7),
              SamplingParams(repetition_penalty=0.8),
              SamplingParams(temperature=0),  # no penalty in a batch where others have one
              SamplingParams(frequency_penalty=-1.0, presence_penalty=2.0)]
    histories = [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in (30, 12, 20, 25)]
    prompt_lens = [10, 12, 5, 0]
    batch = build(params, logits, histories=histories, prompt_lens=prompt_lens)
    got = apply_penalties(logits, batch)
    for row, (p, hist, plen) in enumerate(zip(params, histories, prompt_lens)):
        expected = torch.tensor(reference_penalties(logits[row].tolist(), hist, plen, p))
        torch.testing.assert_close(got[row], expected)
    assert not torch.equal(got[0], logits[0])
    assert torch.equal(got[2], logits[2])


def test_greedy_takes_the_argmax_of_penalised_logits() -> None:
    logits = torch.tensor([[5.0, 4.0, 1.0, -2.0]])
    params = [SamplingParams(temperature=0, repetition_penalty=2.0)]
    batch = build(params, logits, histories=[[0]], prompt_lens=[1])
    assert sample(logits, batch).item() == 1  # 5 / 2 < 4


def test_penalties_need_the_token_histories() -> None:
    with pytest.raises(ValueError, match="token_histories"):
        build([SamplingParams(presence_penalty=1.0)], torch.zeros(1, 10))


def allowed_tokens(logits: list[float], p: SamplingParams, tol: float = 1e-4) -> set[int]:
    """Tokens a correct sampler may pick, from the definitions, with slack for rounding/ties:
    min-p vs the max prob, then top-k by rank, then top-p on the top-k renormalised probs."""
    scaled = [x / p.temperature for x in logits]
    top = max(scaled)
    probs = [math.exp(x - top) for x in scaled]
    total = sum(probs)
    probs = [q / total for q in probs]
    alive = {v for v, q in enumerate(probs) if q >= p.min_p * max(probs) - tol}
    if p.top_k:
        kth = sorted((scaled[v] for v in alive), reverse=True)[min(p.top_k, len(alive)) - 1]
        alive = {v for v in alive if scaled[v] >= kth - tol}
    alive_mass = sum(probs[v] for v in alive)
    return {v for v in alive
            if sum(probs[u] for u in alive if probs[u] > probs[v] + 1e-9) / alive_mass
            < p.top_p + tol}


@settings(max_examples=150, deadline=None)
@given(logits=st.lists(st.floats(-6, 6), min_size=2, max_size=12),
       temperature=st.floats(0.2, 3.0), top_k=st.integers(0, 6), top_p=st.floats(0.05, 1.0),
       min_p=st.sampled_from([0.0, 0.05, 0.3, 0.9]), seed=st.integers(0, 2**40))
def test_filtered_tokens_are_never_sampled(logits: list[float], temperature: float, top_k: int,
                                           top_p: float, min_p: float, seed: int) -> None:
    p = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    draws = 64
    batch = build([p] * draws, torch.zeros(1, len(logits)), seeds=[seed] * draws,
                  output_indices=list(range(draws)))
    tokens = sample(torch.tensor([logits] * draws), batch)
    assert set(tokens.tolist()) <= allowed_tokens(logits, p)


def full_sort_top_k_top_p(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """The textbook version: one full sort per row, top-k then renormalised top-p."""
    out = torch.full_like(logits, float("-inf"))
    for row, p in enumerate(params):
        if p.greedy or (not p.top_k and p.top_p == 1):
            out[row] = logits[row]
            continue
        values, order = logits[row].sort(descending=True)
        values[p.top_k or len(values):] = float("-inf")
        if p.top_p < 1:
            probs = values.softmax(-1)
            values[probs.cumsum(-1) - probs >= p.top_p] = float("-inf")
        out[row, order] = values
    return out


# flat (huge nucleus) to peaked; 100: most of exp(x - max) would be denormal (EXP_FLOOR)
@pytest.mark.parametrize("scale", [0.05, 1.0, 8.0, 100.0])
def test_candidate_top_k_top_p_equals_a_full_sort(scale: float) -> None:
    """The widening candidate search must keep exactly what a full sort keeps."""
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(7, 5000, generator=gen) * scale
    params = [SamplingParams(top_p=0.9), SamplingParams(top_p=0.3, top_k=100),
              SamplingParams(top_k=3), SamplingParams(temperature=0, top_p=0.5),
              SamplingParams(), SamplingParams(top_p=0.999), SamplingParams(top_k=2000)]
    got = apply_top_k_top_p(logits, build(params, logits))
    assert torch.equal(got.isfinite(), full_sort_top_k_top_p(logits, params).isfinite())
    assert torch.equal(got[got.isfinite()], logits[got.isfinite()])


@pytest.mark.parametrize("temperature", [0.2, 1.0])
def test_a_draw_among_the_kept_candidates_picks_what_the_whole_vocabulary_would(
        temperature: float) -> None:
    """The draw takes a truncated row's token from its candidates only: with the same
    uniforms, the inverse CDF over the whole vocabulary, the dropped tokens at -inf (the
    sampler before it), picks the same tokens, truncated rows and others alike."""
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(64, 3000, generator=gen) * 4
    kinds = [SamplingParams(temperature=temperature, top_p=0.9),
             SamplingParams(temperature=temperature, top_k=20, top_p=0.95),
             SamplingParams(temperature=temperature, min_p=0.05),
             SamplingParams(temperature=temperature)]
    params = [kinds[row % len(kinds)] for row in range(len(logits))]
    batch = build(params, logits, seeds=list(range(100, 164)), output_indices=list(range(64)))
    scaled = logits / temperature
    cdf = apply_top_k_top_p(apply_min_p(scaled, batch), batch).double().softmax(-1).cumsum(-1)
    whole = torch.searchsorted(cdf, (batch.uniforms * cdf[:, -1])[:, None]).squeeze(1)
    assert torch.equal(sample(logits, batch), whole)


def test_a_rows_draw_does_not_depend_on_the_rest_of_the_batch() -> None:
    gen = torch.Generator().manual_seed(4)
    vocab = 1000
    mine = torch.randn(1, vocab, generator=gen)
    p = SamplingParams(temperature=1.0, top_p=0.95)
    alone = [sample(mine, build([p], mine, seeds=[42], output_indices=[i])).item()
             for i in range(20)]
    others = [SamplingParams(temperature=0.5), SamplingParams(temperature=0),
              SamplingParams(top_k=5, min_p=0.1)] * 5
    batched = []
    for i in range(20):
        logits = torch.cat([torch.randn(7, vocab, generator=gen), mine,
                            torch.randn(8, vocab, generator=gen)])
        params = others[:7] + [p] + others[7:]
        seeds = torch.randint(0, 2**62, (16,), generator=gen).tolist()
        seeds[7] = 42
        indices = torch.randint(0, 500, (16,), generator=gen).tolist()
        indices[7] = i
        batched.append(sample(logits, build(params, logits, seeds, indices))[7].item())
    assert alone == batched
    other_seed = [sample(mine, build([p], mine, seeds=[43], output_indices=[i])).item()
                  for i in range(20)]
    assert other_seed != alone
    assert len(set(alone)) > 10  # successive output indices give fresh draws


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_sampled_frequencies_match_softmax_over_temperature(temperature: float) -> None:
    """Chi-square goodness of fit; the same statistic against softmax(logits) (temperature
    ignored) must be far off, so the test can fail."""
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, -1.0, -1.5, -3.0])
    draws = 40_000
    p = SamplingParams(temperature=temperature)
    batch = build([p] * draws, logits[None], seeds=[7] * draws,
                  output_indices=list(range(draws)))
    counts = torch.bincount(sample(logits.expand(draws, -1), batch), minlength=len(logits))

    def chi2(probs: torch.Tensor) -> float:
        expected = probs.double() * draws
        return float(((counts - expected) ** 2 / expected).sum())

    critical = 26.0  # chi-square, 7 degrees of freedom, p = 0.0005
    assert chi2((logits / temperature).softmax(-1)) < critical
    if temperature != 1.0:
        assert chi2(logits.softmax(-1)) > 10 * critical
