"""Bad input at the engine: each gets a clear message (or passes through as documented) and
nothing else breaks. Also the terminal sanitizer every printer of model text relies on.

Config files, the store and `ask --file` have their own fuzz tests (test_settings,
test_store, test_cli).
"""

from __future__ import annotations

import asyncio
import re

import numpy as np
import pytest
import torch
from helpers import ESCAPE_IDS, ESCAPE_SOUP, GREEDY, generate, scripted, step_as_a_client
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from paged_chat.app.conversation import ChatTemplateError, Conversation
from paged_chat.app.text import sanitize_for_terminal
from paged_chat.engine import ClientSpec, SamplingParams, make_client
from paged_chat.engine.core.detokenizer import IncrementalDetokenizer

pytestmark = pytest.mark.timeout(300)

SHORT = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
FUZZ = settings(max_examples=150, deadline=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture])


def run(engine, prompt, params=SHORT):
    return engine.generate([prompt], params)[0]


# ---- prompts ------------------------------------------------------------------------


def test_prompts_at_and_past_max_model_len(make_engine):
    engine = make_engine(max_model_len=64)
    too_long = run(engine, list(range(3, 67)))
    assert too_long.finish_reason == "error" and too_long.token_ids == []
    assert "64 tokens" in too_long.error and "max_model_len" in too_long.error
    longest = run(engine, list(range(3, 66)))  # 63 tokens: room for one reply token
    assert longest.finish_reason == "length" and len(longest.token_ids) == 1


@pytest.mark.parametrize("prompt", [[], ""])
def test_empty_prompts_are_value_errors(make_engine, prompt):
    with pytest.raises(ValueError, match="empty"):
        make_engine().add_request(prompt, SHORT)


@pytest.mark.parametrize("prompt, message", [
    ([5, -1], "outside the vocabulary"),
    ([5, 512], "outside the vocabulary"),
    ([5, 3.7], "integer token ids"),
    ([5, "12"], "integer token ids"),
    ([5, None], "integer token ids"),
    ([[5, 6]], "integer token ids"),
    (None, "text or a sequence"),
    (b"hello", "bytes"),
])
def test_invalid_token_ids_are_value_errors(make_engine, prompt, message):
    engine = make_engine()
    with pytest.raises(ValueError, match=message):
        engine.add_request(prompt, SHORT)
    assert not engine.has_unfinished()


def test_integer_ids_of_any_integer_type_are_fine(make_engine):
    engine = make_engine()
    expected = run(engine, [5, 6, 7]).token_ids
    assert run(engine, np.array([5, 6, 7])).token_ids == expected
    assert run(engine, torch.tensor([5, 6, 7])).token_ids == expected


def test_prompts_of_only_special_tokens(make_engine):
    engine = make_engine()
    special = engine.tokenizer.all_special_ids
    for prompt in ([0], [1, 2, 0, 2], "<|im_end|><|im_start|><|endoftext|>"):
        out = run(engine, prompt, SamplingParams(temperature=0, max_tokens=8))
        assert out.finish_reason in ("stop", "length")
        if isinstance(prompt, str):
            assert set(engine.tokenizer.encode(prompt)) <= set(special)


async def test_a_megabyte_prompt_fails_alone(make_engine):
    """A 1 MB paste is far past max_model_len: it gets its error while a chat next to it
    streams on undisturbed, and its ids, as a list, fare the same."""
    engine = make_client(ClientSpec(engine=make_engine()))
    try:
        paste = ("All work and no play makes Jack a dull boy. \x1b[31m" * 20_000)[:1_000_000]
        bystander = asyncio.create_task(generate(engine, [5, 6, 7], GREEDY))
        paste_out = await asyncio.wait_for(generate(engine, paste, SHORT), 120)
        assert paste_out.finish_reason == "error" and "max_model_len" in paste_out.error
        ids_out = await asyncio.wait_for(generate(engine, [5] * 300_000, SHORT), 120)
        assert ids_out.finish_reason == "error"
        final = await asyncio.wait_for(bystander, 120)
        assert final.finish_reason == "length" and len(final.token_ids) == 24
    finally:
        engine.shutdown()


def test_a_chat_template_that_raises(make_engine):
    """A template refusing a conversation (many refuse a system turn) raises with its own
    words when the prompt is built, before the engine sees anything; the engine serves on."""
    engine = make_engine()
    refusing = "{{ raise_exception('System role not supported') }}"
    conversation = Conversation(engine.tokenizer, refusing, system_prompt="be brief")
    with pytest.raises(ChatTemplateError, match="chat template failed: System role not supported"):
        conversation.next_prompt_ids("hello")
    broken = Conversation(engine.tokenizer, "{% for m in messages %}{{ m.content }")
    with pytest.raises(ChatTemplateError):
        broken.next_prompt_ids("hello")
    assert run(engine, [5, 6, 7]).finish_reason == "length"


# ---- model output -------------------------------------------------------------------


def test_escape_sequences_in_output_pass_through_for_the_printer_to_sanitize(make_engine,
                                                                           monkeypatch):
    """The engine's text is the model's, byte for byte (it is stored and fed back as is);
    what prints it must sanitize it."""
    scripted(monkeypatch, ESCAPE_IDS + [17] * 4)
    out = run(make_engine(), [5, 6, 7])
    assert out.text == "\x1b[2J!!!!"
    assert sanitize_for_terminal(out.text) == "!!!!"


def engine_stop_oracle(tokenizer, ids: list[int], stop: list[str]) -> tuple[str, bool]:
    """The text a request generating `ids` must end with: the full decode, cut before the
    stop string that ends first; and whether one did."""
    full = tokenizer.decode(ids, skip_special_tokens=True)
    hits = [(i + len(s), i) for s in stop if (i := full.find(s)) >= 0]
    return (full[:min(hits)[1]], True) if hits else (full, False)


def stop_strings(text: str, data: st.DataObject) -> list[str]:
    """Up to two arbitrary stop strings, and often a piece of `text` (so that some fire)."""
    stop = data.draw(st.lists(st.text(st.characters(codec="utf-8"), min_size=1, max_size=5),
                              max_size=2))
    if text and data.draw(st.booleans()):
        start = data.draw(st.integers(0, len(text) - 1))
        stop.append(text[start:start + data.draw(st.integers(1, 4))])
    return stop


# ids a fuzzer can build hard cases from: byte fragments of multi-byte characters, special
# tokens, spaces, escapes, ordinary words
INTERESTING_IDS = st.sampled_from([0, 2, 17, 30, 201, 212, 75, 34, 58, 141, 216, 229, 242,
                                   251, 260, 282, 313, 355, 400, 511, 28120, 2756, 31, 32])


@FUZZ
@given(ids=st.lists(INTERESTING_IDS, min_size=1, max_size=30), data=st.data())
def test_fuzz_stop_strings_against_the_detokenizer(tokenizer, ids, data):
    """Arbitrary ids (unlike test_detokenizer's encoded texts) and arbitrary stop strings,
    drawn from the output or not, fed in arbitrary chunks: what comes out is always a prefix
    of the oracle, and all of it once flushed."""
    full = tokenizer.decode(ids, skip_special_tokens=True)
    stop = stop_strings(full, data)
    expected, hit = engine_stop_oracle(tokenizer, ids, stop)
    detokenizer = IncrementalDetokenizer(tokenizer, stop)
    emitted, position, stopped = "", 0, False
    while position < len(ids) and not stopped:
        size = data.draw(st.integers(1, 4))
        new, stopped = detokenizer.add_tokens(ids[position:position + size])
        position += size
        emitted += new
        assert expected.startswith(emitted)
    emitted += detokenizer.flush()
    assert emitted == expected == detokenizer.text
    assert stopped == hit or (not stopped and hit and full.endswith("\ufffd"))


def test_fuzz_stop_strings_through_the_engine(make_engine, monkeypatch):
    """The same oracle end to end: a request whose output is scripted stops where its stop
    strings say, with the right finish reason, and streams exactly the final text."""
    engine = make_engine()
    script = [0]
    scripted(monkeypatch, script)

    @FUZZ
    @given(ids=st.lists(INTERESTING_IDS.filter(lambda i: i < 512), min_size=1, max_size=20),
           data=st.data())
    def check(ids, data):
        stop = stop_strings(engine.tokenizer.decode(ids, skip_special_tokens=True), data)
        script[:] = ids
        params = SamplingParams(temperature=0, max_tokens=len(ids), stop=stop, ignore_eos=True)
        request_id = engine.add_request([5, 6, 7], params)
        deltas = []
        while engine.has_unfinished():
            deltas += [out for out in step_as_a_client(engine) if out.request_id == request_id]
        final = deltas[-1]
        expected, hit = engine_stop_oracle(engine.tokenizer, ids, stop)
        assert "".join(d.new_text for d in deltas) == final.text == expected
        assert final.finish_reason == ("stop" if hit else "length")

    check()


def test_a_vanishing_temperature_is_greedy(make_engine):
    """1e-38 would overflow the scaled logits to inf and draw an id past the vocabulary."""
    engine = make_engine()
    tiny = SamplingParams(temperature=1e-38, max_tokens=8, ignore_eos=True, seed=1)
    outputs = engine.generate([[5, 6, 7], [8, 9]], [tiny, SHORT])
    assert outputs[0].finish_reason == "length"
    assert outputs[0].token_ids == run(engine, [5, 6, 7]).token_ids


@pytest.mark.parametrize("stop", [[""], ["ok", ""], [3], ""])
def test_bad_stop_strings_are_value_errors(stop):
    with pytest.raises(ValueError, match="stop"):
        SamplingParams(stop=stop)


# ---- sanitize_for_terminal ----------------------------------------------------------


@pytest.mark.parametrize("raw, clean", [
    ("plain text, naïve ✓ 😀\n\tindented", "plain text, naïve ✓ 😀\n\tindented"),
    ("\x1b[31mred\x1b[0m and \x1b[1;4mbold\x1b[m", "red and bold"),
    ("\x1b[2J\x1b[Hcleared", "cleared"),
    ("\x1b]0;pwned\x07title", "title"),
    ("\x1b]8;;https://evil.example\x1b\\link\x1b]8;;\x1b\\", "link"),
    ("\x1bPdevice control\x1b\\after", "after"),
    ("\x9b31mC1 CSI\x9dC1 OSC\x9cdone", "C1 CSIdone"),
    ("\x1b(Bcharset\x1bcreset\x1b7saved", "charsetresetsaved"),
    ("over\rwrite\x08\x07\x00\x7f", "overwrite"),
    ("\x1b]unterminated osc swallows the rest", ""),
    ("a lone \x1b", "a lone "),
    ("\r\n", "\n"),
])
def test_sanitize_examples(raw, clean):
    assert sanitize_for_terminal(raw) == clean


_CONTROLS = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


@settings(max_examples=500, deadline=None)
@given(text=ESCAPE_SOUP)
def test_fuzz_sanitize(text):
    """Nothing a terminal acts on survives, a second pass changes nothing, and text with no
    control character in it is left exactly as it was."""
    clean = sanitize_for_terminal(text)
    assert not _CONTROLS.search(clean)
    assert sanitize_for_terminal(clean) == clean
    if not _CONTROLS.search(text):
        assert clean == text
