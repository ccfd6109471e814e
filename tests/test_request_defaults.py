"""What `serve` gives the sampling fields a request omits: the model's generation config
where it sets them, else `[chat]`'s, as `ask` has them."""

from __future__ import annotations

import json
from types import SimpleNamespace

from paged_chat.engine.models.loader import generation_defaults
from paged_chat.settings import Settings, load_settings


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


def test_ask_starts_from_the_model_s_generation_config_as_serve_does(cli, chat_model_dir, tmp_path):
    model = tmp_path / "model-with-sampling-defaults"
    model.mkdir()
    for file in chat_model_dir.iterdir():
        if file.name != "generation_config.json":
            (model / file.name).symlink_to(file)
    generation = json.loads((chat_model_dir / "generation_config.json").read_text())
    (model / "generation_config.json").write_text(json.dumps(
        {**generation, "do_sample": True, "temperature": 0.7, "top_p": 0.8, "top_k": 20}))
    assert cli("ask", "--model", str(model), "Hi").exit_code == 0
    assert cli("ask", "--model", str(model), "--top-k", "5", "Hi").exit_code == 0
    stored = [cli.store().get_chat(chat.id).sampling for chat in cli.store().list_chats()]
    # config.toml's [chat] (temperature 0.0, max_tokens 8) is under the model's values
    ask = {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "min_p": 0.0,
           "repetition_penalty": 1.0, "max_tokens": 8, "seed": None}
    assert sorted(stored, key=lambda sampling: sampling["top_k"]) == [{**ask, "top_k": 5}, ask]
    serve = load_settings(cli.config).request_defaults(generation_defaults(source_with(model, None)))
    assert serve == {name: value for name, value in ask.items() if name not in ("max_tokens", "seed")}
