#!/usr/bin/env python3
"""Count the torch ops and Triton launches of one decode step, on the CPU.

A 30-layer tiny random llama (the layer count of SmolLM2-135M) decodes a batch; one
decode step is then run under a TorchDispatchMode that counts every aten op the step
dispatches (each is a kernel launch on a GPU), split into the runner's host preparation
(`_prepare`) and the rest, and with the Triton kernels wrapped to count their launches
(the Triton backend runs under TRITON_INTERPRET=1 here).

    TRITON_INTERPRET=1 HF_HUB_OFFLINE=1 python -m benchmarks.step_ops [--batch 8] [--backend triton]
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import tempfile
from pathlib import Path

from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from tiny_models import build_tiny_model  # noqa: E402

from paged_chat.engine import Engine, EngineConfig, SamplingParams  # noqa: E402
from paged_chat.engine.models.loader import load_model_source  # noqa: E402

# Ops that make a view (no kernel on a GPU); the rest each run a kernel or a copy.
VIEW_OPS = frozenset({"view", "_unsafe_view", "slice", "select", "as_strided", "reshape",
                      "transpose", "t", "expand", "unsqueeze", "squeeze", "alias", "split",
                      "chunk", "permute", "detach", "split_with_sizes", "unbind", "lift_fresh"})
_IN_KERNEL = [False]  # the interpreter runs a kernel as torch ops: not the step's own


class OpCounter(TorchDispatchMode):
    """Counts aten ops by name while active (outside interpreted Triton kernels)."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        if not _IN_KERNEL[0]:
            self.counts[str(func.overloadpacket.__name__)] += 1
        return func(*args, **(kwargs or {}))


def count_triton_launches(counts: collections.Counter[str]) -> None:
    """Wrap the module's kernels so each launch is counted by kernel name."""
    from paged_chat.engine.attention import triton_paged_attention as triton_kernels

    for name in ("_store_kv_kernel", "_paged_attention_kernel", "_merge_splits_kernel"):
        kernel = getattr(triton_kernels, name)

        class Counted:
            def __init__(self, kernel, name: str) -> None:  # noqa: ANN001
                self.kernel, self.name = kernel, name

            def __getitem__(self, grid):  # noqa: ANN001
                def launch(*args, **kwargs):  # noqa: ANN002, ANN003
                    counts[self.name] += 1
                    _IN_KERNEL[0] = True
                    try:
                        self.kernel[grid](*args, **kwargs)
                    finally:
                        _IN_KERNEL[0] = False
                return launch

            def __getattr__(self, attribute: str):
                return getattr(self.kernel, attribute)

        setattr(triton_kernels, name, Counted(kernel, name))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--backend", default="auto", choices=("auto", "torch", "triton", "cpu"))
    parser.add_argument("--no-fused-ops", dest="fused_ops", action="store_false",
                        help="the torch reference ops instead of the fused C ops")
    args = parser.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="step-ops-"))
    build_tiny_model("llama", folder, num_layers=args.layers)
    load_model_source("smollm2-135m").tokenizer.save_pretrained(folder)
    engine = Engine(EngineConfig(model=str(folder), device="cpu", dtype="float32",
                                 num_blocks=256, attention_backend=args.backend,
                                 fused_ops=args.fused_ops))
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    for i in range(args.batch):
        engine.add_request(list(range(3 + i, 40 + i)), params)
    engine.step()  # the prompts
    engine.step()  # a first decode (anything lazily made on the first one)
    launches: collections.Counter[str] = collections.Counter()
    count_triton_launches(launches)
    prepare = OpCounter()
    runner = engine.runner
    original_prepare = runner._prepare

    def counted_prepare(*a, **k):  # noqa: ANN002, ANN003
        with prepare:
            return original_prepare(*a, **k)

    runner._prepare = counted_prepare
    everything = OpCounter()
    with everything:
        engine.step()
    total = sum(everything.counts.values())
    prepared = sum(prepare.counts.values())
    work = sum(n for op, n in everything.counts.items() if op not in VIEW_OPS)
    prepared_work = sum(n for op, n in prepare.counts.items() if op not in VIEW_OPS)
    print(json.dumps({"batch": args.batch, "layers": args.layers, "backend": args.backend,
                      "attention": type(engine.runner.attention).__name__,
                      "fused_ops": args.fused_ops,
                      "torch_ops_step": total, "torch_ops_prepare": prepared,
                      "torch_ops_per_layer": round((total - prepared) / args.layers, 1),
                      "non_view_ops_step": work, "non_view_ops_prepare": prepared_work,
                      "prepare_ops": dict(prepare.counts),
                      "triton_launches": sum(launches.values()),
                      "triton_launches_by_kernel": dict(launches),
                      "top_ops": dict(everything.counts.most_common(12))}))


if __name__ == "__main__":
    main()
