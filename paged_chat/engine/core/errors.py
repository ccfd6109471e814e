"""Exceptions (and the one warning) the engine raises. The CLI and TUI turn each into one line
for the user."""

from collections.abc import Iterator
from contextlib import contextmanager


class PagedChatError(Exception):
    """Base class: anything the user can act on, with a message that says how."""


class ModelLoadError(PagedChatError):
    """A model spec could not be resolved or its files could not be read."""


class UnsupportedModelError(ModelLoadError):
    """The weights are readable but the architecture is not one the decoder implements."""


class KVTierWarning(UserWarning):
    """The disk KV tier turned itself off (full, read-only or vanished directory); the engine
    goes on without it, and `EngineStats.tier.disk_error` says why."""


class EngineDeadError(PagedChatError):
    """The engine's step loop failed; every open stream gets this."""


# Errors whose message is written for the user: ours, ValueError (a bad setting names its
# field) and OSError (names its path). Anything else is a surprise.
USER_ERRORS = (PagedChatError, ValueError, OSError)


def describe_error(error: BaseException) -> str:
    """The one line a user sees for an error: its message, or for a surprise its type too."""
    if isinstance(error, USER_ERRORS):
        return str(error)
    return f"{type(error).__name__}: {error}"


# On the CPU, torch's allocator reports a failure as a plain RuntimeError with this text.
_CPU_ALLOCATION_FAILURE = "can't allocate memory"


@contextmanager
def out_of_memory(doing: str, advice: str) -> Iterator[None]:
    """Turn an out-of-memory error at start-up into one line that says what to change."""
    import torch  # this module is imported by the app: keep torch out of its import

    try:
        yield
    except (torch.OutOfMemoryError, MemoryError, RuntimeError) as error:
        cpu_failure = isinstance(error, MemoryError) or _CPU_ALLOCATION_FAILURE in str(error)
        if not isinstance(error, torch.OutOfMemoryError) and not cpu_failure:
            raise
        raise PagedChatError(f"out of memory while {doing}: {advice}") from error
