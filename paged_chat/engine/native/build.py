"""C sources built into one shared library with the system C compiler, once per machine,
loaded with ctypes (which releases the GIL for each call).

A build goes into `<cache_dir>/kernels` (`use_cache_dir`: the EngineConfig's cache_dir;
else the user's platformdirs cache dir), a folder created mode 0700. A library is loaded
only from a folder and a file this user owns and no one else can write; otherwise a
warning says why and nothing loads (the caller runs its torch paths). A build is named by
a hash of every source and header, the compiler, the flags and this machine's CPU (its
model and feature flags): a -march=native build never loads on another CPU, even from a
shared cache dir. Its OpenMP runtime is torch's own (same soname, already loaded), so
thread counts and the thread pool are shared with torch's ops.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import stat
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path

import platformdirs

logger = logging.getLogger(__name__)
# -flto: the sources are separate translation units, and a kernel's inner calls across
# them (a tile, a work item) must still inline as they did when one file held them all.
NATIVE_FLAG_SETS = (["-O3", "-march=native", "-fopenmp", "-flto"], ["-O3", "-march=native", "-fopenmp"],
                    ["-O3", "-march=native"])
BUILD_FOLDER_NAME = "kernels"
_APP_NAME = "paged-chat"

_cache_dir: Path | None = None


def use_cache_dir(cache_dir: str | Path | None) -> None:
    """Later builds go under `<cache_dir>/kernels` (None: the user's cache dir)."""
    global _cache_dir
    _cache_dir = None if cache_dir is None else Path(cache_dir)


def build_folder() -> Path:
    """Where builds go: `<cache_dir>/kernels`."""
    return (_cache_dir or platformdirs.user_cache_path(_APP_NAME)) / BUILD_FOLDER_NAME


@functools.cache
def cpu_description() -> str:
    """This machine's CPU as a build depends on it: vendor, model and feature flags of its
    first processor in /proc/cpuinfo (elsewhere, what `platform` says)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return f"{platform.machine()} {platform.processor()}"
    fields: dict[str, str] = {}
    for line in text.splitlines():
        if not line.strip():
            break
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    keys = ("vendor_id", "model name", "flags", "CPU implementer", "CPU part", "Features")
    return f"{platform.machine()} " + " | ".join(fields.get(key, "") for key in keys)


def compile_library(name: str, sources: Sequence[Path],
                    flag_sets: Sequence[list[str]] = NATIVE_FLAG_SETS) -> ctypes.CDLL | None:
    """`sources` compiled together into one library `name`, with the first of `flag_sets`
    the compiler takes; every header in the sources' folders is on the include path. None,
    after a warning, where no C compiler builds it, a source is missing or the build folder
    or file is not this user's alone; None without one where there is no C compiler."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        return None
    missing = [str(source) for source in sources if not source.is_file()]
    if missing:
        logger.warning("native kernels not built, a source is missing (a broken install?): "
                       "%s; the torch paths run", ", ".join(missing))
        return None
    folders = sorted({source.parent for source in sources})
    headers = sorted(header for folder in folders for header in folder.glob("*.h"))
    text = b"".join(path.read_bytes() for path in (*sources, *headers))
    folder = build_folder()
    refused = _refusal(folder, create=True)
    if refused:
        logger.warning("native kernels not loaded: %s; the torch paths run", refused)
        return None
    errors = b""
    for flags in flag_sets:
        key = "\0".join([compiler, *flags, cpu_description()]).encode()
        digest = hashlib.sha256(text + b"\0" + key).hexdigest()[:16]
        target = folder / f"{name}-{digest}.so"
        if target.exists():
            logger.debug("%s: built for this machine before, nothing compiled (%s)", name,
                         target)
        else:
            started = time.perf_counter()
            partial = folder / f".partial-{os.getpid()}-{target.name}"
            result = subprocess.run([compiler, *flags, *(f"-I{f}" for f in folders), "-shared",
                                     "-fPIC", "-o", str(partial), *map(str, sources), "-lm"],
                                    capture_output=True, check=False)
            if result.returncode != 0:
                partial.unlink(missing_ok=True)
                errors = result.stderr
                continue
            os.replace(partial, target)
            logger.info("%s: compiled for this machine in %.1f s (%s), once: later starts "
                        "load %s", name, time.perf_counter() - started, " ".join(flags),
                        target)
        refused = _refusal(target)
        if refused:
            logger.warning("native kernels not loaded: %s; the torch paths run", refused)
            return None
        return ctypes.CDLL(str(target))
    logger.warning("native kernels did not compile with %s; the torch paths run:\n%s",
                   compiler, errors.decode(errors="replace")[-2000:])
    return None


def _refusal(path: Path, create: bool = False) -> str | None:
    """Why `path` (a build folder, created 0700 first where `create`, or a built file) may
    not be loaded from: not a plain folder or file, owned by another user, or writable by
    group or others. None where it may."""
    try:
        if create:
            path.parent.mkdir(parents=True, exist_ok=True)
            try:
                path.mkdir(mode=0o700)
            except FileExistsError:
                pass
        info = os.lstat(path)
    except OSError as exc:
        return f"{path} could not be made: {exc.strerror}"
    kind = stat.S_ISDIR if create else stat.S_ISREG
    if not kind(info.st_mode):
        return f"{path} is not a plain {'folder' if create else 'file'}"
    if info.st_uid != os.getuid():
        return f"{path} is owned by another user (uid {info.st_uid}, this user is {os.getuid()})"
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return (f"{path} can be written by other users (mode {stat.S_IMODE(info.st_mode):04o}); "
                f"make it private (chmod go-w) or remove it")
    return None
