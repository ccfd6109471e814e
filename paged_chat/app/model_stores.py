"""Models users already have: GGUF files in Ollama's and LM Studio's stores, by name.

`--model ollama:NAME[:TAG]` and `--model lmstudio:PUBLISHER/REPO[/FILE]` name them; this
module turns such a spec into the GGUF file's path before an EngineConfig is built, so
the engine only ever sees a path (it never imports this module). The files are read in
place, never copied or written; what is not a regular file (a FIFO, a device) is a note,
never opened in a way that could block.

Ollama (`$OLLAMA_MODELS`, else `~/.ollama/models`): a model is a JSON manifest at
`manifests/HOST/NAMESPACE/NAME/TAG`; its layer with media type
`application/vnd.ollama.image.model` names the GGUF blob by digest (`sha256:<hex>`), stored
as `blobs/sha256-<hex>`. `NAME` means `registry.ollama.ai/library/NAME`, `USER/NAME`
`registry.ollama.ai/USER/NAME` and `HOST/USER/NAME` itself (e.g. `hf.co/org/repo`); the tag
defaults to `latest`. Its template and params layers are Go templates and Ollama options:
paged-chat uses the chat template in the GGUF itself.

LM Studio (`$LMSTUDIO_MODELS`, else `~/.lmstudio/models` and `~/.cache/lm-studio/models`):
`PUBLISHER/REPO/*.gguf`. A repo with one model file needs no FILE; vision projectors
(`mmproj*.gguf`) are not models.

A spec that cannot be resolved is a ModelStoreError: one line saying what is missing and
where it was looked for.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

from paged_chat.engine.core.errors import ModelLoadError
from paged_chat.engine.regular_files import NotARegularFileError, open_regular, read_regular

OLLAMA = "ollama:"
LMSTUDIO = "lmstudio:"
OLLAMA_MODEL_LAYER = "application/vnd.ollama.image.model"
OLLAMA_REGISTRY = "registry.ollama.ai"
OLLAMA_LIBRARY = "library"
DEFAULT_TAG = "latest"

_DIGEST = re.compile(r"sha256[:-]([0-9a-f]{64})")
_NAME_PART = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
# An Ollama manifest is a few hundred bytes of JSON.
_MAX_MANIFEST_BYTES = 1 << 20


class ModelStoreError(ModelLoadError):
    """An `ollama:` or `lmstudio:` spec names no usable model."""


@dataclass(frozen=True, slots=True)
class StoredModel:
    """A GGUF model found in another app's store."""

    spec: str       # what --model takes: ollama:NAME:TAG or lmstudio:PUBLISHER/REPO[/FILE]
    path: Path      # the GGUF file, in place
    store: str      # "ollama" or "lmstudio"


def resolve_model_spec(spec: str) -> str:
    """`spec` with an `ollama:` or `lmstudio:` name turned into its GGUF file's path; any
    other spec unchanged."""
    if spec.startswith(OLLAMA):
        return str(resolve_ollama(spec.removeprefix(OLLAMA)))
    if spec.startswith(LMSTUDIO):
        return str(resolve_lmstudio(spec.removeprefix(LMSTUDIO)))
    return spec


def find_stored_models() -> tuple[list[StoredModel], list[str]]:
    """Every model in the Ollama and LM Studio stores on this machine, and a note for each
    manifest or file that could not be used."""
    ollama, notes = _ollama_models()
    return ollama + _lmstudio_models(), notes


# ---- Ollama ---------------------------------------------------------------------------


def ollama_root() -> Path:
    return Path(os.environ.get("OLLAMA_MODELS") or "~/.ollama/models").expanduser()


def resolve_ollama(name: str) -> Path:
    """The GGUF blob of the Ollama model `name` (`NAME[:TAG]`)."""
    root = ollama_root()
    repository, _, tag = name.partition(":")
    tag = tag or DEFAULT_TAG
    parts = repository.split("/")
    if not repository or len(parts) > 3 or not all(_NAME_PART.fullmatch(part) for part in [*parts, tag]):
        raise ModelStoreError(f"ollama:{name} is not an Ollama model name: expected "
                              "ollama:NAME[:TAG], e.g. ollama:llama3.2 or ollama:qwen2.5:0.5b")
    folder = root.joinpath("manifests", *[OLLAMA_REGISTRY, OLLAMA_LIBRARY][:3 - len(parts)], *parts)
    spec = f"{OLLAMA}{repository}:{tag}"
    if not (folder / tag).exists():
        tags = sorted(path.name for path in folder.iterdir()) if folder.is_dir() else []
        have = f" (it has {', '.join(tags)})" if tags else ""
        raise ModelStoreError(f"no Ollama model {spec} in {root}{have}: `ollama pull` it, or "
                              "`paged-chat models` lists what there is")
    return _ollama_blob(root, folder / tag, spec)


