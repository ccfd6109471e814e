"""GGUF weights kept quantized (engine/models/quant/): every format's layout and kernels
against `gguf.quants.dequantize` then a float64 matmul, the torch fallback, the bf16 path,
a tiny GGUF loaded quantized end to end (and from the converted-weights cache), the
`weights` setting, and greedy tokens of the default model against the dequantize path."""

from __future__ import annotations

import os
import platform
import shutil
from pathlib import Path

import gguf
import numpy as np
import pytest
import tiny_models
import torch
import torch.nn.functional as F
from tiny_models import PagedSequence, tiny_gguf

from paged_chat.engine import Engine, EngineConfig, SamplingParams
from paged_chat.engine.models.loader import load_model, load_model_source
from paged_chat.engine.models.quant import BLOCK_FORMATS, kernels
from paged_chat.engine.models.quant.layout import QuantizedWeight
from paged_chat.engine.models.quant.linear import QuantizedEmbedding, QuantizedLinear
from paged_chat.engine.models.weight_cache import list_cached_weights
from paged_chat.engine.native import bindings

ROWS = (1, 3, 17, 32)
OUT_FEATURES = 72  # not a multiple of 64, nor of the kernel's 4-row tiles' 64-byte lines
Q = gguf.GGMLQuantizationType


def raw_rows(name: str, out_features: int, in_features: int, seed: int) -> np.ndarray:
    """GGUF bytes of a random [out_features, in_features] tensor in format `name`: quantized
    by gguf where it can, else random blocks with every field valid (finite fp16 scales)."""
    rng = np.random.default_rng(seed)
    qtype = Q[name]
    try:
        return gguf.quants.quantize(rng.standard_normal((out_features, in_features),
                                                        dtype=np.float32), qtype)
    except NotImplementedError:
        block, type_size = gguf.GGML_QUANT_SIZES[qtype]
        blocks = rng.integers(0, 256, (out_features, in_features // block, type_size),
                              dtype=np.uint8)
        fp16 = lambda values: np.asarray(values, np.float16).view(np.uint8)
        scales = rng.uniform(0.005, 0.05, blocks.shape[:2] + (1,))
        if name == "Q6_K":  # ql, qh, int8 scales, then d
            blocks[..., 208:210] = fp16(scales).reshape(*blocks.shape[:2], 2)
        else:  # d, dmin, then the packed 6-bit scales and mins
            blocks[..., 0:2] = fp16(scales).reshape(*blocks.shape[:2], 2)
            blocks[..., 2:4] = fp16(scales / 4).reshape(*blocks.shape[:2], 2)
        return blocks.reshape(out_features, -1)


def quantized(name: str, in_features: int, seed: int = 0) -> tuple[QuantizedWeight, np.ndarray]:
    """A QuantizedWeight of random rows in format `name`, and gguf's float64 dequantization."""
    raw = raw_rows(name, OUT_FEATURES, in_features, seed)
    fmt = BLOCK_FORMATS[name]
    weight = QuantizedWeight.empty(fmt, OUT_FEATURES, in_features)
    weight.fill(*fmt.decode(raw))
    return weight, gguf.quants.dequantize(raw, Q[name]).astype(np.float64)


def relative_error(got: torch.Tensor, expected: np.ndarray) -> float:
    return float(np.abs(got.double().numpy() - expected).max() / np.abs(expected).max())


def in_features_of(name: str) -> int:
    return 512 if name.endswith("_K") else 96  # K-quants come in blocks of 256


@pytest.mark.parametrize("name", sorted(BLOCK_FORMATS))
def test_the_layout_dequantizes_exactly_as_gguf(name):
    weight, expected = quantized(name, in_features_of(name))
    assert np.array_equal(weight.dequantize().numpy(), expected.astype(np.float32))
    assert torch.equal(kernels.dequantize(weight), weight.dequantize())


# The C kernels as built for this machine, the same source without AVX2 (its portable
# loops, what other CPUs run), and none (the torch fallback).
KERNEL_BUILDS = {"native": lambda: bindings.library(),
                 "portable": lambda: bindings.build((["-O3", "-mno-avx2", "-fopenmp"],)),
                 "torch-fallback": lambda: None}


@pytest.mark.parametrize("build", KERNEL_BUILDS)
@pytest.mark.parametrize("name", sorted(BLOCK_FORMATS))
def test_float32_matmul_matches_a_float64_product_of_gguf_weights(name, build, monkeypatch):
    if build == "portable" and platform.machine() != "x86_64":
        pytest.skip("-mno-avx2 is an x86 flag")
    if build != "torch-fallback" and not (os.environ.get("CC") or shutil.which("cc")
                                          or shutil.which("gcc")):
        pytest.skip("no C compiler: every shape runs the torch fallback")
    library = KERNEL_BUILDS[build]()
    assert (library is None) == (build == "torch-fallback"), "the C kernels did not build"
    monkeypatch.setattr(bindings, "library", lambda: library)
    in_features = in_features_of(name)
    weight, dense = quantized(name, in_features)
    layer = QuantizedLinear([weight])
    generator = torch.Generator().manual_seed(1)
    for rows in ROWS:
        x = torch.randn(rows, in_features, generator=generator)
        expected = x.double().numpy() @ dense.T
        assert relative_error(layer(x), expected) < 1e-5, (name, rows)


def poisoned_rows(weight: QuantizedWeight) -> QuantizedWeight:
    """`weight` as rows [1, 1 + rows) of a weight whose first and last rows have NaN scales
    and offsets: a kernel whose row offsets are off by one, or whose mask lets a neighbour
    row into a result, returns NaN."""
    rows, half = weight.low.shape
    groups = weight.scale.shape[1]
    nan_rows = lambda t, fill: torch.cat([torch.full((1, t.shape[1]), fill, dtype=t.dtype), t,
                                          torch.full((1, t.shape[1]), fill, dtype=t.dtype)])
    padded = QuantizedWeight(weight.format, weight.group, nan_rows(weight.low, 255),
                             None if weight.high is None else nan_rows(weight.high, 255),
                             nan_rows(weight.scale, float("nan")),
                             nan_rows(weight.offset, float("nan")))
    assert padded.scale.shape == (rows + 2, groups) and padded.low.shape == (rows + 2, half)
    return padded.narrow(1, rows)


def poisoned_activations(rows: int, in_features: int, dtype: torch.dtype,
                         generator: torch.Generator) -> torch.Tensor:
    """Random x [rows, in_features] in a view whose neighbours in memory are NaN."""
    padded = torch.full((rows + 2, in_features + 2), float("nan"), dtype=dtype)
    inner = padded[1:rows + 1, 1:in_features + 1]
    inner.copy_(torch.randn(rows, in_features, generator=generator))
    return inner


CPU_KERNELS = ("stream_matmul", "gemm_matmul", "tile_matmul")


@pytest.mark.parametrize("kernel", CPU_KERNELS)
@pytest.mark.parametrize("name", ("Q4_0", "Q8_0", "Q6_K"))
def test_each_cpu_kernel_computes_ragged_shapes_and_writes_only_its_columns(name, kernel):
    """Every CPU kernel, whichever shapes `matmul` gives it: 71 weight rows (pc_gemm's
    tiles of 24 and blocks of 3 both end part-way), 1-13 rows of x (its blocks of 4 too),
    neighbour weight rows NaN, into a view of a wider NaN output that must keep its NaNs."""
    if bindings.library() is None:
        pytest.skip("no C compiler: only the torch fallback runs here")
    in_features = in_features_of(name)
    weight, dense = quantized(name, in_features)
    part = poisoned_rows(weight.narrow(0, 71))
    generator = torch.Generator().manual_seed(6)
    for rows in (1, 2, 5, 7, 13):
        x = torch.randn(rows, in_features, generator=generator)
        out = torch.full((rows, 80), float("nan"))
        getattr(kernels, kernel)(x, part, out[:, 4:75])
        assert relative_error(out[:, 4:75], x.double().numpy() @ dense[:71].T) < 1e-5, rows
        assert out[:, :4].isnan().all() and out[:, 75:].isnan().all(), rows


# One format per case the Triton kernels tell apart (the layout makes the rest alike): 4-bit
# codes in groups of 32, 8-bit in groups of 32 and of 16, and a K-quant's K of 512.
TRITON_FORMATS = ("Q4_0", "Q8_0", "Q6_K", "Q4_K")


@pytest.mark.parametrize("name", TRITON_FORMATS)
def test_triton_kernels_match_a_float64_product_of_gguf_weights(name):
    """The GPU kernels (quant/triton_kernels.py), under TRITON_INTERPRET without a GPU:
    the split-K GEMV at 1 and 3 rows, the tl.dot kernel at 17 and 32, against gguf's
    weights and a float64 product, with tiles smaller than the shapes (N = 72 leaves a
    partial tile of rows, K = 96 a partial tile of K of 64) and every input's neighbours NaN.
    fp32 within 1e-5 relative; bf16 activations no worse than 1.5x a bf16 F.linear."""
    triton_kernels = pytest.importorskip(
        "paged_chat.engine.models.quant.triton_dequant",
        reason="the GPU kernels need the triton package (extra 'gpu')")
    in_features = in_features_of(name)
    weight, dense = quantized(name, in_features)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    poisoned = poisoned_rows(weight)
    poisoned = QuantizedWeight(poisoned.format, poisoned.group,
                               *[None if t is None else t.to(device) for t in
                                 (poisoned.low, poisoned.high, poisoned.scale, poisoned.offset)])
    dense_bf16 = torch.from_numpy(dense).to(torch.bfloat16)
    generator = torch.Generator().manual_seed(2)
    for dtype in (torch.float32, torch.bfloat16):
        for rows in ROWS:
            x = poisoned_activations(rows, in_features, dtype, generator)
            expected = x.double().numpy() @ dense.T
            out = torch.full((rows, OUT_FEATURES), float("nan"), dtype=dtype, device=device)
            triton_kernels.matmul(x.to(device), poisoned, out, block_n=32,
                                  block_k=64 if in_features < 256 else 256, block_m=16)
            error = relative_error(out.cpu(), expected)
            if dtype == torch.float32:
                assert error < 1e-5, (name, rows)
            else:
                baseline = relative_error(F.linear(x.contiguous(), dense_bf16), expected)
                assert error <= 1.5 * baseline, (name, rows, error, baseline)


@pytest.mark.parametrize("name", sorted(BLOCK_FORMATS))
def test_bfloat16_activations_lose_no_more_than_a_bfloat16_f_linear(name):
    in_features = in_features_of(name)
    weight, dense = quantized(name, in_features)
    layer = QuantizedLinear([weight])
    dense_bf16 = torch.from_numpy(dense).to(torch.bfloat16)
    generator = torch.Generator().manual_seed(2)
    for rows in ROWS:
        x = torch.randn(rows, in_features, generator=generator).to(torch.bfloat16)
        expected = x.double().numpy() @ dense.T
        ours = layer(x)
        assert ours.dtype == torch.bfloat16
        baseline = relative_error(F.linear(x, dense_bf16), expected)
        assert relative_error(ours, expected) <= 1.5 * baseline, (name, rows)


def test_a_fused_layer_of_two_formats_runs_each_part_into_its_rows():
    """A Q4_K_M file's Q/K (Q4_K) and V (Q6_K) share one fused projection."""
    q4k, dense_q = quantized("Q4_K", 512, seed=3)
    q6k, dense_v = quantized("Q6_K", 512, seed=4)
    layer = QuantizedLinear([q4k, q6k])
    x = torch.randn(5, 512, generator=torch.Generator().manual_seed(5))
    expected = x.double().numpy() @ np.concatenate([dense_q, dense_v]).T
    assert layer.formats == ["Q4_K", "Q6_K"] and layer.out_features == 2 * OUT_FEATURES
    assert relative_error(layer(x), expected) < 1e-5
    assert torch.equal(layer.rows(OUT_FEATURES, 8).low, q6k.low[:8])


@pytest.mark.parametrize("build", KERNEL_BUILDS)
@pytest.mark.parametrize("name", ["Q8_0", "Q4_1", "Q6_K"])
def test_an_embedding_gathers_dequantized_rows_and_ties_the_output_projection(name, build,
                                                                             monkeypatch):
    """One format of each family the C kernels compile for; ids repeated, out of order,
    the first and last rows, of int32 and int64."""
    library = KERNEL_BUILDS[build]()
    monkeypatch.setattr(bindings, "library", lambda: library)
    weight, dense = quantized(name, in_features_of(name))
    embedding = QuantizedEmbedding(weight, torch.float32)
    for ids in (torch.tensor([[3, 0], [weight.rows - 1, 3]]),
                torch.tensor([5, 2], dtype=torch.int32)):
        rows = embedding(ids)
        assert rows.shape == (*ids.shape, weight.in_features)
        assert np.array_equal(rows.numpy(), dense[ids.numpy()].astype(np.float32)), ids
    assert embedding.as_linear().parts[0] is weight


@pytest.mark.parametrize("build", ["native", "torch-fallback"])
def test_an_embedding_refuses_an_id_outside_its_table(build, monkeypatch):
    library = KERNEL_BUILDS[build]()
    monkeypatch.setattr(bindings, "library", lambda: library)
    weight, _ = quantized("Q4_1", 96)
    embedding = QuantizedEmbedding(weight, torch.float32)
    for bad in (weight.rows, -1 - weight.rows):
        with pytest.raises(IndexError):
            embedding(torch.tensor([0, bad]))


def quantized_tiny_gguf(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A tiny llama GGUF whose matrices (embedding and output projection too) are Q4_0,
    Q4_1 and Q8_0 in turn (hidden 64: too narrow for the 256-wide K-quants), written with
    gguf's GGUFWriter."""
    formats = iter([Q.Q4_0, Q.Q4_1, Q.Q8_0] * 8)
    monkeypatch.setattr(tiny_models, "storage_type", lambda name, array, quantize: (
        next(formats) if array.ndim == 2 else Q.F32))
    path, _, _ = tiny_gguf(tmp_path)
    return path


def test_a_tiny_gguf_loads_quantized_end_to_end_and_from_the_cache(tmp_path, monkeypatch):
    path = quantized_tiny_gguf(tmp_path, monkeypatch)
    cache = tmp_path / "cache"
    source = load_model_source(str(path), cache_dir=cache)
    cpu = torch.device("cpu")
    model = load_model(source, torch.float32, cpu, cache, 1 << 30)
    dense = load_model(source, torch.float32, cpu, weights="dequantize")
    layers = model.quantized_layers()
    assert {f for layer in layers.values() for f in layer.formats} == {"Q4_0", "Q4_1", "Q8_0"}
    assert not any(isinstance(m, QuantizedLinear) for m in dense.modules())
    assert model.num_weights() == dense.num_weights()
    assert model.weight_bytes() < dense.weight_bytes() / 2
    [entry] = list_cached_weights(cache / "weights")
    assert entry.quantized == "+".join(model.quantized_formats()) and entry.dtype == "F32"
    cached = load_model(source, torch.float32, cpu, cache, 1 << 30)
    for name, tensor in model.weight_tensors().items():
        assert torch.equal(cached.weight_tensors()[name], tensor), name
    prompt = [1, 5, 9, 2, 7, 3]
    for decoder in (cached, dense):
        decoder.build_rope_tables(16)
    ours, reference = PagedSequence(cached, 16), PagedSequence(dense, 16)
    torch.testing.assert_close(ours.feed(prompt), reference.feed(prompt), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(ours.feed([4]), reference.feed([4]), rtol=1e-4, atol=1e-4)


def test_the_weights_setting_names_its_choices():
    with pytest.raises(ValueError, match=r"EngineConfig.weights='int4' is invalid: expected one "
                                         r"of 'quantized', 'dequantize'"):
        EngineConfig(weights="int4")


PROMPTS = ["The history of the Roman Empire", "def fibonacci(n):",
           "Once upon a time, in a small village,", "The three primary colors are"]


@pytest.mark.slow
def test_greedy_tokens_of_the_default_model_equal_the_dequantize_path(smollm2_source):
    """Teacher-forced: the dequantized model's argmax after every prefix of the quantized
    engine's output is its next token; a flip is reported with the dequantized logits'
    margin at that step."""
    engine = Engine(EngineConfig(device="cpu", dtype="float32", num_blocks=128,
                                 kv_cache_dtype="auto"),
                    source=smollm2_source)
    assert engine.info.weights.startswith("Q4_1+Q8_0, ")
    outputs = engine.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=32,
                                                      ignore_eos=True))
    dense = load_model(smollm2_source, torch.float32, torch.device("cpu"), weights="dequantize")
    dense.build_rope_tables(256)
    for prompt, output in zip(PROMPTS, outputs):
        ids = engine.tokenizer.encode(prompt)
        logits = PagedSequence(dense, len(ids) + 32).feed(ids + output.token_ids)
        logits = logits[len(ids) - 1:-1]
        expected = logits.argmax(-1).tolist()
        flips = [(step, float(logits[step, expected[step]] - logits[step, token]))
                 for step, token in enumerate(output.token_ids) if token != expected[step]]
        assert not flips, f"{prompt!r}: flipped at (step, dequantized margin) {flips}"


def test_what_is_held_is_counted_and_fingerprinted_as_held(tmp_path, monkeypatch):
    """The header-only estimate `paged-chat models` shows is the bytes a load holds, and
    the KV tier's fingerprint sees the quantized weights (a cache of KV computed with them
    is not the dequantized model's)."""
    from paged_chat.engine.kv.tier import model_fingerprint
    from paged_chat.engine.models.quant import held_nbytes

    source = load_model_source(str(quantized_tiny_gguf(tmp_path, monkeypatch)))
    model = load_model(source, torch.float32, torch.device("cpu"))
    dense = load_model(source, torch.float32, torch.device("cpu"), weights="dequantize")
    estimate = sum(held_nbytes(t.dtype, t.shape) or 0 for t in source.checkpoint.tensors.values())
    assert estimate == sum(layer.nbytes for layer in model.quantized_layers().values())
    assert model_fingerprint(model.weight_tensors()) != model_fingerprint(dense.weight_tensors())
    assert sorted(model.held_formats().split("+")) == ["Q4_0", "Q4_1", "Q8_0"]
    assert dense.held_formats() == "float32"


def test_auto_dtype_runs_quantized_weights_in_float32_on_a_bf16_cpu(tmp_path, monkeypatch,
                                                                    tiny_model_dir):
    """On a CPU with bf16 dot products (AVX512-BF16, AMX), "auto" chose bf16 for every model:
    a quantized GGUF then converted its activations around each layer and lost the fused
    float32 step (1.6-1.8x slower on a Sapphire Rapids). It runs float32 now; an HF folder,
    whose dense weights bf16 halves, stays bf16; "dequantize" reads the GGUF dense."""
    from paged_chat.engine.core import dtypes

    monkeypatch.setattr(dtypes, "_cpu_has_native_bf16", lambda: True)
    config = dict(device="cpu", dtype="auto", num_blocks=16)
    quantized = Engine(EngineConfig(model=str(quantized_tiny_gguf(tmp_path, monkeypatch)), **config))
    assert quantized.info.dtype == "float32"
    dequantized = Engine(EngineConfig(model=quantized.config.model, weights="dequantize", **config))
    assert dequantized.info.dtype == "bfloat16"
    assert Engine(EngineConfig(model=str(tiny_model_dir), **config)).info.dtype == "bfloat16"
