"""The app's engine: its config as the app runs it, and its start (in a process of its own
by default). This module imports no Textual: the bare command launches the engine through
it before Textual loads (start.py), so the two load side by side."""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from paged_chat.app.settings import Settings, cache_dir
from paged_chat.tui.frame_clock import FRAME_S

if TYPE_CHECKING:
    from paged_chat.engine import EngineConfig, StartingClient

DEMO_NUM_BLOCKS = 1536      # --demo's KV pool unless config.toml sizes it
STATS_EVERY_S = FRAME_S / 2  # two snapshots a frame: a frame never finds the one it drew


def app_engine_config(settings: Settings, demo: int | None) -> EngineConfig:
    """`[engine]` as the app runs it: with --demo, a pool the block map shows block by block
    unless config.toml sizes it."""
    pool = {}
    if demo and settings.engine.num_blocks is None and settings.engine.kv_cache_memory is None:
        pool = {"num_blocks": DEMO_NUM_BLOCKS}
    return settings.engine_config(**pool)


def start_engine(config: EngineConfig, in_a_process: bool = True) -> StartingClient:
    """The app's engine, on its way: in a process of its own (launched now), its output to a
    log file (the app owns the terminal), its steps on the cores its thread policy picks;
    else on a thread of the app (`[tui] engine_process = false`), started when the app
    waits for it. It sends a stats snapshot (the whole block map) every STATS_EVERY_S while
    it steps: each of the app's frames finds one it has not drawn."""
    from paged_chat.app.client_spec import client_spec
    from paged_chat.engine import start_client

    if not in_a_process:
        spec = client_spec(config, "thread")
    else:
        spec = client_spec(config, "process", log_path=cache_dir() / "engine.log",
                           fork_if_safe=True)
    return start_client(replace(spec, stats_interval_s=STATS_EVERY_S))
