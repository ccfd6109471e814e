"""Where paged-chat keeps its files: platformdirs locations, each overridable by an env var.

The env vars let tests and scripted runs keep everything out of the real home directory.
Each directory is created on first use, so callers can write into it straight away.
"""

from __future__ import annotations

import os
from pathlib import Path

import platformdirs

APP_NAME = "paged-chat"


def _ensure(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    return path


def _env_path(var: str) -> Path | None:
    value = os.environ.get(var)
    return Path(value).expanduser() if value else None


def cache_dir() -> Path:
    """Converted artefacts that can be rebuilt at any time (e.g. GGUF tokenizers)."""
    return _ensure(_env_path("PAGED_CHAT_CACHE_DIR") or platformdirs.user_cache_path(APP_NAME))


def data_dir() -> Path:
    """User data that cannot be rebuilt (the chat store)."""
    return _ensure(_env_path("PAGED_CHAT_DATA_DIR") or platformdirs.user_data_path(APP_NAME))


def config_path() -> Path:
    """The config.toml file; it may not exist yet."""
    return _env_path("PAGED_CHAT_CONFIG") or platformdirs.user_config_path(APP_NAME) / "config.toml"


def config_dir() -> Path:
    """The directory holding config.toml."""
    return _ensure(config_path().parent)
