"""Issue 31's command-line faults, each as a user meets them: files that are not regular
files where paged-chat reads one (3), a disk that fills during a reply (4), one-line errors
that were tracebacks or went unchecked (8), and Ctrl+C or SIGTERM at any moment, whatever a
thread is blocked on (3, 9).

Whatever could hang on the old code runs in a subprocess with a timeout, so a regression
fails instead of hanging the suite.
"""

from __future__ import annotations

import errno
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from helpers import REPO, WAIT_S, one_line, wait_for, write_manifest

from paged_chat.app.chat_store import MAX_SEARCH_WORDS, ChatStore, StoreFullError
from paged_chat.cli import ask as ask_module
from paged_chat.engine.regular_files import (
    FileTooLargeError,
    NotARegularFileError,
    open_regular,
    read_regular,
)

# A process told to stop must be gone within this (the issue's bound is "within seconds").
EXIT_BOUND_S = 20.0


def paged_chat(*args: str, env: dict[str, str], stdin: bytes = b"", timeout: float = 120
               ) -> subprocess.CompletedProcess:
    """`python -m paged_chat ARGS` in a process of its own, killed after `timeout`."""
    return subprocess.run([sys.executable, "-m", "paged_chat", *args], input=stdin,
                          capture_output=True, env={**os.environ, "PYTHONPATH": str(REPO), **env},
                          cwd=REPO, timeout=timeout)


@pytest.fixture
def dirs(tmp_path) -> dict[str, str]:
    return {"PAGED_CHAT_DATA_DIR": str(tmp_path / "data"), "PAGED_CHAT_CACHE_DIR": str(tmp_path / "cache"),
            "PAGED_CHAT_CONFIG": str(tmp_path / "none.toml")}


@pytest.fixture
def fifo(tmp_path) -> Path:
    path = tmp_path / "fifo"
    os.mkfifo(path)
    return path


# ---- 3. what is not a regular file ----------------------------------------------------


def test_open_regular_refuses_what_is_not_a_regular_file_without_blocking(tmp_path, fifo):
    (tmp_path / "real").write_bytes(b"abc")
    (tmp_path / "link").symlink_to(tmp_path / "real")
    with open_regular(tmp_path / "link") as file:  # links are followed unless told not to
        assert file.read() == b"abc" and file.name == str(tmp_path / "link")
    cases = [(fifo, {}, "a FIFO (named pipe)"), ("/dev/zero", {}, "a character device"),
             (tmp_path, {}, "a directory"),
             (tmp_path / "link", {"follow_links": False}, "a symbolic link")]
    for path, options, kind in cases:
        with pytest.raises(NotARegularFileError) as refused:
            open_regular(path, **options)
        assert str(refused.value).startswith(f"{path} is {kind}")
    with pytest.raises(FileNotFoundError):
        open_regular(tmp_path / "missing")
    (tmp_path / "big").write_bytes(b"x" * 101)
    assert read_regular(tmp_path / "real", 3) == b"abc"
    with pytest.raises(FileTooLargeError, match="larger than 100 bytes"):
        read_regular(tmp_path / "big", 100)


@pytest.mark.parametrize("target, kind", [("fifo", "a FIFO (named pipe), not a regular file"),
                                          ("/dev/zero", "a character device, not a regular file")])
def test_a_config_that_is_a_fifo_or_a_device_is_one_line(dirs, fifo, target, kind):
    path = str(fifo) if target == "fifo" else target
    done = paged_chat("config", env={**dirs, "PAGED_CHAT_CONFIG": path}, timeout=60)
    assert done.returncode == 1
    assert one_line(done.stderr.decode()) == f"Error: cannot read the config file: {path} is {kind}"


def test_a_config_file_is_read_up_to_a_bound(dirs, tmp_path):
    big = tmp_path / "big.toml"
    big.write_bytes(b"#" * (2 << 20))
    done = paged_chat("config", env={**dirs, "PAGED_CHAT_CONFIG": str(big)}, timeout=60)
    assert done.returncode == 1
    assert one_line(done.stderr.decode()) == (f"Error: cannot read the config file: {big} is larger "
                                              "than 1,048,576 bytes, too large for this kind of file")


