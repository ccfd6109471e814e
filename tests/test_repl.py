"""`paged-chat chat`: the interactive loop, driven with lines on stdin on the tiny chat
model (in-process, through CliRunner), and once for real in a pseudo-terminal on the
default model: a reply streams, Ctrl+C stops it, Ctrl+D exits."""

from __future__ import annotations

import fcntl
import os
import pty
import select
import signal
import subprocess
import sys
import termios
import time

import pytest
from helpers import REPO, default_gguf, link, write_manifest

from paged_chat.app.chat_store import ChatStore
from paged_chat.cli.chat import Repl


def test_each_line_is_a_saved_turn_and_the_commands_work(cli):
    alone = cli.json("--no-save", "--system", "Be brief.", "What is a page?")["text"]
    result = cli("chat", "--system", "Be brief.",
                 input="What is a page?\n\n/stats\nAnd a block?\n/system Be very brief.\n/system\n"
                       "/new\nA new topic\n/nonsense\n/help\n/quit\nnever asked\n")
    assert result.exit_code == 0, result.stderr
    with cli.store() as store:
        second, first = (store.get_chat(chat.id) for chat in store.list_chats())
    assert [m.content for m in first.messages if m.role == "user"] == ["What is a page?", "And a block?"]
    assert first.title == "What is a page?" and first.system_prompt == "Be very brief."
    assert first.messages[1].content == alone                   # the same reply as `ask`
    assert [m.content for m in second.messages if m.role == "user"] == ["A new topic"]
    assert second.system_prompt == "Be brief."                   # /new: the default again
    out = result.stdout
    assert out.startswith(alone + "\n")                           # streamed, then a newline
    assert "prompt tokens" in out and "KV pool:" in out           # /stats
    assert "system prompt: 'Be very brief.'" in out and "/quit" in out   # /system, /help
    assert "unknown command '/nonsense'" in result.stderr
    assert "never asked" not in out and all(m.content != "never asked" for m in second.messages)


@pytest.mark.parametrize("command", [["chat"], ["chats", "list"], ["ask"], ["models"]])
def test_help_shows_the_new_options(cli, command):
    result = cli(*command, "--help")
    assert result.exit_code == 0 and "Usage:" in result.stdout, result.output


def test_end_of_input_exits_and_continue_goes_on_with_the_chat(cli):
    assert cli("chat", input="First question\n").exit_code == 0
    result = cli("chat", "-c", input="Second question\n")
    assert result.exit_code == 0, result.stderr
    with cli.store() as store:
        [chat] = store.list_chats()
        users = [m.content for m in store.get_chat(chat.id).messages if m.role == "user"]
    assert users == ["First question", "Second question"]
    assert cli("chat", "--chat", "nope", input="Hi\n").exit_code == 1


def signal_at_third_delta(monkeypatch, signum: int) -> None:
    """Send `signum` to this process once the loop has printed three pieces of a reply, as
    a user pressing Ctrl+C (or a `kill`) while it streams."""
    write, written = Repl._write, []

    def write_then_signal(self: Repl, text: str) -> None:
        write(self, text)
        written.append(text)
        if len(written) == 3:
            os.kill(os.getpid(), signum)

    monkeypatch.setattr(Repl, "_write", write_then_signal)


def test_ctrl_c_stops_the_reply_keeps_it_and_the_loop_goes_on(cli, monkeypatch):
    signal_at_third_delta(monkeypatch, signal.SIGINT)
    before = signal.getsignal(signal.SIGINT)
    cli.config.write_text(cli.config.read_text().replace("max_tokens = 8", "max_tokens = 50"))
    result = cli("chat", input="Tell me a long story\nAnd then?\n")
    assert result.exit_code == 0, result.stderr
    assert "(stopped: the reply so far is saved)" in result.stderr
    with cli.store() as store:
        messages = store.latest_chat().messages
    assert [m.finish_reason for m in messages] == [None, "abort", None, "length"]
    assert 0 < len(messages[1].token_ids) < 50 and len(messages[3].token_ids) == 50
    shown, _, rest = result.stdout.partition("\n")
    assert messages[1].content.startswith(shown) and rest.startswith(messages[3].content)
    assert signal.getsignal(signal.SIGINT) is before


def test_nothing_prints_after_ctrl_c(cli, monkeypatch):
    write, written, after_signal = Repl._write, [], []

    def write_then_signal(self: Repl, text: str) -> None:
        write(self, text)
        (after_signal if len(written) >= 3 else written).append(text)
        if len(written) == 3 and not after_signal:
            os.kill(os.getpid(), signal.SIGINT)

    monkeypatch.setattr(Repl, "_write", write_then_signal)
    cli.config.write_text(cli.config.read_text().replace("max_tokens = 8", "max_tokens = 50"))
    result = cli("chat", input="Tell me a long story\n")
    assert result.exit_code == 0, result.stderr
    assert after_signal == [] and result.stdout == "".join(written) + "\n"


def test_new_starts_from_the_default_system_prompt(cli):
    result = cli("chat", "--system", "Be brief.",
                 input="First\n/system Be very brief.\n/new\n/system\nSecond\n")
    assert result.exit_code == 0, result.stderr
    assert "system prompt: 'Be brief.'" in result.stdout
    with cli.store() as store:
        second, first = (store.get_chat(chat.id) for chat in store.list_chats())
    assert first.system_prompt == "Be very brief." and second.system_prompt == "Be brief."


