"""Models in Ollama's and LM Studio's stores: listed by `paged-chat models`, resolved for
`--model`, read in place. The stores are laid out in a temp dir around a link to the
default model's GGUF (the file itself is never copied)."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
from helpers import default_gguf, link, write_manifest
from typer.testing import CliRunner

from paged_chat.app.model_stores import ModelStoreError, find_stored_models, resolve_model_spec
from paged_chat.app.settings import Settings
from paged_chat.cli.main import app
from paged_chat.cli.state import CliState


@pytest.fixture
def stores(tmp_path, monkeypatch):
    """An Ollama store with smollm2:latest (plus a user namespace and an hf.co model, all the
    same blob) and an LM Studio folder with one repo of one model and one of two."""
    gguf = default_gguf()
    digest = hashlib.sha256(gguf.name.encode()).hexdigest()  # any digest names the blob
    ollama = tmp_path / "ollama"
    link(gguf, ollama / "blobs" / f"sha256-{digest}")
    for parts in (("registry.ollama.ai", "library", "smollm2", "latest"),
                  ("registry.ollama.ai", "someone", "tiny", "q4"),
                  ("hf.co", "org", "repo", "Q4_1")):
        write_manifest(ollama, parts, f"sha256:{digest}")
    lmstudio = tmp_path / "lmstudio"
    link(gguf, lmstudio / "pub" / "single" / "model.Q4_1.gguf")
    link(gguf, lmstudio / "pub" / "single" / "mmproj-model.gguf")
    link(gguf, lmstudio / "pub" / "double" / "a.gguf")
    link(gguf, lmstudio / "pub" / "double" / "b.gguf")
    monkeypatch.setenv("OLLAMA_MODELS", str(ollama))
    monkeypatch.setenv("LMSTUDIO_MODELS", str(lmstudio))
    return {"gguf": gguf, "ollama": ollama, "lmstudio": lmstudio, "digest": digest}


def test_specs_resolve_to_the_files_in_place(stores):
    blob = str(stores["ollama"] / "blobs" / f"sha256-{stores['digest']}")
    assert resolve_model_spec("ollama:smollm2") == blob
    assert resolve_model_spec("ollama:smollm2:latest") == blob
    assert resolve_model_spec("ollama:someone/tiny:q4") == blob
    assert resolve_model_spec("ollama:hf.co/org/repo:Q4_1") == blob
    single = stores["lmstudio"] / "pub" / "single" / "model.Q4_1.gguf"
    assert resolve_model_spec("lmstudio:pub/single") == str(single)
    assert resolve_model_spec("lmstudio:pub/double/b.gguf") == str(stores["lmstudio"] / "pub/double/b.gguf")
    assert resolve_model_spec("smollm2-135m") == "smollm2-135m"
    assert Path(resolve_model_spec("ollama:smollm2")).resolve() == stores["gguf"].resolve()


def test_the_store_spec_reaches_the_engine_as_a_path(stores):
    config = Settings().engine_config(model="ollama:smollm2")
    assert config.model == str(stores["ollama"] / "blobs" / f"sha256-{stores['digest']}")
    assert Settings().engine_config().model == "smollm2-135m"   # no model given: the default


def test_listed_by_the_names_model_takes(stores):
    models, notes = find_stored_models()
    assert notes == []
    assert [(model.spec, model.store) for model in models] == [
        ("ollama:hf.co/org/repo:Q4_1", "ollama"), ("ollama:smollm2:latest", "ollama"),
        ("ollama:someone/tiny:q4", "ollama"),
        ("lmstudio:pub/double/a.gguf", "lmstudio"), ("lmstudio:pub/double/b.gguf", "lmstudio"),
        ("lmstudio:pub/single", "lmstudio")]
    assert all(resolve_model_spec(model.spec) == str(model.path) for model in models)


def test_models_command_lists_them_ready(stores, tmp_path, monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "no-hub"))
    result = CliRunner().invoke(app, ["models"], obj=CliState())
    assert result.exit_code == 0, result.stderr
    rows = {line.split()[0]: line.split() for line in result.stdout.splitlines()[1:]}
    # ... ARCH STATUS WEIGHTS, the last what the engine holds: the GGUF's formats, quantized
    assert rows["ollama:smollm2:latest"][1] == "ollama"
    assert rows["ollama:smollm2:latest"][-5:] == ["llama", "ready", "Q4_1+Q8_0", "0.12", "GB"]
    assert rows["lmstudio:pub/single"][1] == "lmstudio" and rows["lmstudio:pub/single"][-4] == "ready"


def test_broken_entries_are_notes_not_failures(stores):
    write_manifest(stores["ollama"], ("registry.ollama.ai", "library", "gone", "latest"), "sha256:" + "2" * 64)
    broken = stores["ollama"] / "manifests" / "registry.ollama.ai" / "library" / "broken" / "latest"
    broken.parent.mkdir(parents=True)
    broken.write_text("{not json")
    models, notes = find_stored_models()
    assert len(models) == 6 and len(notes) == 2
    assert any("ollama:gone:latest is missing" in note for note in notes)
    assert any("ollama:broken:latest" in note and "unreadable" in note for note in notes)


@pytest.mark.parametrize("spec, message", [
    ("ollama:smollm2:7b", "no Ollama model ollama:smollm2:7b in {ollama} (it has latest)"),
    ("ollama:nothing", "no Ollama model ollama:nothing:latest in {ollama}:"),
    ("ollama:../../etc/passwd", "is not an Ollama model name"),
    ("lmstudio:pub/double", "lmstudio:pub/double holds several models: name one"),
    ("lmstudio:pub/single/other.gguf", "no GGUF model lmstudio:pub/single/other.gguf"),
    ("lmstudio:pub/none", "no LM Studio model lmstudio:pub/none in {lmstudio}"),
    ("lmstudio:../x", "is not an LM Studio model name"),
])
def test_a_spec_that_names_nothing_is_one_clear_line(stores, spec, message):
    with pytest.raises(ModelStoreError) as error:
        resolve_model_spec(spec)
    assert message.format(**{k: str(v) for k, v in stores.items()}) in str(error.value)
    assert "\n" not in str(error.value)


def test_missing_blob_and_broken_manifest_are_one_clear_line(stores, tmp_path):
    write_manifest(stores["ollama"], ("registry.ollama.ai", "library", "gone", "latest"), "sha256:" + "2" * 64)
    write_manifest(stores["ollama"], ("registry.ollama.ai", "library", "evil", "latest"), "sha256:../../x")
    broken = stores["ollama"] / "manifests" / "registry.ollama.ai" / "library" / "broken" / "latest"
    broken.parent.mkdir(parents=True)
    broken.write_text('{"layers": [')
    cases = {"ollama:gone": "the model blob of ollama:gone:latest is missing",
             "ollama:evil": "names no model blob",
             "ollama:broken": "the manifest of ollama:broken:latest"}
    for spec, message in cases.items():
        with pytest.raises(ModelStoreError, match=message):
            resolve_model_spec(spec)
    config = tmp_path / "config.toml"
    config.write_text("")
    result = CliRunner().invoke(app, ["--config", str(config), "ask", "--model", "ollama:gone", "Hi"],
                                obj=CliState())
    assert result.exit_code == 1
    [line] = result.stderr.strip().splitlines()
    assert line.startswith("Error: the model blob of ollama:gone:latest is missing")


def test_the_loader_knows_a_blob_by_its_gguf_magic(stores, tmp_path):
    from paged_chat.engine.core.errors import ModelLoadError
    from paged_chat.engine.models.loader import _resolve

    blob = Path(resolve_model_spec("ollama:smollm2"))
    assert _resolve(str(blob)) == (blob.stem, blob)
    not_a_model = tmp_path / ("sha256-" + "3" * 64)
    not_a_model.write_bytes(b"NOPE" + bytes(64))
    with pytest.raises(ModelLoadError, match="is not a .gguf file"):
        _resolve(str(not_a_model))
