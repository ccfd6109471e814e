"""Shared test setup: no network, and every paged-chat directory in a throwaway folder.

Set at import time, before any test module imports huggingface_hub or paged_chat, so
that nothing a test does can reach the network or the real home directory.
"""

import asyncio
import atexit
import os
import shutil
import tempfile
from pathlib import Path

import pytest
import torch

_TEST_HOME = Path(tempfile.mkdtemp(prefix="paged-chat-tests-"))
atexit.register(shutil.rmtree, _TEST_HOME, ignore_errors=True)

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["PAGED_CHAT_CACHE_DIR"] = str(_TEST_HOME / "cache")
# Private from the start, as the app makes it: fixtures write to it too (engine_fixtures.py).
(_TEST_HOME / "cache").mkdir(mode=0o700)
os.environ["PAGED_CHAT_DATA_DIR"] = str(_TEST_HOME / "data")
os.environ["PAGED_CHAT_CONFIG"] = str(_TEST_HOME / "config" / "config.toml")

from paged_chat.engine.native.build import use_cache_dir  # noqa: E402

use_cache_dir(_TEST_HOME / "cache")  # the native build too, for engines given no cache_dir

# pytest-asyncio asks the main thread for its event loop around each async test; with none
# set, asyncio makes one there that nobody closes, and its "unclosed event loop" warning
# lands wherever the garbage collector finds it (a CLI test's stderr, say). One, closed at exit.
_MAIN_THREAD_LOOP = asyncio.new_event_loop()
asyncio.set_event_loop(_MAIN_THREAD_LOOP)
atexit.register(_MAIN_THREAD_LOOP.close)

if not torch.cuda.is_available():
    # Without a GPU the Triton kernels run interpreted. Triton reads this when it defines a
    # kernel (its own helpers included), so it is set before anything imports triton.
    os.environ.setdefault("TRITON_INTERPRET", "1")

# None of these imports textual or fastapi (the TUI's helpers are imported by its tests):
# tests/gpu collects on a GPU image that has neither (tests/test_gpu_collection.py).
pytest_plugins = ["engine_fixtures", "server_fixtures", "cli_fixtures"]


@pytest.fixture
def store(tmp_path: Path):
    """A chat store of the test's own."""
    # Imported here: tests/gpu collects without the app's dependencies.
    from paged_chat.app.chat_store import ChatStore

    with ChatStore(tmp_path / "chats.db") as chat_store:
        yield chat_store
