"""paged-chat's OpenAI-compatible API server (`paged-chat serve`, `paged-chat --serve`)."""

from paged_chat.server.app import build_app
from paged_chat.server.run import DEFAULT_HOST, DEFAULT_PORT, ApiServer, UnsafeBindError, check_bind

__all__ = ["ApiServer", "DEFAULT_HOST", "DEFAULT_PORT", "UnsafeBindError", "build_app", "check_bind"]