def _ollama_blob(root: Path, manifest: Path, spec: str) -> Path:
    """The model layer's blob that `manifest` names, checked to exist."""
    try:
        layers = json.loads(read_regular(manifest, _MAX_MANIFEST_BYTES).decode("utf-8")).get("layers")
        digests = [layer.get("digest") for layer in layers
                   if layer.get("mediaType") == OLLAMA_MODEL_LAYER]
    except NotARegularFileError as exc:
        raise ModelStoreError(f"the manifest of {spec} ({manifest}) is {exc.strerror}") from None
    except (OSError, UnicodeDecodeError, ValueError, RecursionError, AttributeError, TypeError) as exc:
        raise ModelStoreError(f"the manifest of {spec} ({manifest}) is unreadable: {exc}") from None
    if len(digests) != 1 or not isinstance(digests[0], str) or not _DIGEST.fullmatch(digests[0]):
        raise ModelStoreError(f"the manifest of {spec} ({manifest}) names no model blob "
                              f"(one layer of type {OLLAMA_MODEL_LAYER} with a sha256 digest)")
    blob = root / "blobs" / f"sha256-{_DIGEST.fullmatch(digests[0]).group(1)}"
    try:
        open_regular(blob).close()
    except NotARegularFileError as exc:
        raise ModelStoreError(f"the model blob of {spec} ({blob}) is {exc.strerror}") from None
    except OSError:
        raise ModelStoreError(f"the model blob of {spec} is missing: {blob} (`ollama pull` it again)") from None
    return blob


def _ollama_models() -> tuple[list[StoredModel], list[str]]:
    root = ollama_root()
    manifests = root / "manifests"
    models, notes = [], []
    for manifest in sorted(manifests.glob("*/*/*/*")) if manifests.is_dir() else []:
        host, namespace, name, tag = manifest.relative_to(manifests).parts
        repository = "/".join([host, namespace, name][_prefix_kept(host, namespace):])
        spec = f"{OLLAMA}{repository}:{tag}"
        try:
            models.append(StoredModel(spec, _ollama_blob(root, manifest, spec), "ollama"))
        except ModelStoreError as exc:
            notes.append(f"Ollama: {exc}")
    return models, notes


def _prefix_kept(host: str, namespace: str) -> int:
    """How many leading parts of HOST/NAMESPACE/NAME a short Ollama name leaves out."""
    if host != OLLAMA_REGISTRY:
        return 0
    return 2 if namespace == OLLAMA_LIBRARY else 1


# ---- LM Studio ------------------------------------------------------------------------


def lmstudio_roots() -> list[Path]:
    given = os.environ.get("LMSTUDIO_MODELS")
    if given:
        return [Path(given).expanduser()]
    return [Path("~/.lmstudio/models").expanduser(), Path("~/.cache/lm-studio/models").expanduser()]


def resolve_lmstudio(name: str) -> Path:
    """The GGUF file of the LM Studio model `name` (`PUBLISHER/REPO[/FILE]`)."""
    parts = name.split("/")
    if len(parts) not in (2, 3) or not all(_NAME_PART.fullmatch(part) for part in parts):
        raise ModelStoreError(f"lmstudio:{name} is not an LM Studio model name: expected "
                              "lmstudio:PUBLISHER/REPO[/FILE.gguf]")
    roots = lmstudio_roots()
    for root in roots:
        folder = root.joinpath(*parts[:2])
        if not folder.is_dir():
            continue
        files = _lmstudio_files(folder)
        if len(parts) == 3:
            chosen = [file for file in files if file.name == parts[2]]
        else:
            chosen = files
        if len(chosen) == 1:
            return chosen[0]
        if len(chosen) > 1:
            names = ", ".join(f"lmstudio:{name}/{file.name}" for file in chosen)
            raise ModelStoreError(f"lmstudio:{name} holds several models: name one ({names})")
        raise ModelStoreError(f"no GGUF model lmstudio:{name} in {folder}"
                              + (f" (it has {', '.join(file.name for file in files)})" if files else ""))
    raise ModelStoreError(f"no LM Studio model lmstudio:{name} in "
                          f"{' or '.join(str(root) for root in roots)}: `paged-chat models` lists what there is")


def _lmstudio_files(folder: Path) -> list[Path]:
    return sorted(file for file in folder.glob("*.gguf")
                  if file.is_file() and not file.name.lower().startswith("mmproj"))


def _lmstudio_models() -> list[StoredModel]:
    models = []
    for root in lmstudio_roots():
        for folder in sorted(root.glob("*/*")) if root.is_dir() else []:
            files = _lmstudio_files(folder) if folder.is_dir() else []
            repository = f"{LMSTUDIO}{folder.parent.name}/{folder.name}"
            models += [StoredModel(repository if len(files) == 1 else f"{repository}/{file.name}",
                                   file, "lmstudio") for file in files]
    return models
