"""Edit and branch at any message in the TUI (Pilot, tiny random model): Alt+Up selects a
message, Alt+E edits it, Enter sends the edit as a new branch that prefills only from the
edited message, `◀ 1/2 ▶` marks it and Alt+Shift+Left/Right switch branches, and both
branches come back after a restart."""

from __future__ import annotations

import json

import pytest
from helpers import wait_until
from tui_helpers import idle, make_app, make_settings, press, type_prompt

from paged_chat.app.chat_store import ChatStore
from paged_chat.tui.message_widgets import AssistantMessage, UserMessage

QUESTIONS = ("first question", "second question", "third question", "fourth question")


def asked(tab) -> list[str]:
    return [view.text for view in tab.query(UserMessage)]


def titles(tab) -> list[str]:
    return [str(view.border_title) for view in tab.query(UserMessage)]


def selected(tab):
    found = tab.query(".selected")
    return found.first() if found else None


@pytest.mark.timeout(240)
async def test_an_edit_of_the_second_of_four_messages_branches_there(engine, tmp_path):
    settings = make_settings(max_tokens=12)
    app = make_app(engine, tmp_path, settings)
    async with app.run_test(size=(120, 40)) as pilot:
        tab = app.active_tab
        for text in QUESTIONS:
            await type_prompt(pilot, text)
            await wait_until(lambda text=text: idle(app) and tab.session.turn is not None
                             and tab.session.turn.user_text == text, timeout=60)
        stored = app.store.get_chat(tab.chat_id).messages
        first_turn = stored[0].token_ids + stored[1].token_ids
        old_prompt = len(tab.session.turn.prompt_ids)
        hits_before = engine.stats().prefix_cache_hit_tokens

        await press(pilot, *["alt+up"] * 6)   # the last reply, ..., the second question
        await wait_until(lambda: isinstance(selected(tab), UserMessage)
                         and selected(tab).text == "second question")
        await press(pilot, "alt+e")
        await wait_until(lambda: tab.prompt.text == "second question")
        await type_prompt(pilot, ", edited")
        await wait_until(lambda: idle(app) and tab.session.turn.user_text == "second question, edited",
                         timeout=60)

        # Only the edited message and after were prefilled: the first turn's blocks hit.
        turn = tab.session.turn
        assert turn.prompt_ids[:len(first_turn)] == first_turn
        assert turn.num_cached_tokens >= (len(first_turn) - 1) // 16 * 16 > 0
        assert len(turn.prompt_ids) < old_prompt
        assert engine.stats().prefix_cache_hit_tokens - hits_before >= turn.num_cached_tokens
        assert asked(tab) == ["first question", "second question, edited"]
        assert titles(tab) == ["you", "you ◀ 2/2 ▶"]
        assert len(tab.query(AssistantMessage)) == 2

        await press(pilot, "alt+shift+left")   # the old branch, all four turns
        await wait_until(lambda: asked(tab) == list(QUESTIONS))
        assert titles(tab) == ["you", "you ◀ 1/2 ▶", "you", "you"]
        await wait_until(lambda: selected(tab) is not None and selected(tab).text == "second question")
        await press(pilot, "alt+shift+right")
        await wait_until(lambda: asked(tab) == ["first question", "second question, edited"])
        await press(pilot, "alt+shift+left")
        await wait_until(lambda: asked(tab) == list(QUESTIONS))
        assert len(app.store.get_chat_tree(tab.chat_id).messages) == 10
    app.store.close()

    app = make_app(engine, tmp_path, settings)
    async with app.run_test(size=(120, 40)) as pilot:
        tab = app.active_tab
        await wait_until(lambda: asked(tab) == list(QUESTIONS))   # the branch last used
        assert titles(tab) == ["you", "you ◀ 1/2 ▶", "you", "you"]
        await wait_until(lambda: app.focused is tab.prompt)
        await press(pilot, "alt+shift+right")
        await wait_until(lambda: asked(tab) == ["first question", "second question, edited"])
        assert titles(tab) == ["you", "you ◀ 2/2 ▶"]
        # The palette lists the other branch, and goes there.
        commands = {command.title: command for command in app.get_system_commands(app.screen)}
        assert [title for title in commands if title.startswith("Branch")] == \
            ["Branch 1/2 at message 3 (user)"]
        await commands["Branch 1/2 at message 3 (user)"].callback()
        await wait_until(lambda: asked(tab) == list(QUESTIONS))


@pytest.mark.timeout(180)
async def test_a_selected_reply_regenerates_as_a_branch_and_esc_gives_up_an_edit(engine, tmp_path):
    app = make_app(engine, tmp_path, make_settings(max_tokens=12))
    async with app.run_test(size=(120, 40)) as pilot:
        tab = app.active_tab
        for text in QUESTIONS[:2]:
            await type_prompt(pilot, text)
            await wait_until(lambda text=text: idle(app) and tab.session.turn is not None
                             and tab.session.turn.user_text == text, timeout=60)
        tab.session.sampling = {"temperature": 1.0, "seed": 5}
        await press(pilot, *["alt+up"] * 3)   # the first reply
        await wait_until(lambda: isinstance(selected(tab), AssistantMessage))
        first_reply = selected(tab).text
        await press(pilot, "ctrl+r")
        await wait_until(lambda: idle(app) and tab.session.turn.user_text == "first question",
                         timeout=60)
        [reply] = tab.query(AssistantMessage)
        assert asked(tab) == ["first question"] and reply.text != first_reply
        assert str(reply.border_title) == "assistant ◀ 2/2 ▶"
        await press(pilot, *"draft", "alt+up", "alt+up", "alt+e")
        await wait_until(lambda: tab.prompt.text == "first question")
        await press(pilot, "escape")   # the edit given up: the draft is back
        await wait_until(lambda: tab.prompt.text == "draft" and not tab.prompt.border_title)
        tab.prompt.clear()
        await type_prompt(pilot, "a plain follow-up")
        await wait_until(lambda: idle(app) and tab.session.turn.user_text == "a plain follow-up",
                         timeout=60)
        assert asked(tab) == ["first question", "a plain follow-up"]


@pytest.mark.timeout(120)
async def test_alt_up_past_the_first_mounted_message_mounts_the_earlier_ones(engine, tmp_path):
    with ChatStore(tmp_path / "chats.db") as store:
        chat = store.create_chat("long", "tiny")
        for index in range(40):
            store.add_message(chat.id, "user", f"question {index}", [1])
            store.add_message(chat.id, "assistant", f"answer {index}", [2], "stop")
    (tmp_path / "session.json").write_text(json.dumps({"open": [chat.id], "active": chat.id}))
    app = make_app(engine, tmp_path)
    async with app.run_test(size=(120, 40)) as pilot:
        tab = app.active_tab
        await wait_until(lambda: len(tab.query(".message")) == 30 and app.focused is tab.prompt)
        await press(pilot, *["alt+up"] * 31)
        await wait_until(lambda: selected(tab) is not None and selected(tab).text == "answer 24")
        assert len(tab.query(".message")) == 60
        await press(pilot, "alt+down")
        await wait_until(lambda: selected(tab).text == "question 25")
