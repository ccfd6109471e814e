"""config.toml: defaults, every key, overrides, and errors that name the file, line and key."""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile
import tomllib
import typing
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given
from hypothesis import settings as hypothesis_settings
from hypothesis import strategies as st

from paged_chat.app.settings import (
    CHAT_SAMPLING_KEYS,
    ChatSettings,
    EngineSettings,
    Settings,
    SettingsError,
    cache_dir,
    config_path,
    load_settings,
)
from paged_chat.engine import EngineConfig, SamplingParams

FULL = """\
# every key, none at its default
[engine]
model = "some/model"
device = "cpu"
dtype = "bfloat16"
block_size = 32
num_blocks = 1000
kv_cache_memory = "512MiB"
gpu_memory_utilization = 0.5
max_num_seqs = 8
max_num_batched_tokens = 256
max_model_len = 2048
enable_prefix_caching = false
attention_backend = "torch"

[chat]
system_prompt = "You are terse."
temperature = 1
top_p = 0.8
top_k = 40
min_p = 0.05
max_tokens = 64
repetition_penalty = 1.1

[tui]
theme = "nord"

[tui.keys]
new_chat = "ctrl+t"
"fork chat" = "ctrl+f"
"""


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "config.toml"
    path.write_text(text)
    return path


def test_a_missing_file_means_defaults(tmp_path):
    assert load_settings(tmp_path / "none.toml") == Settings()


def test_the_default_path_comes_from_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGED_CHAT_CONFIG", str(tmp_path / "mine.toml"))
    (tmp_path / "mine.toml").write_text("[chat]\nmax_tokens = 5\n")
    assert config_path() == tmp_path / "mine.toml"
    settings = load_settings()
    assert settings.chat.max_tokens == 5 and settings.path == tmp_path / "mine.toml"


def test_unset_engine_keys_take_the_engine_defaults():
    assert Settings().engine_config() == EngineConfig(cache_dir=str(cache_dir()))


def test_settings_derive_from_the_engine_dataclasses():
    """Every EngineConfig knob is an [engine] key, typed as the engine types it; [chat] holds
    the sampling fields a chat keeps, typed as SamplingParams types them."""
    engine_fields = {f.name for f in dataclasses.fields(EngineConfig)} - {"cache_dir"}
    assert {f.name for f in dataclasses.fields(EngineSettings)} == engine_fields
    hints, engine_hints = typing.get_type_hints(EngineSettings), typing.get_type_hints(EngineConfig)
    assert all(set(typing.get_args(hints[name])) >= set(typing.get_args(engine_hints[name])
                                                         or (engine_hints[name],))
               for name in engine_fields)
    assert set(CHAT_SAMPLING_KEYS) < {f.name for f in dataclasses.fields(SamplingParams)}
    assert [f.name for f in dataclasses.fields(ChatSettings)] == ["system_prompt", *CHAT_SAMPLING_KEYS]


def test_engine_defaults_appear_in_the_shown_config():
    shown = tomllib.loads(Settings().to_toml())["engine"]
    assert shown["model"] == EngineConfig().model and shown["block_size"] == EngineConfig().block_size
    assert "num_blocks" not in shown  # sized by the engine


def test_every_key_is_read(tmp_path):
    settings = load_settings(write(tmp_path, FULL))
    config = settings.engine_config()
    assert (config.model, config.device, config.dtype, config.block_size, config.num_blocks) == \
        ("some/model", "cpu", "bfloat16", 32, 1000)
    assert (config.kv_cache_memory, config.gpu_memory_utilization, config.max_num_seqs,
            config.max_num_batched_tokens, config.max_model_len, config.enable_prefix_caching,
            config.attention_backend) == (512 * 2**20, 0.5, 8, 256, 2048, False, "torch")
    params = settings.sampling_params()
    assert (params.temperature, params.top_p, params.top_k, params.min_p, params.max_tokens,
            params.repetition_penalty) == (1.0, 0.8, 40, 0.05, 64, 1.1)
    assert isinstance(settings.chat.temperature, float)  # an integer is a fine number
    assert settings.chat.system_prompt == "You are terse."
    assert settings.tui.theme == "nord" and settings.tui.keys == {"new_chat": "ctrl+t", "fork chat": "ctrl+f"}


def test_overrides_win_and_none_is_not_given(tmp_path):
    settings = load_settings(write(tmp_path, FULL))
    config = settings.engine_config(model="other", device=None, dtype="float32")
    assert (config.model, config.device, config.dtype) == ("other", "cpu", "float32")
    params = settings.sampling_params(temperature=0.0, top_k=None, seed=3)
    assert (params.temperature, params.top_k, params.seed) == (0.0, 40, 3)


def test_to_toml_reads_back_the_same(tmp_path):
    for settings in (Settings(), load_settings(write(tmp_path, FULL))):
        again = load_settings(write(tmp_path, settings.to_toml()))
        assert again.engine_config() == settings.engine_config()
        assert (again.chat, again.tui) == (settings.chat, settings.tui)


