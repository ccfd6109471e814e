"""A grammar's trial compile in a child process: bounded in memory, and killed when nobody
waits for it any more.

xgrammar can neither stop a compile nor bound its memory, and a hostile schema compiles
for minutes and takes gigabytes. So the structured-output manager compiles a grammar its
cache does not hold first in a `TrialCompiler`'s child, whose address space is limited
(RLIMIT_AS) to its size when the compile starts plus `memory_bytes`, and kills the child
when the compile's last waiter leaves or its time limit passes. xgrammar's compile is
deterministic: a grammar that passed its trial takes as much time and memory when the
engine's process compiles it again for its matchers. (The compiled grammar does not come
back from the child: xgrammar's serialize_json and deserialize_json cost about a hundred
compiles of it.)

The child compiles on one thread: past its limit, a compile then raises std::bad_alloc,
where in xgrammar's thread pool it aborts or deadlocks the process. The child ends with
the thread that started it (PR_SET_PDEATHSIG): start it on a thread that lives as long as
the process.

Each way, a frame is a 4-byte big-endian length and that many bytes. The parent sends the
TokenizerInfo's JSON, then one frame per trial, a JSON object {"grammar": the Grammar's
JSON, "memory_bytes": int}; the child answers each with {"ok": true} or
{"error": "memory" | "compile", "message": str}.
"""

from __future__ import annotations

import json
import os
import signal
import struct
import subprocess
import sys
from typing import BinaryIO

_LENGTH = struct.Struct(">I")
_PR_SET_PDEATHSIG = 1


class TrialOutOfMemory(Exception):
    """The grammar's compile needed more memory than its trial's limit."""


class TrialFailed(Exception):
    """The grammar library refused to compile the grammar; the message says why."""


class TrialEnded(Exception):
    """The child ended before it answered: killed (`kill`), or crashed."""


class TrialCompiler:
    """A child process that trial-compiles grammars for one tokenizer, one at a time."""

    def __init__(self, tokenizer_info_json: str) -> None:
        self._process = subprocess.Popen(
            [sys.executable, "-m", __name__, str(os.getpid())],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        self._tokenizer_info = tokenizer_info_json.encode()
        self._started = False

    @property
    def pid(self) -> int:
        return self._process.pid

    @property
    def alive(self) -> bool:
        return self._process.poll() is None

    def trial(self, grammar_json: str, memory_bytes: int) -> None:
        """Compile the grammar in the child, its address space allowed to grow by at most
        `memory_bytes`. Raises TrialOutOfMemory past that, TrialFailed for a grammar the
        library refuses, TrialEnded when the child ends first."""
        request = json.dumps({"grammar": grammar_json, "memory_bytes": memory_bytes}).encode()
        try:
            if not self._started:  # here, not in __init__: the child reads it after its imports
                self._started = True
                _write_frame(self._process.stdin, self._tokenizer_info)
            _write_frame(self._process.stdin, request)
            reply = _read_frame(self._process.stdout)
        except (BrokenPipeError, ValueError) as error:  # ValueError: a pipe closed by kill
            raise TrialEnded(self._ending()) from error
        if reply is None:
            raise TrialEnded(self._ending())
        answer = json.loads(reply)
        if answer.get("error") == "memory":
            raise TrialOutOfMemory(answer["message"])
        if "error" in answer:
            raise TrialFailed(answer["message"])

    def kill(self) -> None:
        """End the child now (a trial in progress raises TrialEnded) and reap it."""
        self._process.kill()
        self._process.wait()

    def _ending(self) -> str:
        code = self._process.wait()
        if code < 0:
            return f"its process was ended by {signal.Signals(-code).name}"
        return f"its process exited with code {code}"


def _write_frame(stream: BinaryIO, payload: bytes) -> None:
    stream.write(_LENGTH.pack(len(payload)) + payload)
    stream.flush()


def _read_frame(stream: BinaryIO) -> bytes | None:
    """The next frame; None at the end of the stream."""
    header = stream.read(_LENGTH.size)
    if len(header) < _LENGTH.size:
        return None
    (length,) = _LENGTH.unpack(header)
    payload = stream.read(length)
    return payload if len(payload) == length else None


def _address_space() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")


def _end_with_parent(parent_pid: int) -> None:
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent_pid:  # the parent ended before prctl took
        os._exit(1)


def _serve(parent_pid: int) -> None:
    import resource

    _end_with_parent(parent_pid)
    replies = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # what a library prints goes to stderr, never into a reply
    requests = sys.stdin.buffer
    import xgrammar as xgr

    tokenizer_info = _read_frame(requests)
    if tokenizer_info is None:
        return
    compiler = xgr.GrammarCompiler(xgr.TokenizerInfo.deserialize_json(tokenizer_info.decode()),
                                   max_threads=1, cache_enabled=False)
    unlimited = resource.getrlimit(resource.RLIMIT_AS)
    while (frame := _read_frame(requests)) is not None:
        request = json.loads(frame)
        grammar = xgr.Grammar.deserialize_json(request["grammar"])
        resource.setrlimit(resource.RLIMIT_AS,
                           (_address_space() + request["memory_bytes"], unlimited[1]))
        try:
            compiler.compile_grammar(grammar)
            reply = {"ok": True}
        except (MemoryError, RuntimeError) as error:
            memory = isinstance(error, MemoryError) or "bad_alloc" in str(error)
            reply = {"error": "memory" if memory else "compile", "message": str(error)}
        finally:
            resource.setrlimit(resource.RLIMIT_AS, unlimited)
        _write_frame(replies, json.dumps(reply).encode())


if __name__ == "__main__":
    _serve(int(sys.argv[1]))
