"""The quantize transform: a decoder's layers swapped for the quantized ones a GGUF stores."""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn

from paged_chat.engine.models.quant import BLOCK_FORMATS
from paged_chat.engine.models.quant.layout import QuantizedWeight
from paged_chat.engine.models.quant.linear import QuantizedEmbedding, QuantizedLinear
from paged_chat.engine.models.tensor_names import split_hf_name

if TYPE_CHECKING:
    from paged_chat.engine.models.llama import LlamaForCausalLM


def quantize_model(model: LlamaForCausalLM, stored_formats: dict[str, str]) -> None:
    """Swap each linear layer and the embedding of a freshly made `model` (before its
    weights are read) whose checkpoint weights are all stored in a format quant/ keeps
    (`stored_formats`: HF tensor name -> GGML type name) for its quantized module,
    uninitialised; a tied output projection becomes the embedding's table. Weights in
    other formats stay dense in the model's dtype."""
    shards: dict[str, tuple[str, dict[int, str]]] = {}
    for name, type_name in stored_formats.items():
        split = split_hf_name(name)
        if split is not None and split[2] == "weight":
            t, layer, _ = split
            module = t.param if layer is None else f"layers.{layer}.{t.param}"
            shards.setdefault(module, (t.param, {}))[1][t.shard] = type_name
    for module, (param, formats) in shards.items():
        target = model.get_submodule(module)
        counts = model.shard_rows.get(param, (target.weight.shape[0],))
        fmts = [BLOCK_FORMATS.get(formats.get(shard, "")) for shard in range(len(counts))]
        if None in fmts or target.weight.shape[1] % 32:
            continue
        if isinstance(target, nn.Embedding):
            weight = QuantizedWeight.empty(fmts[0], *target.weight.shape)
            replacement: nn.Module = QuantizedEmbedding(weight, target.weight.dtype)
        else:
            replacement = QuantizedLinear.empty(list(zip(fmts, counts)),
                                                target.weight.shape[1], target.bias)
        parent, _, attr = module.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, attr, replacement)
    if model.lm_head is None and isinstance(model.embed_tokens, QuantizedEmbedding):
        model.lm_head = model.embed_tokens.as_linear()