def test_a_fifo_manifest_in_an_ollama_store_is_a_note_not_a_hang(dirs, tmp_path):
    root = tmp_path / "ollama"
    manifest = write_manifest(root, ("registry.ollama.ai", "library", "evil", "latest"), "0" * 64)
    manifest.unlink()
    os.mkfifo(manifest)
    env = {**dirs, "OLLAMA_MODELS": str(root), "LMSTUDIO_MODELS": str(tmp_path / "none"),
           "HF_HUB_CACHE": str(tmp_path / "hub")}
    listed = paged_chat("models", env=env, timeout=60)
    assert listed.returncode == 0
    note = f"Ollama: the manifest of ollama:evil:latest ({manifest}) is a FIFO (named pipe), not a regular file"
    assert note in listed.stderr.decode().splitlines()
    asked = paged_chat("ask", "-m", "ollama:evil", "Hi", env=env, timeout=60)
    assert asked.returncode == 1
    assert one_line(asked.stderr.decode()) == f"Error: {note.removeprefix('Ollama: ')}"


@pytest.mark.parametrize("target", ["fifo", "/dev/zero"])
def test_a_prompt_file_that_is_a_fifo_or_a_device_is_a_usage_error(dirs, fifo, target):
    path = str(fifo) if target == "fifo" else target
    done = paged_chat("ask", "--file", path, env=dirs, timeout=60)
    assert done.returncode == 2
    assert one_line(done.stderr.decode()).startswith(f"Error: cannot read the prompt file: {path} is a ")


def test_a_missing_prompt_file_is_a_usage_error_naming_it(cli, tmp_path):
    result = cli("ask", "--file", str(tmp_path / "none.txt"))
    assert result.exit_code == 2 and cli.engines == []
    assert one_line(result.stderr) == (f"Error: cannot read the prompt file: {tmp_path / 'none.txt'}: "
                                       "No such file or directory")


# ---- 3 and 9: signals, whatever a thread is blocked on --------------------------------

# Runs the real console entry point with the engine made to block where the test says:
# "load" (the engine thread turns matrices over in torch forever, as a model load does),
# "step" (the first step waits on a pipe no one writes) or "slow" (steps take 50 ms, so a
# reply is still streaming when the signal lands).
DRIVER = r"""
import os, sys, time, torch
from paged_chat.engine.core.engine import Engine

where = sys.argv.pop(1)
real_init, real_step = Engine.__init__, Engine.step

def slow_load(self, *args, **kwargs):
    print("loading", file=sys.stderr, flush=True)
    matrix = torch.ones(256, 256)
    while True:
        matrix = torch.tanh(matrix @ matrix)

def stuck_step(self):
    if self.has_unfinished():
        print("stepping", file=sys.stderr, flush=True)
        os.read(os.pipe()[0], 1)
    return real_step(self)

def slow_step(self):
    time.sleep(0.05)
    return real_step(self)

Engine.__init__ = slow_load if where == "load" else real_init
Engine.step = {"step": stuck_step, "slow": slow_step}.get(where, real_step)
from paged_chat.cli.main import main
sys.argv[0] = "paged-chat"
main()
"""


@pytest.fixture
def driver_env(dirs, tmp_path, chat_model_dir) -> dict[str, str]:
    config = tmp_path / "config.toml"
    config.write_text(f'[engine]\nmodel = "{chat_model_dir}"\ndevice = "cpu"\ndtype = "float32"\n'
                      'num_blocks = 64\n\n[chat]\ntemperature = 0.0\n')
    return {**dirs, "PAGED_CHAT_CONFIG": str(config)}


def run_until_signalled(where: str, args: list[str], env: dict[str, str], marker: str,
                        signum: int, on_stdout: bool = False) -> tuple[int, list[str], float]:
    """Run the driver, send `signum` once `marker` shows (on stderr, or any stdout with
    `on_stdout`); its status, its stderr lines but the markers, and how long it took to go."""
    process = subprocess.Popen([sys.executable, "-c", DRIVER, where, *args], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, env={**os.environ, "PYTHONPATH": str(REPO), **env},
                               cwd=REPO)
    seen = {"stdout": b"", "stderr": b""}

    def collect(name: str) -> None:
        stream = getattr(process, name)
        while chunk := stream.read1(4096):
            seen[name] += chunk

    readers = [threading.Thread(target=collect, args=(name,), daemon=True) for name in seen]
    for reader in readers:
        reader.start()
    try:
        wait_for(lambda: (seen["stdout"] if on_stdout else marker.encode() in seen["stderr"])
                 or process.poll() is not None, what=lambda: repr(seen))
        assert process.poll() is None, f"it ended before the signal: {seen!r}"
        process.send_signal(signum)
        signalled = time.monotonic()
        status = process.wait(timeout=EXIT_BOUND_S)
        took = time.monotonic() - signalled
    finally:
        process.kill()
    for reader in readers:
        reader.join(WAIT_S)
    lines = [line for line in seen["stderr"].decode().splitlines()
             if line not in ("loading", "stepping")]
    return status, lines, took


