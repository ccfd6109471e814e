"""The adversarial pass of issue 16, each case as a user meets it: escape sequences that
must not reach a terminal, private files under umask 022, a corrupt store found by many
processes at once, confirmations, signals, and bad input that must be named (the prompt,
the line, the file, the path, the field) before anything loads.
"""

from __future__ import annotations

import json
import os
import pty
import re
import shutil
import stat
import subprocess
import sys
import threading
from io import StringIO
from pathlib import Path

import pytest
from helpers import ESCAPE_IDS, ESCAPE_SOUP, REPO, one_line, scripted
from hypothesis import given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from paged_chat.app import chat_store as store_module
from paged_chat.app.chat_session import chat_title
from paged_chat.app.chat_store import ChatStore
from paged_chat.app.settings import load_settings
from paged_chat.app.text import StreamSanitizer, sanitize_for_terminal
from paged_chat.cli.ask import OrderedOutput, parse_prompt_file, run_ask
from paged_chat.cli.main import app
from paged_chat.cli.plain_terminal import PlainTerminalOptions, UsageError
from paged_chat.cli.state import CliState
from paged_chat.engine import SamplingParams

# A clipboard write (OSC 52), a screen clear and a window title, then some text.
HOSTILE = "\x1b]52;c;SGVsbG8=\x07\x1b[2J\x1b]0;pwned\x07 hi"
# What a terminal acts on: C0 controls but tab, LF and the CR a pty puts before LF, DEL,
# and C1 as UTF-8.
TERMINAL_CONTROLS = re.compile(rb"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]|\r(?!\n)|\xc2[\x80-\x9f]")


def paged_chat(*args: str, env: dict[str, str], terminal: bool = False, answer: bytes = b"",
               umask: int | None = None) -> tuple[int, bytes]:
    """Run `python -m paged_chat ARGS` with stdin, stdout and stderr on a pseudo-terminal
    (`terminal`), or piped; its exit status and everything it wrote (stdout, then stderr
    when piped)."""
    command = [sys.executable, "-m", "paged_chat", *args]
    setup = None if umask is None else (lambda: os.umask(umask))
    full_env = {**os.environ, "PYTHONPATH": str(REPO), **env}
    if not terminal:
        done = subprocess.run(command, input=answer, capture_output=True, env=full_env, cwd=REPO,
                              preexec_fn=setup, timeout=120)
        return done.returncode, done.stdout + done.stderr
    controller, device = pty.openpty()
    process = subprocess.Popen(command, stdin=device, stdout=device, stderr=device, env=full_env,
                               cwd=REPO, preexec_fn=setup, start_new_session=True)
    os.close(device)
    os.write(controller, answer)
    output = b""
    while True:
        try:
            chunk = os.read(controller, 65536)
        except OSError:  # EIO: the process is gone and its side of the terminal closed
            break
        if not chunk:
            break
        output += chunk
    os.close(controller)
    return process.wait(timeout=120), output


@pytest.fixture
def dirs(tmp_path) -> dict[str, str]:
    return {"PAGED_CHAT_DATA_DIR": str(tmp_path / "data"), "PAGED_CHAT_CACHE_DIR": str(tmp_path / "cache"),
            "PAGED_CHAT_CONFIG": str(tmp_path / "none.toml")}


def hostile_chat(data_dir: Path) -> str:
    with ChatStore(data_dir / "chats.db") as store:
        chat = store.create_chat(HOSTILE, "m\x1b[5m", system_prompt=HOSTILE)
        store.add_message(chat.id, "user", HOSTILE, [1])
        store.add_message(chat.id, "assistant", "\x9b2J\x1b]8;;http://evil.example\x1b\\link\rover", [2], "stop")
    return chat.id


# ---- 1. escape sequences -------------------------------------------------------------


@pytest.mark.parametrize("command", [["chats", "list"], ["chats", "show"], ["chats", "export"],
                                     ["chats", "export", "--format", "json"], ["chats", "delete"]])
def test_chats_commands_send_no_escape_sequence_to_a_terminal(dirs, tmp_path, command):
    chat_id = hostile_chat(tmp_path / "data")
    args = command if command[1] == "list" else [*command, chat_id]
    status, shown = paged_chat(*args, env=dirs, terminal=True, answer=b"y\n")
    assert status == 0, shown
    assert not TERMINAL_CONTROLS.search(shown), shown
    assert b"hi" in shown


