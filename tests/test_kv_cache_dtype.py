"""`EngineConfig.kv_cache_dtype`: a bfloat16 KV pool (the CPU's default) against the model's
dtype ("auto", the exact reference): the C kernel's bf16 store and widening (as built for
this machine, AVX2 only, and portable) against the torch reference, the pool's size, the
engine's greedy tokens, and the KV tier, which never reads a block at another dtype."""

from __future__ import annotations

import platform

import pytest
import torch
from test_cpu_attention import STEPS, random_step
from tiny_models import PagedSequence

from paged_chat.engine import Engine, EngineConfig, SamplingParams
from paged_chat.engine.attention.cpu_backend import CpuAttention, cpu_kernels_available
from paged_chat.engine.attention.kv_rows import to_cache_rows
from paged_chat.engine.attention.metadata import AttentionMetadata
from paged_chat.engine.attention.torch_backend import TorchAttention
from paged_chat.engine.core.errors import PagedChatError
from paged_chat.engine.native import bindings

# The C kernels as built for this machine, the same source without AVX-512 (its AVX2
# loops), and without AVX2 (its portable loops, what other CPUs run).
KERNEL_BUILDS = {
    "native": lambda: bindings.library(),
    "avx2": lambda: bindings.build((["-O3", "-march=native", "-mno-avx512f", "-fopenmp"],)),
    "portable": lambda: bindings.build((["-O3", "-mno-avx2", "-fopenmp"],)),
}

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module", params=KERNEL_BUILDS)
def kernels(request):
    if not cpu_kernels_available():
        pytest.skip("no C compiler")
    if request.param != "native" and platform.machine() != "x86_64":
        pytest.skip("-mno-avx2 and -mno-avx512f are x86 flags")
    library = KERNEL_BUILDS[request.param]()
    assert library is not None, f"the {request.param} build of the C kernels failed"
    return library


# How far a cache's rounding may move the attention's output, against a float32 cache's.
KV_TOLERANCE = {torch.bfloat16: 2e-2, torch.int8: 5e-2}


@pytest.mark.parametrize("kv_dtype", KV_TOLERANCE)
@pytest.mark.parametrize("step", STEPS)
@pytest.mark.parametrize("window", [None, 7])
@pytest.mark.parametrize("heads,kv_heads,dim", [(6, 2, 8), (9, 3, 64), (8, 2, 32)])
def test_kernel_over_a_narrow_cache_matches_the_references(kernels, kv_dtype, step, window,
                                                          heads, kv_heads, dim, monkeypatch):
    """Ragged decodes and prefill chunks: the kernel stores the new K/V as the torch
    reference rounds them (bf16) or quantizes them (int8: kv_rows.py), attends the widened
    cache as the reference does (to float32's precision), and is within the dtype's
    rounding of the float32 cache's output."""
    monkeypatch.setattr(bindings, "library", lambda: kernels)
    generator = torch.Generator().manual_seed(heads + (window or 0))
    decodes, prefills = STEPS[step]
    seq_lens = [*decodes, *(length for length, _ in prefills)]
    new_tokens = [*[1] * len(decodes), *(count for _, count in prefills)]
    query, key, value, key_cache, value_cache, meta = random_step(
        generator, heads, kv_heads, dim, seq_lens, new_tokens, block=16)
    scale = dim ** -0.5
    exact = TorchAttention(heads, kv_heads, dim, scale)(
        query, key, value, key_cache.clone(), value_cache.clone(), meta, sliding_window=window)
    reference_caches = to_cache_rows(key_cache, kv_dtype), to_cache_rows(value_cache, kv_dtype)
    caches = tuple(cache.clone() for cache in reference_caches)
    expected = TorchAttention(heads, kv_heads, dim, scale)(
        query, key, value, *reference_caches, meta, sliding_window=window)
    got = CpuAttention(heads, kv_heads, dim, scale, prefill_in_kernel=True)(
        query, key, value, *caches, meta, sliding_window=window)
    for stored, reference in zip(caches, reference_caches):
        assert torch.equal(stored, reference), "K/V stored as the reference stores them"
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    tolerance = KV_TOLERANCE[kv_dtype]
    torch.testing.assert_close(got, exact, rtol=tolerance, atol=tolerance)
    assert not torch.equal(got, exact), "the narrow cache was read as float32"


