"""C kernels built once per machine with the system C compiler, loaded with ctypes (which
releases the GIL for each call).

A library is built into a per-user folder under the temp dir, named by a hash of its
source, compiler and flags, with -march=native: a binary never moves between machines.
Its OpenMP runtime is torch's own (same soname, already loaded), so thread counts and the
thread pool are shared with torch's ops. This folder is on every build's include path: its
headers (vector_exp.h) are in every build's hash, and so are the C files a source
includes from under it (models/decode_layer.c builds three others into one library).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

_HEADERS = Path(__file__).parent / "csrc"
logger = logging.getLogger(__name__)
NATIVE_FLAG_SETS = (["-O3", "-march=native", "-fopenmp"], ["-O3", "-march=native"])


def compile_library(source: Path, flag_sets: tuple[list[str], ...] = NATIVE_FLAG_SETS
                    ) -> ctypes.CDLL | None:
    """`source` built with the first of `flag_sets` the compiler takes, or None where no C
    compiler builds it."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        return None
    text = b"".join(path.read_bytes() for path in (source, *_included_sources(source),
                                                     *sorted(_HEADERS.glob("*.h"))))
    folder = Path(tempfile.gettempdir()) / f"paged-chat-kernels-{os.getuid()}"
    for flags in flag_sets:
        digest = hashlib.sha256(text + " ".join([compiler, *flags]).encode()).hexdigest()[:16]
        target = folder / f"{source.stem}-{digest}.so"
        if target.is_file():
            logger.debug("%s: built for this machine before, nothing compiled (%s)",
                         source.name, target)
        else:
            started = time.perf_counter()
            folder.mkdir(parents=True, exist_ok=True)
            partial = folder / f".partial-{os.getpid()}-{target.name}"
            result = subprocess.run([compiler, *flags, f"-I{_HEADERS}", "-shared", "-fPIC",
                                     "-o", str(partial), str(source), "-lm"],
                                    capture_output=True, check=False)
            if result.returncode != 0:
                partial.unlink(missing_ok=True)
                continue
            os.replace(partial, target)
            logger.info("%s: compiled for this machine in %.1f s (%s), once: later starts "
                        "load %s", source.name, time.perf_counter() - started, " ".join(flags),
                        target)
        return ctypes.CDLL(str(target))
    return None


def _included_sources(source: Path) -> list[Path]:
    """The files `source` #includes by a path under this folder ("models/fused_ops.c"),
    and theirs: a change to any of them is a new build."""
    found: list[Path] = []
    for line in source.read_text().splitlines():
        name = line.removeprefix("#include \"").removesuffix("\"")
        if line.startswith("#include \"") and (_HEADERS / name).is_file():
            included = _HEADERS / name
            if included not in found and included.suffix == ".c":
                found += [included, *_included_sources(included)]
    return found


class NativeLibrary:
    """One C source's library, built (or found built) on first use, once per process;
    `declare` sets the argument types of its functions on each library built."""

    def __init__(self, source: Path, declare: Callable[[ctypes.CDLL], None]) -> None:
        self.source = source
        self.declare = declare
        self._library: ctypes.CDLL | None = None
        self._loaded = False
        self._lock = threading.Lock()

    def load(self) -> ctypes.CDLL | None:
        """The native build, or None where no C compiler builds it."""
        if self._loaded:  # the hot path: several hundred calls a decode step, no lock
            return self._library
        with self._lock:
            if not self._loaded:
                self._library = self.build(NATIVE_FLAG_SETS)
                self._loaded = True
        return self._library

    def build(self, flag_sets: tuple[list[str], ...]) -> ctypes.CDLL | None:
        """A build with the first of `flag_sets` the compiler takes (tests build variants)."""
        lib = compile_library(self.source, flag_sets)
        if lib is not None:
            self.declare(lib)
        return lib