@pytest.mark.parametrize("text, line, message", [
    ("[engine]\nblok_size = 16\n", 2, "unknown key 'engine.blok_size': did you mean 'block_size'?"),
    ("[engin]\nmodel = 'x'\n", 1, "unknown section 'engin': did you mean 'engine'?"),
    ('model = "x"\n', 1, "unknown section 'model'"),
    ("[chat]\n\n# a comment\ntemperature = 'hot'\n", 4, 'chat.temperature = "hot" is invalid: expected a number'),
    ("[engine]\nmax_num_seqs = true\n", 2, "engine.max_num_seqs = true is invalid: expected an integer"),
    ("[engine]\nenable_prefix_caching = 1\n", 2, "expected true or false"),
    ("[engine]\nnum_blocks = 1.5\n", 2, "engine.num_blocks = 1.5 is invalid: expected an integer"),
    ("[engine]\nblock_size = 7\n", 2, "engine.block_size = 7 is invalid: expected one of 8, 16, 32, 64, 128"),
    ("[engine]\ndevice = 'tpu'\n", 2, "engine.device = \"tpu\" is invalid: expected one of 'auto', 'cpu', 'cuda'"),
    ("[engine]\ngpu_memory_utilization = 1.5\n", 2, "expected a fraction in (0, 1)"),
    ("[engine]\nkv_cache_memory = 'lots'\n", 2, "engine.kv_cache_memory = \"lots\" is invalid"),
    ("[chat]\ntop_p = 0\n", 2, "chat.top_p = 0.0 is invalid: expected a number in (0, 1]"),
    ("[chat]\nmax_tokens = 0\n", 2, "chat.max_tokens = 0 is invalid: expected an integer >= 1"),
    ("[tui.keys]\nquit = 3\n", 2, 'tui.keys.quit = 3 is invalid: expected a key like "ctrl+n"'),
    ("[tui]\nkeys = 'ctrl+q'\n", 2, "tui.keys must be a table"),
    ("engine = 3\n", 1, "engine must be a table"),
    ("engine.block_size = 7\n", 1, "engine.block_size = 7 is invalid"),
    ('[tui]\ntheme = "dark"\n[tui.keys]\n"new chat" = ""\n', 4, "tui.keys.new chat = \"\" is invalid"),
])
def test_bad_values_name_the_file_line_and_key(tmp_path, text, line, message):
    path = write(tmp_path, text)
    with pytest.raises(SettingsError) as caught:
        load_settings(path)
    assert str(caught.value).startswith(f"{path}, line {line}: ")
    assert message in str(caught.value)


def test_threads_beyond_the_machines_cores_are_refused(tmp_path):
    """100,000 threads crashed libgomp, 5,000 hung: the machine's core count bounds them."""
    cores = os.cpu_count()
    assert load_settings(write(tmp_path, f"[engine]\nthreads = {cores}\n")).engine.threads == cores
    path = write(tmp_path, "[engine]\n\nthreads = 100000\n")
    with pytest.raises(SettingsError) as caught:
        load_settings(path)
    assert str(caught.value).startswith(f"{path}, line 3: engine.threads = 100000 is invalid: ")
    assert f"expected an integer from 1 to {cores} (this machine's cores)" in str(caught.value)


def test_a_syntax_error_names_the_line(tmp_path):
    path = write(tmp_path, "[engine]\nmodel = \n")
    with pytest.raises(SettingsError, match=r"invalid TOML: .*line 2"):
        load_settings(path)


def test_unreadable_files(tmp_path):
    path = tmp_path / "config.toml"
    path.write_bytes(b"[chat]\nsystem_prompt = '\xff'\n")
    with pytest.raises(SettingsError, match="cannot read the config file"):
        load_settings(path)
    with pytest.raises(SettingsError, match="cannot read the config file"):
        load_settings(tmp_path)  # a directory


@hypothesis_settings(suppress_health_check=[HealthCheck.too_slow])
@given(st.text())
def test_fuzz_any_text_loads_or_is_a_settings_error(text):
    with tempfile.TemporaryDirectory() as folder:
        path = write(Path(folder), text)
        try:
            settings = load_settings(path)
        except SettingsError as error:
            assert str(error).startswith(str(path))
        else:
            assert settings.path == path


SECTION_KEYS = {
    "engine": [f.name for f in dataclasses.fields(EngineSettings)] + ["blok_size"],
    "chat": list(CHAT_SAMPLING_KEYS) + ["system_prompt", "temprature"],
    "tui": ["theme", "colour"],
    "extra": ["anything"],
}
VALUES = st.one_of(
    st.integers(-3, 5000), st.booleans(), st.floats(-2, 2, allow_nan=False),
    st.sampled_from(["cpu", "auto", "cuda", "float32", "torch", "2GiB", "smollm2-135m", "", "16"]),
    st.text(max_size=8))


def toml_literal(value) -> str:
    if isinstance(value, float):
        return repr(value)
    return json.dumps(value, ensure_ascii=False).replace("\x7f", "\\u007f")  # TOML escapes DEL too


@hypothesis_settings(max_examples=200, suppress_health_check=[HealthCheck.too_slow])
@given(st.dictionaries(st.sampled_from(list(SECTION_KEYS)), st.data(), max_size=4), st.data())
def test_fuzz_config_files_load_every_value_or_name_the_bad_key(sections, data):
    """Random tables of known and misspelt keys with values of every type: the file loads
    and holds exactly those values, or the error names the file and one of its keys."""
    tables = {section: data.draw(st.dictionaries(st.sampled_from(SECTION_KEYS[section]), VALUES, max_size=4))
              for section in sections}
    text = "".join(f"[{section}]\n" + "".join(f"{key} = {toml_literal(value)}\n" for key, value in table.items())
                   for section, table in tables.items())
    with tempfile.TemporaryDirectory() as folder:
        path = write(Path(folder), text)
        try:
            settings = load_settings(path)
        except SettingsError as error:
            names = [f"{section}.{key}" for section, table in tables.items() for key in table] + list(tables)
            assert str(error).startswith(f"{path}, line ")
            assert any(f"{name} " in str(error) or f"'{name}'" in str(error) for name in names), str(error)
            return
    for section, table in tables.items():
        for key, value in table.items():
            loaded = getattr(getattr(settings, section), key)
            assert loaded == value and isinstance(loaded, bool) == isinstance(value, bool)
