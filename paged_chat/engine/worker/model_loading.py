"""The runner's model: its weights read from a ModelSource onto the device, described while
they are still plain tensors (LoadedModel); on the CPU packed for oneDNN and switched to the
fused C ops where they apply, on CUDA to the Triton ones (`EngineConfig.fused_ops`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from paged_chat.engine.attention.backend import AttentionBackend
from paged_chat.engine.core.config import EngineConfig
from paged_chat.engine.core.errors import out_of_memory
from paged_chat.engine.kv.tier import model_fingerprint
from paged_chat.engine.models import fused_ops
from paged_chat.engine.models.fused_decode import FusedDecode
from paged_chat.engine.models.llama import MLP, Attention, LlamaForCausalLM, RMSNorm
from paged_chat.engine.models.loader import ModelSource, ProgressHook, load_model
from paged_chat.engine.models.packed_linear import pack_for_cpu


@dataclass(frozen=True, slots=True)
class LoadedModel:
    """What the engine reports of the weights it serves, read before packing makes them
    opaque: how many there are (a quantized one counted as one), the bytes they take as
    held, what they are held as ("Q4_1+Q8_0", "bfloat16"), and the fingerprint a KV tier
    keys its blocks by (kv/tier.py)."""

    num_parameters: int
    weight_bytes: int
    held_formats: str
    fingerprint: bytes


def load_weights(source: ModelSource, config: EngineConfig, device: torch.device,
                 dtype: torch.dtype, on_progress: ProgressHook | None = None
                 ) -> tuple[LlamaForCausalLM, LoadedModel]:
    """The decoder with `source`'s weights in `dtype` on `device` (see loader.load_model),
    and its description. Running out of memory is a PagedChatError that says what to do."""
    with out_of_memory(f"loading the weights onto {device}", "the model does not fit; "
                       "use a smaller model or dtype, or device='cpu'"):
        model = load_model(source, dtype, device, config.cache_dir, config.weight_cache_size,
                           on_progress, config.weights)
    return model, LoadedModel(model.num_weights(), model.weight_bytes(), model.held_formats(),
                              model_fingerprint(model.weight_tensors()))


def prepare_for_cpu(model: LlamaForCausalLM, fused: bool) -> None:
    """Pack the weights for oneDNN and, with `fused`, switch to the fused C ops: the
    runner's last set-up step, since nothing may read a packed weight after it."""
    pack_for_cpu(model)
    if fused:
        use_fused_ops(model)


def use_triton_ops(model: LlamaForCausalLM, attention: AttentionBackend) -> bool:
    """Run the pointwise work as one Triton kernel each (triton_fused_ops.py): residual
    add + RMSNorm, the q/k norm and RoPE with the K/V store, the gated activation. They
    apply with an attention backend that attends K/V already stored (Triton's, the CUDA
    path; CPU tensors under TRITON_INTERPRET). Returns whether they are on."""
    if not attention.attends_stored_kv:
        return False
    # Imported here: triton is an optional extra, and TRITON_INTERPRET is read when the
    # kernels are defined (see attention/selector.py).
    from paged_chat.engine.models import triton_fused_ops

    model.triton_ops = triton_fused_ops
    for module in model.modules():
        if isinstance(module, (RMSNorm, Attention, MLP)):
            module.triton_ops = triton_fused_ops
    return True


def use_fused_ops(model: LlamaForCausalLM) -> bool:
    """Run the pointwise work as fused C ops (fused_ops.py) where they apply: float32 on
    the CPU, the llama layer (Gemma 3 keeps the torch ops), RoPE where no q/k norm comes
    before it, and each decode step's layers as one call (FusedDecode) where it is exact.
    Returns whether they are on."""
    weight = model.norm.weight
    if (model.config.gemma or weight.dtype != torch.float32 or weight.device.type != "cpu"
            or not fused_ops.available()):
        return False
    model.norm.fused = True
    for layer in model.layers:
        layer.input_layernorm.fused = layer.post_attention_layernorm.fused = True
        layer.self_attn.fused_rope = layer.self_attn.q_norm is None
        layer.mlp.fused = True
    model.fused_decode = FusedDecode.for_model(model.layers)
    return True
