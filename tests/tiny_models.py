"""Tiny random models of every supported family, built with transformers and saved as HF
folders, and our decoder loaded from such a folder.

Random models with the default init have nearly flat logits, so greedy near-ties flip on
rounding; a larger `initializer_range` gives them clear preferences.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import transformers

from paged_chat.engine.models.checkpoint import Checkpoint, SafetensorsFile
from paged_chat.engine.models.llama import LlamaForCausalLM
from paged_chat.engine.models.loader import stream_weights
from paged_chat.engine.models.model_config import ModelConfig

ARCHITECTURES = ("llama", "qwen2", "qwen3", "mistral", "gemma3_text")

_CONFIGS = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
    "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
    "gemma3_text": (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM),
}
# Mistral windows every layer by default: off unless a test asks for a window.
_DEFAULTS = {"mistral": {"sliding_window": None}}
# Vision-language models: the wrapper around a text config of the family above, with a
# SigLIP tower as small as transformers allows (one layer, a 2x2 grid of patches).
VISION_LANGUAGE = {
    "gemma3": (transformers.Gemma3ForConditionalGeneration, "gemma3_text",
               lambda text: transformers.Gemma3Config(
                   text_config=text, mm_tokens_per_image=4,
                   tie_word_embeddings=text.tie_word_embeddings,
                   vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=2, image_size=32, patch_size=16))),
}


def build_tiny_model(architecture: str, folder: Path, *, vocab_size: int = 512,
                     num_heads: int = 6, num_kv_heads: int = 2, head_dim: int = 16,
                     num_layers: int = 2, tie_word_embeddings: bool = False, seed: int = 0,
                     **overrides) -> transformers.PreTrainedModel:
    """Save a tiny random model of `architecture` (or of VISION_LANGUAGE, with the text
    decoder these arguments describe) to `folder` and return it (fp32, eval)."""
    wrapper_cls, architecture, wrap = VISION_LANGUAGE.get(architecture, (None, architecture, None))
    config_cls, model_cls = _CONFIGS[architecture]
    config = config_cls(
        vocab_size=vocab_size, hidden_size=num_heads * head_dim, intermediate_size=96,
        num_hidden_layers=num_layers, num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads, head_dim=head_dim, max_position_embeddings=1024,
        initializer_range=0.25, tie_word_embeddings=tie_word_embeddings, bos_token_id=1,
        eos_token_id=2, pad_token_id=0, **(_DEFAULTS.get(architecture, {}) | overrides))
    if wrapper_cls is not None:
        config, model_cls = wrap(config), wrapper_cls
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder, safe_serialization=True)
    return model


def load_decoder(folder: Path, dtype: torch.dtype = torch.float32,
                 max_positions: int = 1024) -> LlamaForCausalLM:
    """Our decoder with the weights of a folder `build_tiny_model` saved."""
    config = ModelConfig.from_hf(json.loads((folder / "config.json").read_text()))
    model = LlamaForCausalLM.empty(config, dtype, "cpu")
    stream_weights(model, Checkpoint(SafetensorsFile(folder / "model.safetensors").tensors))
    model.build_rope_tables(max_positions)
    return model