@pytest.mark.parametrize("signum, status", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_signal_ends_ask_while_a_step_is_stuck(driver_env, signum, status):
    code, lines, took = run_until_signalled("step", ["ask", "Hi"], driver_env, "stepping", signum)
    assert (code, lines) == (status, []) and took < EXIT_BOUND_S


def test_ctrl_c_while_the_model_loads_exits_130_without_a_word(driver_env):
    # The old code left the load running on its daemon thread while the interpreter shut
    # down: "terminate called without an active exception" and status 134 (SIGABRT).
    code, lines, took = run_until_signalled("load", ["ask", "--max-tokens", "300", "Write a long essay."],
                                            driver_env, "loading", signal.SIGINT)
    assert (code, lines) == (130, []) and took < EXIT_BOUND_S


def test_ctrl_c_after_the_first_output_exits_130_and_keeps_the_reply(driver_env):
    code, lines, _ = run_until_signalled("slow", ["ask", "--max-tokens", "300", "Write a long essay."],
                                         driver_env, "", signal.SIGINT, on_stdout=True)
    assert code == 130 and len(lines) <= 1
    with ChatStore(Path(driver_env["PAGED_CHAT_DATA_DIR"]) / "chats.db") as store:
        reply = store.latest_chat().messages[-1]
    assert reply.finish_reason == "abort" and reply.token_ids


# ---- 4. a full disk ---------------------------------------------------------------------


def fill(folder: Path) -> None:
    """Write into `folder` until its file system is full."""
    with open(folder / "filler", "wb") as file:
        try:
            while True:
                file.write(b"\0" * 65536)
                file.flush()
        except OSError as exc:
            assert exc.errno == errno.ENOSPC


@pytest.fixture
def small_disk(tmp_path):
    """A 3 MB file system (tmpfs, as root), unmounted after."""
    folder = tmp_path / "small"
    folder.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(folder)],
                             capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({mounted.stderr.decode().strip()})")
    yield folder
    subprocess.run(["umount", "-l", str(folder)], check=True)


def test_the_store_says_precisely_that_the_disk_is_full(tmp_path):
    with ChatStore(tmp_path / "chats.db") as store:
        chat = store.create_chat("t", "m")
        pages = store._conn.execute("PRAGMA page_count").fetchone()[0]
        store._conn.execute(f"PRAGMA max_page_count = {pages}")  # as full as a full disk
        with pytest.raises(StoreFullError) as full:
            store.add_message(chat.id, "user", "x" * 100_000, [1])
        assert str(full.value) == f"the disk holding the chat store {tmp_path / 'chats.db'} is full"
        assert full.value.path == tmp_path / "chats.db"
        store.add_message(chat.id, "user", "small", [1])  # the store goes on where it fits
        assert [m.content for m in store.get_chat(chat.id).messages] == ["small"]


def test_a_disk_that_fills_during_a_reply_keeps_it_and_exits_1(cli, monkeypatch, small_disk):
    monkeypatch.setenv("PAGED_CHAT_DATA_DIR", str(small_disk / "data"))
    assert cli("ask", "--max-tokens", "2", "Hi").exit_code == 0  # the store exists
    real_delta = ask_module.OrderedOutput.delta

    def fill_after_the_first_token(self, index, text):
        if not (small_disk / "filler").exists():
            fill(small_disk)
        real_delta(self, index, text)

    monkeypatch.setattr(ask_module.OrderedOutput, "delta", fill_after_the_first_token)
    result = cli("ask", "--max-tokens", "60", "--temperature", "0", "Tell me about the sea.")
    assert result.exit_code == 1 and result.stdout.strip()
    last = result.stderr.strip().splitlines()[-1]
    match = re.fullmatch(rf"Error: the reply was not saved to the chat \(the disk holding the chat "
                         rf"store {re.escape(str(small_disk / 'data' / 'chats.db'))} is full\): it is "
                         r"kept in (.+\.md)", last)
    assert match, last
    kept = Path(match.group(1)).read_text()
    assert "## User\n\nTell me about the sea.\n" in kept
    assert kept.endswith(f"## Assistant\n\n{result.stdout.removesuffix(chr(10))}\n")
    Path(match.group(1)).unlink()
    (small_disk / "filler").unlink()
    chat = cli.store().latest_chat()
    assert chat.messages[-2].content == "Tell me about the sea."  # what the user wrote is kept


