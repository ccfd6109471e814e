"""The remote client, `ask --server` and the TUI against a fake vLLM (fake_vllm.py) whose
model, served as `smollm2`, has no local tokenizer: the server's own tokenizes and
templates, a matching local one is used where given, the cached tokens come from the
usage, else /metrics, else are unknown; the engine panel shows what /metrics has.
Every reply is the fake's fixed one: nothing here assumes what a model says."""

from __future__ import annotations

import re
from contextlib import aclosing

import pytest
from fake_vllm import REPLY, FakeVllm
from helpers import wait_until
from tui_helpers import make_app, make_settings, text_of, type_prompt
from typer.testing import CliRunner

from paged_chat.app.chat_session import ChatSession
from paged_chat.app.conversation import Conversation
from paged_chat.cli.main import app as cli_app
from paged_chat.cli.state import CliState
from paged_chat.engine import ClientSpec, SamplingParams, make_client
from paged_chat.engine.clients.server_tokenizer import ServerTokenizer
from paged_chat.tui.app import PagedChatApp
from paged_chat.tui.engine_panel import EnginePanel

GREEDY = SamplingParams(temperature=0.0, max_tokens=64)
def no_engine() -> CliState:
    """A fresh state per invocation (it keeps the settings it read)."""
    return CliState(engine_factory=lambda config: pytest.fail("no local engine"))


@pytest.fixture
def fake_vllm(smollm2_source):
    fakes: list[FakeVllm] = []

    def start(**options) -> FakeVllm:
        fakes.append(FakeVllm(smollm2_source.tokenizer, smollm2_source.chat_template, **options).start())
        return fakes[-1]

    yield start
    for fake in fakes:
        fake.stop()


async def two_turns(client) -> ChatSession:
    session = ChatSession(system_prompt="Be brief.")
    for text in ("Hello there", "And again"):
        async with aclosing(session.send(client, text, GREEDY)) as stream:
            async for _ in stream:
                pass
    return session


async def test_a_model_with_no_local_tokenizer_chats_on_the_servers(fake_vllm, smollm2_source):
    fake = fake_vllm()
    remote = make_client(ClientSpec(fake.url))
    assert isinstance(remote.info.tokenizer, ServerTokenizer)
    assert remote.info.name == "smollm2" and remote.info.tokenizer_from == "the server's"
    assert remote.info.max_model_len == fake.max_model_len
    assert remote.capabilities.where == f"remote at 127.0.0.1:{fake.server.config.port} (the server's tokenizer)"
    session = await two_turns(remote)
    remote.shutdown()
    assert session.turn.text == REPLY and session.turn.finish_reason == "stop"
    # The very ids a local copy of the tokenizer and template gives: the prefix cache hits.
    local = Conversation(smollm2_source.tokenizer, smollm2_source.chat_template, "Be brief.")
    for text in ("Hello there", "And again"):
        prompt = local.next_prompt_ids(text)
        assert prompt in fake.prompts
        reply = smollm2_source.tokenizer.encode(REPLY, add_special_tokens=False)
        local.add_reply(prompt, reply, REPLY)
    assert session.conversation.token_ids == local.token_ids
    assert fake.prompts[1][:len(fake.prompts[0])] == fake.prompts[0]


@pytest.mark.parametrize("priority_scheduling", [True, False])
async def test_a_priority_goes_as_vllms_field_and_a_server_that_refuses_it_gets_none(
        fake_vllm, priority_scheduling):
    fake = fake_vllm(priority_scheduling=priority_scheduling)
    remote = make_client(ClientSpec(fake.url))
    assert not remote.capabilities.reprioritize
    for priority in (2, 0, -1):
        async with aclosing(remote.stream([1, 2, 3], GREEDY, priority=priority)) as stream:
            async for output in stream:
                pass
        assert output.finish_reason == "stop"
    remote.shutdown()
    if priority_scheduling:
        assert fake.priorities == [(2, True), (None, True), (-1, True)]
    else:   # refused once by name: none from then on, and the prompts stay token ids
        assert fake.refused_priorities == 1
        assert fake.priorities == [(None, True)] * 3


def test_a_matching_local_tokenizer_is_used(fake_vllm, chat_model_dir):
    fake = fake_vllm()
    remote = make_client(ClientSpec(fake.url, remote_model=str(chat_model_dir)))
    assert remote.info.tokenizer_from == "local" and not isinstance(remote.info.tokenizer, ServerTokenizer)
    assert remote.capabilities.where.endswith("(local tokenizer)")
    remote.shutdown()


def ask(*args: str, config=None):
    prefix = ["--config", str(config)] if config else []
    return CliRunner().invoke(cli_app, [*prefix, "ask", *args], obj=no_engine())


@pytest.mark.parametrize("details, metrics, cached", [
    (True, True, "the usage"), (False, True, "the /metrics delta"), (False, False, None)])
