"""The package as a user installs it: pyproject.toml read without a warning, and a wheel that
runs `paged-chat ask` on the native kernels from a fresh venv outside the repo."""

from __future__ import annotations

import os
import shutil
import site
import stat
import subprocess
import sys
import venv
import warnings
import zipfile
from pathlib import Path

import pytest
from setuptools.config.pyprojecttoml import apply_configuration
from setuptools.dist import Distribution

REPO = Path(__file__).parents[1]
PYPROJECT = REPO / "pyproject.toml"


def test_setuptools_reads_pyproject_without_a_warning():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        distribution = apply_configuration(Distribution(), PYPROJECT)
    assert [str(warning.message) for warning in caught] == []
    assert distribution.metadata.license_expression == "Apache-2.0"


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel `pip wheel .` builds from a copy of this checkout (a build in place leaves
    build/ in it, whose stale modules a later wheel would ship)."""
    folder = tmp_path_factory.mktemp("wheel")
    source = folder / "source"
    shutil.copytree(REPO, source, ignore=shutil.ignore_patterns(
        ".git", ".venv", "build", "*.egg-info", "__pycache__", ".pytest_cache", ".hypothesis"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps",
                    "--no-build-isolation", "--wheel-dir", str(folder), str(source)],
                   check=True, capture_output=True, cwd=folder)
    (built,) = folder.glob("paged_chat-*.whl")
    return built


def test_the_wheel_ships_the_package_alone(wheel: Path):
    shipped = {name for name in zipfile.ZipFile(wheel).namelist() if ".dist-info/" not in name}
    package = {path.relative_to(REPO).as_posix() for path in (REPO / "paged_chat").rglob("*.py")}
    assert {name for name in shipped if name.endswith(".py")} == package


def test_the_wheel_ships_every_native_source(wheel: Path):
    shipped = set(zipfile.ZipFile(wheel).namelist())
    sources = {path.relative_to(REPO).as_posix() for path in (REPO / "paged_chat").rglob("*")
               if path.suffix in {".c", ".h", ".tcss"}}
    assert sources and sources <= shipped


@pytest.mark.slow
def test_a_non_editable_install_answers_on_the_native_kernels_from_outside_the_repo(
        wheel: Path, tmp_path: Path):
    """A fresh venv, the wheel installed into it (its dependencies are this venv's: a .pth
    names them, so nothing downloads), run from a folder that is not the repo."""
    fresh = tmp_path / "venv"
    venv.create(fresh, with_pip=True)
    fresh_python = fresh / "bin" / "python"
    fresh_site = Path(subprocess.check_output(
        [fresh_python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
        text=True).strip())
    # Every site-packages this interpreter imports from: its own, and any a .pth adds.
    dependencies = dict.fromkeys([*site.getsitepackages(),
                                  *(p for p in sys.path if p.endswith("site-packages"))])
    (fresh_site / "dependencies.pth").write_text("\n".join(dependencies) + "\n")
    subprocess.run([fresh_python, "-m", "pip", "install", "--quiet", "--no-deps", "--no-index",
                    str(wheel)], check=True, capture_output=True)
    home = tmp_path / "home"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PAGED_CHAT_CACHE_DIR": str(home / "cache"),
           "PAGED_CHAT_DATA_DIR": str(home / "data"),
           "PAGED_CHAT_CONFIG": str(home / "config" / "config.toml"), "TMPDIR": str(tmp_path)}
    env.pop("PYTHONPATH", None)
    where = subprocess.run([fresh_python, "-c", "import paged_chat; print(paged_chat.__file__)"],
                           cwd=tmp_path, env=env, capture_output=True, text=True, check=True)
    assert Path(where.stdout.strip()).is_relative_to(fresh_site)

    result = subprocess.run([fresh / "bin" / "paged-chat", "ask", "--stats", "--max-tokens", "8",
                             "--temperature", "0", "Say hi."],
                            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip()
    assert "tokens/s" in result.stderr
    kernels = home / "cache" / "kernels"
    assert stat.S_IMODE(kernels.stat().st_mode) == 0o700
    assert list(kernels.glob("paged-chat-kernels-*.so")), f"no native build: {result.stderr}"
