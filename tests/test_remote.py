"""The remote engine client against a `paged-chat serve` the test starts: chat sessions,
`ask --server`, the TUI on a remote engine and under `--serve`, and the one-line errors
(connection refused, a wrong key, a server that goes away mid-reply)."""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
from contextlib import aclosing
from pathlib import Path

import httpx
import openai
import pytest
from helpers import wait_for, wait_until
from server_fixtures import answers_health, chat_engine_config, free_port, start_server
from tui_helpers import make_app, make_settings, replies, text_of, type_prompt
from typer.testing import CliRunner

from paged_chat.app.chat_session import ChatSession
from paged_chat.app.chat_store import ChatStore
from paged_chat.cli.main import app as cli_app
from paged_chat.cli.state import CliState
from paged_chat.engine import (
    ClientSpec,
    Engine,
    EngineClient,
    EngineDeadError,
    RemoteClient,
    RemoteEngineError,
    SamplingParams,
    make_client,
)
from paged_chat.tui.app import PagedChatApp
from paged_chat.tui.engine_panel import EnginePanel

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


async def two_turns(client, system: str = "Be brief.") -> ChatSession:
    session = ChatSession(system_prompt=system)
    for text in ("Hello there", "And again"):
        async with aclosing(session.send(client, text, GREEDY)) as stream:
            async for _ in stream:
                pass
    return session


async def test_a_remote_chat_is_the_same_chat_as_in_process(api):
    remote = make_client(ClientSpec(api.url, stats_interval_s=0.05))
    assert isinstance(remote, RemoteClient) and remote.running
    assert not remote.capabilities.block_map and remote.info.name == api.model
    assert remote.capabilities.where == f"remote at {api.server.url.removeprefix('http://')} (local tokenizer)"
    generated_before = remote.stats().generation_tokens_total
    over_http = await two_turns(remote)
    in_process = await two_turns(api.client)
    assert over_http.conversation.token_ids == in_process.conversation.token_ids
    assert over_http.turn.text == in_process.turn.text and len(over_http.turn.token_ids) == 6
    assert remote.capabilities.metrics
    # The server's counters hold all four turns: the two it served and the two run in-process.
    await asyncio.wait_for(_scraped(remote, generated_before + 4 * 6), timeout=30)
    assert remote.stats().generation_tokens_total == generated_before + 4 * 6
    assert remote.stats().prefix_cache_queried_tokens > 0


async def _scraped(remote: EngineClient, generated: int) -> None:
    while remote.stats().generation_tokens_total < generated:  # stats() schedules the next scrape
        await asyncio.sleep(0.05)


async def test_abort_closes_the_stream_and_frees_the_server_blocks(api):
    remote = make_client(ClientSpec(api.url))
    seen = []
    async for output in remote.stream([1, 520, 9531, 198], SamplingParams(max_tokens=5000, ignore_eos=True),
                                      request_id="long"):
        seen.append(output)
        if len(seen) == 3:
            remote.abort("long")
    assert seen[-1].finished and seen[-1].finish_reason == "abort" and len(seen[-1].token_ids) >= 3
    await asyncio.to_thread(wait_for, lambda: not api.client.transport.engine.requests, 60, "the server to abort")


def test_ask_server(api, tmp_path, monkeypatch):
    monkeypatch.setenv("PAGED_CHAT_DATA_DIR", str(tmp_path / "data"))
    config = tmp_path / "config.toml"
    config.write_text(f'[chat]\ntemperature = 0.0\nmax_tokens = 5\n\n[server]\nurl = "{api.url}"\n')
    result = CliRunner().invoke(cli_app, ["--config", str(config), "ask", "--json", "Hi there"],
                                obj=CliState(engine_factory=lambda config: pytest.fail("no local engine")))
    assert result.exit_code == 0, result.stderr
    answer = json.loads(result.stdout)
    assert answer["completion_tokens"] >= 1 and answer["finish_reason"] in ("stop", "length")
    assert ChatStore().list_chats()[0].id == answer["chat_id"]