def test_piped_chats_output_keeps_the_exact_text(dirs, tmp_path):
    chat_id = hostile_chat(tmp_path / "data")
    status, shown = paged_chat("chats", "show", chat_id, env=dirs)
    assert status == 0 and f"## User\n\n{HOSTILE}\n".encode() in shown


class Terminal(StringIO):
    def isatty(self) -> bool:
        return True


@pytest.mark.parametrize("stdout, expected", [(Terminal(), "!!!!\n"), (StringIO(), "\x1b[2J!!!!\n")])
def test_ask_sanitizes_a_streamed_reply_only_on_a_terminal(cli, monkeypatch, stdout, expected):
    """The model writes "ESC [ 2 J" one token (one delta) at a time: on a terminal none of
    it shows, not even the "[2J" a per-delta filter would leave; piped, it is exact."""
    scripted(monkeypatch, ESCAPE_IDS + [17] * 4)
    monkeypatch.setattr(sys, "stdout", stdout)
    options = PlainTerminalOptions(prompt="Hi", save=False, sampling={"max_tokens": 8})
    assert run_ask(options, load_settings(cli.config), cli.engine_factory, None) == 0
    assert stdout.getvalue() == expected


def test_a_sequence_left_open_does_not_swallow_the_next_answer():
    screen = Terminal()
    output = OrderedOutput(2, as_json=False, stdout=screen)
    output.delta(0, "one \x1b]0;never closed")
    output.delta(1, "two")
    output.finished(1, {})
    output.finished(0, {})
    assert screen.getvalue() == "one \n\ntwo\n"


@settings(max_examples=300, deadline=None)
@given(text=ESCAPE_SOUP, cuts=st.lists(st.integers(0, 60), max_size=8))
def test_fuzz_a_stream_is_sanitized_as_the_whole_text(text, cuts):
    """However the text is cut into deltas, the screen shows what sanitizing it whole does."""
    bounds = [0, *sorted(min(cut, len(text)) for cut in cuts), len(text)]
    sanitizer = StreamSanitizer()
    shown = "".join(sanitizer.feed(text[a:b]) for a, b in zip(bounds, bounds[1:])) + sanitizer.flush()
    assert shown == sanitize_for_terminal(text)


@pytest.mark.parametrize("prompt", ["x" * 55 + HOSTILE, "\x1b]0;" + "y" * 80 + "\x07 tail", "\x1b[2J"])
def test_a_title_never_holds_an_escape_sequence(prompt):
    title = chat_title(prompt)
    assert title == sanitize_for_terminal(title) and len(title) <= 60


# ---- 2. private files ------------------------------------------------------------------


PERMISSIONS = """
import os, stat
from paged_chat.app.chat_store import ChatStore
from paged_chat.app.settings import cache_dir

def mode(path):
    return oct(stat.S_IMODE(os.stat(path).st_mode))

with ChatStore() as store:
    store.create_chat("private", "m")
    names = [store.path.parent, store.path, str(store.path) + "-wal", str(store.path) + "-shm", cache_dir()]
    print(" ".join(mode(name) for name in names))
"""


def test_chats_are_private_under_umask_022(dirs, tmp_path):
    done = subprocess.run([sys.executable, "-c", PERMISSIONS], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(REPO), **dirs},
                          preexec_fn=lambda: os.umask(0o022), timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["0o700", "0o600", "0o600", "0o600", "0o700"]


def test_loose_permissions_are_tightened_once_with_a_notice(dirs, tmp_path):
    data, cache = tmp_path / "data", tmp_path / "cache"
    hostile_chat(data)
    cache.mkdir()
    for path, loose in ((data, 0o755), (data / "chats.db", 0o644), (cache, 0o775)):
        path.chmod(loose)
    said = [paged_chat(*args, env=dirs, umask=0o022) for args in (["chats", "list"], ["config"])]
    assert [status for status, _ in said] == [0, 0], said
    warnings = [line for _, out in said for line in out.decode().splitlines() if line.startswith("Warning:")]
    assert warnings == [
        f"Warning: {data} could be read by other users (mode 0755): made it private (mode 0700)",
        f"Warning: {data / 'chats.db'} could be read by other users (mode 0644): made it private (mode 0600)",
        f"Warning: {cache} could be read by other users (mode 0775): made it private (mode 0700)"]
    assert [stat.S_IMODE(p.stat().st_mode) for p in (data, data / "chats.db", cache)] == [0o700, 0o600, 0o700]
    again = [paged_chat(*args, env=dirs, umask=0o022) for args in (["chats", "list"], ["config"])]
    assert all(status == 0 and b"Warning" not in out for status, out in again), again


