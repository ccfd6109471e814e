"""The device check's engine stages (benchmarks/device_check.py runs them first): the engine
through its public API (Engine, EngineConfig, SamplingParams, stats()) against transformers
on the same random weights, CUDA graphs against eager, the default configuration, sampling,
prefix hits and preemption, a step roofline, and transformers' continuous batching as the peer.

Every stage returns a dict whose "checks" list holds {"check", "ok", ...} entries: the
driver's verdict reads them, and a stage that makes none fails. Top-1 agreement with
transformers counts only the positions where the reference is clear of rounding
(CLEAR_MARGIN).
"""

from __future__ import annotations

import copy
import functools
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Self

import torch

from paged_chat.engine import Engine, EngineConfig, SamplingParams


@dataclass(frozen=True)
class ModelShape:
    """A decoder built with transformers from random weights: its config, and the init's
    spread (larger gives tiny models clearer preferences; deep ones turn chaotic)."""

    name: str
    hf: dict[str, Any]
    initializer_range: float = 0.02


DEFAULT_MODEL_SHAPE = ModelShape("smollm2-135m-shape", {
    "model_type": "llama", "vocab_size": 49152, "hidden_size": 576, "intermediate_size": 1536,
    "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
    "head_dim": 64, "rms_norm_eps": 1e-5, "rope_theta": 100000.0,
    "max_position_embeddings": 8192, "tie_word_embeddings": True})
GEMMA3_SHAPE = ModelShape("gemma3-d256-window32", {
    "model_type": "gemma3_text", "vocab_size": 8192, "hidden_size": 512,
    "intermediate_size": 1024, "num_hidden_layers": 4, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 256, "query_pre_attn_scalar": 256,
    "sliding_window": 32, "max_position_embeddings": 4096,
    "layer_types": ["sliding_attention", "full_attention"] * 2})
