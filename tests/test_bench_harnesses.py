"""Every harness under benchmarks/ runs as `python -m benchmarks.NAME` from the repository
root: its imports resolve and its argparse answers -h."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
HARNESSES = sorted(path.stem for path in (REPO / "benchmarks").glob("*.py")
                   if "def main(" in path.read_text())

pytestmark = pytest.mark.perf


@pytest.mark.parametrize("name", HARNESSES)
def test_a_harness_answers_help_from_the_repo_root(name):
    env = {**os.environ, "TRITON_INTERPRET": "1"}  # device_check imports triton
    result = subprocess.run([sys.executable, "-m", f"benchmarks.{name}", "-h"], cwd=REPO, env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "usage:" in result.stdout
