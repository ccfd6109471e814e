"""Models that think: a tiny random Qwen3 with <think> tokens and Qwen3's thinking template,
its replies scripted, through the conversation, the session and the store."""

from __future__ import annotations

import asyncio
import warnings

import openai
import pytest
from cli_fixtures import Cli
from helpers import assert_no_leaks, engine_config, scripted, wait_for, wait_until
from server_fixtures import start_server
from tiny_models import EOS_ID, thinking_tokenizer

from paged_chat.app.chat_session import ChatSession
from paged_chat.app.chat_store import ChatStore
from paged_chat.app.conversation import Conversation
from paged_chat.engine import ClientSpec, SamplingParams, make_client

REASONING = "The user says hi. I say hi back."
ANSWER = "Hi there!"
REPLY = f"<think>\n{REASONING}\n</think>\n\n{ANSWER}"
PARAMS = SamplingParams(temperature=0.0, max_tokens=64)


def reply_ids(tokenizer, text: str = REPLY) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False) + [EOS_ID]


@pytest.fixture
def client(thinking_model_dir, monkeypatch):
    """A thread client on the tiny thinking Qwen3 whose every reply is REPLY."""
    tokenizer = thinking_tokenizer()
    scripted(monkeypatch, reply_ids(tokenizer))
    client = make_client(ClientSpec("thread", engine_config(thinking_model_dir, block_size=8)))
    yield client
    client.shutdown()
    assert_no_leaks(client.transport.engine)


async def ask(session: ChatSession, client, text: str) -> None:
    async for _ in session.send(client, text, PARAMS):
        pass


def test_the_next_prompt_keeps_the_generated_thinking_ids():
    tokenizer = thinking_tokenizer()
    conversation = Conversation(tokenizer, tokenizer.chat_template)
    first = conversation.next_prompt_ids("Hello")
    generated = reply_ids(tokenizer)
    conversation.add_reply(first, generated, ANSWER, REASONING)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "re-encoding" fallback
        second = conversation.next_prompt_ids("And again")
    # The template renders the first reply without its thinking; the prompt keeps it.
    assert "<think>" not in tokenizer.apply_chat_template(
        conversation.messages + [{"role": "user", "content": "x"}], tokenize=False)
    assert second[:len(first) + len(generated)] == first + generated
    assert tokenizer.decode(second[len(first) + len(generated):]) == \
        "\n<|im_start|>user\nAnd again<|im_end|>\n<|im_start|>assistant\n"


def test_a_reply_cut_in_its_thinking_keeps_its_ids_too():
    tokenizer = thinking_tokenizer()
    conversation = Conversation(tokenizer, tokenizer.chat_template)
    first = conversation.next_prompt_ids("Hello")
    cut = tokenizer.encode(f"<think>\n{REASONING}", add_special_tokens=False)  # max_tokens: no EOS
    conversation.add_reply(first, cut, "", REASONING)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        second = conversation.next_prompt_ids("Go on")
    assert second[:len(first) + len(cut)] == first + cut
    assert tokenizer.decode(second[len(first) + len(cut):]).startswith("\n<|im_end|>\n<|im_start|>user\nGo on")


def r1_template() -> str:
    """The thinking template with its generation prompt opening the thinking, as
    DeepSeek-R1 distills' does."""
    template = thinking_tokenizer().chat_template.replace(
        "'<|im_start|>assistant\n' }}", "'<|im_start|>assistant\n<think>\n' }}")
    assert "<think>\n' }}" in template
    return template


def test_the_next_prompt_keeps_the_ids_where_the_prompt_opened_the_thinking():
    tokenizer = thinking_tokenizer()
    conversation = Conversation(tokenizer, r1_template())
    first = conversation.next_prompt_ids("Hello")
    generated = reply_ids(tokenizer, f"{REASONING}\n</think>\n\n{ANSWER}")
    conversation.add_reply(first, generated, ANSWER, REASONING)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        second = conversation.next_prompt_ids("And again")
    assert second[:len(first) + len(generated)] == first + generated
    assert tokenizer.decode(second[len(first) + len(generated):]) == \
        "\n<|im_start|>user\nAnd again<|im_end|>\n<|im_start|>assistant\n<think>\n"


