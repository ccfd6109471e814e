"""float32 linear layers on the CPU, their weights laid out once for oneDNN.

A decode step multiplies a few rows (one per sequence) by every weight matrix once, and
each matrix comes from memory, not from cache. `F.linear` goes to MKL's GEMM, which packs
the weight panel by panel on every call; oneDNN's inner product reads a weight reordered
once, at load, into the blocked layout its kernel streams: faster for the few rows of a
decode step, about even for a whole prefill chunk, and decode steps far outnumber prefill
ones (docs/ has the measurements).

oneDNN sums in another order than MKL, so outputs differ in the last bits, as they do
between thread counts. Only float32 is packed: oneDNN's bf16 and fp16 paths need AVX512
or AVX-NE-CONVERT, and they were not measured against MKL.

A packed weight is an opaque tensor (layout `torch._mkldnn`): its shape and numel are the
original's, but it cannot be viewed, sliced or read. So the worker counts and fingerprints
the weights before they are packed (worker/model_loading.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from paged_chat.engine.models.llama import LlamaForCausalLM


class PackedLinear(nn.Module):
    """`nn.Linear`'s forward over a oneDNN-packed copy of `weight`, for 2-D inputs."""

    def __init__(self, weight: torch.Tensor, bias: nn.Parameter | None = None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)
        self.weight = nn.Parameter(packed, requires_grad=False)
        self.bias = bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [None], "")


def packs(weight: torch.Tensor) -> bool:
    """Whether a weight is packed: float32, on the CPU, with oneDNN there."""
    return (weight.device.type == "cpu" and weight.dtype == torch.float32
            and torch.backends.mkldnn.is_available())


def pack_linears(model: nn.Module) -> int:
    """Swap every `nn.Linear` of `model` whose weight `packs` for a PackedLinear, one at a
    time, each plain weight freed as its packed copy is made (nothing here may hold on to a
    swapped layer); return how many were swapped."""
    targets = [(parent, name) for parent in model.modules()
               for name, child in parent.named_children()
               if isinstance(child, nn.Linear) and packs(child.weight)]
    for parent, name in targets:
        linear = getattr(parent, name)
        setattr(parent, name, PackedLinear(linear.weight, linear.bias))
    return len(targets)


def pack_for_cpu(model: LlamaForCausalLM) -> None:
    """Pack the model's float32 linear layers for oneDNN, its output projection too; last,
    as nothing reads a packed weight. A tied projection is packed as a copy, since the
    embedding lookup still reads the plain rows: vocab x hidden more memory for the
    logits' share of a decode step on the packed path."""
    if (model.lm_head is None and isinstance(model.embed_tokens, nn.Embedding)
            and packs(model.embed_tokens.weight)):
        model.lm_head = PackedLinear(model.embed_tokens.weight)
    pack_linears(model)
