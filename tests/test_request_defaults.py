"""What `serve` gives the sampling fields a request omits, and what `ask` and a TUI tab
sample with where nothing is given: the model's generation config where it sets them, else
`[chat]`'s."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from paged_chat.app.chat_store import ChatStore
from paged_chat.app.settings import Settings, load_settings
from paged_chat.engine import ClientSpec, EngineConfig, make_client
from paged_chat.engine.models.loader import generation_defaults
from paged_chat.tui.app import PagedChatApp


def source_with(tmp_path, config: dict | None):
    if config is not None:
        (tmp_path / "generation_config.json").write_text(json.dumps(config))
    return SimpleNamespace(path=tmp_path)


def test_generation_config_sampling_values_are_read(tmp_path):
    config = {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "do_sample": True, "max_length": 9}
    assert generation_defaults(source_with(tmp_path, config)) == {"temperature": 0.7, "top_p": 0.8,
                                                                  "top_k": 20}
    assert generation_defaults(source_with(tmp_path, {"do_sample": False})) == {"temperature": 0.0}


def test_no_generation_config_means_none(tmp_path):
    assert generation_defaults(source_with(tmp_path, None)) == {}
    assert generation_defaults(SimpleNamespace(path=tmp_path / "model.gguf")) == {}


def test_the_model_s_values_go_over_chat_settings():
    settings = Settings()
    assert settings.request_defaults({}) == {"temperature": 0.2, "top_p": 0.9, "top_k": 0,
                                             "min_p": 0.0, "repetition_penalty": 1.0}
    assert settings.request_defaults({"temperature": 0.6})["temperature"] == 0.6
    assert settings.request_defaults({"temperature": 0.6})["top_p"] == 0.9


def test_what_config_toml_sets_goes_over_the_model_s_values(tmp_path):
    """A user who wrote `temperature = 0.0` in [chat] gets 0.0, not the 0.7 a model
    recommends; what the file leaves out still comes from the model."""
    config = tmp_path / "config.toml"
    config.write_text("[chat]\ntemperature = 0.0\n")
    settings = load_settings(config)
    sampling = settings.model_sampling({"temperature": 0.7, "top_p": 0.8})
    assert sampling["temperature"] == 0.0 and sampling["top_p"] == 0.8
    assert settings.request_defaults({"temperature": 0.7})["temperature"] == 0.0


@pytest.fixture
def sampling_model(chat_model_dir, tmp_path) -> Path:
    """The tiny chat model with a generation config that recommends sampling values."""
    model = tmp_path / "model-with-sampling-defaults"
    model.mkdir()
    for file in chat_model_dir.iterdir():
        if file.name != "generation_config.json":
            (model / file.name).symlink_to(file)
    generation = json.loads((chat_model_dir / "generation_config.json").read_text())
    (model / "generation_config.json").write_text(json.dumps(
        {**generation, "do_sample": True, "temperature": 0.7, "top_p": 0.8, "top_k": 20}))
    return model


# The model's values over the test config's [chat] (temperature 0.0, max_tokens 8).
# The model recommends temperature 0.7, but the CLI tests' config.toml sets [chat]
# temperature = 0.0 (and max_tokens = 8): what the file sets wins.
MODEL_SAMPLING = {"temperature": 0.0, "top_p": 0.8, "top_k": 20, "min_p": 0.0,
                  "repetition_penalty": 1.0, "max_tokens": 8, "seed": None}


def test_ask_starts_from_the_model_s_generation_config_as_serve_does(cli, sampling_model):
    assert cli("ask", "--model", str(sampling_model), "Hi").exit_code == 0
    assert cli("ask", "--model", str(sampling_model), "--top-k", "5", "Hi").exit_code == 0
    stored = [cli.store().get_chat(chat.id).sampling for chat in cli.store().list_chats()]
    assert sorted(stored, key=lambda sampling: sampling["top_k"]) == [
        {**MODEL_SAMPLING, "top_k": 5}, MODEL_SAMPLING]
    served = load_settings(cli.config).request_defaults(
        generation_defaults(source_with(sampling_model, None)))
    assert served == {name: value for name, value in MODEL_SAMPLING.items()
                      if name not in ("max_tokens", "seed")}


def test_a_tui_tab_starts_from_the_model_s_generation_config_too(cli, sampling_model, new_engine,
                                                                 tmp_path):
    client = make_client(ClientSpec(engine=new_engine(EngineConfig(
        model=str(sampling_model), device="cpu", dtype="float32", num_blocks=64))))
    try:
        app = PagedChatApp(load_settings(cli.config), engine=client, restore=False,
                           store=ChatStore(tmp_path / "chats.db"), session_path=tmp_path / "s.json")
        assert app.model_sampling() == MODEL_SAMPLING  # what the settings dialog shows as defaults
        params = app.sampling_params({"top_p": 0.5})
        assert (params.temperature, params.top_p, params.top_k, params.max_tokens) == (0.0, 0.5, 20, 8)
    finally:
        client.shutdown()