# ---- 4. a corrupt store found by several processes at once -------------------------------


GARBAGE = b"not a database, not at all" * 100


def test_a_corrupt_store_is_moved_aside_once_when_two_find_it(tmp_path, monkeypatch):
    """B finds the store corrupt; A moves it aside and starts a fresh one within the same
    second; then B goes on. The original must survive, and B must keep A's fresh store."""
    path = tmp_path / "chats.db"
    path.write_bytes(GARBAGE)
    monkeypatch.setattr(store_module.time, "strftime", lambda fmt: "20260101-000000")
    b_found_it, a_done = threading.Event(), threading.Event()
    real_open = ChatStore._open

    def slow_open(self):
        try:
            return real_open(self)
        finally:
            if threading.current_thread().name == "B" and not b_found_it.is_set():
                b_found_it.set()
                assert a_done.wait(30)

    monkeypatch.setattr(ChatStore, "_open", slow_open)
    stores = {}
    b = threading.Thread(target=lambda: stores.setdefault("B", ChatStore(path)), name="B")
    b.start()
    assert b_found_it.wait(30)
    stores["A"] = ChatStore(path)
    stores["A"].create_chat("written after the recovery", "m")
    a_done.set()
    b.join(30)
    moved = sorted(tmp_path.glob("chats.db.corrupt-*"))
    assert [p.read_bytes() for p in moved if not p.name.endswith(("-wal", "-shm"))] == [GARBAGE]
    assert [c.title for c in stores["B"].list_chats()] == ["written after the recovery"]
    assert "another paged-chat moved it aside" in stores["B"].notice
    for store in stores.values():
        store.close()


RECOVER = "import sys; from pathlib import Path; from paged_chat.app.chat_store import ChatStore; ChatStore(Path(sys.argv[1])).close()"