def test_ask_stats_says_the_cached_tokens_or_that_they_are_unknown(fake_vllm, tmp_path, monkeypatch,
                                                                   details, metrics, cached):
    monkeypatch.setenv("PAGED_CHAT_DATA_DIR", str(tmp_path / "data"))
    fake = fake_vllm(prompt_tokens_details=details, metrics=metrics)
    first = ask("--server", fake.url, "--stats", "--max-tokens", "64", "Hello there " * 20)
    assert first.exit_code == 0, first.stderr
    [line] = first.stderr.strip().splitlines()
    assert re.search(rf"connected to {re.escape(fake.url)} in \d+\.\d s \(the server's tokenizer\)$", line), line
    assert "model loaded" not in line
    second = ask("--server", fake.url, "--stats", "-c", "And again")
    assert second.exit_code == 0, second.stderr
    [line] = second.stderr.strip().splitlines()
    expected = fake.cached[-1]
    assert expected >= 16 * 4
    if cached is None:
        assert "(from the cache: unknown, the server did not say (vLLM says it with " \
               "--enable-prompt-tokens-details))" in line, line
    else:
        assert f"({expected:,} from the cache)" in line, (cached, line)
    assert " 0 from the cache" not in line


@pytest.mark.timeout(180)
async def test_tui_on_a_vllm_shows_the_servers_tokenizer_and_metrics(fake_vllm, tmp_path):
    fake = fake_vllm()
    remote = make_client(ClientSpec(fake.url, stats_interval_s=0.05))
    app = make_app(remote, tmp_path, make_settings(max_tokens=6), PagedChatApp, restore=False)
    async with app.run_test(size=(120, 40)) as pilot:
        await type_prompt(pilot, "hello remote")
        tab = app.active_tab
        await wait_until(lambda: tab.session.turn is not None and tab.session.turn.finished, timeout=60)
        assert tab.session.turn.text == fake.tokenizer.decode(fake.reply_ids(6)[0])
        status = text_of(app.query_one("#status"))
        assert "smollm2 · remote at 127.0.0.1:" in status and "(the server's tokenizer)" in status, status
        panel = app.query_one(EnginePanel)
        # The panel polls /metrics: a poll from while the reply streamed says "running 1"
        # until the next one comes in.
        await wait_until(lambda: "running 0 · waiting 0" in text_of(panel.query_one("#numbers")),
                         what=lambda: text_of(panel.query_one("#numbers")))
        numbers = text_of(panel.query_one("#numbers"))
        assert "25% used" in numbers, numbers
        hits, queries = fake.counters["prefix_cache_hits"], fake.counters["prefix_cache_queries"]
        assert f"hit {hits / queries:.0%}" in numbers, numbers
        # Nothing that a remote engine cannot fill: no block map, its legend, its detail line.
        for selector in ("#block-map", "#legend", "#block-detail", "#row-used"):
            assert not panel.query_one(selector).display, selector
        assert panel.query_one("#row-gen").display and panel.query_one("#row-batch").display
        assert text_of(panel.query_one("#row-batch Label")) == "running"


@pytest.mark.timeout(180)
async def test_tui_on_a_server_without_metrics_shows_no_graph(fake_vllm, tmp_path):
    fake = fake_vllm(metrics=False)
    remote = make_client(ClientSpec(fake.url, stats_interval_s=0.05))
    app = make_app(remote, tmp_path, make_settings(max_tokens=6), PagedChatApp, restore=False)
    async with app.run_test(size=(120, 40)):
        panel = app.query_one(EnginePanel)
        await wait_until(lambda: "no vLLM /metrics" in text_of(panel.query_one("#numbers")))
        for selector in ("#block-map", "#legend", "#block-detail", "#row-used", "#row-gen", "#row-batch"):
            assert not panel.query_one(selector).display, selector


@pytest.mark.parametrize("how", ["--model", "[engine] model", "neither"])
def test_the_tui_takes_its_remote_tokenizer_from_model_or_the_config(fake_vllm, chat_model_dir, tmp_path,
                                                                     monkeypatch, how):
    """`paged-chat --server URL` with `--model`, or `[engine] model` in config.toml: that
    local tokenizer where it matches the server's; with neither, the server's own."""
    import paged_chat.cli.main

    fake = fake_vllm()
    config = tmp_path / "config.toml"
    config.write_text(f'[engine]\nmodel = "{chat_model_dir}"\n' if how == "[engine] model" else "")
    opened = []
    monkeypatch.setattr(paged_chat.cli.main, "_has_terminal", lambda: True)
    monkeypatch.setattr(PagedChatApp, "run", lambda app: opened.append(app.engine.info.tokenizer_from))
    args = ["--model", str(chat_model_dir)] if how == "--model" else []
    result = CliRunner().invoke(cli_app, ["--config", str(config), "--server", fake.url, *args], obj=no_engine())
    assert result.exit_code == 0, result.output
    assert opened == ["the server's" if how == "neither" else "local"]
