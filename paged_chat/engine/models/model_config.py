"""ModelConfig: the hyperparameters the decoder needs, read and bounds-checked from an HF config.

Every number is checked against sane bounds here, before anything is allocated or looped
on from it: a hostile or broken config is refused with the key that is wrong.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from paged_chat.engine.core.errors import UnsupportedModelError


@dataclass(frozen=True, slots=True)
class Family:
    """What a model_type changes in the decoder."""

    attention_bias: bool = False  # q/k/v projections always carry a bias
    qk_norm: bool = False         # RMSNorm of each head's q and k before RoPE
    gemma: bool = False           # scaled embeddings, (1 + w) norms, norms around attention
                                  # and MLP, GELU-tanh MLP, local/global layers


SUPPORTED_ARCHITECTURES: dict[str, Family] = {
    "llama": Family(),
    "mistral": Family(),
    "qwen2": Family(attention_bias=True),
    "qwen3": Family(qk_norm=True),
    "gemma3_text": Family(qk_norm=True, gemma=True),
}
# Upper bounds far above any released model, low enough that nothing sized from them can
# exhaust memory before the weights are checked against them.
_BOUNDS = {
    "vocab_size": 1 << 24, "hidden_size": 1 << 16, "intermediate_size": 1 << 20,
    "num_hidden_layers": 1 << 10, "num_attention_heads": 1 << 10, "num_key_value_heads": 1 << 10,
    "head_dim": 1 << 12, "max_position_embeddings": 1 << 31, "sliding_window": 1 << 31,
    "sliding_window_pattern": 1 << 10,
}
_DEFAULT_SLIDING_WINDOW_PATTERN = 6  # Gemma 3: five local layers, then a global one

# Vision-language model types whose text decoder paged-chat runs on its own (text chat; the
# vision tower is never read). Their config.json nests the decoder's config under
# `text_config`, which transformers 4.x saves without every value equal to the decoder
# config class's default: those defaults, here, complete it. RoPE keys are left out: their
# defaults depend on the config's style and `_rope` supplies them.
TEXT_DECODER_DEFAULTS: dict[str, dict[str, Any]] = {
    "gemma3": {
        "model_type": "gemma3_text", "vocab_size": 262208, "hidden_size": 2304,
        "intermediate_size": 9216, "num_hidden_layers": 26, "num_attention_heads": 8,
        "num_key_value_heads": 4, "head_dim": 256, "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-6, "query_pre_attn_scalar": 256, "sliding_window": 4096,
        "bos_token_id": 2, "eos_token_id": 1, "tie_word_embeddings": True,
    },
}
# Wrapper keys that override the nested decoder's (transformers 5 ties the embeddings by the
# top-level flag). The wrapper's eos ids are added to the decoder's: Gemma 3 lists its
# end-of-turn token there.
_WRAPPER_KEYS = ("bos_token_id", "tie_word_embeddings")


class ConfigValueError(ValueError):
    """A config key is missing or out of bounds; the message names the key."""


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
    # Per layer: the sliding window (a query at p sees keys k with p - window < k <= p) or None.
    layer_windows: tuple[int | None, ...] = ()
    # RoPE base of the windowed layers, where it differs from the global one (Gemma 3).
    local_rope_theta: float | None = None
    attention_scale: float = 0.0  # 1/sqrt(head_dim) unless the family says otherwise
    gemma: bool = False

    @property
    def window_of_every_layer(self) -> int | None:
        """The smallest sliding window when every layer has one (no layer sees a key older
        than that), or None when some layer attends to the whole context."""
        if not self.layer_windows or None in self.layer_windows:
            return None
        return min(self.layer_windows)

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> "ModelConfig":
        """Build from a config.json dict (a vision-language one: its text decoder's); raise
        UnsupportedModelError for other families and ConfigValueError, naming the key, for a
        missing or out-of-bounds number."""
        if not isinstance(hf, dict):
            raise ConfigValueError(f"the config is {type(hf).__name__}, not a JSON object")
        hf = text_decoder_config(hf)
        model_type = hf.get("model_type", "")
        if model_type not in SUPPORTED_ARCHITECTURES:
            supported = ", ".join(SUPPORTED_ARCHITECTURES)
            raise UnsupportedModelError(
                f"model type {model_type or '(none)'!r} is not supported: paged-chat runs "
                f"{supported}")
        family = SUPPORTED_ARCHITECTURES[model_type]
        num_heads = _count(hf, "num_attention_heads")
        hidden = _count(hf, "hidden_size")
        num_kv_heads = _count(hf, "num_key_value_heads", num_heads)
        if num_heads % num_kv_heads:
            raise ConfigValueError(f"num_attention_heads={num_heads} is not a multiple of "
                                   f"num_key_value_heads={num_kv_heads}")
        head_dim = _count(hf, "head_dim", hidden // num_heads or None)
        num_layers = _count(hf, "num_hidden_layers")
        eos = hf.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        rope_theta, rope, local_theta = _rope(hf, family)
        scalar = hf.get("query_pre_attn_scalar") if family.gemma else None
        return cls(
            model_type=model_type,
            vocab_size=_count(hf, "vocab_size"),
            hidden_size=hidden,
            intermediate_size=_count(hf, "intermediate_size"),
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            rms_norm_eps=_positive_float(hf, "rms_norm_eps", 1e-6),
            rope_theta=rope_theta,
            rope_scaling=rope,
            max_position_embeddings=_count(hf, "max_position_embeddings", 4096),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", family.gemma)),
            attention_bias=family.attention_bias or bool(hf.get("attention_bias")),
            qk_norm=family.qk_norm,
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=eos_ids,
            layer_windows=_layer_windows(hf, model_type, num_layers),
            local_rope_theta=local_theta,
            attention_scale=(scalar if scalar is not None else head_dim) ** -0.5,
            gemma=family.gemma,
        )


def text_decoder_config(hf: dict[str, Any]) -> dict[str, Any]:
    """The config of the decoder paged-chat runs: for a vision-language model (a model type
    of TEXT_DECODER_DEFAULTS), its `text_config` completed with the class defaults and the
    wrapper's token ids and tying; any other config as it is."""
    model_type = hf.get("model_type")
    defaults = TEXT_DECODER_DEFAULTS.get(model_type) if isinstance(model_type, str) else None
    if defaults is None:
        return hf
    text = hf.get("text_config")
    if not isinstance(text, dict):
        raise ConfigValueError("the config lacks text_config, its text decoder's config")
    decoder = defaults | text | {key: hf[key] for key in _WRAPPER_KEYS if hf.get(key) is not None}
    decoder["eos_token_id"] = merged_token_ids(decoder["eos_token_id"], hf.get("eos_token_id"))
    return decoder


def merged_token_ids(*values: int | list[int] | None) -> list[int]:
    """The ids of several token-id values (an id, a list of ids, or None), each once, in
    order."""
    ids: list[int] = []
    for value in values:
        for token_id in value if isinstance(value, list) else [] if value is None else [value]:
            if token_id not in ids:
                ids.append(token_id)
    return ids


def _count(hf: dict[str, Any], key: str, default: int | None = None) -> int:
    value = hf.get(key)
    if value is None:
        value = default
    if value is None:
        raise ConfigValueError(f"the config lacks {key}")
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= _BOUNDS[key]:
        raise ConfigValueError(f"{key}={value!r} is invalid: expected an integer in "
                               f"[1, {_BOUNDS[key]}]")
    return value


def _positive_float(hf: dict[str, Any], key: str, default: float) -> float:
    value = hf.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < 1e30:
        raise ConfigValueError(f"{key}={value!r} is invalid: expected a number > 0")
    return float(value)


def _rope(hf: dict[str, Any], family: Family) -> tuple[float, dict[str, Any] | None, float | None]:
    """(global RoPE base, global scaling or None, local base or None) from either config
    style: rope_theta/rope_scaling, or rope_parameters (per layer type for Gemma 3)."""
    params = hf.get("rope_parameters")
    local = None
    if family.gemma:
        if isinstance(params, dict) and "full_attention" in params:
            local = (params.get("sliding_attention") or {}).get("rope_theta")
            params = params["full_attention"]
        local = local if local is not None else hf.get("rope_local_base_freq", 10000.0)
    rope = hf.get("rope_scaling") or params
    theta = hf.get("rope_theta")
    if theta is None and isinstance(rope, dict):
        theta = rope.get("rope_theta")
    if isinstance(rope, dict) and rope.get("rope_type", rope.get("type")) in (None, "default"):
        rope = None
    theta = _positive_float({"rope_theta": theta}, "rope_theta", 10000.0) if theta is not None \
        else (1_000_000.0 if family.gemma else 10000.0)
    local = _positive_float({"rope_local_base_freq": local}, "rope_local_base_freq", 0) \
        if local is not None else None
    return theta, dict(rope) if rope else None, local


def _layer_windows(hf: dict[str, Any], model_type: str,
                   num_layers: int) -> tuple[int | None, ...]:
    """The sliding window of each layer, as transformers applies it.

    Mistral windows every layer; Qwen2/3 only with use_sliding_window, from layer
    max_window_layers on; Gemma 3 every layer but each sliding_window_pattern-th. A
    `layer_types` list, where the config has one, says which layers are windowed.
    """
    window = hf.get("sliding_window")
    if model_type in ("qwen2", "qwen3") and not hf.get("use_sliding_window"):
        window = None
    if model_type == "llama" or window is None:
        return (None,) * num_layers
    window = _count({"sliding_window": window}, "sliding_window")
    layer_types = hf.get("layer_types")
    if layer_types is not None:
        if not isinstance(layer_types, list) or len(layer_types) != num_layers:
            raise ConfigValueError(f"layer_types does not list num_hidden_layers={num_layers} "
                                   f"layer types")
        windowed = [kind == "sliding_attention" for kind in layer_types]
    elif model_type == "mistral":
        windowed = [True] * num_layers
    elif model_type == "gemma3_text":
        pattern = _count(hf, "sliding_window_pattern", _DEFAULT_SLIDING_WINDOW_PATTERN)
        windowed = [(i + 1) % pattern != 0 for i in range(num_layers)]
    else:
        first = hf.get("max_window_layers", 28)
        if isinstance(first, bool) or not isinstance(first, int) or first < 0:
            raise ConfigValueError(f"max_window_layers={first!r} is invalid: expected an "
                                   f"integer >= 0")
        windowed = [i >= first for i in range(num_layers)]
    return tuple(window if w else None for w in windowed)