def test_kernel_rounds_to_nearest_even_as_torch(kernels, monkeypatch):
    """Halfway cases both ways, the largest finite float, infinities and NaN."""
    monkeypatch.setattr(bindings, "library", lambda: kernels)
    specials = torch.tensor([0x3F808000, 0x3F818000, 0x3F80FFFF, 0x3F807FFF, 0x7F7FFFFF,
                             0xFF800000, 0x7FC00000, 0x80000001], dtype=torch.int64)
    row = specials.to(torch.int32).view(torch.float32)
    dim = 8
    key = row.view(1, 1, dim)
    caches = (torch.zeros(1, 2, 4, dim, dtype=torch.bfloat16),
              torch.zeros(1, 2, 4, dim, dtype=torch.bfloat16))
    meta = AttentionMetadata.build([1], [1], [[1]], 4, torch.device("cpu"))
    CpuAttention(1, 1, dim, 1.0)(torch.zeros(1, 1, dim), key, key.clone(), *caches, meta)
    stored, expected = caches[0][0, 1, 0], row.to(torch.bfloat16)
    finite = ~expected.isnan()   # a NaN's payload is torch's choice, by its code path
    assert torch.equal(stored[finite].view(torch.int16), expected[finite].view(torch.int16))
    assert torch.equal(stored.isnan(), ~finite)


def test_an_unknown_kv_cache_dtype_is_refused_by_name():
    with pytest.raises(ValueError, match="kv_cache_dtype='int4' is invalid: expected one of"):
        EngineConfig(kv_cache_dtype="int4")


def test_bf16_is_the_cpu_default_and_auto_the_cuda_one():
    assert EngineConfig().for_device("cpu").kv_cache_dtype == "bfloat16"
    assert EngineConfig().for_device("cuda").kv_cache_dtype == "auto"
    assert EngineConfig(kv_cache_dtype="auto").for_device("cpu").kv_cache_dtype == "auto"


def test_the_pool_holds_twice_the_blocks_at_bf16(make_engine):
    """The same memory, half the bytes a block: twice the blocks (the null block counted);
    int8: a byte a value and 4 a row for its scale."""
    budget = 4 * 2**20
    sized = {kv: make_engine(num_blocks=None, kv_cache_memory=budget, kv_cache_dtype=kv)
             for kv in ("auto", "bfloat16", "int8", None)}
    assert sized["auto"].runner.kv_cache.dtype == torch.float32
    assert sized["bfloat16"].runner.kv_cache.dtype == torch.bfloat16
    assert sized[None].runner.kv_cache.dtype == torch.bfloat16, "the CPU default"
    assert sized["bfloat16"].num_blocks + 1 == 2 * (sized["auto"].num_blocks + 1)
    assert sized["bfloat16"].runner.kv_cache.nbytes == sized["auto"].runner.kv_cache.nbytes
    layers, _, kv_heads, blocks, block_size, width = sized["int8"].runner.kv_cache.shape
    assert width == sized["auto"].runner.kv_cache.shape[-1] + 4
    assert blocks == sized["int8"].num_blocks + 1 == budget // (layers * 2 * kv_heads * block_size * width)