def test_six_processes_finding_a_corrupt_store_never_lose_it(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    for trial in range(3):
        folder = tmp_path / str(trial)
        folder.mkdir()
        (folder / "chats.db").write_bytes(GARBAGE)
        processes = [subprocess.Popen([sys.executable, "-c", RECOVER, str(folder / "chats.db")], env=env)
                     for _ in range(6)]
        assert [p.wait(timeout=120) for p in processes] == [0] * 6
        moved = [p for p in folder.glob("chats.db.corrupt-*") if not p.name.endswith(("-wal", "-shm"))]
        assert [p.read_bytes() for p in moved] == [GARBAGE]


# ---- 5. delete asks, and an empty id names nothing ---------------------------------------


@pytest.mark.parametrize("answer, status, kept", [("n\n", 1, True), ("", 2, True), ("yes\n", 0, False)])
def test_delete_reads_its_answer_from_stdin(cli, answer, status, kept):
    chat_id = cli.json("Keep me")["chat_id"]
    result = cli("chats", "delete", chat_id[:4], input=answer)
    assert result.exit_code == status, result.stderr
    assert (len(cli.store().list_chats()) == 1) == kept
    said = result.stderr.splitlines()
    assert said[0] == f"Delete chat {chat_id} ('Keep me', 2 messages)? [y/N] {answer.strip()}"
    assert said[1:] == {"n\n": [f"not deleted: chat {chat_id}"],
                        "": ["Error: no answer on stdin: the chat was not deleted (--yes deletes without asking)"],
                        "yes\n": [f"deleted chat {chat_id} (Keep me)"]}[answer]


@pytest.mark.parametrize("args", [["chats", "delete", "", "--yes"], ["chats", "show", " "],
                                  ["ask", "--chat", "", "Hi"]])
def test_an_empty_chat_id_names_no_chat(cli, args):
    cli.json("The only chat")
    result = cli(*args)
    assert result.exit_code == 1
    assert one_line(result.stderr).startswith("Error: an empty chat id names no chat")
    assert len(cli.store().list_chats()) == 1 and len(cli.store().latest_chat().messages) == 2


# ---- 9, 10. prompts that are blank or not text ----------------------------------------------


def test_a_blank_argument_with_stdin_asks_stdin(cli):
    result = cli("ask", "   ", input="What is 2+2?\n")
    assert result.exit_code == 0, result.stderr
    assert cli.store().latest_chat().title == "What is 2+2?"


def test_an_argument_that_is_not_utf8_is_refused_before_loading(dirs):
    status, out = paged_chat("ask", os.fsdecode(b"caf\xe9 hi"), env=dirs)
    assert status == 2
    assert one_line(out.decode()) == ("Error: the prompt argument is not valid UTF-8 text: "
                                      "the byte 0xe9 at character 4")


@pytest.mark.parametrize("args, message", [
    (["--system", "caf\udce9", "Hi"], "Error: --system is not valid UTF-8 text: the byte 0xe9 at character 4"),
    (["--chat", "ab\udcff"], "Error: --chat is not valid UTF-8 text: the byte 0xff at character 3"),
])
def test_options_that_are_not_utf8_are_usage_errors(cli, args, message):
    result = cli("ask", *args)
    assert result.exit_code == 2 and one_line(result.stderr) == message and cli.engines == []


def test_a_lone_surrogate_in_jsonl_names_its_line(cli, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "fine"}\n{"prompt": "bad \\ud800 here"}\n')
    result = cli("ask", "--file", str(prompts))
    assert result.exit_code == 2 and cli.engines == []
    assert one_line(result.stderr) == ('Error: line 2 of the prompt file: "prompt" is not valid UTF-8 '
                                       "text: a lone surrogate U+D800 at character 5")


# ---- 12. store paths that cannot work -------------------------------------------------------


def test_a_store_that_is_a_directory_is_named(cli, tmp_path):
    (tmp_path / "data").mkdir(mode=0o700)
    (tmp_path / "data" / "chats.db").mkdir()
    result = cli("chats")
    assert result.exit_code == 1
    assert one_line(result.stderr) == (f"Error: the chat store {tmp_path / 'data' / 'chats.db'} is a "
                                       "directory, not a file: move it away, or set "
                                       "PAGED_CHAT_DATA_DIR to use another store")


@pytest.mark.parametrize("suffix", ["", "-wal", "-shm", ".lock"])
def test_a_store_file_that_is_a_symlink_is_refused_untouched(cli, tmp_path, suffix):
    """A link in the data dir must not carry the store's writes, chmods and moves to a
    file outside it (a 0644 file went 0600, then was moved aside as corrupt)."""
    outside = tmp_path / "outside.txt"
    outside.write_text("not a chat store")
    outside.chmod(0o644)
    data = tmp_path / "data"
    data.mkdir(mode=0o700)
    link = data / f"chats.db{suffix}"
    link.symlink_to(outside)
    result = cli("chats")
    assert result.exit_code == 1
    assert one_line(result.stderr) == (f"Error: the chat store's file {link} is a symbolic link: "
                                       "paged-chat does not follow it out of its data directory; "
                                       "move it away, or set PAGED_CHAT_DATA_DIR to use another "
                                       "store")
    assert stat.S_IMODE(outside.stat().st_mode) == 0o644 and outside.read_text() == "not a chat store"
    assert [path.name for path in data.iterdir()] == [link.name] and link.is_symlink()


def test_a_data_dir_that_is_a_file_is_named(cli, tmp_path):
    (tmp_path / "data").write_text("oops")
    for args in (["chats"], ["ask", "Hi"]):
        result = cli(*args)
        assert result.exit_code == 1
        assert one_line(result.stderr) == (f"Error: {tmp_path / 'data'} should be a directory but is a "
                                           "file: move the file away, or set PAGED_CHAT_DATA_DIR to "
                                           "use another place")


def read_only(folder: Path, *args: str, env: dict[str, str]) -> tuple[int, bytes]:
    """`paged-chat ARGS` with `folder` read-only: a read-only bind mount in a mount
    namespace of its own for root (whom permission bits do not stop), else permission bits."""
    if os.geteuid() != 0:
        for path in folder.iterdir():
            path.chmod(0o444)
        folder.chmod(0o555)
        try:
            return paged_chat(*args, env=env)
        finally:
            folder.chmod(0o700)
    if shutil.which("unshare") is None:
        pytest.skip("root without unshare(1): no way to make a read-only store")
    remount = 'mount --bind "$0" "$0" && mount -o remount,ro,bind "$0" "$0" && exec "$@"'
    done = subprocess.run(["unshare", "-m", "sh", "-c", remount, str(folder), sys.executable, "-m",
                           "paged_chat", *args], capture_output=True, cwd=REPO, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(REPO), **env})
    if b"mount" in done.stderr and done.returncode != 0 and b"Error" not in done.stderr:
        pytest.skip(f"cannot mount here: {done.stderr.decode()}")
    return done.returncode, done.stdout + done.stderr


