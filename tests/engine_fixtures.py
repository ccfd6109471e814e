"""Fixtures for engine tests: a tiny random llama with the default model's tokenizer.

Every engine a test makes is checked at teardown: no request left means no block in use,
and the pool's invariants hold.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import transformers

from paged_chat.engine import Engine, EngineConfig
from helpers import assert_no_leaks
from tiny_models import build_tiny_model


@pytest.fixture(scope="session")
def smollm2_source():
    from paged_chat.engine.models.loader import load_model_source
    return load_model_source("smollm2-135m")


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


@pytest.fixture
def make_engine(tiny_model_dir):
    engines: list[Engine] = []

    def make(**overrides) -> Engine:
        settings = dict(model=str(tiny_model_dir), device="cpu", dtype="float32", num_blocks=256,
                        block_size=16, max_num_seqs=32, max_num_batched_tokens=512)
        engine = Engine(EngineConfig(**{**settings, **overrides}))
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        assert_no_leaks(engine)