def kv_logit_errors(model, prompt: list[int], reply: list[int], kv_dtype: torch.dtype
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Teacher-forced over `prompt + reply`: the float32-KV logits' top-2 gap and spread
    (standard deviation) at each reply token, and the `kv_dtype` KV logits' largest error
    against them there."""
    sequence = prompt + reply
    logits = {kv: PagedSequence(model, len(sequence), kv).feed(sequence)[len(prompt) - 1:-1]
              for kv in (torch.float32, kv_dtype)}
    top2 = logits[torch.float32].topk(2, dim=-1).values
    error = (logits[kv_dtype] - logits[torch.float32]).abs().amax(dim=-1)
    return top2[:, 0] - top2[:, 1], logits[torch.float32].std(dim=-1), error


@pytest.mark.parametrize("attention_backend", ["cpu", "torch"])
def test_bf16_kv_departs_from_float32_kv_only_at_near_ties(make_engine, attention_backend):
    """Decodes, chunked prefills (a 512-token budget over longer prompts) and prefix hits on
    a tiny random model, whose logits lie close together: where the bf16 pool's greedy
    tokens first differ, the float32 pool's top two logits were within the bf16 pool's
    measured logit error of each other."""
    prompts = [[5 + i % 200 for i in range(n)] for n in (3, 40, 700, 130, 40)]
    expected = make_engine(attention_backend=attention_backend,
                           kv_cache_dtype="auto").generate(prompts, GREEDY)
    engine = make_engine(attention_backend=attention_backend, kv_cache_dtype="bfloat16")
    got = engine.generate(prompts, GREEDY)
    for prompt, reference, output in zip(prompts, expected, got):
        gaps, spreads, errors = kv_logit_errors(engine.runner.model, prompt,
                                                reference.token_ids, torch.bfloat16)
        assert (errors < 0.3 * spreads).all(), "bf16 KV's logits off by a lot"
        differ = [i for i, (a, b) in enumerate(zip(reference.token_ids, output.token_ids))
                  if a != b]
        if differ:
            assert gaps[differ[0]] <= 2 * errors.max(), (
                f"prompt of {len(prompt)} tokens: token {differ[0]} differs at a logit gap "
                f"of {gaps[differ[0]]:.4f}, the bf16 KV's largest error {errors.max():.4f}")


def test_a_tier_written_at_one_kv_dtype_is_never_read_at_another(make_engine, tmp_path):
    prompt = [5 + i % 200 for i in range(100)]
    cache_dir = str(tmp_path / "cache")

    def tier_hits(kv_cache_dtype: str) -> int:
        engine = make_engine(cache_dir=cache_dir, kv_cache_dtype=kv_cache_dtype)
        try:
            return engine.generate([prompt], GREEDY)[0].num_tier_cached_tokens
        finally:
            engine.close()

    assert tier_hits("bfloat16") == 0
    assert tier_hits("auto") == 0, "a float32 pool read blocks written in bf16"
    assert tier_hits("int8") == 0
    assert tier_hits("auto") > 0
    assert tier_hits("bfloat16") > 0
    assert tier_hits("int8") > 0


def test_the_triton_kernels_refuse_a_kv_dtype_other_than_the_models(make_engine):
    pytest.importorskip("triton")
    with pytest.raises(PagedChatError, match="kv_cache_dtype='bfloat16' differs from the model"):
        make_engine(attention_backend="triton", kv_cache_dtype="bfloat16")


DEFAULT_MODEL_PROMPTS = ["The history of the Roman Empire", "def fibonacci(n):",
                         "Once upon a time, in a small village,", "The three primary colors are",
                         "Explain how a paged KV cache works, step by step:"]


# How far a narrow pool's logits may sit from the float32 pool's, in standard deviations
# of the float32 logits at that step.
LOGIT_ERROR_BOUND = {"bfloat16": 0.1, "int8": 0.4}


@pytest.mark.slow
@pytest.mark.parametrize("kv_cache_dtype", LOGIT_ERROR_BOUND)
def test_narrow_kv_on_the_default_model_departs_only_at_near_ties(smollm2_source,
                                                                  kv_cache_dtype):
    """The default model (quantized weights, the fused decode step over the narrow pool):
    bf16 KV gives the float32 pool's greedy tokens on every prompt; int8 KV may depart, but
    only where the float32 pool's top two logits were within int8's measured logit error.
    Each step's logits (teacher-forced) stay within the bound of the float32 pool's."""
    replies = {}
    for kv in ("auto", kv_cache_dtype):
        engine = Engine(EngineConfig(device="cpu", dtype="float32", num_blocks=128,
                                     kv_cache_dtype=kv), source=smollm2_source)
        replies[kv] = [o.token_ids for o in engine.generate(
            DEFAULT_MODEL_PROMPTS, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))]
    assert engine.runner.model.fused_decode is not None
    departed = []
    for prompt, reference, got in zip(DEFAULT_MODEL_PROMPTS, replies["auto"],
                                      replies[kv_cache_dtype]):
        gaps, spreads, errors = kv_logit_errors(engine.runner.model,
                                                engine.tokenizer.encode(prompt), reference,
                                                engine.runner.kv_cache.dtype)
        assert (errors < LOGIT_ERROR_BOUND[kv_cache_dtype] * spreads).all(), (
            f"{prompt!r}: a logit off by {errors.max():.3f}")
        differ = [i for i, (a, b) in enumerate(zip(reference, got)) if a != b]
        if differ:
            departed.append(prompt)
            assert gaps[differ[0]] <= 2 * errors.max(), (
                f"{prompt!r}: token {differ[0]} differs at a logit gap of "
                f"{gaps[differ[0]]:.3f}, the largest error {errors.max():.3f}")
    if kv_cache_dtype == "bfloat16":
        assert departed == []


def test_ask_takes_the_kv_cache_dtype_and_refuses_an_unknown_one(cli):
    """A bad value is one line naming the setting and what it takes."""
    assert cli("ask", "--no-save", "--kv-cache-dtype", "int8", "Hi").exit_code == 0
    assert cli.engines[-1].runner.kv_cache.dtype == torch.int8
    result = cli("ask", "--no-save", "--kv-cache-dtype", "fp4", "Hi")
    assert result.exit_code == 2, "a bad setting, as a bad --dtype"
    assert "kv_cache_dtype='fp4' is invalid" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
