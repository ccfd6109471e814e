"""Read a .gguf file as Hugging Face parts: config dict, tensor locations, tokenizer.

The decoder only knows HF parameter names and HF config keys, so everything GGUF-specific
(metadata keys, tensor names, llama.cpp's q/k row permutation, Gemma's norm weights stored
plus one, Llama 3 rope factors stored as a tensor) is translated here and nowhere else.
Tensors are dequantized one at a time (large ones in row chunks) when the model loads.
"""

from __future__ import annotations

import hashlib
import math
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import gguf
import numpy as np
import torch

from paged_chat.engine.core.errors import ModelLoadError, UnsupportedModelError
from paged_chat.engine.models.checkpoint import Checkpoint, StoredTensor, read_exact
from paged_chat.engine.models.gguf_header import GGUFHeader, TensorInfo, read_gguf_header
from paged_chat.engine.models.model_config import SUPPORTED_ARCHITECTURES
from paged_chat.engine.models.quant import BLOCK_FORMATS
from paged_chat.engine.models.quant.layout import QuantizedWeight
from paged_chat.engine.models.tensor_names import gguf_to_hf_name
from paged_chat.engine.models.tokenizer_source import saved_tokenizer_folder
from paged_chat.engine.regular_files import open_regular

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

# GGUF architecture -> HF model_type. llama.cpp stores Mistral models as "llama".
GGUF_ARCHITECTURES: dict[str, str] = {
    "llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma3": "gemma3_text",
}
_HF_CLASSES = {
    "llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
}
# What llama.cpp hard-codes for Gemma 3 rather than storing it in the file.
_GEMMA3_LOCAL_ROPE_THETA = 10000.0
_GEMMA3_SLIDING_WINDOW_PATTERN = 6
_GEMMA3_27B_LAYERS = 62  # the one size whose queries are not scaled by head_dim (below)
# Llama 3 rope scaling: convert_hf_to_gguf writes per-frequency divisors instead of metadata.
_ROPE_FREQS = "rope_freqs.weight"
# Large tensors are dequantized this many fp32 bytes at a time.
_CHUNK_BYTES = 16 << 20


@dataclass(frozen=True, slots=True)
class GGUFModel:
    """A GGUF file's HF config, its tensors under HF names, and a digest of its header
    (all metadata and tensor infos: what the converted tokenizer and weights depend on)."""

    hf_config: dict[str, Any]
    checkpoint: "GGUFCheckpoint"
    header_digest: str


class GGUFCheckpoint(Checkpoint):
    """GGUF tensors under HF names, dequantized and put back in HF layout as they are read."""

    def __init__(self, tensors: dict[str, StoredTensor], arch: str, num_heads: int,
                 num_kv_heads: int) -> None:
        super().__init__(tensors)
        self.arch = arch
        self.heads = {"self_attn.q_proj.weight": num_heads, "self_attn.k_proj.weight": num_kv_heads}

    def read_into(self, name: str, out: torch.Tensor | QuantizedWeight) -> int:
        if isinstance(out, QuantizedWeight):
            return self._read_quantized(name, out)
        stored = self.tensors[name]
        qtype = gguf.GGMLQuantizationType[stored.dtype]
        block, type_size = gguf.GGML_QUANT_SIZES[qtype]
        cols = stored.shape[-1]
        rows = math.prod(stored.shape[:-1])
        row_bytes = cols // block * type_size
        heads = self.heads.get(name.split(".", 3)[-1]) if self.arch == "llama" else None
        chunk = rows if heads else max(1, _CHUNK_BYTES // (4 * cols))
        flat = out.view(rows, cols)
        for start in range(0, rows, chunk):
            count = min(chunk, rows - start)
            raw = np.empty((count, row_bytes), dtype=np.uint8)
            read_exact(stored.file, stored.offset + start * row_bytes, memoryview(raw).cast("B"))
            values = torch.from_numpy(_dequantize(raw, qtype, name, stored.file)).view(count, cols)
            if heads:
                values = _unpermute_rows(values, heads)
            if self.arch == "gemma3" and name.endswith("norm.weight"):
                values = values - 1  # convert_hf_to_gguf stores Gemma's (1 + w) as the weight
            flat[start:start + count].copy_(values)
        return 0

    def _read_quantized(self, name: str, out: QuantizedWeight) -> int:
        """Re-lay a tensor's blocks out into `out` (quant/layout.py), rows as HF has them."""
        stored = self.tensors[name]
        fmt = BLOCK_FORMATS[stored.dtype]
        qtype = gguf.GGMLQuantizationType[stored.dtype]
        block, type_size = gguf.GGML_QUANT_SIZES[qtype]
        cols = stored.shape[-1]
        row_bytes = cols // block * type_size
        heads = self.heads.get(name.split(".", 3)[-1]) if self.arch == "llama" else None
        chunk = out.rows if heads else max(1, _CHUNK_BYTES // (4 * cols))
        for start in range(0, out.rows, chunk):
            count = min(chunk, out.rows - start)
            raw = np.empty((count, row_bytes), dtype=np.uint8)
            read_exact(stored.file, stored.offset + start * row_bytes, memoryview(raw).cast("B"))
            decoded = fmt.decode(raw)
            if heads:
                decoded = tuple(_unpermute_rows(torch.from_numpy(np.ascontiguousarray(a)),
                                                heads).numpy() for a in decoded)
            out.narrow(start, count).fill(*decoded)
        return 0


def read_gguf(path: Path) -> GGUFModel:
    """The HF config and the tensor locations of a GGUF file; no tensor data is read."""
    header = read_gguf_header(path)
    arch = _field(header, "general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        supported = ", ".join(SUPPORTED_ARCHITECTURES)
        raise UnsupportedModelError(
            f"{path}: GGUF architecture {arch!r} is not supported: paged-chat runs {supported}")
    if (_field(header, "split.count") or 1) > 1:
        raise ModelLoadError(
            f"{path} is one part of a split GGUF: merge the parts first with "
            f"`llama-gguf-split --merge FIRST_PART OUT.gguf`")
    tensors = {t.name: t for t in header.tensors}
    rope_freqs = tensors.pop(_ROPE_FREQS, None)
    hf_config = _hf_config(header, arch, tensors, rope_freqs, path)
    stored = {_hf_tensor_name(arch, name, path): _stored(t, path) for name, t in tensors.items()}
    checkpoint = GGUFCheckpoint(stored, arch, hf_config["num_attention_heads"],
                                hf_config["num_key_value_heads"])
    return GGUFModel(hf_config, checkpoint, _header_digest(path, header.data_offset))


def gguf_tokenizer_folder(header_digest: str, cache_dir: Path | None) -> Path | None:
    """The saved copy of a GGUF's converted tokenizer, where one is (None: convert it)."""
    if cache_dir is None:
        return None
    folder = saved_tokenizer_folder(cache_dir, header_digest)
    return folder if folder.is_dir() else None


def load_gguf_tokenizer(path: Path, header_digest: str,
                        cache_dir: Path | None) -> PreTrainedTokenizerBase:
    """Build the tokenizer from GGUF metadata and save a copy under `cache_dir` (None: no
    copy). The transformers conversion re-reads the whole vocabulary (seconds); the saved
    tokenizer.json, found by `gguf_tokenizer_folder` next time, loads in a fraction of that.
    """
    from transformers import AutoTokenizer  # 1-3 s of imports: only a first conversion pays

    try:
        tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    except (KeyError, ValueError, NotImplementedError, OSError) as exc:
        reason = str(exc).strip().split("\n", 1)[0]
        raise ModelLoadError(
            f"{path}: cannot build a tokenizer from its GGUF metadata ({reason}); use a GGUF "
            f"file made by a recent llama.cpp convert_hf_to_gguf.py, or the HF model folder"
        ) from exc
    if cache_dir is not None:
        _save_atomically(tokenizer, saved_tokenizer_folder(cache_dir, header_digest))
    return tokenizer


def _field(header: GGUFHeader, key: str) -> Any:
    """A metadata value as a Python value (float32 values at their shortest repr), or None."""
    value = header.metadata.get(key)
    if value is not None and key in header.float32_keys:
        return _shortest_float32(value)
    return value


def _shortest_float32(value: float) -> float:
    """1e-05 rather than 9.999999747378752e-06, as the HF config that was converted said."""
    return float(str(np.float32(value)))


def _hf_config(header: GGUFHeader, arch: str, tensors: dict[str, TensorInfo],
               rope_freqs: TensorInfo | None, path: Path) -> dict[str, Any]:
    def meta(suffix: str) -> Any:
        return _field(header, f"{arch}.{suffix}")

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
    # A zero head count is refused by ModelConfig, naming the key; not divided by here.
    head_dim = meta("attention.key_length") or (hidden // num_heads if num_heads else None)
    rotary_dim = meta("rope.dimension_count")
    if None not in (rotary_dim, head_dim) and rotary_dim != head_dim:
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
        "bos_token_id": _field(header, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _eos_token_ids(header),
    }
    rope_scaling = _metadata_rope_scaling(meta)
    if rope_freqs is not None:
        raw = np.empty(rope_freqs.nbytes, dtype=np.uint8)
        read_exact(path, rope_freqs.offset, memoryview(raw))
        factors = _dequantize(raw, rope_freqs.qtype, _ROPE_FREQS, path)
        rope_scaling = _llama3_rope_scaling(factors, rope_theta, head_dim, path)
    if rope_scaling:
        config["rope_scaling"] = rope_scaling
    if (window := meta("attention.sliding_window")) is not None:
        config["sliding_window"] = window
    if arch == "gemma3":
        config |= {"query_pre_attn_scalar": gemma3_query_scalar(config["num_hidden_layers"], hidden,
                                                                num_heads, head_dim),
                   "rope_local_base_freq": _GEMMA3_LOCAL_ROPE_THETA}
        pattern = meta("attention.sliding_window_pattern")
        if isinstance(pattern, list):  # one bool per layer: True where the layer is windowed
            config["layer_types"] = ["sliding_attention" if windowed else "full_attention"
                                     for windowed in pattern]
        else:
            config["sliding_window_pattern"] = pattern or _GEMMA3_SLIDING_WINDOW_PATTERN
    return config


def gemma3_query_scalar(num_layers: int, hidden: int, num_heads: int, head_dim: int) -> int:
    """Gemma 3's query_pre_attn_scalar, which its GGUF files do not store: hidden/heads for
    the 27B (62 layers; 5376/32 = 168, not its head_dim of 128), head_dim for every other
    size, as the HF configs say and llama.cpp decides from the layer count."""
    return hidden // num_heads if num_layers == _GEMMA3_27B_LAYERS else head_dim


def _eos_token_ids(header: GGUFHeader) -> int | list[int] | None:
    """eos plus the end-of-turn/message tokens llama.cpp also stops on, as HF configs list them."""
    ids: list[int] = []
    for key in ("eos_token_id", "eot_token_id", "eom_token_id"):
        value = _field(header, f"tokenizer.ggml.{key}")
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


def _hf_tensor_name(arch: str, name: str, path: Path) -> str:
    hf_name = gguf_to_hf_name(arch, name)
    if hf_name is None:
        raise UnsupportedModelError(
            f"{path}: unexpected tensor {name!r} for a {arch} model; this GGUF uses features "
            f"paged-chat does not implement")
    return hf_name


def _stored(tensor: TensorInfo, path: Path) -> StoredTensor:
    """Where a tensor's bytes are, with its shape in HF order (GGUF lists dims reversed)."""
    return StoredTensor(path, tensor.offset, tensor.nbytes, tensor.qtype.name,
                        tuple(reversed(tensor.shape)))


def _dequantize(raw: np.ndarray, qtype: gguf.GGMLQuantizationType, name: str,
                path: Path) -> np.ndarray:
    """float32 rows of stored rows (dequantize may return a read-only view: copy it)."""
    try:
        array = gguf.quants.dequantize(raw, qtype)
    except NotImplementedError as exc:
        raise ModelLoadError(
            f"{path}: tensor {name} is stored as {qtype.name}, which the gguf package cannot "
            f"dequantize; use a Q4_0/Q4_1/Q5_x/Q8_0/K-quant/F16/BF16/F32 file") from exc
    return np.require(array, np.float32, ["C", "W"])


def _unpermute_rows(rows: torch.Tensor, heads: int) -> torch.Tensor:
    """Undo convert_hf_to_gguf's permute() of q/k rows (llama.cpp's rope pairs dims differently).

    permute() reshapes rows to (heads, 2, rows/heads/2) and swaps the last two axes; the
    inverse reshapes to (heads, rows/heads/2, 2) and swaps them back.
    """
    count = rows.shape[0]
    return rows.reshape(heads, count // heads // 2, 2, -1).swapaxes(1, 2).reshape(rows.shape)


def _header_digest(path: Path, data_offset: int) -> str:
    """sha256 of everything before the tensor data (metadata and tensor infos: small) and
    of the data's size."""
    digest = hashlib.sha256()
    with open_regular(path) as f:
        digest.update(f.read(data_offset))
    digest.update(str(path.stat().st_size - data_offset).encode())
    return digest.hexdigest()


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
