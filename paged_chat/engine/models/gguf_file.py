"""Read a llama-family .gguf file as Hugging Face parts: config dict, weights, tokenizer.

The decoder only knows HF parameter names and HF config keys, so everything GGUF-specific
(metadata keys, tensor names, llama.cpp's q/k row permutation, Llama 3 rope factors stored as
a tensor) is translated here and nowhere else.
"""

from __future__ import annotations

import hashlib
import math
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Callable

import gguf
import numpy as np
import torch
import transformers
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from paged_chat import settings
from paged_chat.engine.errors import ModelLoadError, UnsupportedModelError
from paged_chat.engine.models.model_config import SUPPORTED_ARCHITECTURES

# GGUF architecture -> HF model_type. llama.cpp stores Mistral models as "llama".
GGUF_ARCHITECTURES: dict[str, str] = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}
_HF_CLASSES = {
    "llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
}

_TOP_LEVEL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_BLOCK_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
# Llama 3 rope scaling: convert_hf_to_gguf writes per-frequency divisors instead of metadata.
_ROPE_FREQS = "rope_freqs.weight"
_MIB = 1 << 20


def read_gguf(path: Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """Return (HF config dict, float32 weights under HF names) for a llama-family GGUF file."""
    reader = _open_reader(path)
    arch = _field(reader, "general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        supported = ", ".join(SUPPORTED_ARCHITECTURES)
        raise UnsupportedModelError(
            f"{path}: GGUF architecture {arch!r} is not supported: paged-chat runs the llama "
            f"family ({supported})")
    if (_field(reader, "split.count") or 1) > 1:
        raise ModelLoadError(
            f"{path} is one part of a split GGUF: merge the parts first with "
            f"`llama-gguf-split --merge FIRST_PART OUT.gguf`")
    tensors = {t.name: t for t in reader.tensors}
    rope_freqs = tensors.pop(_ROPE_FREQS, None)
    hf_config = _hf_config(reader, arch, tensors, rope_freqs, path)
    weights = {_hf_tensor_name(name, path): _dequantize(t, path) for name, t in tensors.items()}
    if arch == "llama":
        _unpermute_qk(weights, hf_config["num_attention_heads"], hf_config["num_key_value_heads"])
    return hf_config, weights


def load_gguf_tokenizer(path: Path) -> PreTrainedTokenizerBase:
    """Build the tokenizer from GGUF metadata, converting once and reusing a saved copy.

    The transformers conversion re-reads the whole vocabulary (seconds); the saved
    tokenizer.json loads in a fraction of that.
    """
    cached = settings.cache_dir() / "tokenizers" / _cache_key(path)
    if cached.is_dir():
        return AutoTokenizer.from_pretrained(cached)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    except (KeyError, ValueError, NotImplementedError, OSError) as exc:
        reason = str(exc).strip().split("\n", 1)[0]
        raise ModelLoadError(
            f"{path}: cannot build a tokenizer from its GGUF metadata ({reason}); use a GGUF "
            f"file made by a recent llama.cpp convert_hf_to_gguf.py, or the HF model folder"
        ) from exc
    _save_atomically(tokenizer, cached)
    return tokenizer


def _open_reader(path: Path) -> gguf.GGUFReader:
    try:
        return gguf.GGUFReader(path)
    except (OSError, ValueError, IndexError, OverflowError) as exc:
        raise ModelLoadError(
            f"{path} is not a readable GGUF file ({exc}): it is probably truncated or corrupt, "
            f"download it again") from exc


def _field(reader: gguf.GGUFReader, key: str) -> Any:
    """A metadata value as a Python value (float32 values at their shortest repr), or None."""
    field = reader.get_field(key)
    if field is None:
        return None
    value = field.contents()
    if field.types[-1] == gguf.GGUFValueType.FLOAT32:
        return _shortest_float32(value)
    return value


def _shortest_float32(value: float) -> float:
    """1e-05 rather than 9.999999747378752e-06, as the HF config that was converted said."""
    return float(str(np.float32(value)))


def _hf_config(reader: gguf.GGUFReader, arch: str, tensors: dict[str, gguf.ReaderTensor],
               rope_freqs: gguf.ReaderTensor | None, path: Path) -> dict[str, Any]:
    def meta(suffix: str) -> Any:
        return _field(reader, f"{arch}.{suffix}")

    def required(suffix: str) -> Any:
        if (value := meta(suffix)) is None:
            raise ModelLoadError(
                f"{path}: GGUF metadata lacks {arch}.{suffix}; the file is incomplete or was "
                f"written by a broken converter: download or convert it again")
        return value

    if "token_embd.weight" not in tensors:
        raise ModelLoadError(
            f"{path}: GGUF has no token_embd.weight tensor; the file is incomplete or not a "
            f"language model: download or convert it again")
    hidden = required("embedding_length")
    num_heads = required("attention.head_count")
    head_dim = meta("attention.key_length") or hidden // num_heads
    rotary_dim = meta("rope.dimension_count")
    if rotary_dim is not None and rotary_dim != head_dim:
        raise UnsupportedModelError(
            f"{path}: rope covers {rotary_dim} of {head_dim} head dims; paged-chat only runs "
            f"full-rotary llama-family models")
    rope_theta = meta("rope.freq_base") or 10000.0
    config: dict[str, Any] = {
        "model_type": GGUF_ARCHITECTURES[arch],
        "architectures": [_HF_CLASSES[arch]],
        # The embedding matrix is authoritative: metadata vocab_size is optional.
        "vocab_size": int(tensors["token_embd.weight"].shape[-1]),
        "hidden_size": hidden,
        "intermediate_size": required("feed_forward_length"),
        "num_hidden_layers": required("block_count"),
        "num_attention_heads": num_heads,
        "num_key_value_heads": meta("attention.head_count_kv") or num_heads,
        "head_dim": head_dim,
        "rms_norm_eps": meta("attention.layer_norm_rms_epsilon") or 1e-6,
        "rope_theta": rope_theta,
        "max_position_embeddings": meta("context_length") or 4096,
        "tie_word_embeddings": "output.weight" not in tensors,
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _eos_token_ids(reader),
    }
    rope_scaling = _metadata_rope_scaling(meta)
    if rope_freqs is not None:
        rope_scaling = _llama3_rope_scaling(_dequantize(rope_freqs, path).numpy(), rope_theta,
                                            head_dim, path)
    if rope_scaling:
        config["rope_scaling"] = rope_scaling
    return config


def _eos_token_ids(reader: gguf.GGUFReader) -> int | list[int] | None:
    """eos plus the end-of-turn/message tokens llama.cpp also stops on, as HF configs list them."""
    ids: list[int] = []
    for key in ("eos_token_id", "eot_token_id", "eom_token_id"):
        value = _field(reader, f"tokenizer.ggml.{key}")
        if value is not None and value not in ids:
            ids.append(value)
    if not ids:
        return None
    return ids[0] if len(ids) == 1 else ids


def _metadata_rope_scaling(meta: Callable[[str], Any]) -> dict[str, Any] | None:
    rope_type = meta("rope.scaling.type")
    if rope_type in (None, "none"):
        return None
    scaling: dict[str, Any] = {"rope_type": rope_type, "factor": meta("rope.scaling.factor")}
    optional = {
        "rope.scaling.original_context_length": "original_max_position_embeddings",
        "rope.scaling.yarn_beta_fast": "beta_fast",
        "rope.scaling.yarn_beta_slow": "beta_slow",
    }
    for suffix, hf_key in optional.items():
        if (value := meta(suffix)) is not None:
            scaling[hf_key] = value
    return scaling


def _llama3_factors(inv_freq: np.ndarray, factor: float, low: float, high: float,
                    original: float) -> np.ndarray:
    """The per-frequency divisors convert_hf_to_gguf.py computes for "llama3" rope scaling."""
    wavelen = 2 * math.pi / inv_freq
    smooth = np.clip((original / wavelen - low) / (high - low), 0.0, 1.0)
    return 1.0 / ((1.0 - smooth) / factor + smooth)


def _llama3_rope_scaling(freqs: np.ndarray, theta: float, head_dim: int,
                         path: Path) -> dict[str, Any] | None:
    """Recover HF's llama3 rope_scaling from the rope_freqs tensor.

    The divisors depend on (factor, low_freq_factor, high_freq_factor, original context)
    only through the factor and a line in 1/wavelength, so fixing low_freq_factor = 1 (as
    every Llama 3 release does) makes the fit exact. Released values are short decimals, so
    the fit is rounded to 4 significant digits and then checked against the tensor.
    """
    freqs = freqs.astype(np.float64)
    factor = float(freqs.max())
    if factor == 1.0:
        return None
    inv_freq = theta ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    smooth = (1.0 / freqs - 1.0 / factor) / (1.0 - 1.0 / factor)
    band = (smooth > 1e-6) & (smooth < 1.0 - 1e-6)
    scaling = None
    if band.sum() >= 2:
        slope, intercept = np.polyfit(inv_freq[band] / (2 * math.pi), smooth[band], 1)
        if intercept < 0:
            scaling = {
                "rope_type": "llama3",
                "factor": float(f"{factor:.4g}"),
                "low_freq_factor": 1.0,
                "high_freq_factor": float(f"{1.0 - 1.0 / intercept:.4g}"),
                "original_max_position_embeddings": round(-slope / intercept),
            }
    if scaling is None or not np.allclose(
            _llama3_factors(inv_freq, scaling["factor"], scaling["low_freq_factor"],
                            scaling["high_freq_factor"],
                            scaling["original_max_position_embeddings"]),
            freqs, rtol=1e-4):
        raise UnsupportedModelError(
            f"{path}: its {_ROPE_FREQS} tensor is not llama3-style rope scaling, the only "
            f"rope-factor tensor paged-chat understands")
    return scaling


def _hf_tensor_name(name: str, path: Path) -> str:
    stem, _, suffix = name.rpartition(".")
    if stem in _TOP_LEVEL_NAMES:
        return f"{_TOP_LEVEL_NAMES[stem]}.{suffix}"
    parts = stem.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in _BLOCK_NAMES:
        return f"model.layers.{parts[1]}.{_BLOCK_NAMES[parts[2]]}.{suffix}"
    raise UnsupportedModelError(
        f"{path}: unexpected tensor {name!r} for a llama-family model; this GGUF uses "
        f"features paged-chat does not implement")


def _dequantize(tensor: gguf.ReaderTensor, path: Path) -> torch.Tensor:
    """float32 copy of a GGUF tensor in HF layout ([out, in]: GGUF lists dims reversed)."""
    try:
        array = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    except NotImplementedError as exc:
        raise ModelLoadError(
            f"{path}: tensor {tensor.name} is stored as {tensor.tensor_type.name}, which the gguf "
            f"package cannot dequantize; use a Q4_0/Q4_1/Q5_x/Q8_0/K-quant/F16/BF16/F32 file"
        ) from exc
    # The reader hands out read-only views of the memory-mapped file: copy them off it.
    return torch.from_numpy(np.require(array, np.float32, ["C", "W"]))


def _unpermute_qk(weights: dict[str, torch.Tensor], num_heads: int, num_kv_heads: int) -> None:
    """Undo convert_hf_to_gguf's permute() of q/k rows (llama.cpp's rope pairs dims differently).

    permute() reshapes rows to (heads, 2, rows/heads/2) and swaps the last two axes; the
    inverse reshapes to (heads, rows/heads/2, 2) and swaps them back.
    """
    for name, tensor in weights.items():
        if name.endswith("self_attn.q_proj.weight"):
            heads = num_heads
        elif name.endswith("self_attn.k_proj.weight"):
            heads = num_kv_heads
        else:
            continue
        rows = tensor.shape[0]
        weights[name] = (tensor.reshape(heads, rows // heads // 2, 2, *tensor.shape[1:])
                         .swapaxes(1, 2).reshape(tensor.shape).contiguous())


def _cache_key(path: Path) -> str:
    """A content key that costs two MiB of reading even for multi-GB files.

    Size plus first and last MiB identify a GGUF in practice (the header holds all metadata);
    the transformers version is included because it decides the converted result.
    """
    digest = hashlib.sha256(transformers.__version__.encode())
    size = path.stat().st_size
    digest.update(str(size).encode())
    with path.open("rb") as f:
        digest.update(f.read(_MIB))
        f.seek(max(size - _MIB, 0))
        digest.update(f.read(_MIB))
    return digest.hexdigest()[:32]


def _save_atomically(tokenizer: PreTrainedTokenizerBase, target: Path) -> None:
    """Write next to target then rename, so a crash or a concurrent load never sees half a save."""
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=target.parent, prefix=".partial-"))
    try:
        tokenizer.save_pretrained(staging)
        os.replace(staging, target)
    except OSError:
        # Another process finished the same conversion first: its copy is as good as ours.
        if not target.is_dir():
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
