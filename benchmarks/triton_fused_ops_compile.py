"""Compile the fused ops' Triton kernels (engine/models/triton_fused_ops.py) with triton's own
compiler, no GPU needed, for sm_80, sm_89 and sm_90 at real models' shapes in bf16 and
fp32, and report the variants that spill registers. Exits 1 when one does.

    python -m benchmarks.triton_fused_ops_compile [--json FILE]

Run it with the Triton a GPU image has too (its package directory first on PYTHONPATH):
the kernels must compile under every Triton the project meets. Not under TRITON_INTERPRET.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch
import triton

from benchmarks.device_check import ptxas_usage, specialise
from paged_chat.engine.models import triton_fused_ops

KERNELS = ("_add_rms_norm_kernel", "_rope_and_store_kernel", "_act_and_mul_kernel")
ARCHS = (80, 89, 90)
# (hidden, heads, kv heads, head dim, MLP size, q/k norm, Gemma)
SHAPES = {"smollm2-135m": (576, 9, 3, 64, 1536, False, False),
          "llama-3-8b": (4096, 32, 8, 128, 14336, False, False),
          "qwen3-1.7b": (2048, 16, 8, 128, 6144, True, False),
          "gemma-3-1b": (1152, 4, 1, 256, 6912, True, True)}


def recorded_launches() -> list[tuple[Any, dict[str, Any], dict[str, Any]]]:
    """(kernel, arguments by name, launch options) of every variant a model of SHAPES
    launches, in bf16 and fp32, recorded without running anything."""
    launches: list[tuple[Any, dict[str, Any], dict[str, Any]]] = []

    class Recorder:
        def __init__(self, kernel: Any) -> None:
            self.kernel = kernel

        def __getitem__(self, grid: tuple[int, ...]) -> Any:
            def record(*args: Any, **kwargs: Any) -> None:
                options = {k: kwargs.pop(k) for k in ("num_warps", "num_stages") if k in kwargs}
                launches.append((self.kernel, dict(zip(self.kernel.arg_names, args)) | kwargs,
                                 options))
            return record

    originals = {name: getattr(triton_fused_ops, name) for name in KERNELS}
    for name, kernel in originals.items():
        setattr(triton_fused_ops, name, Recorder(kernel))
    try:
        for dtype in (torch.bfloat16, torch.float32):
            for hidden, heads, kv_heads, head_dim, mlp, qk_norm, gemma in SHAPES.values():
                _launch_all(dtype, hidden, heads, kv_heads, head_dim, mlp, qk_norm, gemma)
    finally:
        for name, kernel in originals.items():
            setattr(triton_fused_ops, name, kernel)
    return launches


def _launch_all(dtype: torch.dtype, hidden: int, heads: int, kv_heads: int, head_dim: int,
                mlp: int, qk_norm: bool, gemma: bool) -> None:
    rows = torch.empty(4, hidden, dtype=dtype)
    weight = torch.empty(hidden, dtype=dtype)
    triton_fused_ops.add_rms_norm(None, rows, weight, 1e-6, gemma)
    triton_fused_ops.add_rms_norm(rows, rows.clone(), weight, 1e-6, gemma)
    if gemma:
        triton_fused_ops.add_rms_norm(rows, rows.clone(), weight, 1e-6, True, (weight, 1e-6))
    qkv = torch.empty(4, (heads + 2 * kv_heads) * head_dim, dtype=dtype)
    table = torch.empty(1024, head_dim, dtype=dtype)
    cache = torch.empty(kv_heads, 8, 16, head_dim, dtype=dtype)
    index = torch.zeros(4, dtype=torch.int64)
    norms = (torch.empty(head_dim, dtype=dtype),) * 2 if qk_norm else None
    triton_fused_ops.rope_and_store(qkv, index, table, table, cache, cache.clone(), index, heads,
                                    kv_heads, head_dim, norms, 1e-6, gemma)
    triton_fused_ops.act_and_mul(torch.empty(4, 2 * mlp, dtype=dtype), gemma)


def compile_all() -> list[dict[str, Any]]:
    """Each distinct variant compiled per arch, with what ptxas reports of it."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    launches = recorded_launches()
    results = []
    for arch in ARCHS:
        seen = set()
        for kernel, named, options in launches:
            signature, constexprs, attrs = specialise(kernel, named)
            key = (kernel.fn.__name__, repr(sorted(signature.items())), repr(constexprs),
                   repr(sorted(options.items())))
            if key in seen:
                continue
            seen.add(key)
            compiled = triton.compile(ASTSource(kernel, signature, constexprs, attrs),
                                      target=GPUTarget("cuda", arch, 32), options=options)
            results.append({"arch": arch, "kernel": kernel.fn.__name__,
                            "constexprs": {k: v for k, v in constexprs.items() if k.isupper()}}
                           | ptxas_usage(compiled.asm["ptx"],
                                         f"sm_{arch}a" if arch >= 90 else f"sm_{arch}"))
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="write every variant's report here")
    args = parser.parse_args()
    results = compile_all()
    spilled = [result for result in results if result["spill_bytes"]]
    print(f"triton {triton.__version__}: {len(results)} variants compiled for sm_"
          f"{'/'.join(map(str, ARCHS))}, {len(spilled)} spill registers")
    for result in spilled:
        print(" ", result)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 1 if spilled else 0


if __name__ == "__main__":
    sys.exit(main())