def test_a_changed_template_still_re_encodes_with_a_warning():
    tokenizer = thinking_tokenizer()
    conversation = Conversation(tokenizer, tokenizer.chat_template, "Be brief.")
    first = conversation.next_prompt_ids("Hello")
    conversation.add_reply(first, reply_ids(tokenizer), ANSWER, REASONING)
    conversation.system_prompt = "Be verbose."
    with pytest.warns(UserWarning, match="re-encoding"):
        conversation.next_prompt_ids("Again")


def test_a_session_splits_the_reply_and_the_next_turn_hits_the_cache(client, tmp_path):
    store = ChatStore(tmp_path / "chats.db")
    chat = store.create_chat("t", "m")
    session = ChatSession(store, chat)
    asyncio.run(ask(session, client, "Hello"))
    first = session.turn
    assert (first.text, first.reasoning, first.finish_reason) == (ANSWER, REASONING, "stop")
    assert first.reasoning_tokens == len(thinking_tokenizer().encode(f"<think>\n{REASONING}\n</think>"))
    asyncio.run(ask(session, client, "Again"))
    second = session.turn
    assert second.prompt_ids[:len(first.live_ids)] == first.live_ids
    assert second.num_cached_tokens >= len(first.live_ids) - 8  # all but the last, partial block
    stored = store.get_chat(chat.id).messages
    assert [(m.role, m.content, m.reasoning) for m in stored] == [
        ("user", "Hello", None), ("assistant", ANSWER, REASONING),
        ("user", "Again", None), ("assistant", ANSWER, REASONING)]
    assert stored[1].timings["reasoning_tokens"] == first.reasoning_tokens
    # A new process rebuilds the same prompt from the store.
    rebuilt = Conversation.from_chat(store.get_chat(chat.id), thinking_tokenizer(),
                                     thinking_tokenizer().chat_template)
    assert rebuilt.token_ids == second.live_ids


def test_a_chat_with_thinking_off_says_so_to_the_template(client, tmp_path):
    store = ChatStore(tmp_path / "chats.db")
    chat = store.create_chat("t", "m")
    session = ChatSession(store, chat)
    assert session.can_switch_thinking(client)
    session.set_thinking(False)
    asyncio.run(ask(session, client, "Hello"))
    tokenizer = thinking_tokenizer()
    assert tokenizer.decode(session.turn.prompt_ids).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert store.get_chat(chat.id).thinking is False


def test_a_prompt_that_opens_the_thinking_starts_the_reply_in_it(thinking_model_dir, monkeypatch):
    """DeepSeek-R1 distills' templates end the generation prompt with <think>."""
    tokenizer = thinking_tokenizer()
    template = r1_template()
    scripted(monkeypatch, reply_ids(tokenizer, f"{REASONING}\n</think>\n\n{ANSWER}"))
    client = make_client(ClientSpec("thread", engine_config(thinking_model_dir)))
    try:
        session = ChatSession(conversation=Conversation(tokenizer, template))
        asyncio.run(ask(session, client, "Hello"))
        assert (session.turn.text, session.turn.reasoning) == (ANSWER, REASONING)
    finally:
        client.shutdown()


def test_a_store_from_before_thinking_migrates_in_place(tmp_path, monkeypatch):
    from helpers import insert_old_chat, insert_old_message

    from paged_chat.app import chat_store
    path = tmp_path / "chats.db"
    # Before branches too, so the rows below are as that version wrote them (the branch
    # step gives them their parents).
    monkeypatch.setattr(chat_store, "MIGRATIONS", chat_store.MIGRATIONS[:-2])
    ChatStore(path).close()
    monkeypatch.undo()
    insert_old_chat(path, "old", "Old")
    insert_old_message(path, "old", "user", "Hello", [1])
    insert_old_message(path, "old", "assistant", "Hi", [2])
    with ChatStore(path) as store:
        chat = store.get_chat("old")
        assert chat.thinking is None and [m.reasoning for m in chat.messages] == [None, None]
        store.set_thinking("old", True)
        fork = store.fork_chat("old")
        assert fork.thinking is True and [m.content for m in fork.messages] == ["Hello", "Hi"]


