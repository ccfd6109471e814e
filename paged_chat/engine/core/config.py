"""EngineConfig: every knob of the engine, validated when it is made."""

from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import dataclass

DEVICES = ("auto", "cpu", "cuda")
DTYPES = ("auto", "float32", "bfloat16", "float16")
KV_CACHE_DTYPES = ("auto", "bfloat16", "int8")
ATTENTION_BACKENDS = ("auto", "torch", "triton", "cpu")
WEIGHTS = ("quantized", "dequantize")
_BLOCK_SIZES = (8, 16, 32, 64, 128)
# What `max_num_seqs`, `max_num_batched_tokens` and `enforce_eager` are where left unset: a
# CPU step's cost grows with every token of its batch, so it keeps batches chat-sized; a GPU
# step costs about the same from one row to hundreds, so it takes vLLM's batch sizes, and
# replays CUDA graphs (the runner falls back to eager, saying so, when they fail).
DEVICE_DEFAULTS = {
    "cpu": {"max_num_seqs": 32, "max_num_batched_tokens": 512, "enforce_eager": True,
            "kv_cache_dtype": "bfloat16"},
    "cuda": {"max_num_seqs": 256, "max_num_batched_tokens": 8192, "enforce_eager": False,
             "kv_cache_dtype": "auto"},
}
_MEMORY_UNITS = {"": 1, "b": 1, "k": 2**10, "kb": 10**3, "kib": 2**10, "m": 2**20,
                 "mb": 10**6, "mib": 2**20, "g": 2**30, "gb": 10**9, "gib": 2**30}