def test_stats_waits_for_the_snapshot_after_the_reply(monkeypatch):
    """The snapshot at hand when a piped reply ends can be a step old: /stats shows the one
    the engine publishes once idle."""
    import io
    import threading
    from types import SimpleNamespace

    busy = SimpleNamespace(num_running=1, num_waiting=0, blocks_in_use=7, num_blocks=128, blocks_cached=0)
    idle = SimpleNamespace(num_running=0, num_waiting=0, blocks_in_use=0, num_blocks=128, blocks_cached=7)
    client = SimpleNamespace(snapshot=busy)
    client.stats = lambda: client.snapshot
    calls = []

    def stats() -> SimpleNamespace:
        calls.append(1)
        if len(calls) == 3:  # the idle snapshot arrives from the engine's thread meanwhile
            threading.Thread(target=setattr, args=(client, "snapshot", idle)).start()
        return client.snapshot

    client.stats = stats
    out = io.StringIO()
    repl = Repl(client, None, SimpleNamespace(model="tiny"), None, None, out, "ready")
    repl._stats("")
    assert "KV pool: 0 of 128 blocks in use, 7 cached for reuse" in out.getvalue(), out.getvalue()


def test_sigterm_stops_the_reply_and_ends_the_loop(cli, monkeypatch):
    signal_at_third_delta(monkeypatch, signal.SIGTERM)
    result = cli("chat", input="Hi\nnever asked\n")
    assert result.exit_code == 143
    with cli.store() as store:
        assert [m.finish_reason for m in store.latest_chat().messages] == [None, "abort"]


def take_the_terminal() -> None:
    """In the child: a session of its own whose controlling terminal is the pty on stdin,
    so the pty's line discipline turns Ctrl+C into SIGINT as a real terminal does."""
    os.setsid()
    fcntl.ioctl(0, termios.TIOCSCTTY, 0)


def read_until(fd: int, wanted, deadline_s: float) -> bytes:
    """Read the pty until `wanted(bytes so far)` holds; fail (with what came) after the bound."""
    seen, deadline = b"", time.monotonic() + deadline_s
    while not wanted(seen):
        remaining = deadline - time.monotonic()
        assert remaining > 0, f"timed out; the terminal showed: {seen.decode(errors='replace')!r}"
        ready, _, _ = select.select([fd], [], [], remaining)
        if ready:
            try:
                chunk = os.read(fd, 4096)
            except OSError:  # the child closed the terminal
                break
            seen += chunk
    assert wanted(seen), f"the terminal closed; it showed: {seen.decode(errors='replace')!r}"
    return seen


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_real_terminal_streams_stops_on_ctrl_c_and_exits_on_ctrl_d(tmp_path):
    """On the default model as Ollama would store it (`ollama:smollm2`, its blob a link to
    the GGUF file): the name resolves and the blob loads in place."""
    ollama = tmp_path / "ollama"
    link(default_gguf(), ollama / "blobs" / f"sha256-{'a' * 64}")
    write_manifest(ollama, ("registry.ollama.ai", "library", "smollm2", "latest"), f"sha256:{'a' * 64}")
    env = {**os.environ, "PAGED_CHAT_DATA_DIR": str(tmp_path), "PAGED_CHAT_CONFIG": str(tmp_path / "none.toml"),
           "OMP_NUM_THREADS": "1", "TERM": "dumb", "OLLAMA_MODELS": str(ollama)}
    controller, terminal = pty.openpty()
    process = subprocess.Popen(
        [sys.executable, "-m", "paged_chat", "chat", "-m", "ollama:smollm2", "--system", "You tell long stories."],
        cwd=REPO, env=env, stdin=terminal, stdout=terminal, stderr=terminal,
        preexec_fn=take_the_terminal)
    os.close(terminal)
    try:
        read_until(controller, lambda seen: b">>> " in seen, 300)
        os.write(controller, b"Write a very long story about a lighthouse keeper.\r")
        typed = read_until(controller, lambda seen: b"lighthouse keeper." in seen, 60)
        streamed = read_until(controller, lambda seen: len(seen.strip()) > 40, 300)   # it streams
        assert process.poll() is None and b">>> " not in streamed
        os.write(controller, b"\x03")   # Ctrl+C, as the terminal sends it
        stopped = read_until(controller, lambda seen: b">>> " in seen, 120)
        assert b"(stopped: the reply so far is saved)" in stopped
        os.write(controller, b"\x04")   # Ctrl+D at the prompt
        assert process.wait(timeout=120) == 0
    finally:
        if process.poll() is None:
            process.kill()
        os.close(controller)
    with ChatStore(tmp_path / "chats.db") as store:
        chat = store.latest_chat()
    user, reply = chat.messages
    assert user.content == "Write a very long story about a lighthouse keeper."
    assert chat.model == str((ollama / "blobs" / f"sha256-{'a' * 64}").resolve())   # the blob, read in place
    assert reply.finish_reason == "abort" and len(reply.token_ids) > 5
    shown = (typed + streamed + stopped).decode(errors="replace").replace("\r\n", "\n")
    assert reply.content.strip()[:30] in shown
    assert (tmp_path / "chat_history").read_text().strip().endswith("lighthouse keeper.")
