"""What `paged-chat models` lists: the model aliases, and the models already on this
machine in the Hugging Face cache (GGUF files and HF folders), without the network.

Every entry's `name` is what `--model` takes. Nothing here raises on a strange cache: an
unreadable file is listed as such, and cache problems come back as notes.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

_SAFETENSORS_SUFFIX = ".safetensors"


@dataclass(frozen=True, slots=True)
class ModelEntry:
    name: str           # what --model takes: an alias, a .gguf path or a hub id
    kind: str           # "alias", "gguf" or "hf folder"
    size: str
    architecture: str
    status: str         # "ready", or what is missing and how to get it


def find_models() -> tuple[list[ModelEntry], list[str]]:
    """The aliases, then the usable models in the HF cache; and notes on the cache."""
    from paged_chat.engine.models.loader import MODEL_ALIASES

    entries = [_alias_entry(name) for name in MODEL_ALIASES]
    cached, notes = _hf_cache_entries()
    stored, store_notes = _model_store_entries()
    return entries + cached + stored, notes + store_notes


def _alias_entry(name: str) -> ModelEntry:
    from paged_chat.engine.errors import ModelLoadError
    from paged_chat.engine.models.loader import MODEL_ALIASES, resolve_alias_path

    alias = MODEL_ALIASES[name]
    try:
        path = resolve_alias_path(name)
    except ModelLoadError:
        return ModelEntry(name, "alias", alias.size, "-", f"not installed: {alias.install_command}")
    architecture = _gguf_architecture(path)
    return ModelEntry(name, "alias", _size(path.stat().st_size), architecture,
                      _status(architecture, gguf=True))


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
                architecture = _gguf_architecture(file.file_path)
                entries.append(ModelEntry(str(file.file_path), "gguf", _size(file.size_on_disk),
                                          architecture, _status(architecture, gguf=True)))
        weights = [file.size_on_disk for name, file in files.items() if name.endswith(_SAFETENSORS_SUFFIX)]
        if "config.json" in files and weights:
            architecture = _model_type(files["config.json"].file_path)
            entries.append(ModelEntry(repo.repo_id, "hf folder", _size(sum(weights)), architecture,
                                      _status(architecture, gguf=False)))
    notes = [f"Hugging Face cache: {warning}" for warning in cache.warnings]
    return entries, notes


def _model_store_entries() -> tuple[list[ModelEntry], list[str]]:
    """The GGUF models of Ollama and LM Studio (paged_chat.model_stores), by the names
    --model takes for them."""
    from paged_chat.model_stores import find_stored_models

    models, notes = find_stored_models()
    entries = []
    for model in models:
        architecture = _gguf_architecture(model.path)
        entries.append(ModelEntry(model.spec, model.store, _size(model.path.stat().st_size),
                                  architecture, _status(architecture, gguf=True)))
    return entries, notes


def _gguf_architecture(path: Path) -> str:
    """general.architecture from the GGUF header (memory-mapped: no weights are read)."""
    import gguf

    try:
        field = gguf.GGUFReader(path).get_field("general.architecture")
    except (OSError, ValueError, IndexError, OverflowError):
        return "unreadable"
    return str(field.contents()) if field is not None else "unknown"


def _model_type(config_file: Path) -> str:
    try:
        return str(json.loads(config_file.read_text(encoding="utf-8")).get("model_type", "unknown"))
    except (OSError, ValueError, AttributeError):
        return "unreadable"


def _status(architecture: str, gguf: bool) -> str:
    from paged_chat.engine.models.gguf_file import GGUF_ARCHITECTURES
    from paged_chat.engine.models.model_config import SUPPORTED_ARCHITECTURES

    supported = GGUF_ARCHITECTURES if gguf else SUPPORTED_ARCHITECTURES
    if architecture in supported:
        return "ready"
    return f"unsupported: paged-chat runs {', '.join(SUPPORTED_ARCHITECTURES)}"


def _size(num_bytes: int) -> str:
    """Decimal units, as download sizes are usually quoted."""
    size = float(num_bytes)
    for unit in ("B", "kB", "MB", "GB"):
        if size < 1000:
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1000
    return f"{size:.1f} TB"