TINY_LLAMA_SHAPE = ModelShape("tiny-llama", {
    "model_type": "llama", "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "head_dim": 16, "max_position_embeddings": 1024, "tie_word_embeddings": True},
    initializer_range=0.25)
TINY_GEMMA3_SHAPE = ModelShape("tiny-gemma3-d256-window8", {
    "model_type": "gemma3_text", "vocab_size": 512, "hidden_size": 64,
    "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 2,
    "num_key_value_heads": 1, "head_dim": 256, "query_pre_attn_scalar": 256,
    "sliding_window": 8, "max_position_embeddings": 1024,
    "layer_types": ["sliding_attention", "full_attention"]}, initializer_range=0.25)

# A position counts for top-1 agreement when the fp32 reference's top two logits differ by
# more than this fraction of the top one: 4 bf16 ulps for bf16; a 16th of that for fp32
# (exact arithmetic in another order). Random weights tie often: at the default model's
# shape transformers' own bf16 picks its fp32 argmax at ~95% of all positions, and at every
# clear one.
CLEAR_MARGIN = {"bfloat16": 2.0 ** -6, "float32": 2.0 ** -10}
MIN_AGREEMENT = {"bfloat16": 0.99, "float32": 1.0}
# fp32 logprobs of the chosen tokens against transformers': exact arithmetic in another
# order (the Triton kernels multiply fp32 in ieee, not tf32).
FP32_LOGPROB_TOLERANCE = 2e-3
# A reference with fewer clear positions than this says nothing about agreement.
MIN_CLEAR_FRACTION = 0.25
# The figures for the default model in bf16 on an H200.
TARGET_TOKENS_PER_S = {1: 1_000, 256: 60_000}


@dataclass(frozen=True)
class EnginePlan:
    """How much the engine stages do: the GPU run, or the CPU dry run at toy sizes."""

    device: str
    attention_backend: str
    reference_shapes: tuple[ModelShape, ...]
    model_shape: ModelShape                     # the graph, default, sampling and peer stages'
    prompts: int
    prompt_lens: tuple[int, int]
    max_tokens: int
    graph_batches: tuple[int, ...]
    num_blocks: int
    default_steps: int
    default_overrides: dict[str, Any] = field(default_factory=dict)
    throughput_batches: tuple[int, ...] = (1,)
    throughput_context: int = 16
    throughput_tokens: int = 4
    peer_batch: int = 2
    peer_prompt_len: int = 8
    peer_tokens: int = 4
    empty_kernel_launches: int = 100
    # The peer's KV cache and batch (ContinuousBatchingConfig); empty: its own sizing.
    peer_cache: dict[str, int] = field(default_factory=dict)


GPU_ENGINE_PLAN = EnginePlan(
    device="cuda", attention_backend="triton",
    reference_shapes=(DEFAULT_MODEL_SHAPE, GEMMA3_SHAPE), model_shape=DEFAULT_MODEL_SHAPE,
    prompts=8, prompt_lens=(20, 200), max_tokens=32, graph_batches=(1, 8, 32),
    num_blocks=4096, default_steps=64,
    throughput_batches=(1, 256), throughput_context=1024, throughput_tokens=64,
    peer_batch=64, peer_prompt_len=512, peer_tokens=64, empty_kernel_launches=2000)
DRY_ENGINE_PLAN = EnginePlan(
    device="cpu", attention_backend="torch",
    reference_shapes=(TINY_LLAMA_SHAPE, TINY_GEMMA3_SHAPE), model_shape=TINY_LLAMA_SHAPE,
    prompts=2, prompt_lens=(10, 24), max_tokens=4, graph_batches=(1, 3),
    num_blocks=64, default_steps=8,
    default_overrides={"kv_cache_memory": "4MiB", "kv_tier_host_bytes": "1MiB"},
    throughput_batches=(1, 2), peer_cache={"num_blocks": 16, "max_batch_tokens": 64})


def check(name: str, ok: bool, **detail: Any) -> dict[str, Any]:
    return {"check": name, "ok": bool(ok), **detail}


# ---- models ----------------------------------------------------------------------------


class RandomModel:
    """A ModelShape built with transformers from seeded random weights and saved as an HF
    folder (with a word-level tokenizer of its vocabulary) that the engine loads as any
    other; `reference(dtype)` is transformers' model on the device in that dtype."""

    def __init__(self, shape: ModelShape, device: str) -> None:
        import transformers
        from tokenizers import Tokenizer
        from tokenizers.models import WordLevel
        from tokenizers.pre_tokenizers import WhitespaceSplit

        self.shape, self.device = shape, torch.device(device)
        self._scratch = tempfile.TemporaryDirectory(prefix="device-check-")  # removed with it
        self.folder = Path(self._scratch.name) / shape.name
        hf = dict(shape.hf)
        config = transformers.AutoConfig.for_model(
            hf.pop("model_type"), **hf, initializer_range=shape.initializer_range,
            bos_token_id=1, eos_token_id=2, pad_token_id=0)
        torch.manual_seed(0)
        self._model = transformers.AutoModelForCausalLM.from_config(config).eval()
        self._model.save_pretrained(self.folder)
        words = Tokenizer(WordLevel({f"t{i}": i for i in range(config.vocab_size)},
                                    unk_token="t0"))
        words.pre_tokenizer = WhitespaceSplit()
        transformers.PreTrainedTokenizerFast(
            tokenizer_object=words, bos_token="t1", eos_token="t2", pad_token="t0",
        ).save_pretrained(self.folder)
        self.vocab_size = config.vocab_size
        self.kv_elements_per_token = 2 * config.num_hidden_layers * config.num_key_value_heads * (
            getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)

    @functools.cache  # noqa: B019 - one copy per dtype for the model's lifetime, on purpose
    def reference(self, dtype: torch.dtype) -> Any:
        return copy.deepcopy(self._model).to(self.device, dtype)

    def config(self, plan: EnginePlan, dtype: str, **overrides: Any) -> EngineConfig:
        # The KV pool in the model's dtype: the checks hold the engine to transformers'
        # numbers, which a narrower pool (the CPU's bf16 default) only approaches.
        return EngineConfig(**({"model": str(self.folder), "device": plan.device, "dtype": dtype,
                                "kv_cache_dtype": "auto", "num_blocks": plan.num_blocks,
                                "attention_backend": plan.attention_backend,
                                "max_num_seqs": max(plan.graph_batches),
                                "kv_tier_disk_bytes": 0} | overrides))

    def prompts(self, count: int, lens: tuple[int, int], seed: int = 0) -> list[list[int]]:
        generator = torch.Generator().manual_seed(seed)
        low, high = lens
        return [torch.randint(3, self.vocab_size, (int(n),), generator=generator).tolist()
                for n in torch.randint(low, high + 1, (count,), generator=generator)]


_MODELS: dict[tuple[str, str], RandomModel] = {}


def random_model(shape: ModelShape, device: str) -> RandomModel:
    """Each shape built once a run."""
    if (shape.name, device) not in _MODELS:
        _MODELS[shape.name, device] = RandomModel(shape, device)
    return _MODELS[shape.name, device]


def release(device: str) -> None:
    import gc

    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


def synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


# ---- stage: transformers ---------------------------------------------------------------


def transformers_stage(plan: EnginePlan) -> dict[str, Any]:
    """Per reference shape and dtype (fp32, bf16): the engine's greedy tokens, each against
    transformers' fp32 argmax on the same prefix (teacher-forced), over the positions
    whose reference margin is clear; in fp32 also the chosen tokens' logprobs. transformers'
    own bf16 is measured beside ours."""
    results: dict[str, Any] = {"checks": []}
    for shape in plan.reference_shapes:
        model = random_model(shape, plan.device)
        for dtype in ("float32", "bfloat16"):
            entry = compare_with_transformers(plan, model, dtype)
            results[f"{shape.name} {dtype}"] = entry
            results["checks"] += [c | {"model": shape.name, "dtype": dtype}
                                  for c in entry.pop("checks")]
            release(plan.device)
    return results


def compare_with_transformers(plan: EnginePlan, model: RandomModel, dtype: str) -> dict[str, Any]:
    engine = Engine(model.config(plan, dtype))
    prompts = model.prompts(plan.prompts, plan.prompt_lens)
    params = SamplingParams(temperature=0.0, max_tokens=plan.max_tokens, ignore_eos=True,
                            logprobs=True)
    outputs = engine.generate(prompts, params)
    del engine
    release(plan.device)
    reference = model.reference(torch.float32)
    agree = clear = positions = 0
    worst_logprob = 0.0
    with torch.inference_mode():
        for prompt, output in zip(prompts, outputs):
            ids = torch.tensor(prompt + output.token_ids, device=plan.device)
            logits = reference(ids[None]).logits[0, len(prompt) - 1:-1].float()
            ours = torch.tensor(output.token_ids, device=plan.device)
            top2 = logits.topk(2, dim=-1).values
            is_clear = (top2[:, 0] - top2[:, 1]) > CLEAR_MARGIN[dtype] * top2[:, 0].abs()
            agree += int(((logits.argmax(-1) == ours) & is_clear).sum())
            clear += int(is_clear.sum())
            positions += len(ours)
            expected = logits.log_softmax(-1).gather(1, ours[:, None]).squeeze(1)
            logprobs = torch.tensor([lp.logprob for lp in output.logprobs], device=plan.device)
            worst_logprob = max(worst_logprob, float((logprobs - expected).abs().max()))
    entry: dict[str, Any] = {
        "positions": positions, "clear_positions": clear,
        "top1_agreement": round(agree / max(clear, 1), 4),
        "max_logprob_error": round(worst_logprob, 6)}
    if dtype == "bfloat16":
        entry["transformers_bf16_top1_agreement"] = transformers_bf16_agreement(
            plan, model, prompts, outputs)
    entry["checks"] = [
        check("reference has clear preferences", clear >= MIN_CLEAR_FRACTION * positions,
              clear_fraction=round(clear / max(positions, 1), 3)),
        check(f"top-1 agreement >= {MIN_AGREEMENT[dtype]:.0%}",
              agree >= MIN_AGREEMENT[dtype] * clear, agreement=entry["top1_agreement"])]
    if dtype == "float32":
        entry["checks"].append(check(f"logprobs within {FP32_LOGPROB_TOLERANCE}",
                                     worst_logprob <= FP32_LOGPROB_TOLERANCE,
                                     max_error=entry["max_logprob_error"]))
    return entry


def transformers_bf16_agreement(plan: EnginePlan, model: RandomModel, prompts: list[list[int]],
                                outputs: list[Any]) -> float:
    """transformers' bf16 argmax against its fp32 one on our sequences, at the clear
    positions: what rounding alone leaves of agreement."""
    sequences = [torch.tensor(p + o.token_ids, device=plan.device) for p, o in zip(prompts, outputs)]
    with torch.inference_mode():
        fp32 = [model.reference(torch.float32)(s[None]).logits[0].float() for s in sequences]
        bf16 = [model.reference(torch.bfloat16)(s[None]).logits[0].float() for s in sequences]
    agree = clear = 0
    for prompt, ref, ours in zip(prompts, fp32, bf16):
        ref, ours = ref[len(prompt) - 1:-1], ours[len(prompt) - 1:-1]
        top2 = ref.topk(2, dim=-1).values
        is_clear = (top2[:, 0] - top2[:, 1]) > CLEAR_MARGIN["bfloat16"] * top2[:, 0].abs()
        agree += int(((ref.argmax(-1) == ours.argmax(-1)) & is_clear).sum())
        clear += int(is_clear.sum())
    return round(agree / max(clear, 1), 4)


# ---- stage: graphs -----------------------------------------------------------------------


class GraphReplays:
    """Counts CUDA graph replays (any graph, through torch's public CUDAGraph.replay); none
    off CUDA."""

    def __init__(self, device: str) -> None:
        self.device = device
        self.count = 0

    def __enter__(self) -> Self:
        if self.device != "cuda":
            return self
        self._original = torch.cuda.CUDAGraph.replay
        counter = self

        def replay(graph: torch.cuda.CUDAGraph) -> None:
            counter.count += 1
            counter._original(graph)

        torch.cuda.CUDAGraph.replay = replay
        return self

    def __exit__(self, *exc: object) -> None:
        if self.device == "cuda":
            torch.cuda.CUDAGraph.replay = self._original


def staggered_tokens(engine: Engine, prompts: list[list[int]], params: SamplingParams
                     ) -> tuple[list[list[int]], list[float]]:
    """Half the prompts first, the rest two steps later (steps that prefill some requests
    while others decode); each request's tokens, and the wall ms of every decode-only step."""
    tokens: dict[str, list[int]] = {}
    first = (len(prompts) + 1) // 2
    ids = [engine.add_request(p, params) for p in prompts[:first]]
    decode_ms: list[float] = []
    steps = 0
    while engine.has_unfinished() or len(ids) < len(prompts):
        if steps == 2:
            ids += [engine.add_request(p, params) for p in prompts[first:]]
        synchronize(engine.device.type)
        start = time.perf_counter()
        outputs = engine.step()
        synchronize(engine.device.type)
        stats = engine.stats()
        if stats.batch_tokens and stats.batch_tokens == stats.batch_size:
            decode_ms.append((time.perf_counter() - start) * 1e3)
        for output in outputs:
            tokens.setdefault(output.request_id, []).extend(output.new_token_ids)
        steps += 1
    return [tokens[i] for i in ids], decode_ms


def graphs_stage(plan: EnginePlan) -> dict[str, Any]:
    """Greedy tokens with CUDA graphs on against eager, in fp32 (exact arithmetic: any
    difference is a bug, not rounding), at each batch of the plan, arrivals staggered so
    steps mix prefill and decode; on CUDA the graphs must have replayed."""
    model = random_model(plan.model_shape, plan.device)
    results: dict[str, Any] = {"checks": []}
    params = SamplingParams(temperature=0.0, max_tokens=plan.max_tokens, ignore_eos=True)
    runs: dict[bool, dict[int, tuple[list[list[int]], list[float]]]] = {}
    replays = 0
    for eager in (True, False):
        engine = Engine(model.config(plan, "float32", enforce_eager=eager))
        with GraphReplays(plan.device) as counter:
            runs[eager] = {batch: staggered_tokens(engine, model.prompts(
                batch, plan.prompt_lens, seed=batch), params) for batch in plan.graph_batches}
        replays = replays if eager else counter.count
        del engine
        release(plan.device)
    for batch in plan.graph_batches:
        (eager_tokens, eager_ms), (graph_tokens, graph_ms) = runs[True][batch], runs[False][batch]
        same = sum(a == b for a, b in zip(eager_tokens, graph_tokens))
        results[f"batch {batch}"] = {
            "identical": same, "of": batch,
            "decode_step_ms_eager": round(statistics.median(eager_ms), 3) if eager_ms else None,
            "decode_step_ms_graphs": round(statistics.median(graph_ms), 3) if graph_ms else None}
        results["checks"].append(check(f"graphs == eager at batch {batch}", same == batch,
                                       identical=same, of=batch))
    results["graph_replays"] = replays
    if plan.device == "cuda":
        results["checks"].append(check("CUDA graphs replayed", replays > 0, replays=replays))
    return results


# ---- stage: the default configuration --------------------------------------------------


def default_config_stage(plan: EnginePlan) -> dict[str, Any]:
    """The engine as a user starts it (auto sizing at gpu_memory_utilization 0.9, dtype
    auto, the host KV tier on) for `default_steps` steps of requests that share a prefix
    and finish (their blocks go down to the tier), stats() after every step."""
    model = random_model(plan.model_shape, plan.device)
    start = time.perf_counter()
    engine = Engine(EngineConfig(model=str(model.folder), device=plan.device,
                                 **plan.default_overrides))
    startup_s = time.perf_counter() - start
    shared = model.prompts(1, (3 * engine.block_size, 3 * engine.block_size), seed=1)[0]
    tails = model.prompts(4 * plan.prompts, plan.prompt_lens, seed=2)
    params = SamplingParams(temperature=0.0, max_tokens=plan.max_tokens, ignore_eos=True)
    errors, stats_ms, step_ms = [], [], []
    steps = 0
    stats = engine.stats()
    while steps < plan.default_steps:
        if not engine.has_unfinished():
            for tail in tails[:plan.prompts]:
                engine.add_request(shared + tail, params)
            tails = tails[plan.prompts:] + tails[:plan.prompts]
        start = time.perf_counter()
        outputs = engine.step()
        synchronize(plan.device)
        step_ms.append((time.perf_counter() - start) * 1e3)
        errors += [o.error for o in outputs if o.error]
        start = time.perf_counter()
        stats = engine.stats()
        stats_ms.append((time.perf_counter() - start) * 1e3)
        steps += 1
    tier = stats.tier
    result = {
        "startup_s": round(startup_s, 2), "num_blocks": engine.num_blocks,
        "dtype": engine.info.dtype, "steps": steps,
        "step_ms_median": round(statistics.median(step_ms), 3),
        "stats_ms_median": round(statistics.median(stats_ms), 3),
        "stats_ms_max": round(max(stats_ms), 3),
        "prefix_cache_hit_tokens": stats.prefix_cache_hit_tokens,
        "tier_host_capacity_bytes": tier.host_capacity_bytes, "tier_host_blocks": tier.host_blocks,
        "generation_tokens_total": stats.generation_tokens_total}
    engine.close()
    del engine
    release(plan.device)
    result["checks"] = [
        check(f"{plan.default_steps} steps without an error", not errors, errors=errors[:3]),
        check("stats() counts the pool", stats.num_blocks == result["num_blocks"]),
        check("tokens generated", result["generation_tokens_total"] > 0),
        check("the host KV tier is on", tier.host_capacity_bytes > 0),
        check("the prefix cache hit the shared prefix", stats.prefix_cache_hit_tokens > 0)]
    return result


# ---- stage: sampling, prefix hits, preemption -------------------------------------------


def sampling_stage(plan: EnginePlan) -> dict[str, Any]:
    """Non-greedy sampling (the chat defaults and a wider one) reproducible by seed and
    changed by it; a prefix hit that gives the same tokens as the cold run; preemption in
    a pool too small for the batch, with the tokens of an unconstrained pool (fp32)."""
    model = random_model(plan.model_shape, plan.device)
    engine = Engine(model.config(plan, "float32"))
    prompts = model.prompts(plan.prompts, plan.prompt_lens)
    checks = []
    for name, options in (("chat defaults", {"temperature": 0.2, "top_p": 0.9}),
                          ("wide", {"temperature": 1.0, "top_p": 0.95, "top_k": 50,
                                    "min_p": 0.01})):
        first, again, other = (seeded_tokens(engine, prompts, plan, seed, options)
                               for seed in (7, 7, 8))
        checks += [check(f"sampling ({name}) reproducible by seed", first == again),
                   check(f"sampling ({name}) tokens in the vocabulary",
                         all(0 <= t < model.vocab_size for seq in first for t in seq))]
        if name == "wide":
            checks.append(check("sampling (wide) changes with the seed", first != other))
    greedy = SamplingParams(temperature=0.0, max_tokens=plan.max_tokens, ignore_eos=True)
    long_prompt = model.prompts(1, (4 * engine.block_size, 4 * engine.block_size), seed=3)[0]
    cold = engine.generate([long_prompt], greedy)[0]
    warm = engine.generate([long_prompt], greedy)[0]
    checks += [check("prefix hit", (warm.num_cached_tokens or 0) >= 3 * engine.block_size,
                     cached=warm.num_cached_tokens),
               check("prefix hit gives the cold run's tokens", warm.token_ids == cold.token_ids)]
    # Prompts one token short of two blocks, replies past a block: the pool holds every
    # prompt but not every reply, so decodes must preempt.
    bs, count = engine.block_size, 2 * plan.prompts
    batch = model.prompts(count, (2 * bs - 1, 2 * bs - 1), seed=4)
    growing = SamplingParams(temperature=0.0, max_tokens=bs + 2, ignore_eos=True)
    expected = [o.token_ids for o in engine.generate(batch, growing)]
    del engine
    release(plan.device)
    small = Engine(model.config(plan, "float32", num_blocks=2 * count + count // 2,
                                max_num_seqs=count, enable_prefix_caching=False))
    preempted = [o.token_ids for o in small.generate(batch, growing)]
    preemptions = small.stats().num_preemptions
    del small
    release(plan.device)
    checks += [check("preemption happened", preemptions > 0, preemptions=preemptions),
               check("preempted requests give the same tokens", preempted == expected)]
    return {"checks": checks}


def seeded_tokens(engine: Engine, prompts: list[list[int]], plan: EnginePlan, seed: int,
                  options: dict[str, Any]) -> list[list[int]]:
    params = SamplingParams(max_tokens=plan.max_tokens, ignore_eos=True, seed=seed, **options)
    return [o.token_ids for o in engine.generate(prompts, params)]


# ---- stage: throughput and the step roofline --------------------------------------------


def empty_kernel_us(plan: EnginePlan) -> dict[str, float]:
    """One empty kernel's cost: launched one by one from the host, and replayed back to back
    from a CUDA graph (the floor of a graphed step's kernels)."""
    x = torch.zeros(1, device=plan.device)
    n = plan.empty_kernel_launches
    synchronize(plan.device)
    start = time.perf_counter()
    for _ in range(n):
        x.add_(1)
    synchronize(plan.device)
    result = {"launched_us": round((time.perf_counter() - start) / n * 1e6, 2)}
    if plan.device == "cuda":
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(n):
                x.add_(1)
        graph.replay()
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        result["graphed_us"] = round(begin.elapsed_time(end) / n * 1e3, 3)
    return result


def kernels_per_step(engine: Engine, plan: EnginePlan) -> int:
    """Kernels (on CUDA) or operators (on the CPU) one engine step runs, by torch's profiler."""
    from torch.profiler import ProfilerActivity, profile

    activity = ProfilerActivity.CUDA if plan.device == "cuda" else ProfilerActivity.CPU
    with profile(activities=[activity]) as profiler:
        engine.step()
        synchronize(plan.device)
    if plan.device == "cuda":
        return sum(1 for e in profiler.events() if e.device_type == torch.autograd.DeviceType.CUDA)
    return sum(1 for e in profiler.events() if e.name.startswith("aten::"))


def throughput_stage(plan: EnginePlan, copy_gb_per_s: float | None) -> dict[str, Any]:
    """bf16, CUDA graphs on, the GPU defaults (max_num_seqs 256, 8192 batched tokens): the
    decode step's wall time and tokens/s at each batch over contexts of
    `throughput_context` tokens, beside its roofline: the kernels of an eager decode step
    times an empty kernel's time, and the bytes a step must read (weights, K/V) over the
    copy bandwidth. On CUDA, the issue's figures are checks."""
    model = random_model(plan.model_shape, plan.device)
    result: dict[str, Any] = {"empty_kernel": empty_kernel_us(plan), "checks": []}
    max_batch = max(plan.throughput_batches)
    context = plan.throughput_context + plan.throughput_tokens
    blocks = max_batch * -(-context // 16) + 64
    for eager in (True, False):
        engine = Engine(model.config(plan, "bfloat16", num_blocks=blocks, max_num_seqs=max_batch,
                                     max_num_batched_tokens=max(8192, plan.throughput_context),
                                     enforce_eager=eager))
        for batch in plan.throughput_batches:
            prompts = model.prompts(batch, (plan.throughput_context,) * 2, seed=batch)
            params = SamplingParams(temperature=0.0, max_tokens=plan.throughput_tokens,
                                    ignore_eos=True)
            for prompt in prompts:
                engine.add_request(prompt, params)
            while engine.has_unfinished() and (engine.stats().batch_size != batch
                                               or engine.stats().batch_tokens != batch):
                engine.step()  # until every prompt is in and each step decodes them all
            key = f"batch {batch} {'eager' if eager else 'graphs'}"
            if eager:
                result[key] = {"kernels_per_step": kernels_per_step(engine, plan)}
            times = []  # steps that decode the whole batch (early requests finish first)
            while engine.has_unfinished():
                synchronize(plan.device)
                start = time.perf_counter()
                engine.step()
                synchronize(plan.device)
                if engine.stats().batch_tokens == batch:
                    times.append(time.perf_counter() - start)
            step_s = statistics.median(times)
            weight_bytes = engine.info.weight_bytes
            kv_bytes = (batch * (plan.throughput_context + plan.throughput_tokens // 2)
                        * model.kv_elements_per_token * 2)  # bf16
            entry = result.setdefault(key, {})
            entry |= {"step_ms": round(step_s * 1e3, 3),
                      "tokens_per_s": round(batch / step_s, 1),
                      "bytes_per_step": weight_bytes + kv_bytes}
            if copy_gb_per_s:
                entry["bytes_floor_ms"] = round((weight_bytes + kv_bytes) / copy_gb_per_s / 1e6, 4)
        del engine
        release(plan.device)
    for batch in plan.throughput_batches:
        graphs, eager = result[f"batch {batch} graphs"], result[f"batch {batch} eager"]
        per_kernel_us = result["empty_kernel"].get("graphed_us", result["empty_kernel"]["launched_us"])
        graphs["kernels_floor_ms"] = round(eager["kernels_per_step"] * per_kernel_us / 1e3, 4)
        target = TARGET_TOKENS_PER_S.get(batch)
        if plan.device == "cuda" and target:
            result["checks"].append(check(f"batch {batch} >= {target} tokens/s",
                                          graphs["tokens_per_s"] >= target,
                                          tokens_per_s=graphs["tokens_per_s"]))
    result["checks"].append(check("every batch ran", all(
        result[f"batch {b} graphs"]["tokens_per_s"] > 0 for b in plan.throughput_batches)))
    return result


# ---- stage: the peer -------------------------------------------------------------------


def peer_stage(plan: EnginePlan) -> dict[str, Any]:
    """Our engine and transformers' continuous batching (`generate_batch`, where the
    installed transformers has it) on one workload, greedy in bf16: tokens/s of each. The
    peer's own failure is reported, not counted against us."""
    model = random_model(plan.model_shape, plan.device)
    prompts = model.prompts(plan.peer_batch, (plan.peer_prompt_len,) * 2, seed=5)
    engine = Engine(model.config(plan, "bfloat16", max_num_seqs=plan.peer_batch,
                                 enforce_eager=False))
    params = SamplingParams(temperature=0.0, max_tokens=plan.peer_tokens, ignore_eos=True)
    engine.generate(prompts[:1], SamplingParams(max_tokens=2))
    synchronize(plan.device)
    start = time.perf_counter()
    outputs = engine.generate(prompts, params)
    synchronize(plan.device)
    ours_s = time.perf_counter() - start
    produced = sum(len(o.token_ids) for o in outputs)
    del engine
    release(plan.device)
    result: dict[str, Any] = {
        "workload": f"{plan.peer_batch} x {plan.peer_prompt_len}-token prompts, "
                    f"{plan.peer_tokens} tokens each",
        "ours_tokens_per_s": round(produced / ours_s, 1)}
    result["transformers"] = transformers_continuous_batching(model, prompts, plan)
    result["checks"] = [check("our engine produced every token",
                              produced == plan.peer_batch * plan.peer_tokens)]
    return result


def transformers_continuous_batching(model: RandomModel, prompts: list[list[int]],
                                     plan: EnginePlan) -> dict[str, Any]:
    from transformers import GenerationConfig

    reference = model.reference(torch.bfloat16)
    if not hasattr(reference, "generate_batch"):
        return {"error": "this transformers has no generate_batch"}
    options: dict[str, Any] = {"generation_config": GenerationConfig(
        max_new_tokens=plan.peer_tokens, do_sample=False, eos_token_id=-1, pad_token_id=0)}
    if plan.peer_cache:
        from transformers.generation.configuration_utils import ContinuousBatchingConfig

        options["continuous_batching_config"] = ContinuousBatchingConfig(**plan.peer_cache)
    try:
        reference.generate_batch(inputs=prompts[:1], **options)
        synchronize(plan.device)
        start = time.perf_counter()
        outputs = reference.generate_batch(inputs=prompts, **options)
        synchronize(plan.device)
        elapsed = time.perf_counter() - start
    except Exception as error:  # noqa: BLE001 - the peer's failure is a result here
        return {"error": f"{type(error).__name__}: {str(error)[:200]}"}
    produced = sum(len(o.generated_tokens) for o in outputs.values())
    return {"tokens_per_s": round(produced / elapsed, 1), "tokens": produced}