# ---- paged-chat ask ----------------------------------------------------------------------


@pytest.fixture
def thinking_cli(tmp_path, monkeypatch, thinking_model_dir, new_engine) -> Cli:
    """`paged-chat` on the tiny thinking Qwen3, every reply REPLY."""
    scripted(monkeypatch, reply_ids(thinking_tokenizer()))
    monkeypatch.setenv("PAGED_CHAT_DATA_DIR", str(tmp_path / "data"))
    config = tmp_path / "config.toml"
    config.write_text(f'[engine]\nmodel = "{thinking_model_dir}"\ndevice = "cpu"\n'
                      'dtype = "float32"\nnum_blocks = 128\nblock_size = 8\n\n'
                      '[chat]\ntemperature = 0.0\nmax_tokens = 64\n')
    cli = Cli(config, thinking_model_dir, new_engine)
    yield cli
    for engine in cli.engines:
        assert not engine.has_unfinished() and engine.stats().blocks_in_use == 0


def test_ask_prints_only_the_answer(thinking_cli):
    result = thinking_cli("ask", "Hello")
    assert result.exit_code == 0, result.stderr
    assert result.stdout == ANSWER + "\n"


def test_ask_show_thinking_prints_the_thinking_then_the_answer(thinking_cli):
    result = thinking_cli("ask", "--show-thinking", "Hello")
    assert result.exit_code == 0, result.stderr
    assert result.stdout == f"{REASONING}\n\n{ANSWER}\n"


def test_ask_json_has_the_reasoning_and_the_answer(thinking_cli):
    answer = thinking_cli.json("Hello")
    assert (answer["text"], answer["reasoning"]) == (ANSWER, REASONING)
    assert answer["reasoning_tokens"] > 0 and answer["finish_reason"] == "stop"
    # The next turn (-c) starts with the first turn's exact prompt and generated ids.
    first = thinking_cli.store().get_chat(answer["chat_id"])
    history = [i for message in first.messages for i in message.token_ids]
    again = thinking_cli.json("-c", "Again")
    assert again["cached_tokens"] >= len(history) - 8
    second = thinking_cli.store().get_chat(answer["chat_id"]).messages
    assert [i for message in second[:2] for i in message.token_ids] == history
    assert (second[3].content, second[3].reasoning) == (ANSWER, REASONING)


def test_the_chat_loop_prints_only_the_answer(thinking_cli):
    result = thinking_cli("chat", input="Hello\n/quit\n")
    assert result.exit_code == 0, result.stderr
    assert result.stdout.startswith(ANSWER + "\n") and "think" not in result.stdout


def test_ask_thinking_off_turns_the_thinking_off_and_keeps_it_with_the_chat(thinking_cli):
    answer = thinking_cli.json("--thinking", "off", "Hello")
    chat = thinking_cli.store().get_chat(answer["chat_id"])
    assert chat.thinking is False
    assert thinking_tokenizer().decode(chat.messages[0].token_ids).endswith("<think>\n\n</think>\n\n")
    continued = thinking_cli.json("-c", "Again")
    messages = thinking_cli.store().get_chat(continued["chat_id"]).messages
    assert thinking_tokenizer().decode(messages[2].token_ids).endswith("<think>\n\n</think>\n\n")


# ---- the API -----------------------------------------------------------------------------


@pytest.fixture
def thinking_api(client, thinking_model_dir):
    served = start_server(client, model_names=[str(thinking_model_dir)])
    yield served
    served.stop()
    wait_for(lambda: client.stats().blocks_in_use == 0, what="every block back")


def api_client(served) -> openai.OpenAI:
    return openai.OpenAI(base_url=served.url, api_key="unused", max_retries=0)