@dataclass(slots=True)
class EngineConfig:
    """Configuration of one Engine.

    The KV pool is `num_blocks` blocks of `block_size` tokens. Leave `num_blocks` unset to
    size it from `kv_cache_memory` (CPU; bytes or "2GiB"; default a capped fraction of free
    RAM) or from `gpu_memory_utilization` (CUDA: the fraction of the card this process may
    use, KV pool included).

    `cache_dir` is where the engine may keep what it can rebuild (converted tokenizers and
    weights, the disk KV tier); None keeps nothing on disk. The app passes its platformdirs
    cache dir: the engine never reads the app's settings itself.
    `weight_cache_size` bounds the converted GGUF weights kept there (bytes or "4GiB";
    least recently used models go first).

    `weights` is how a GGUF's weights are held: "quantized" keeps Q4_0/Q4_1/Q5_0/Q5_1/Q8_0/Q4_K/
    Q5_K/Q6_K tensors in their format (CPU; engine/models/quant/), "dequantize" converts
    every weight to `dtype`. HF folders are always read in `dtype`.

    Below the prefix cache, a KV tier keeps full blocks' KV past their eviction and past
    the process: `kv_tier_disk_bytes` (bytes or "4GiB"; 0 turns it off) bounds the disk
    tier under `<cache_dir>/kv-tier` (no cache_dir: no disk tier), `kv_tier_host_bytes`
    a host-RAM tier in front of it (default: none on CPU, where the pool is RAM already;
    2 GiB on CUDA). Both need `enable_prefix_caching`.

    `threads` is the number of torch threads a step runs on, at most the machine's cores
    (os.cpu_count()); None or "auto" starts from the cores this process may use and adapts
    when other processes compete for them (engine/worker/threads.py).

    `fused_ops` runs the decoder's pointwise work as fused kernels: on the CPU in float32 as
    C kernels (residual add + RMSNorm, RoPE in place, SiLU-and-mul: engine/models/fused_ops.py)
    where a C compiler builds them; on CUDA with the Triton backend as Triton kernels (the
    same, RoPE with the K/V store: engine/models/triton_fused_ops.py). False keeps the torch
    ops (the reference).

    `enforce_eager=False` captures CUDA graphs of decode steps (per batch-size bucket, Triton
    backend on CUDA only), checked against eager steps at start-up.

    `kv_cache_dtype` is what the KV pool holds (vLLM's name): "auto" the model's dtype (the
    exact reference), "bfloat16" half of float32's bytes, K/V rounded to nearest even as
    they are stored and widened to the model's dtype in attention; "int8" about a quarter
    (a row of codes and its scale per token and KV head, as llama.cpp's q8_0). Left None:
    bfloat16 on the CPU, where a decode step reads more KV than weights at a few dozen
    chats; "auto" on CUDA (its model dtype is 16-bit already). A KV tier's blocks are kept
    per KV dtype.

    `max_num_seqs`, `max_num_batched_tokens`, `enforce_eager` and `kv_cache_dtype` left None
    take the device's defaults (DEVICE_DEFAULTS), filled in by `for_device` once the device
    is known.

    `num_speculative_tokens` > 0 drafts up to that many tokens a step for each greedy
    request from its own history (prompt lookup: the longest suffix of `prompt_lookup_min`
    to `prompt_lookup_max` tokens seen before; vLLM's names) and verifies them in the same
    forward; 0 turns drafting off.
    """

    model: str = "smollm2-135m"
    device: str = "auto"
    dtype: str = "auto"
    block_size: int = 16
    num_blocks: int | None = None
    kv_cache_memory: int | str | None = None
    gpu_memory_utilization: float = 0.90
    max_model_len: int | None = None
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    enable_prefix_caching: bool = True
    attention_backend: str = "auto"
    seed: int = 0
    cache_dir: str | None = None
    enforce_eager: bool | None = None
    fused_ops: bool = True
    weight_cache_size: int | str = "4GiB"
    weights: str = "quantized"
    kv_tier_disk_bytes: int | str = 4 * 2**30
    kv_tier_host_bytes: int | str | None = None
    threads: int | str | None = None
    kv_cache_dtype: str | None = None
    num_speculative_tokens: int = 0
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 4

    def __post_init__(self) -> None:
        _choice("device", self.device, DEVICES)
        _choice("dtype", self.dtype, DTYPES)
        _choice("attention_backend", self.attention_backend, ATTENTION_BACKENDS)
        _choice("weights", self.weights, WEIGHTS)
        if self.kv_cache_dtype is not None:
            _choice("kv_cache_dtype", self.kv_cache_dtype, KV_CACHE_DTYPES)
        _choice("block_size", self.block_size, _BLOCK_SIZES)
        if self.max_num_seqs is not None:
            _positive("max_num_seqs", self.max_num_seqs)
        if self.max_num_batched_tokens is not None:
            _positive("max_num_batched_tokens", self.max_num_batched_tokens)
        if self.num_blocks is not None:
            _positive("num_blocks", self.num_blocks)
        if self.max_model_len is not None:
            _positive("max_model_len", self.max_model_len)
        if self.kv_cache_memory is not None:
            self.kv_cache_memory = parse_memory("kv_cache_memory", self.kv_cache_memory)
        self.weight_cache_size = parse_memory("weight_cache_size", self.weight_cache_size)
        self.kv_tier_disk_bytes = parse_memory("kv_tier_disk_bytes", self.kv_tier_disk_bytes,
                                               allow_zero=True)
        if self.kv_tier_host_bytes is not None:
            self.kv_tier_host_bytes = parse_memory("kv_tier_host_bytes", self.kv_tier_host_bytes,
                                                   allow_zero=True)
        if not (isinstance(self.gpu_memory_utilization, (int, float))
                and 0 < self.gpu_memory_utilization < 1):
            raise ValueError(f"EngineConfig.gpu_memory_utilization={self.gpu_memory_utilization!r}"
                             " is invalid: expected a fraction in (0, 1), below 1 so the CUDA "
                             "context, the allocator's fragmentation and other processes keep "
                             "some room")
        # More threads than cores only wait on each other: thousands hang a step, and
        # libgomp crashes on a hundred thousand.
        cores = os.cpu_count() or 1
        if self.threads is not None and self.threads != "auto" and not (
                isinstance(self.threads, int) and not isinstance(self.threads, bool)
                and 1 <= self.threads <= cores):
            raise ValueError(f"EngineConfig.threads={self.threads!r} is invalid: expected an "
                             f"integer from 1 to {cores} (this machine's cores), or 'auto' "
                             "(None) to adapt to the machine")
        if not isinstance(self.model, str) or not self.model.strip():
            raise ValueError("EngineConfig.model is empty: expected an alias, a path or a hub id")
        if self.enforce_eager is not None and not isinstance(self.enforce_eager, bool):
            raise ValueError(f"EngineConfig.enforce_eager={self.enforce_eager!r} is invalid: "
                             "expected true or false")
        if not isinstance(self.fused_ops, bool):
            raise ValueError(f"EngineConfig.fused_ops={self.fused_ops!r} is invalid: "
                             "expected true or false")
        if not (isinstance(self.num_speculative_tokens, int)
                and not isinstance(self.num_speculative_tokens, bool)
                and self.num_speculative_tokens >= 0):
            raise ValueError(f"EngineConfig.num_speculative_tokens={self.num_speculative_tokens!r}"
                             " is invalid: expected an integer >= 0 (0 turns drafting off)")
        _positive("prompt_lookup_min", self.prompt_lookup_min)
        _positive("prompt_lookup_max", self.prompt_lookup_max)
        if self.prompt_lookup_max < self.prompt_lookup_min:
            raise ValueError(f"EngineConfig.prompt_lookup_max={self.prompt_lookup_max!r} is "
                             f"invalid: expected at least prompt_lookup_min "
                             f"({self.prompt_lookup_min})")
        if not isinstance(self.seed, int) or self.seed < 0:
            raise ValueError(f"EngineConfig.seed={self.seed!r} is invalid: expected an integer >= 0")


    def for_device(self, device_type: str) -> EngineConfig:
        """This config with every field left None for the device (DEVICE_DEFAULTS) set to
        `device_type`'s ("cpu" or "cuda") default."""
        unset = {name: value for name, value in DEVICE_DEFAULTS[device_type].items()
                 if getattr(self, name) is None}
        return dataclasses.replace(self, **unset)


def parse_memory(name: str, value: int | str, allow_zero: bool = False) -> int:
    """Bytes from an int or a string like "512MiB", "2GiB", "1.5GB" (0 only with `allow_zero`)."""
    if isinstance(value, bool):
        value = -1
    if isinstance(value, int):
        number = value
    else:
        match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(value))
        unit = match.group(2).lower() if match else None
        if unit not in _MEMORY_UNITS:
            raise ValueError(f"EngineConfig.{name}={value!r} is invalid: expected bytes or a "
                             "size like '512MiB' or '2GiB'")
        number = int(float(match.group(1)) * _MEMORY_UNITS[unit])
    if number < 0 or (number == 0 and not allow_zero):
        bound = ">= 0 (0 turns it off)" if allow_zero else "> 0"
        raise ValueError(f"EngineConfig.{name}={value!r} is invalid: expected a size {bound}")
    return number


def _choice(name: str, value: object, allowed: tuple) -> None:
    if value not in allowed:
        shown = ", ".join(repr(a) for a in allowed)
        raise ValueError(f"EngineConfig.{name}={value!r} is invalid: expected one of {shown}")


def _positive(name: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"EngineConfig.{name}={value!r} is invalid: expected an integer >= 1")
