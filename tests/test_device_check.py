"""benchmarks/device_check.py's verdict, on the CPU: the dry run runs every stage in order
within its cap, any stage's failure fails the run, and its GPU tests (tests/gpu) collect on
an image without textual and fastapi."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from benchmarks import device_check

REPO = Path(__file__).resolve().parent.parent
STAGE_ORDER = ["bandwidth", "transformers", "graphs", "default_config", "sampling",
               "throughput", "peer", "kernels", "timings", "quantized", "compile"]
# Imported first by every Python that has it on its path: an import of a dependency the GPU
# image lacks (beyond the pure-Python wheels the device check's docstring carries) fails.
BLOCKER = '''
import sys

class _Absent:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("textual", "fastapi", "uvicorn", "openai", "xgrammar"):
            raise ImportError(f"{name} is not installed on the GPU image")
        return None

sys.meta_path.insert(0, _Absent())
'''


def test_the_dry_run_runs_every_stage_in_order_within_its_cap(tmp_path):
    summary_path = tmp_path / "device_check.json"
    result = subprocess.run(
        [sys.executable, "-m", "benchmarks.device_check", "--cpu-dry-run", "--out",
         str(summary_path)], cwd=REPO, env={**os.environ, "TRITON_INTERPRET": "1"},
        capture_output=True, text=True, timeout=1200)
    summary = json.loads(summary_path.read_text())
    stages = summary["stages"]
    assert [s["stage"] for s in stages] == STAGE_ORDER
    for stage in stages:
        assert stage["status"] == "ok", (stage, summary["errors"].get(stage["stage"]))
        assert stage["seconds"] <= stage["cap_s"], stage
    assert result.stdout.count("VERDICT so far") == len(STAGE_ORDER), "a table after every stage"
    assert "VERDICT so far: PASS" in result.stdout.splitlines()[-2]
    assert result.returncode == 0, result.stderr[-3000:]


def passing(summary):
    return {"checks": [{"check": "stub", "ok": True}]}


def planted(monkeypatch, name, run, cap_s=None):
    """Every stage of the dry run stubbed to pass, but `name`, which runs `run`."""
    stage_list = device_check.stage_list

    def stages(*args):
        return [replace(stage, run=run if stage.name == name else passing,
                        cap_s=cap_s if cap_s and stage.name == name else stage.cap_s)
                for stage in stage_list(*args)]

    monkeypatch.setattr(device_check, "stage_list", stages)


def run_dry(tmp_path, capsys):
    code = device_check.main(["--cpu-dry-run", "--out", str(tmp_path / "summary.json")])
    summary = json.loads((tmp_path / "summary.json").read_text())
    return code, {s["stage"]: s["status"] for s in summary["stages"]}, capsys.readouterr().out


@pytest.mark.parametrize("name", STAGE_ORDER)
def test_a_failed_check_in_any_stage_fails_the_run(name, monkeypatch, tmp_path, capsys):
    planted(monkeypatch, name, lambda summary: {"checks": [{"check": "planted", "ok": False}]})
    code, statuses, out = run_dry(tmp_path, capsys)
    assert code == 1
    assert statuses == {stage: "failed" if stage == name else "ok" for stage in STAGE_ORDER}
    assert f"{name} FAILED planted" in out or f"stage {name:15s} failed" in out
    assert out.splitlines()[-2] == f"VERDICT so far: FAIL ({name})"


@pytest.mark.parametrize("outcome", ["raises", "makes no check", "overruns its cap"])
def test_a_stage_that_breaks_fails_the_run_and_the_next_stages_still_run(
        outcome, monkeypatch, tmp_path, capsys):
    def broken(summary):
        if outcome == "raises":
            raise RuntimeError("planted")
        if outcome == "overruns its cap":
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:  # the cap's signal ends this
                time.sleep(0.01)
        return {"checks": []}

    planted(monkeypatch, "graphs", broken, cap_s=0.5)
    code, statuses, _ = run_dry(tmp_path, capsys)
    expected = {"raises": "error", "makes no check": "failed", "overruns its cap": "timeout"}
    assert code == 1
    assert statuses == {stage: expected[outcome] if stage == "graphs" else "ok"
                        for stage in STAGE_ORDER}


def test_the_gpu_tests_collect_without_textual_fastapi_and_the_server_packages(tmp_path):
    (tmp_path / "sitecustomize.py").write_text(BLOCKER)
    env = {**os.environ, "PYTHONPATH": str(tmp_path),
           # The GPU image has no pytest plugin of textual's (this venv's snapshot plugin
           # imports it).
           "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}
    blocked = subprocess.run([sys.executable, "-c", "import textual"], env=env,
                             capture_output=True, text=True, timeout=60)
    assert "not installed on the GPU image" in blocked.stderr, "the blocker must be in effect"
    result = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q",
                             "tests/gpu"], cwd=REPO, env=env, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "test_engine_stage_passes_on_the_gpu" in result.stdout


def test_the_transformers_stage_fails_an_engine_that_computes_another_model():
    from benchmarks import engine_checks

    plan = engine_checks.DRY_ENGINE_PLAN
    model = engine_checks.random_model(engine_checks.TINY_LLAMA_SHAPE, "cpu")
    assert all(c["ok"] for c in engine_checks.compare_with_transformers(
        plan, model, "float32")["checks"])
    reference = model.reference(torch.float32)
    original = reference.model.layers[0].mlp.down_proj.weight.clone()
    try:
        with torch.no_grad():  # the reference now differs from the weights the engine loads
            reference.model.layers[0].mlp.down_proj.weight.mul_(3.0)
        failed = [c["check"] for c in engine_checks.compare_with_transformers(
            plan, model, "float32")["checks"] if not c["ok"]]
    finally:
        with torch.no_grad():
            reference.model.layers[0].mlp.down_proj.weight.copy_(original)
    assert "logprobs within 0.002" in failed


HUNG_RUN = '''
import signal, sys, time
from dataclasses import replace
from benchmarks import device_check

def stuck(summary):
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM})  # as a call that never returns
    time.sleep(120)

stage_list = device_check.stage_list
device_check.stage_list = lambda *args: [
    replace(s, run=stuck, cap_s=0.5) if s.name == "graphs" else
    replace(s, run=lambda summary: {"checks": [{"check": "stub", "ok": True}]})
    for s in stage_list(*args)]
device_check.HANG_GRACE_S = 0.5
sys.exit(device_check.main(["--cpu-dry-run", "--out", sys.argv[1]]))
'''


def test_a_stage_stuck_past_its_cap_ends_the_run_with_the_verdict_so_far(tmp_path):
    summary_path = tmp_path / "summary.json"
    result = subprocess.run([sys.executable, "-c", HUNG_RUN, str(summary_path)], cwd=REPO,
                            env={**os.environ, "TRITON_INTERPRET": "1"}, capture_output=True,
                            text=True, timeout=110)
    assert result.returncode == 3, result.stderr[-3000:]
    stages = json.loads(summary_path.read_text())["stages"]
    assert [(s["stage"], s["status"]) for s in stages] == [
        ("bandwidth", "ok"), ("transformers", "ok"), ("graphs", "hung")]
    assert result.stdout.splitlines()[-1] == "VERDICT so far: FAIL (graphs)"
