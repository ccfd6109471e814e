"""Fixtures for engine tests: the default model's source and transformers' model of it,
loaded once; tiny random models with its tokenizer, built once; and `new_engine`, which
every fixture that builds an engine on them goes through.

Every engine `make_engine` makes is checked at teardown: no request left means no block in
use, and the pool's invariants hold.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from pathlib import Path

import pytest
import torch
import transformers
from helpers import assert_no_leaks, engine_config
from tiny_models import build_tiny_model, thinking_qwen3_folder

from paged_chat.engine import ClientSpec, Engine, EngineConfig, LocalClient, make_client
from paged_chat.engine.models.loader import ModelSource, load_model_source

NewEngine = Callable[..., Engine]


@pytest.fixture(scope="session")
def smollm2_source() -> ModelSource:
    """The default model's source (config, tokenizer, GGUF checkpoint), loaded once: the
    tokenizer's conversion from the GGUF alone takes seconds. Engines do not modify it. The
    converted tokenizer goes to the session's cache dir (conftest.py), where the commands
    the tests run in subprocesses on the default model find it."""
    return load_model_source("smollm2-135m", cache_dir=os.environ["PAGED_CHAT_CACHE_DIR"])


@pytest.fixture(scope="session")
def smollm2_reference() -> transformers.PreTrainedModel:
    """transformers' own fp32 model from the default model's GGUF (its loader dequantizes and
    un-permutes the weights itself), loaded once; tests only read it."""
    from paged_chat.engine.models.loader import resolve_alias_path
    path = resolve_alias_path("smollm2-135m")
    return transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                             dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def tokenizer(smollm2_source):
    """The default model's tokenizer (a real, full-vocabulary one)."""
    return smollm2_source.tokenizer


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, smollm2_source) -> Path:
    folder = tmp_path_factory.mktemp("tiny-llama")
    build_tiny_model("llama", folder)
    smollm2_source.tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def chat_model_dir(tmp_path_factory, smollm2_source) -> Path:
    """A tiny random llama with the default model's full vocabulary and tokenizer, so real
    chat templates (whose tokens are ids in the thousands) run through it."""
    folder = tmp_path_factory.mktemp("tiny-chat-llama")
    build_tiny_model("llama", folder, vocab_size=len(smollm2_source.tokenizer), tie_word_embeddings=True)
    smollm2_source.tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def thinking_model_dir(tmp_path_factory) -> Path:
    """A tiny random Qwen3 with <think> and </think> tokens and Qwen3's thinking template."""
    return thinking_qwen3_folder(tmp_path_factory.mktemp("tiny-thinking-qwen3"))


# A tiny Mistral's sliding window (every layer): not a multiple of any block size.
MISTRAL_WINDOW = 13


@pytest.fixture(scope="session")
def mistral_dir(tmp_path_factory, smollm2_source) -> Path:
    folder = tmp_path_factory.mktemp("tiny-mistral")
    build_tiny_model("mistral", folder, sliding_window=MISTRAL_WINDOW)
    smollm2_source.tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def tiny_reference(tiny_model_dir) -> transformers.PreTrainedModel:
    return transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype="float32").eval()


class SharedSources:
    """`Engine(config, ...)`, with the source of each of the session's tiny model folders
    read once (its full-vocabulary tokenizer alone takes a third of a second to load, more
    than the rest of a tiny engine). Engines keep only the source's tokenizer and config and
    change neither, so they can share it; any other model loads as the engine loads it."""

    def __init__(self, folders: Iterable[Path]) -> None:
        self._sources: dict[str, ModelSource | None] = {str(folder): None for folder in folders}

    def __call__(self, config: EngineConfig, **options) -> Engine:
        if config.model in self._sources and "source" not in options:
            if self._sources[config.model] is None:
                self._sources[config.model] = load_model_source(config.model)
            options["source"] = self._sources[config.model]
        return Engine(config, **options)


@pytest.fixture(scope="session")
def new_engine(tiny_model_dir, chat_model_dir, mistral_dir) -> NewEngine:
    """The one place the tests' fixtures build an Engine on a tiny model."""
    return SharedSources([tiny_model_dir, chat_model_dir, mistral_dir])


@pytest.fixture
def make_engine(tiny_model_dir, new_engine):
    engines: list[Engine] = []

    def make(**overrides) -> Engine:
        settings = dict(model=str(tiny_model_dir), device="cpu", dtype="float32", num_blocks=256,
                        block_size=16, max_num_seqs=32, max_num_batched_tokens=512,
                        kv_cache_dtype="auto")
        engine = new_engine(EngineConfig(**{**settings, **overrides}))
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        assert_no_leaks(engine)


@pytest.fixture(scope="session")
def smollm2_engine(smollm2_source) -> Engine:
    """An engine on the default model, fp32 on the CPU, shared by the session's tests that
    only run requests to completion on it (each leaves it without a request)."""
    return Engine(EngineConfig(device="cpu", dtype="float32", num_blocks=512, max_num_seqs=32,
                               kv_cache_dtype="auto"),
                  source=smollm2_source)


@pytest.fixture
def make_async_engine(chat_model_dir, new_engine):
    """Engine clients on the chat model, as the TUI and the server start them; shut down
    and checked for leaks at teardown."""
    engines: list[LocalClient] = []

    def make(**overrides) -> LocalClient:
        engine = make_client(ClientSpec(engine=new_engine(engine_config(chat_model_dir, **overrides))))
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        engine.shutdown()
        assert_no_leaks(engine.transport.engine)


@pytest.fixture
def engine(make_async_engine) -> LocalClient:
    return make_async_engine()
