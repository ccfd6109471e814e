"""Opening the files paged-chat reads: regular files only, and an open that never blocks.

A FIFO, a character device (/dev/zero, a tty) or a socket where a config file, a manifest,
a model file or a KV tier entry should be would block the open or the read forever, or
never end. Every such file is opened with O_NONBLOCK (a FIFO's open returns at once
instead of waiting for a writer; on a regular file the flag does nothing) and fstat'ed
before a byte is read: what is not a regular file raises NotARegularFileError, an OSError
naming what it is. `follow_links=False` adds O_NOFOLLOW, for directories whose entries
must never be links (the KV tier). The check is on the descriptor that is read, so no
rename between a check and the open can slip another file in.

The engine and the app both read files this way; it lives in the engine because the
engine never imports the app.
"""

from __future__ import annotations

import errno
import os
import stat
from io import BufferedReader, FileIO
from pathlib import Path

_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
          (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
          (stat.S_ISSOCK, "a socket"), (stat.S_ISLNK, "a symbolic link"))


class NotARegularFileError(OSError):
    """The path names something that is not a regular file (or a link where none may be).
    Its message is "PATH is WHAT", without the errno."""

    def __str__(self) -> str:
        return f"{self.filename} is {self.strerror}"


class FileTooLargeError(NotARegularFileError):
    """A file read whole is larger than its bound (as endless as a device, for its reader)."""


def file_kind(mode: int) -> str:
    """What a file of this st_mode is, in words ("a FIFO (named pipe)", "a directory"...)."""
    return next((kind for is_kind, kind in _KINDS if is_kind(mode)), "not a regular file")


def open_regular(path: str | Path, *, dir_fd: int | None = None, follow_links: bool = True,
                 buffered: bool = True) -> BufferedReader | FileIO:
    """`path` opened for reading in binary mode, once it is known to be a regular file.

    Raises NotARegularFileError for anything else (and, with follow_links=False, for a
    symbolic link), and the open's own OSError (FileNotFoundError, PermissionError...).
    """
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | (0 if follow_links else os.O_NOFOLLOW)
    try:
        fd = os.open(path, flags, dir_fd=dir_fd)
    except OSError as error:
        if error.errno == errno.ELOOP and not follow_links:
            raise NotARegularFileError(errno.ELOOP, "a symbolic link (links are not followed here)",
                                       str(path)) from None
        raise
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise NotARegularFileError(errno.EINVAL, f"{file_kind(mode)}, not a regular file",
                                       str(path))
        file = open(fd, "rb", buffering=-1 if buffered else 0)
    except BaseException:
        os.close(fd)
        raise
    (file.raw if buffered else file).name = str(path)  # messages name the path, not the fd
    return file


def read_regular(path: str | Path, max_bytes: int) -> bytes:
    """The whole of the regular file `path`; FileTooLargeError when it holds more than
    `max_bytes` (checked by reading, not by st_size, which a file may misstate)."""
    with open_regular(path) as file:
        data = file.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise FileTooLargeError(errno.EFBIG, f"larger than {max_bytes:,} bytes, too large for "
                                             "this kind of file", str(path))
    return data
