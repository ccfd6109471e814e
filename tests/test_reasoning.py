"""The reasoning splitter: a reply's thinking apart from its answer, delta by delta."""

from __future__ import annotations

import pytest

from paged_chat.app.reasoning import ReasoningSplitter, SplitText, opens_thinking, split_reply

QWEN3_REPLY = "<think>\nThe user greets me.\nI greet back.\n</think>\n\nHello there!"


def streamed(deltas: list[str], in_thinking: bool = False) -> tuple[list[SplitText], ReasoningSplitter]:
    splitter = ReasoningSplitter(in_thinking)
    parts = [splitter.feed(delta) for delta in deltas]
    parts.append(splitter.finish())
    return parts, splitter


def joined(parts: list[SplitText]) -> SplitText:
    return SplitText("".join(p.reasoning for p in parts), "".join(p.answer for p in parts))


def test_a_whole_reply_splits_into_reasoning_and_answer():
    assert split_reply(QWEN3_REPLY) == SplitText("The user greets me.\nI greet back.", "Hello there!")


@pytest.mark.parametrize("size", [1, 2, 3, 5, 7])
def test_markers_split_across_deltas_split_the_same(size):
    deltas = [QWEN3_REPLY[i:i + size] for i in range(0, len(QWEN3_REPLY), size)]
    parts, splitter = streamed(deltas)
    assert joined(parts) == split_reply(QWEN3_REPLY)
    assert (splitter.reasoning, splitter.answer) == ("The user greets me.\nI greet back.", "Hello there!")
    assert splitter.opened
    # No delta shows a piece of a marker as text.
    assert all("<" not in part.reasoning + part.answer for part in parts)


def test_the_reasoning_streams_before_the_thinking_ends():
    splitter = ReasoningSplitter()
    assert splitter.feed("<think>Let me see") == SplitText(reasoning="Let me see")
    assert splitter.thinking
    assert splitter.feed(" more</th") == SplitText(reasoning=" more")
    assert splitter.feed("ink>\n\nYes.") == SplitText(answer="Yes.")
    assert not splitter.thinking


def test_a_reply_without_thinking_is_all_answer_unchanged():
    text = "  \nPlain answer with a <think> tag in the middle and </think> too.\n"
    parts, splitter = streamed([text[:3], text[3:10], text[10:]])
    assert joined(parts) == SplitText("", text)
    assert not splitter.opened


def test_a_reply_that_only_starts_like_a_marker_is_answer():
    assert split_reply("<thi") == SplitText("", "<thi")
    assert split_reply("<b>bold</b>") == SplitText("", "<b>bold</b>")


def test_unterminated_thinking_at_max_tokens_is_all_reasoning():
    parts, splitter = streamed(["<think>\nStep one. ", "Step two </thi"])
    assert joined(parts) == SplitText("Step one. Step two </thi", "")
    assert splitter.thinking and splitter.answer == ""


def test_the_prompt_opened_thinking_r1_style():
    reply = "\nOkay, so 2+2.\n</think>\n\nIt is 4."
    assert split_reply(reply, in_thinking=True) == SplitText("Okay, so 2+2.", "It is 4.")
    parts, _ = streamed(list(reply), in_thinking=True)
    assert joined(parts) == SplitText("Okay, so 2+2.", "It is 4.")


def test_an_empty_thinking_section_leaves_the_answer():
    assert split_reply("<think>\n\n</think>\n\nHi.") == SplitText("", "Hi.")


def test_a_prompt_that_opens_thinking_is_recognised():
    assert opens_thinking("<｜User｜>hi<｜Assistant｜><think>\n")
    assert not opens_thinking("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not opens_thinking("<|im_start|>assistant\n")