def test_the_api_returns_the_thinking_apart(thinking_api):
    reply = api_client(thinking_api).chat.completions.create(
        model=thinking_api.model, messages=[{"role": "user", "content": "Hello"}], max_tokens=64)
    message = reply.choices[0].message
    assert message.content == ANSWER
    assert message.model_extra["reasoning_content"] == message.model_extra["reasoning"] == REASONING


def test_the_api_streams_the_thinking_apart(thinking_api):
    chunks = list(api_client(thinking_api).chat.completions.create(
        model=thinking_api.model, messages=[{"role": "user", "content": "Hello"}], max_tokens=64,
        stream=True))
    deltas = [chunk.choices[0].delta for chunk in chunks if chunk.choices]
    assert "".join(d.content or "" for d in deltas) == ANSWER
    for name in ("reasoning_content", "reasoning"):
        assert "".join((d.model_extra or {}).get(name) or "" for d in deltas) == REASONING
    # The thinking streams before the answer: no delta holds a marker as text.
    assert not any("<" in (d.content or "") for d in deltas)


@pytest.mark.parametrize("name", ["reasoning_content", "reasoning"])
def test_the_api_takes_the_thinking_back_in_an_assistant_message(thinking_api, name):
    """A Qwen3 template renders the thinking of a reply after the last user message only:
    a request ending with an assistant message (a prefill to continue) shows it."""
    tokenizer = thinking_tokenizer()
    messages = [{"role": "user", "content": "Hello"},
                {"role": "assistant", "content": ANSWER, name: REASONING}]
    reply = api_client(thinking_api).chat.completions.create(
        model=thinking_api.model, messages=messages, max_tokens=4,
        extra_body={"return_token_ids": True, "chat_template_kwargs": {"enable_thinking": True}})
    expected = tokenizer.apply_chat_template(
        [messages[0], {"role": "assistant", "content": ANSWER, "reasoning_content": REASONING}],
        tokenize=False, add_generation_prompt=True)
    assert f"<think>\n{REASONING}\n</think>" in expected
    assert reply.usage.prompt_tokens == len(tokenizer.encode(expected, add_special_tokens=False))


