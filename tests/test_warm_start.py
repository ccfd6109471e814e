"""A warm start (the TUI restarted: the GGUF's tokenizer and weights converted and cached)
does only what serving needs: no import that a cached GGUF does not use, no memory written
before a request writes it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import torch

from paged_chat.engine import Engine, EngineConfig, SamplingParams
from paged_chat.engine.attention.torch_backend import TorchAttention
from paged_chat.engine.kv_pool_sizing import KVCacheSpec, allocate_kv_cache
from helpers import REPO

# What a warm start of a cached GGUF once imported and never used: sympy (torch's symbolic
# shapes, pulled in by `to_empty` on meta tensors) and AutoTokenizer's mappings of every
# model (for a tokenizer whose class is on file).
NOT_NEEDED = ("sympy", "transformers.models.auto.tokenization_auto")


def test_a_warm_start_imports_nothing_a_cached_gguf_does_not_use(smollm2_source):
    cache_dir = os.environ["PAGED_CHAT_CACHE_DIR"]   # the fixture's converted tokenizer is there
    config = {"model": "smollm2-135m", "device": "cpu", "num_blocks": 64, "cache_dir": cache_dir}
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    cold = Engine(EngineConfig(**config))   # converts and caches the weights if no test has yet
    code = textwrap.dedent(f"""
        import json, sys
        from paged_chat.engine import Engine, EngineConfig, SamplingParams
        engine = Engine(EngineConfig(**{config!r}))
        imported = sorted(set({NOT_NEEDED!r}) & set(sys.modules))
        output = engine.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
        print(json.dumps([imported, output[0].token_ids]))
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=600, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert done.returncode == 0, done.stderr
    imported, tokens = json.loads(done.stdout.strip().splitlines()[-1])
    assert imported == []
    assert tokens == cold.generate([[1, 2, 3]], params)[0].token_ids   # as the engine built cold


def _resident_bytes() -> int:
    with open("/proc/self/status") as status:
        line = next(line for line in status if line.startswith("VmRSS:"))
    return int(line.split()[1]) * 1024


def test_the_cpu_kv_pool_is_not_written_before_use():
    """The pool reads as zeros everywhere (the kernels' never-written slots included), yet
    costs no resident memory until blocks are written."""
    spec = KVCacheSpec(num_layers=4, block_size=16, attention=TorchAttention(4, 2, 64, scale=0.125),
                       dtype=torch.float32, device=torch.device("cpu"))
    num_blocks = (256 << 20) // spec.bytes_per_block
    before = _resident_bytes()
    pool = allocate_kv_cache(spec, num_blocks, EngineConfig(num_blocks=num_blocks))
    assert _resident_bytes() - before < 32 << 20      # torch.zeros would write all 256 MiB
    assert pool.shape == spec.shape(num_blocks + 1) and pool.dtype == torch.float32
    assert pool.is_contiguous() and pool.data_ptr() % 64 == 0
    assert not pool.any()
    pool[:, :, :, 7] = 1.5                           # writable in place, block by block
    assert pool[:, :, :, 7].eq(1.5).all() and not pool[:, :, :, 8].any()
