"""Running torch work on a thread that ends with it, so the systems measured in one process
do not slow each other down through OpenMP.

GNU OpenMP (torch's CPU thread pool on Linux) keeps a pool of worker threads for every
thread that has run a parallel op, for as long as that thread lives, and its workers stop
spin-waiting between parallel regions once the process holds more such threads than it has
cores. A system whose steps run on a thread of their own (paged-chat's thread transport, the
TUI, transformers' continuous batching) is then slowed by a pool some other system left
behind on the main thread. The bench therefore builds and runs each system on a thread that
ends afterwards, and its main thread runs no torch op.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

T = TypeVar("T")


def on_own_thread(work: Callable[[], T]) -> T:
    """`work()` on a new thread that ends when it returns (with it, its OpenMP pool)."""
    with ThreadPoolExecutor(max_workers=1) as executor:
        return executor.submit(work).result()
