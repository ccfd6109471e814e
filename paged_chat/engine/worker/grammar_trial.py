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

A child idle for IDLE_EXIT_S exits (exit code 0, which a trial sent to it as it leaves
ends in: `TrialEnded.idle`), so a warm child costs memory only while grammars compile.

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

import contextlib
import json
import os
import select
import signal
import struct
import subprocess
import sys
from typing import BinaryIO

# How long a child waits for its next trial before it exits: it holds a few hundred MB (its
# imports, torch among them), and a new one takes seconds to start.
IDLE_EXIT_S = 120.0
_LENGTH = struct.Struct(">I")
_PR_SET_PDEATHSIG = 1


class TrialOutOfMemory(Exception):
    """The grammar's compile needed more memory than its trial's limit."""


class TrialFailed(Exception):
    """The grammar library refused to compile the grammar; the message says why."""


class TrialEnded(Exception):
    """The child ended before it answered: killed (`kill`), crashed, or it left idle
    (`idle`: the trial was never started, a new child may take it)."""

    def __init__(self, message: str, idle: bool) -> None:
        super().__init__(message)
        self.idle = idle


class TrialCompiler:
    """A child process that trial-compiles grammars for one tokenizer, one at a time."""

    def __init__(self, tokenizer_info_json: str) -> None:
        self._process = subprocess.Popen(
            [sys.executable, "-m", __name__, str(os.getpid()), str(IDLE_EXIT_S)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        try:  # the child reads it first thing, before its imports
            _write_frame(self._process.stdin, tokenizer_info_json.encode())
        except BrokenPipeError:
            pass  # it ended at once: its first trial says how

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
            _write_frame(self._process.stdin, request)
            reply = _read_frame(self._process.stdout)
        except (BrokenPipeError, ValueError) as error:  # ValueError: a pipe closed by kill
            raise self._ended() from error
        if reply is None:
            raise self._ended()
        answer = json.loads(reply)
        if answer.get("error") == "memory":
            raise TrialOutOfMemory(answer["message"])
        if "error" in answer:
            raise TrialFailed(answer["message"])

    def kill(self) -> None:
        """End the child now (a trial in progress raises TrialEnded) and reap it."""
        self._process.kill()
        self._process.wait()

    def close(self) -> None:
        """Kill the child of a trial compiler nobody uses any more, and close its pipes."""
        self.kill()
        self._close_pipes()

    def _close_pipes(self) -> None:
        for pipe in (self._process.stdin, self._process.stdout):
            with contextlib.suppress(OSError):
                pipe.close()

    def _ended(self) -> TrialEnded:
        code = self._process.wait()
        self._close_pipes()
        if code < 0:
            return TrialEnded(f"its process was ended by {signal.Signals(-code).name}", idle=False)
        return TrialEnded(f"its process exited with code {code}", idle=code == 0)


def _write_frame(stream: BinaryIO, payload: bytes) -> None:
    stream.write(_LENGTH.pack(len(payload)) + payload)
    stream.flush()


def _read_frame(stream: BinaryIO) -> bytes | None:
    """The next frame; None at the end of the stream."""
    header = _read_exactly(stream, _LENGTH.size)
    if header is None:
        return None
    return _read_exactly(stream, _LENGTH.unpack(header)[0])


def _read_exactly(stream: BinaryIO, size: int) -> bytes | None:
    """`size` bytes (a raw stream returns what is there); None at the end of the stream."""
    data = b""
    while len(data) < size:
        chunk = stream.read(size - len(data))
        if not chunk:
            return None
        data += chunk
    return data


def _address_space() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")


def _end_with_parent(parent_pid: int) -> None:
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent_pid:  # the parent ended before prctl took
        os._exit(1)


def _serve(parent_pid: int, idle_exit_s: float) -> None:
    import resource

    _end_with_parent(parent_pid)
    replies = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # what a library prints goes to stderr, never into a reply
    # Unbuffered: a frame is read whole, so select() on the pipe tells whether one waits.
    requests = os.fdopen(0, "rb", buffering=0)
    tokenizer_info = _read_frame(requests)
    if tokenizer_info is None:
        return
    import xgrammar as xgr

    compiler = xgr.GrammarCompiler(xgr.TokenizerInfo.deserialize_json(tokenizer_info.decode()),
                                   max_threads=1, cache_enabled=False)
    unlimited = resource.getrlimit(resource.RLIMIT_AS)
    while select.select([requests], [], [], idle_exit_s)[0]:
        frame = _read_frame(requests)
        if frame is None:
            return
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
    _serve(int(sys.argv[1]), float(sys.argv[2]))