def test_a_read_only_store_can_be_read_and_names_itself_on_a_write(dirs, tmp_path):
    data = tmp_path / "data"
    chat_id = hostile_chat(data)
    status, out = read_only(data, "chats", "list", env=dirs)
    assert status == 0 and chat_id.encode() in out, out
    status, out = read_only(data, "chats", "delete", "--yes", chat_id, env=dirs)
    assert status == 1
    assert one_line(out.decode()).startswith(f"Error: cannot save to the chat store {data / 'chats.db'}: "
                                             "it is read-only"), out


# ---- 13. prompt files and config files --------------------------------------------------------


def test_a_jsonl_file_with_a_bom_is_jsonl(cli, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_bytes(b"\xef\xbb\xbf" + b'{"prompt": "one"}\n{"prompt": "two"}\n')
    result = cli("ask", "--file", str(prompts), "--json")
    assert result.exit_code == 0, result.stderr
    assert [json.loads(line)["prompt"] for line in result.stdout.splitlines()] == ["one", "two"]


def test_deeply_nested_json_is_a_usage_error_naming_the_line():
    deep = "[" * 100_000 + "]" * 100_000
    with pytest.raises(UsageError, match="line 2 of the prompt file is not JSON .nested too deeply"):
        parse_prompt_file('{"prompt": "fine"}\n' + deep)
    assert [p.prompt for p in parse_prompt_file(deep)] == [deep]  # not an object: a plain prompt


def test_a_latin1_prompt_file_is_a_usage_error_naming_it(cli, tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_bytes("café\nnaïve\n".encode("latin-1"))
    result = cli("ask", "--file", str(prompts))
    assert result.exit_code == 2 and cli.engines == []
    assert one_line(result.stderr) == f"Error: the prompt file {prompts} is not UTF-8 text (invalid continuation byte)"
    from_stdin = CliRunner().invoke(app, ["--config", str(cli.config), "ask", "--file", "-"],
                                    input=prompts.read_bytes(), obj=CliState(engine_factory=cli.engine_factory))
    assert from_stdin.exit_code == 2
    assert one_line(from_stdin.stderr) == "Error: stdin is not UTF-8 text (invalid continuation byte)"


def test_a_config_file_with_a_bom_is_read(tmp_path):
    config = tmp_path / "config.toml"
    config.write_bytes(b"\xef\xbb\xbf[chat]\nmax_tokens = 7\n")
    assert load_settings(config).chat.max_tokens == 7


def test_an_empty_system_option_clears_the_configured_one(cli):
    cli.config.write_text(cli.config.read_text() + 'system_prompt = "You are a pirate."\n')
    cli.json("Hi")
    assert cli.store().latest_chat().system_prompt == "You are a pirate."
    cli.json("--system", "", "Hi")
    chat = cli.store().latest_chat()
    assert chat.system_prompt is None
    assert "pirate" not in cli.engines[-1].tokenizer.decode(chat.messages[0].token_ids)


# ---- 14. the engine API -----------------------------------------------------------------------


def test_auto_request_ids_never_collide_with_a_callers(make_engine):
    engine = make_engine()
    mine = [engine.add_request([5, 6], SamplingParams(max_tokens=2), request_id=f"req-{n}") for n in range(3)]
    auto = engine.add_request([5, 6], SamplingParams(max_tokens=2))
    assert auto not in mine
    while engine.has_unfinished():
        engine.step()


@pytest.mark.parametrize("kwargs, message", [
    ({"request_id": True}, "request_id=True is invalid"),
    ({"request_id": 7}, "request_id=7 is invalid"),
    ({"request_id": ""}, "request_id='' is invalid"),
    ({"prompt": [5, True]}, "a bool is not a token id"),
])
def test_bad_request_ids_and_bool_token_ids_are_value_errors(make_engine, kwargs, message):
    engine = make_engine()
    with pytest.raises(ValueError, match=message):
        engine.add_request(**{"prompt": [5, 6], **kwargs})
    assert not engine.has_unfinished()


@pytest.mark.parametrize("field, value", [("max_tokens", True), ("temperature", "1"), ("top_p", "0.5"),
                                          ("top_k", 2.0), ("min_p", None), ("seed", False),
                                          ("repetition_penalty", "1"), ("presence_penalty", True),
                                          ("stop_token_ids", [True])])
def test_sampling_params_of_the_wrong_type_are_value_errors_naming_the_field(field, value):
    with pytest.raises(ValueError, match=rf"SamplingParams\.{field}="):
        SamplingParams(**{field: value})