def leave_free(folder: Path, free: int) -> None:
    """Fill `folder`'s file system until about `free` bytes are left."""
    stats = os.statvfs(folder)
    with open(folder / "filler", "wb") as file:
        file.write(b"\0" * max(0, stats.f_bavail * stats.f_frsize - free))


@pytest.mark.parametrize("free", [12 << 10, 100 << 10])
def test_a_full_data_disk_still_answers_and_leaves_no_half_chat(cli, monkeypatch, small_disk, free):
    """12 KiB free: the store could not even open; 100 KiB: the chat and its user turn were
    written but not the reply's row. Either way `ask` said nothing and left a chat behind."""
    monkeypatch.setenv("PAGED_CHAT_DATA_DIR", str(small_disk / "data"))
    assert cli("ask", "--max-tokens", "2", "Hi").exit_code == 0  # the store exists
    leave_free(small_disk, free)
    result = cli("ask", "--max-tokens", "8", "--temperature", "0", "Tell me about the sea.")
    (small_disk / "filler").unlink()
    assert result.stdout.strip(), result.stderr
    chats = cli.store().list_chats()
    if len(chats) == 1:  # not saved: the answer is kept in the unsaved-replies file
        assert result.exit_code == 1
        last = result.stderr.strip().splitlines()[-1]
        assert last.startswith("Error: the reply was not saved to the chat (the disk holding "
                               "the chat store"), last
        kept = Path(last.rsplit("it is kept in ", 1)[1])
        assert kept.read_text().startswith("# Unsaved turn of a new chat\n")
        assert kept.read_text().endswith(f"## Assistant\n\n{result.stdout.removesuffix(chr(10))}\n")
    else:  # the disk took the turn's rows after all: the chat is whole
        messages = cli.store().get_chat(chats[0].id).messages
        assert [m.role for m in messages] == ["user", "assistant"], result.stderr


def test_a_reply_the_store_refuses_is_kept_whatever_the_file_system(cli, monkeypatch):
    def refuse(self, *args, **kwargs):
        raise StoreFullError(f"the disk holding the chat store {self.path} is full", self.path)

    monkeypatch.setattr(ChatStore, "update_message", refuse)
    result = cli("ask", "--max-tokens", "8", "Hi")
    assert result.exit_code == 1
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("Error: the reply was not saved to the chat (the disk holding the chat store")
    kept = Path(last.rsplit("it is kept in ", 1)[1])
    assert kept.read_text().endswith(f"## Assistant\n\n{result.stdout.removesuffix(chr(10))}\n")
    kept.unlink()


# ---- 8. one line each ---------------------------------------------------------------------


def test_invalid_utf8_on_stdin_is_refused_before_the_model_loads(dirs):
    # The model does not exist: had ask loaded it, the error would say so. A C locale gives
    # Python a surrogateescape stdin, as the issue's shell did.
    done = paged_chat("ask", "-m", "/nonexistent/model.gguf", env={**dirs, "LC_ALL": "C"},
                      stdin=b"caf\xe9 hi\n", timeout=60)
    assert done.returncode == 2
    assert one_line(done.stderr.decode()) == ("Error: stdin is not valid UTF-8 text: the byte 0xe9 "
                                              "at character 4")


def test_a_search_of_thousands_of_words_is_capped_and_deduplicated(cli):
    held = [f"a{i}" for i in range(MAX_SEARCH_WORDS)]
    with cli.store() as store:
        chat = store.create_chat("History of Rome", "m")
        store.add_message(chat.id, "user", "Rome and Carthage " + " ".join(held), [1])
    many = " ".join([*held, *(f"w{i}" for i in range(2000))])  # only the first words are held
    result = cli("chats", "list", "--search", many)
    assert result.exit_code == 0, result.stderr
    assert result.stderr == (f"Warning: the search has {MAX_SEARCH_WORDS + 2000:,} different words: "
                             f"the first {MAX_SEARCH_WORDS} are searched\n")
    assert chat.id in result.stdout
    result = cli("chats", "list", "--search", " ".join(["Rome"] * 600 + ["carthage"] * 600))
    assert result.exit_code == 0 and chat.id in result.stdout and result.stderr == ""


