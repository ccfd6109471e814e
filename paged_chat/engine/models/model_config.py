"""ModelConfig: the llama-family hyperparameters the decoder needs, read from an HF config."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from paged_chat.engine.errors import UnsupportedModelError

# model_type -> (q/k/v projections always carry a bias, q/k RMSNorm)
SUPPORTED_ARCHITECTURES: dict[str, tuple[bool, bool]] = {
    "llama": (False, False),
    "mistral": (False, False),
    "qwen2": (True, False),
    "qwen3": (False, True),
}


@dataclass(slots=True, frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    qk_norm: bool
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> "ModelConfig":
        """Build from a config.json dict; raise UnsupportedModelError for other families."""
        model_type = hf.get("model_type", "")
        if model_type not in SUPPORTED_ARCHITECTURES:
            supported = ", ".join(SUPPORTED_ARCHITECTURES)
            raise UnsupportedModelError(
                f"model type {model_type or '(none)'!r} is not supported: paged-chat runs the "
                f"llama family ({supported})")
        default_bias, qk_norm = SUPPORTED_ARCHITECTURES[model_type]
        num_heads = hf["num_attention_heads"]
        hidden = hf["hidden_size"]
        eos = hf.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        rope = hf.get("rope_scaling") or hf.get("rope_parameters")
        rope_theta = hf.get("rope_theta")
        if rope_theta is None and isinstance(rope, dict):
            rope_theta = rope.get("rope_theta")
        if isinstance(rope, dict) and rope.get("rope_type", rope.get("type")) in (None, "default"):
            rope = None
        return cls(
            model_type=model_type,
            vocab_size=hf["vocab_size"],
            hidden_size=hidden,
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=hf.get("num_key_value_heads") or num_heads,
            head_dim=hf.get("head_dim") or hidden // num_heads,
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta if rope_theta is not None else 10000.0),
            rope_scaling=dict(rope) if rope else None,
            max_position_embeddings=hf.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            attention_bias=default_bias or bool(hf.get("attention_bias")),
            qk_norm=qk_norm,
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )
