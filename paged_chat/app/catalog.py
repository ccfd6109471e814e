"""What `paged-chat models` lists: the model aliases, the models already on this machine
in the Hugging Face cache (GGUF files and HF folders), without the network, and the GGUF
weights paged-chat has converted and keeps in its own cache.

Every entry's `name` is what `--model` takes. Nothing here raises on a strange cache: an
unreadable file is listed as such, and cache problems come back as notes. A GGUF header is
read with a bound on bytes (and so on time): a hostile file is marked, never looped on.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from paged_chat.engine.regular_files import read_regular

# A model's config.json is a few KiB.
_MAX_CONFIG_JSON_BYTES = 1 << 20

_SAFETENSORS_SUFFIX = ".safetensors"
# A real header (the vocabulary included) is a few MB; more is not read.
_GGUF_HEADER_BYTES = 64 << 20


@dataclass(frozen=True, slots=True)
class ModelEntry:
    name: str           # what --model takes: an alias, a .gguf path or a hub id
    kind: str           # "alias", "gguf" or "hf folder"
    size: str
    architecture: str
    status: str         # "ready", or what is missing and how to get it
    weights: str = "-"  # what the engine holds by default: "Q4_1+Q8_0 0.12 GB" (GGUF only)


def find_models(cache_dir: Path | None = None) -> tuple[list[ModelEntry], list[str]]:
    """The aliases, the usable models in the HF cache and in Ollama's and LM Studio's
    stores, then the converted weights kept under `cache_dir` (the app's cache dir by
    default); and notes on the caches and stores."""
    from paged_chat.app.settings import cache_dir as app_cache_dir
    from paged_chat.engine.models.loader import MODEL_ALIASES

    entries = [_alias_entry(name) for name in MODEL_ALIASES]
    cached, notes = _hf_cache_entries()
    stored, store_notes = _model_store_entries()
    converted = _converted_entries((cache_dir or app_cache_dir()) / "weights")
    return entries + cached + stored + converted, notes + store_notes


def _converted_entries(root: Path) -> list[ModelEntry]:
    """The GGUF conversions the engine keeps (most recently used first): their source file
    is what --model takes, and loads from this copy in seconds."""
    import time

    from paged_chat.engine.models.weight_cache import CachedWeights, list_cached_weights

    # The WEIGHTS column says what the entry holds (its quantized formats or its dtype).
    def status(entry: CachedWeights) -> str:
        used = time.strftime("%Y-%m-%d %H:%M", time.localtime(entry.last_used))
        return f"converted, last used {used}"

    return [ModelEntry(entry.source, "converted", _size(entry.size), entry.architecture,
                       status(entry), f"{entry.quantized or entry.dtype.lower()} "
                                      f"{entry.size / 1e9:.2f} GB")
            for entry in list_cached_weights(root)]


def _alias_entry(name: str) -> ModelEntry:
    from paged_chat.engine.core.errors import ModelLoadError
    from paged_chat.engine.models.loader import MODEL_ALIASES, resolve_alias_path

    alias = MODEL_ALIASES[name]
    try:
        path = resolve_alias_path(name)
    except ModelLoadError:
        return ModelEntry(name, "alias", alias.size, "-", f"not installed: {alias.install_command}")
    architecture, held = _gguf_summary(path)
    return ModelEntry(name, "alias", _size(path.stat().st_size), architecture,
                      _status(architecture, gguf=True), held)


def _hf_cache_entries() -> tuple[list[ModelEntry], list[str]]:
    from huggingface_hub import constants, scan_cache_dir
    from huggingface_hub.errors import CacheNotFound

    try:
        cache = scan_cache_dir(constants.HF_HUB_CACHE)  # read now, so HF_HUB_CACHE can change
    except CacheNotFound:
        return [], [f"no Hugging Face cache at {constants.HF_HUB_CACHE}"]
    entries = []
    for repo in sorted(cache.repos, key=lambda repo: repo.repo_id.lower()):
        if repo.repo_type != "model" or not repo.revisions:
            continue
        revision = max(repo.revisions, key=lambda revision: revision.last_modified)
        files = {file.file_path.relative_to(revision.snapshot_path).as_posix(): file
                 for file in revision.files}
        for relative, file in sorted(files.items()):
            if relative.endswith(".gguf"):
                architecture, held = _gguf_summary(file.file_path)
                entries.append(ModelEntry(str(file.file_path), "gguf", _size(file.size_on_disk),
                                          architecture, _status(architecture, gguf=True), held))
        weights = [file.size_on_disk for name, file in files.items() if name.endswith(_SAFETENSORS_SUFFIX)]
        if "config.json" in files and weights:
            architecture = _model_type(files["config.json"].file_path)
            entries.append(ModelEntry(repo.repo_id, "hf folder", _size(sum(weights)), architecture,
                                      _status(architecture, gguf=False)))
    notes = [f"Hugging Face cache: {warning}" for warning in cache.warnings]
    return entries, notes


def _model_store_entries() -> tuple[list[ModelEntry], list[str]]:
    """The GGUF models of Ollama and LM Studio (paged_chat.app.model_stores), by the names
    --model takes for them."""
    from paged_chat.app.model_stores import find_stored_models

    models, notes = find_stored_models()
    entries = []
    for model in models:
        architecture, held = _gguf_summary(model.path)
        entries.append(ModelEntry(model.spec, model.store, _size(model.path.stat().st_size),
                                  architecture, _status(architecture, gguf=True), held))
    return entries, notes


def _gguf_summary(path: Path) -> tuple[str, str]:
    """general.architecture from the GGUF header, which is checked whole (every count
    against the file) within a byte bound, and what the engine holds of its weights by
    default ("Q4_1+Q8_0 0.12 GB": the formats kept quantized and the bytes of every weight,
    the dense ones as stored; "-" when none stays quantized); no weights are read."""
    from paged_chat.engine.core.errors import ModelLoadError
    from paged_chat.engine.models.gguf_header import read_gguf_header
    from paged_chat.engine.models.quant import held_nbytes

    try:
        header = read_gguf_header(path, _GGUF_HEADER_BYTES)
    except (ModelLoadError, OSError):
        return "unreadable", "-"
    architecture = header.metadata.get("general.architecture")
    held: dict[str, int] = {}
    dense = 0
    for tensor in header.tensors:
        nbytes = held_nbytes(tensor.qtype.name, tuple(reversed(tensor.shape)))
        if nbytes is None:
            dense += tensor.nbytes
        else:
            held[tensor.qtype.name] = held.get(tensor.qtype.name, 0) + nbytes
    formats = "+".join(sorted(held, key=held.__getitem__, reverse=True))
    summary = f"{formats} {(sum(held.values()) + dense) / 1e9:.2f} GB" if held else "-"
    return (str(architecture) if architecture is not None else "unknown"), summary


def _model_type(config_file: Path) -> str:
    try:
        text = read_regular(config_file, _MAX_CONFIG_JSON_BYTES).decode("utf-8")
        return str(json.loads(text).get("model_type", "unknown"))
    except (OSError, ValueError, AttributeError):
        return "unreadable"


def _status(architecture: str, gguf: bool) -> str:
    from paged_chat.engine.models.gguf_file import GGUF_ARCHITECTURES
    from paged_chat.engine.models.model_config import SUPPORTED_ARCHITECTURES, TEXT_DECODER_DEFAULTS

    supported = GGUF_ARCHITECTURES if gguf else SUPPORTED_ARCHITECTURES
    if architecture in supported:
        return "ready"
    if not gguf and architecture in TEXT_DECODER_DEFAULTS:
        return "ready (text only)"
    return f"unsupported: paged-chat runs {', '.join(SUPPORTED_ARCHITECTURES)}"


def _size(num_bytes: int) -> str:
    """Decimal units, as download sizes are usually quoted."""
    size = float(num_bytes)
    for unit in ("B", "kB", "MB", "GB"):
        if size < 1000:
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1000
    return f"{size:.1f} TB"
