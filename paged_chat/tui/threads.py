"""The engine's thread policy inside the TUI: torch's threads leave the UI thread a core.

The engine's many short parallel regions wait at a barrier for their slowest thread; when
the UI thread (Markdown, panels, the event loop) takes one of those threads' cores, every
region stalls. Leaving the UI a core costs the engine one thread and spares it the stalls.
"""

from __future__ import annotations

import os


def engine_threads(cores: int | None = None) -> int:
    """torch threads for an engine that shares the process with the UI: the cores this
    process may run on, less one (at least one)."""
    cores = cores if cores is not None else len(os.sched_getaffinity(0))
    assert cores >= 1, cores
    return max(1, cores - 1)


def leave_the_ui_a_core() -> int:
    """Apply `engine_threads()` to torch; return the thread count set."""
    import torch

    threads = engine_threads()
    torch.set_num_threads(threads)
    return threads
