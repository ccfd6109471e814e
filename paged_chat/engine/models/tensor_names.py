"""The one table of checkpoint tensor names: Hugging Face name, GGUF name, our parameter.

The GGUF reader translates llama.cpp names to HF names with it, the loader checks a
checkpoint's HF names against it, and the decoder finds where each HF tensor goes with it
(a slice of a fused parameter for q/k/v and gate/up).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeVar

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class TensorName:
    """One checkpoint module: its HF name, its GGUF name, and our parameter's module.

    `shard` is the slice of a fused parameter the tensor fills (q, k, v of qkv_proj;
    gate, up of gate_up_proj), in row order; 0 for an unfused one.
    """

    hf: str
    gguf: str
    param: str
    shard: int = 0


# Modules under `model.layers.N.` (HF), `blk.N.` (GGUF) and `layers.N.` (ours).
LAYER_TENSORS: tuple[TensorName, ...] = (
    TensorName("self_attn.q_proj", "attn_q", "self_attn.qkv_proj", 0),
    TensorName("self_attn.k_proj", "attn_k", "self_attn.qkv_proj", 1),
    TensorName("self_attn.v_proj", "attn_v", "self_attn.qkv_proj", 2),
    TensorName("self_attn.o_proj", "attn_output", "self_attn.o_proj"),
    TensorName("self_attn.q_norm", "attn_q_norm", "self_attn.q_norm"),
    TensorName("self_attn.k_norm", "attn_k_norm", "self_attn.k_norm"),
    TensorName("mlp.gate_proj", "ffn_gate", "mlp.gate_up_proj", 0),
    TensorName("mlp.up_proj", "ffn_up", "mlp.gate_up_proj", 1),
    TensorName("mlp.down_proj", "ffn_down", "mlp.down_proj"),
    TensorName("input_layernorm", "attn_norm", "input_layernorm"),
    TensorName("post_attention_layernorm", "ffn_norm", "post_attention_layernorm"),
    TensorName("pre_feedforward_layernorm", "", "pre_feedforward_layernorm"),
    TensorName("post_feedforward_layernorm", "", "post_feedforward_layernorm"),
)
TOP_TENSORS: tuple[TensorName, ...] = (
    TensorName("model.embed_tokens", "token_embd", "embed_tokens"),
    TensorName("model.norm", "output_norm", "norm"),
    TensorName("lm_head", "output", "lm_head"),
)

# The GGUF names above are the llama family's. llama.cpp's "ffn_norm" is the norm before the
# MLP, which HF calls post_attention_layernorm there but pre_feedforward_layernorm in Gemma 3,
# whose post_attention_layernorm normalises the attention output.
_GGUF_OVERRIDES: dict[str, dict[str, str]] = {
    "gemma3": {"post_attention_layernorm": "post_attention_norm",
               "pre_feedforward_layernorm": "ffn_norm",
               "post_feedforward_layernorm": "post_ffw_norm"},
}


# Where a vision-language checkpoint (Gemma 3 4B and up) keeps its text decoder, and the
# decoder's own prefix for it. transformers saves `language_model.model.*` (and
# `language_model.lm_head.*`); `model.language_model.*` and `lm_head.*` are the model's
# module names, which files written without transformers' renaming carry.
_TEXT_DECODER_PREFIXES = (("language_model.model.", "model."),
                          ("language_model.lm_head.", "lm_head."),
                          ("model.language_model.", "model."), ("lm_head.", "lm_head."))


def text_decoder_tensors(tensors: dict[str, T]) -> dict[str, T]:
    """A vision-language checkpoint's text-decoder tensors under the decoder's HF names;
    the vision tower's and the projector's are left out, so nothing ever reads them."""
    decoder = {}
    for name, tensor in tensors.items():
        for prefix, ours in _TEXT_DECODER_PREFIXES:
            if name.startswith(prefix):
                decoder[ours + name.removeprefix(prefix)] = tensor
                break
    return decoder


def gguf_to_hf_name(arch: str, name: str) -> str | None:
    """The HF name of a GGUF tensor name ("blk.3.attn_q.weight"), or None if unknown."""
    module, _, kind = name.rpartition(".")
    top = {t.gguf: t.hf for t in TOP_TENSORS}
    if module in top:
        return f"{top[module]}.{kind}"
    blk, _, rest = module.partition(".")
    index, _, gguf_module = rest.partition(".")
    if blk != "blk" or not index.isdecimal():
        return None
    overrides = _GGUF_OVERRIDES.get(arch, {})
    for t in LAYER_TENSORS:
        if overrides.get(t.hf, t.gguf) == gguf_module:
            return f"model.layers.{int(index)}.{t.hf}.{kind}"
    return None


def split_hf_name(name: str) -> tuple[TensorName, int | None, str] | None:
    """(table row, layer index or None, "weight"/"bias") for an HF tensor name, or None."""
    module, _, kind = name.rpartition(".")
    for t in TOP_TENSORS:
        if module == t.hf:
            return t, None, kind
    prefix, _, rest = module.partition(".layers.")
    if prefix != "model" or not rest:
        return None
    index, _, layer_module = rest.partition(".")
    if not index.isdecimal():
        return None
    for t in LAYER_TENSORS:
        if layer_module == t.hf:
            return t, int(index), kind
    return None
