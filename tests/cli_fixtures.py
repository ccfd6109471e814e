"""The `cli` fixture: `paged-chat` run in-process through typer's CliRunner, with a config
file and chat store of the test's own, on the tiny chat model. Loaded as a pytest plugin
(tests/conftest.py)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
from typer.testing import CliRunner

from paged_chat.app.chat_store import ChatStore
from paged_chat.cli.main import app
from paged_chat.cli.state import CliState
from paged_chat.engine import Engine


class Cli:
    """Runs `paged-chat` in-process with this test's config file and chat store; keeps
    every engine it built, for the fixture's checks at teardown."""

    def __init__(self, config: Path, model: Path, new_engine: Callable[..., Engine]) -> None:
        self.config = config
        self.model = model
        self.engines: list[Engine] = []
        self._new_engine = new_engine

    def __call__(self, *args: str, input: str | None = None, obj: CliState | None = None):
        return CliRunner().invoke(app, ["--config", str(self.config), *args], input=input,
                                  obj=obj or CliState(engine_factory=self.engine_factory))

    def engine_factory(self, config) -> Engine:
        """The CLI's engine factory, keeping what it built."""
        self.engines.append(self._new_engine(config))
        return self.engines[-1]

    def json(self, *args: str, input: str | None = None) -> dict:
        result = self("ask", "--json", *args, input=input)
        assert result.exit_code == 0, result.stderr
        return json.loads(result.stdout)

    def store(self) -> ChatStore:
        return ChatStore()


@pytest.fixture
def cli(tmp_path, monkeypatch, chat_model_dir, new_engine) -> Cli:
    monkeypatch.setenv("PAGED_CHAT_DATA_DIR", str(tmp_path / "data"))
    config = tmp_path / "config.toml"
    config.write_text(f'[engine]\nmodel = "{chat_model_dir}"\ndevice = "cpu"\ndtype = "float32"\n'
                      'num_blocks = 128\n\n[chat]\ntemperature = 0.0\nmax_tokens = 8\n')
    cli = Cli(config, chat_model_dir, new_engine)
    yield cli
    for engine in cli.engines:  # every path, Ctrl+C and errors included, frees its blocks
        assert not engine.has_unfinished() and engine.stats().blocks_in_use == 0
        engine.kv_cache.pool.check_invariants()