def test_ask_server_stats_count_the_cached_tokens_of_a_continued_chat(api, tmp_path, monkeypatch):
    """paged-chat serve says them in usage.prompt_tokens_details, as vLLM does when asked."""
    monkeypatch.setenv("PAGED_CHAT_DATA_DIR", str(tmp_path / "data"))
    config = tmp_path / "config.toml"
    config.write_text('[chat]\ntemperature = 0.0\nmax_tokens = 5\nsystem_prompt = "Be brief."\n')
    lines = []
    for args in (["Hello there, tell me about paging in operating systems"], ["-c", "And again"]):
        result = CliRunner().invoke(cli_app, ["--config", str(config), "ask", "--server", api.url,
                                              "--stats", *args],
                                    obj=CliState(engine_factory=lambda config: pytest.fail("no local engine")))
        assert result.exit_code == 0, result.stderr
        assert len(result.stderr.strip().splitlines()) == 1, result.stderr
        lines.append(result.stderr.strip())
    assert f"connected to {api.url} in " in lines[0] and "(local tokenizer)" in lines[0], lines[0]
    [cached] = re.findall(r"prompt tokens \((\d+) from the cache\)", lines[1])
    assert int(cached) >= 16, lines[1]


def test_ask_server_reads_the_saved_converted_tokenizer(api, tmp_path, monkeypatch):
    """A GGUF's tokenizer, converted once, is read back: re-parsing the GGUF took seconds."""
    from tiny_models import tiny_gguf

    from paged_chat.app.settings import cache_dir
    from paged_chat.engine.models import loader
    from paged_chat.engine.models.gguf_file import gguf_tokenizer_folder

    monkeypatch.setenv("PAGED_CHAT_DATA_DIR", str(tmp_path / "data"))
    gguf_path, _, _ = tiny_gguf(tmp_path)
    source = loader.load_model_source(str(gguf_path), cache_dir())   # converts and saves it
    assert gguf_tokenizer_folder(source.header_digest, cache_dir()) is not None

    def converted_again(*args, **kwargs):
        raise AssertionError("the GGUF's tokenizer was converted again")

    monkeypatch.setattr(loader, "load_gguf_tokenizer", converted_again)
    result = CliRunner().invoke(cli_app, ["ask", "--no-save", "--server", api.url,
                                          "--model", str(gguf_path), "--max-tokens", "2", "Hi"],
                                obj=CliState(engine_factory=lambda config: pytest.fail("no local engine")))
    assert result.exit_code == 0, result.output


def test_ask_server_that_is_not_there(tmp_path):
    port = free_port()
    result = CliRunner().invoke(cli_app, ["ask", "--no-save", "--server", f"http://127.0.0.1:{port}/v1", "Hi"])
    assert result.exit_code == 1
    [line] = result.stderr.strip().splitlines()
    assert line.startswith(f"Error: cannot reach the server at http://127.0.0.1:{port}/v1")


def test_a_wrong_key_is_one_line(served, chat_model_dir):
    keyed = start_server(served.client, api_key="right")
    try:
        with pytest.raises(RemoteEngineError, match=r"refused the API key \(401\)"):
            make_client(ClientSpec(keyed.url, api_key="wrong"))
        right = make_client(ClientSpec(keyed.url, api_key="right", remote_model=str(chat_model_dir)))
        assert right.info.name == served.model and right.info.tokenizer is not None
    finally:
        keyed.stop()


async def test_a_server_that_goes_away_mid_reply_keeps_the_partial_reply(chat_model_dir):
    client = make_client(ClientSpec(engine=Engine(chat_engine_config(chat_model_dir))))
    going = start_server(client, model_names=[str(chat_model_dir)])
    remote = make_client(ClientSpec(going.url))
    session = ChatSession(system_prompt="Be brief.")
    def go_away() -> None:
        # No graceful shutdown: uvicorn would otherwise wait up to 5 s for the stream, and a
        # fast machine finishes the reply (at max_model_len) within that time.
        going.server.server.force_exit = True
        going.stop()

    with pytest.raises(RemoteEngineError, match="dropped the stream|ended the stream"):
        async with aclosing(session.send(remote, "Talk", SamplingParams(max_tokens=100000, ignore_eos=True))) as stream:
            async for output in stream:
                if len(output.token_ids) == 3:
                    asyncio.get_running_loop().run_in_executor(None, go_away)
    client.shutdown()
    assert session.turn.finish_reason == "error" and len(session.turn.token_ids) >= 3
    assert session.conversation.token_ids[-len(session.turn.token_ids):] == session.turn.token_ids
    assert remote.running  # a dropped stream fails that stream alone, not the client

    async def unreachable():
        while remote.running:      # stats() schedules the scrape that finds nobody there
            remote.stats()
            await asyncio.sleep(0.05)
    await asyncio.wait_for(unreachable(), 30)
    assert "cannot reach the server" in remote.last_error
    remote.shutdown()
    assert not remote.running
    with pytest.raises(EngineDeadError, match="shut down"):
        await anext(remote.stream([1, 2, 3], GREEDY))