@pytest.mark.perf
def test_a_search_of_a_repeated_word_takes_the_time_of_one(cli):
    with cli.store() as store:
        chat = store.create_chat("History of Rome", "m")
        store.add_message(chat.id, "user", "Rome and Carthage", [1])
    started = time.monotonic()
    result = cli("chats", "list", "--search", " ".join(["Rome"] * 600 + ["carthage"] * 600))
    assert result.exit_code == 0 and chat.id in result.stdout
    assert time.monotonic() - started < 10


@pytest.mark.parametrize("toml, line", [
    ("a = " + "[" * 5000 + "]" * 5000, "invalid TOML: its arrays or tables nest too deeply"),
    ('[server]\nurl = "http://[::1"',
     'line 2: server.url = "http://[::1" is invalid: Invalid IPv6 URL, e.g. "http://127.0.0.1:8000/v1"'),
    ('[server]\nurl = "localhost:8000"', 'line 2: server.url = "localhost:8000" is invalid: expected '
     'an http:// or https:// URL with a host, e.g. "http://127.0.0.1:8000/v1"'),
    ('[tui.keys]\nnew_chatt = "ctrl+t"', "line 2: unknown action 'tui.keys.new_chatt': did you mean "
     "'new_chat'? actions: broadcast, chat_settings, close_chat, copy_code, copy_reply, "
     "edit_message, fork_chat, help, new_chat, next_branch, next_chat, prev_branch, prev_chat, "
     "regenerate, rename_chat, restart_engine, select_next_message, select_prev_message, "
     "show_thinking, stop, switch_thinking, toggle_panel"),
    ('[tui.keys]\nnew_chat = "ctrl+nonsense+q"', 'line 2: tui.keys.new_chat = "ctrl+nonsense+q" is '
     "invalid: 'nonsense' is not a modifier (modifiers: ctrl, shift, alt, meta, super, hyper); "
     'expected a key like "ctrl+n" (several: "f2,ctrl+e")'),
    ('[tui.keys]\nhelp = "f1,pagedwn"', "line 2: tui.keys.help = \"f1,pagedwn\" is invalid: 'pagedwn' "
     'is not a key name; expected a key like "ctrl+n" (several: "f2,ctrl+e")'),
    ('[tui]\ntheme = "no-such-theme"', 'line 2: tui.theme = "no-such-theme" is invalid: no such theme; themes: '),
])
def test_bad_config_values_are_one_line_naming_the_key(cli, tmp_path, toml, line):
    config = tmp_path / "bad.toml"
    config.write_text(toml + "\n")
    result = cli("--config", str(config), "config")
    assert result.exit_code == 1
    assert one_line(result.stderr).startswith(f"Error: {config}: {line}") or \
        one_line(result.stderr).startswith(f"Error: {config}, {line}")


def test_good_tui_keys_and_themes_pass(cli, tmp_path):
    config = tmp_path / "good.toml"
    config.write_text('[tui]\ntheme = "nord"\n\n[tui.keys]\nnew_chat = "ctrl+t"\n'
                      'next_chat = "ctrl+pagedown,alt+right"\nhelp = "f1"\nstop = "ctrl+shift+question_mark"\n')
    result = cli("--config", str(config), "config")
    assert result.exit_code == 0, result.stderr
    assert 'theme = "nord"' in result.stdout and 'new_chat = "ctrl+t"' in result.stdout


# A TUI whose terminal hung up: the app ended (SIGHUP quits as Ctrl+Q does), but Textual's
# input thread, not a daemon, kept reading end of file from the dead terminal, so the
# interpreter's exit waited on it, a core busy, for good (seen after a tmux was killed).
STUCK_INPUT_THREAD = """
import threading, time
from paged_chat.cli.main import _end_process
from paged_chat.tui.textual_compat import INPUT_THREAD_NAME
threading.Thread(target=lambda: time.sleep(600), name=INPUT_THREAD_NAME).start()
_end_process(129)
"""


def test_a_tui_whose_terminal_hung_up_ends_past_textuals_input_thread():
    done = subprocess.run([sys.executable, "-c", STUCK_INPUT_THREAD], capture_output=True,
                          env={**os.environ, "PYTHONPATH": str(REPO)}, cwd=REPO, timeout=60)
    assert done.returncode == 129, done.stderr.decode()