def test_the_api_passes_enable_thinking_to_the_template(thinking_api):
    tokenizer = thinking_tokenizer()
    messages = [{"role": "user", "content": "Hello"}]
    on = api_client(thinking_api).chat.completions.create(
        model=thinking_api.model, messages=messages, max_tokens=2)
    off = api_client(thinking_api).chat.completions.create(
        model=thinking_api.model, messages=messages, max_tokens=2,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    closed = len(tokenizer.encode("<think>\n\n</think>\n\n", add_special_tokens=False))
    assert off.usage.prompt_tokens == on.usage.prompt_tokens + closed


# ---- the TUI -----------------------------------------------------------------------------


async def test_the_tui_shows_the_thinking_collapsed_and_expands_it(client, tmp_path):
    from tui_helpers import idle, make_app, make_settings, press, replies, text_of, type_prompt

    from paged_chat.tui.app import PagedChatApp
    from paged_chat.tui.message_widgets import ThinkingSection

    def open_app():
        return make_app(client, tmp_path, make_settings(max_tokens=64),
                        app_class=PagedChatApp)  # the reply ends at its EOS

    async with open_app().run_test(size=(100, 40)) as pilot:
        app = pilot.app
        await type_prompt(pilot, "Hello")
        await wait_until(lambda: idle(app) and app.active_tab.session.turn is not None
                         and app.active_tab.session.turn.finished)
        [reply] = replies(app.active_tab)
        await wait_until(lambda: reply.thinking is not None and reply.thinking.is_mounted)
        tokens = app.active_tab.session.turn.reasoning_tokens
        assert reply.text == ANSWER and tokens > 0
        section = reply.query_one(ThinkingSection)
        assert section.collapsed and section.title == f"thinking · {tokens} tokens"
        assert "<think>" not in "".join(chunk.source for chunk in reply._chunks)
        await press(pilot, "alt+t")
        await wait_until(lambda: not section.collapsed)
        body = section.query_one(".thinking-text")
        await wait_until(lambda: text_of(body) == REASONING)
        await pilot.pause()
        assert await pilot.click("ThinkingSection CollapsibleTitle"), "the click missed the title"
        await wait_until(lambda: section.collapsed)
        app.active_tab.prompt.focus()   # the click focused the title
        # F3: thinking off in this chat, from its next turn on.
        await press(pilot, "f3")
        await wait_until(lambda: app.active_tab.session.thinking is False)
        assert "thinking=off" in text_of(app.active_tab.query_one(".chat-info"))
        await type_prompt(pilot, "Again")
        await wait_until(lambda: idle(app) and len(replies(app.active_tab)) == 2
                         and app.active_tab.session.turn.finished)
        prompt = thinking_tokenizer().decode(app.active_tab.session.turn.prompt_ids)
        assert prompt.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    # After a restart, the stored reply shows its thinking the same way.
    async with open_app().run_test(size=(100, 40)) as pilot:
        app = pilot.app
        await wait_until(lambda: app.active_tab is not None and len(replies(app.active_tab)) == 2)
        first = replies(app.active_tab)[0]
        await wait_until(lambda: first.thinking is not None and first.thinking.is_mounted)
        assert first.thinking.collapsed and first.thinking.title == f"thinking · {tokens} tokens"
        assert first.text == ANSWER
        assert app.active_tab.session.thinking is False
        await wait_until(lambda: "thinking=off" in text_of(app.active_tab.query_one(".chat-info")))


async def test_the_thinking_streams_into_its_section_shown_or_hidden(chat_model_dir, tmp_path):
    """The section shows while the model thinks, its count rising; a hidden tab's shows
    once the tab is shown, with what streamed meanwhile."""
    from test_tui_streaming import fed_app, shown_words
    from tui_helpers import press

    from paged_chat.tui.message_widgets import AssistantMessage

    app, client = fed_app(chat_model_dir, tmp_path)
    async with app.run_test(size=(120, 40)) as pilot:
        shown = app.active_tab
        assert shown.send("plan")
        client.pieces.put_nowait("<think>\nFirst")
        await wait_until(lambda: shown.query(AssistantMessage)
                         and shown.query_one(AssistantMessage).thinking is not None
                         and shown.query_one(AssistantMessage).thinking.title == "thinking · 1 token")
        reply = shown.query_one(AssistantMessage)
        assert shown_words(reply) == []
        for piece in [" second\n</think>", "\n\nThe answer.", None]:
            client.pieces.put_nowait(piece)
        await wait_until(lambda: not shown.streaming and shown_words(reply) == ["The", "answer."])
        assert reply.thinking.title == "thinking · 2 tokens" and reply.reasoning == "First second"

        await press(pilot, "ctrl+n")
        await wait_until(lambda: len(app.chat_tabs) == 2 and app.active_tab is not shown)
        await press(pilot, "alt+left")
        hidden = app.chat_tabs[1]
        # Hidden as the switcher hides it (not displayed), not only no longer the active tab.
        await wait_until(lambda: app.active_tab is shown and not hidden.display)
        assert hidden.send("again")
        for piece in ["<think>\nQuietly", "</think>Later.", None]:
            client.pieces.put_nowait(piece)
        await wait_until(lambda: not hidden.streaming)
        assert not hidden.query(AssistantMessage)
        await press(pilot, "alt+right")
        await wait_until(lambda: app.active_tab is hidden and hidden.query(AssistantMessage))
        later = hidden.query_one(AssistantMessage)
        await wait_until(lambda: later.thinking is not None and later.thinking.is_mounted
                         and shown_words(later) == ["Later."])
        assert later.thinking.title == "thinking · 2 tokens" and later.reasoning == "Quietly"
        assert later.children[0] is later.thinking and reply.children[0] is reply.thinking  # above the answer