@pytest.mark.timeout(180)
async def test_tui_on_a_remote_engine(api, tmp_path):
    remote = make_client(ClientSpec(api.url))
    app = make_app(remote, tmp_path, make_settings(max_tokens=6), PagedChatApp, restore=False)
    async with app.run_test(size=(120, 40)) as pilot:
        await type_prompt(pilot, "hello remote")
        tab = app.active_tab
        await wait_until(lambda: tab.session.turn is not None and tab.session.turn.finished, timeout=60)
        [reply] = replies(tab)
        assert tab.session.turn.finish_reason in ("stop", "length") and tab.session.turn.token_ids
        status = text_of(app.query_one("#status"))
        host = api.server.url.removeprefix("http://")
        assert f"{api.model} · remote at {host} (local tokenizer) · no block map · max " in status, status
        panel = app.query_one(EnginePanel)
        await wait_until(lambda: "remote engine: no block map" in text_of(panel.query_one("#pool-title")))
        await wait_until(lambda: "running" in text_of(panel.query_one("#numbers")))


@pytest.mark.timeout(180)
async def test_tui_serves_its_engine_and_shows_api_owners(chat_model_dir, tmp_path):
    client = make_client(ClientSpec(engine=Engine(chat_engine_config(chat_model_dir))))
    app = make_app(client, tmp_path, make_settings(max_tokens=6), PagedChatApp, restore=False, serve_port=0)
    try:
        async with app.run_test(size=(120, 40)) as pilot:
            await wait_until(lambda: app.api_server is not None and app.api_server.started)
            api_client = openai.AsyncOpenAI(base_url=app.api_server.url + "/v1", api_key="none", max_retries=0)
            async with httpx.AsyncClient() as http:  # requests that omit them get what `serve`'s get
                listed = (await http.get(app.api_server.url + "/v1/models")).json()["data"][0]
            assert listed["sampling_defaults"] == {"temperature": 0.0, "top_p": 0.9, "top_k": 0,
                                                   "min_p": 0.0, "repetition_penalty": 1.0}
            stream = await api_client.completions.create(
                model=client.info.name, prompt="an editor asks", max_tokens=5000, stream=True,
                user="editor", extra_body={"ignore_eos": True})
            panel = app.query_one(EnginePanel)
            async with stream:
                async for _ in stream:
                    if "editor" in panel.tabs:
                        break
            assert panel.tabs["editor"].title == "editor"
            await api_client.close()
            await wait_until(lambda: client.stats().blocks_in_use == 0 and not client.transport.engine.requests)
    finally:
        client.shutdown()


@pytest.mark.slow
@pytest.mark.timeout(300)
async def test_a_chat_on_transformers_serve(chat_model_dir, tmp_path):
    """Another project's OpenAI server, offline on the local model folder: it takes text
    prompts only and refuses vLLM's sampling fields, and has no /metrics."""
    executable = Path(sys.executable).with_name("transformers")
    port = free_port()
    log = (tmp_path / "transformers-serve.log").open("wb")
    process = subprocess.Popen([str(executable), "serve", str(chat_model_dir), "--port", str(port)],
                               stdout=log, stderr=subprocess.STDOUT)
    try:
        await asyncio.to_thread(wait_for, lambda: answers_health(port) or process.poll() is not None,
                                240, "transformers serve to start")
        assert process.poll() is None, (tmp_path / "transformers-serve.log").read_text()[-2000:]
        remote = make_client(ClientSpec(f"http://127.0.0.1:{port}/v1"))
        assert not remote.capabilities.metrics
        session = await two_turns(remote)
        assert session.turn.finish_reason in ("stop", "length") and session.turn.text
        assert len(session.conversation.messages) == 4
    finally:
        process.terminate()
        process.wait(30)
        log.close()
