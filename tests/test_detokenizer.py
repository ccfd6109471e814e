"""Incremental detokenizer on the default model's real tokenizer (byte-level BPE), and on
tiny sentencepiece-style and WordPiece ones."""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models
from transformers import PreTrainedTokenizerFast

from paged_chat.engine.core.detokenizer import IncrementalDetokenizer, TokenTexts

TEXTS = [
    "Hello wörld! Ça va? Привет, мир. naïve café résumé",
    "Emoji: 😀👍🏽👨‍👩‍👧‍👦 🇫🇷 and CJK: 日本語のテキスト, 中文字符, 한국어 텍스트.",
    "def f(x):\n    return x ** 2  # ✓ done\n\n\tTabs   and  spaces",
    "Mixed: ∑ᵢ xᵢ² ≤ ∞ — “quotes” … 🤖🧠 ok",
]


def feed(detok: IncrementalDetokenizer, ids: list[int], chunks: list[int] | None = None
         ) -> tuple[list[str], bool]:
    """Feed ids in chunks of the given sizes (default one at a time); stop at a stop string."""
    pieces, sizes, i = [], iter(chunks or []), 0
    while i < len(ids):
        size = next(sizes, 1)
        new, stopped = detok.add_tokens(ids[i:i + size])
        pieces.append(new)
        i += size
        if stopped:
            return pieces, True
    return pieces, False


def test_pieces_concatenate_to_the_full_decode(tokenizer) -> None:
    for text in TEXTS:
        ids = tokenizer.encode(text, add_special_tokens=False)
        detok = IncrementalDetokenizer(tokenizer, stop=[])
        pieces, stopped = feed(detok, ids)
        pieces.append(detok.flush())
        full = tokenizer.decode(ids, skip_special_tokens=True)
        assert not stopped and "\ufffd" not in full
        assert "".join(pieces) == full == detok.text
        assert not any("\ufffd" in piece for piece in pieces)


def test_random_token_ids_in_random_chunks(tokenizer) -> None:
    """Arbitrary ids (special ones, byte fragments that never form valid UTF-8) included."""
    rng = random.Random(0)
    vocab = len(tokenizer)
    byte_tokens = [i for i in range(vocab) if "\ufffd" in tokenizer.decode([i])]
    for skip_special_tokens in (True, False):
        for _ in range(40):
            ids = [rng.choice(byte_tokens) if rng.random() < 0.4 else rng.randrange(vocab)
                   for _ in range(rng.randrange(1, 60))]
            chunks = [rng.randrange(1, 4) for _ in ids]
            detok = IncrementalDetokenizer(tokenizer, stop=[],
                                           skip_special_tokens=skip_special_tokens)
            pieces, _ = feed(detok, ids, chunks)
            pieces.append(detok.flush())
            assert "".join(pieces) == tokenizer.decode(ids,
                                                       skip_special_tokens=skip_special_tokens)


def test_special_tokens_are_skipped(tokenizer) -> None:
    ids = tokenizer.encode("Hi there", add_special_tokens=False)
    special = [tokenizer.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<file_sep>")]
    detok = IncrementalDetokenizer(tokenizer, stop=[])
    pieces, _ = feed(detok, [special[1]] + ids[:1] + special + ids[1:])
    assert "".join(pieces) + detok.flush() == "Hi there"


def test_each_step_decodes_a_bounded_window(tokenizer) -> None:
    """The cost per token must not grow with the output: every decode call sees few ids."""
    ids = tokenizer.encode(" ".join(TEXTS * 20), add_special_tokens=False)

    class Spy:
        added_tokens_decoder = tokenizer.added_tokens_decoder
        window = 0

        def decode(self, token_ids: list[int], **kwargs) -> str:
            Spy.window = max(Spy.window, len(token_ids))
            return tokenizer.decode(token_ids, **kwargs)

    detok = IncrementalDetokenizer(Spy(), stop=[])
    pieces, _ = feed(detok, ids)
    assert len(ids) > 1000
    assert "".join(pieces) + detok.flush() == tokenizer.decode(ids, skip_special_tokens=True)
    assert Spy.window <= 8


def test_byte_level_ids_of_whole_characters_are_looked_up_not_decoded(tokenizer, monkeypatch
                                                                      ) -> None:
    """After text that ends on a character, an id of whole characters adds its own text: the
    byte-level tokenizer's ids are looked up, and only the first id and the fragments of a
    character decode windows (before, every id decoded two)."""
    text = "A block table lists the blocks of one request, in order. " * 20 + TEXTS[1]
    ids = tokenizer.encode(text, add_special_tokens=False)
    texts = TokenTexts.of(tokenizer, skip_special_tokens=True)
    fragments = sum(texts.text_of(i) is None for i in ids)  # fills the table first
    assert 0 < fragments < len(ids) // 4  # the emoji and CJK split into byte fragments
    windows = []

    def counting_decode(ids: list[int]) -> str:
        windows.append(len(ids))
        return tokenizer.decode(ids, skip_special_tokens=True)

    monkeypatch.setattr(texts, "decode", counting_decode)
    detok = IncrementalDetokenizer(tokenizer, stop=[])
    pieces, _ = feed(detok, ids)
    assert "".join(pieces) + detok.flush() == tokenizer.decode(ids, skip_special_tokens=True)
    assert len(windows) <= 4 * fragments + 2


def sentencepiece_style(decoder: decoders.Decoder) -> PreTrainedTokenizerFast:
    """A tiny Llama-2-style vocabulary: "▁" words, plain pieces, and a token per byte."""
    pieces = ["<unk>", "\u2581a", "\u2581b", "\u2581the", "a", "b", "\u2581", "\u00e9",
              "\u2581\u00e9t\u00e9"]
    vocab = {piece: index for index, piece in enumerate(
        pieces + [f"<0x{byte:02X}>" for byte in range(256)])}
    backend = Tokenizer(models.BPE(vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    backend.decoder = decoder
    return PreTrainedTokenizerFast(tokenizer_object=backend, clean_up_tokenization_spaces=False)


LLAMA2_DECODER = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(),
                                    decoders.Fuse(), decoders.Strip(" ", 1, 0)])


@pytest.mark.parametrize("decoder", [decoders.Metaspace(), LLAMA2_DECODER],
                         ids=["metaspace", "llama2"])
def test_a_sentencepiece_decoder_strips_only_the_start_of_the_whole_text(decoder) -> None:
    """Such a decoder strips the space that starts the text, so "▁a" is "a" first and " a"
    after other text: the first id goes through a window, the later ones are looked up."""
    tokenizer = sentencepiece_style(decoder)
    a, b = tokenizer.convert_tokens_to_ids(["\u2581a", "\u2581b"])
    assert tokenizer.decode([a, b, a]) == "a b a" and tokenizer.decode([b]) == "b"
    assert TokenTexts.of(tokenizer, skip_special_tokens=True).text_of(b) == " b"
    detok = IncrementalDetokenizer(tokenizer, stop=[])
    pieces, _ = feed(detok, [a, b, a])
    assert "".join(pieces) + detok.flush() == "a b a"


@pytest.mark.parametrize("decoder", [decoders.Metaspace(), LLAMA2_DECODER],
                         ids=["metaspace", "llama2"])
def test_sentencepiece_random_ids_in_random_chunks(decoder) -> None:
    """Pieces and characters spelled in byte tokens, in any order and chunks. (Bytes that
    never form a character are left out: the byte decoder turns a whole run of byte tokens
    with one into a U+FFFD per byte, the valid ones before it included, so text already
    streamed would change afterwards, on any incremental path.)"""
    tokenizer = sentencepiece_style(decoder)
    rng = random.Random(1)
    pieces_ids = list(range(1, 9))
    spelled = [[tokenizer.convert_tokens_to_ids(f"<0x{byte:02X}>") for byte in char.encode()]
               for char in ("é", "😀", "A", " ", "日")]
    for _ in range(200):
        ids = []
        for _ in range(rng.randrange(1, 12)):
            ids += rng.choice(spelled) if rng.random() < 0.4 else [rng.choice(pieces_ids)]
        detok = IncrementalDetokenizer(tokenizer, stop=[])
        pieces, _ = feed(detok, ids, [rng.randrange(1, 4) for _ in ids])
        pieces.append(detok.flush())
        assert "".join(pieces) == tokenizer.decode(ids, skip_special_tokens=True), ids


def test_a_decoder_that_works_across_tokens_gets_no_looked_up_texts() -> None:
    """WordPiece joins pieces and cleans up spaces across tokens: every id goes through a
    window."""
    backend = Tokenizer(models.WordLevel({"a": 0, "##b": 1, "[UNK]": 2}, unk_token="[UNK]"))
    backend.decoder = decoders.WordPiece()
    wordpiece = PreTrainedTokenizerFast(tokenizer_object=backend,
                                        clean_up_tokenization_spaces=False)
    assert wordpiece.decode([0, 1, 0]) == "ab a"
    assert TokenTexts.of(wordpiece, skip_special_tokens=True).text_of(1) is None
    detok = IncrementalDetokenizer(wordpiece, stop=[])
    pieces, _ = feed(detok, [0, 1, 0])
    assert "".join(pieces) + detok.flush() == "ab a"


def check_stop(tokenizer, text: str, stop: list[str], chunks: list[int] | None = None) -> None:
    """Emitted text is always a prefix of the text before the stop string that ends first: no
    part of a stop string ever goes out, even when it spans several tokens."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    full = tokenizer.decode(ids, skip_special_tokens=True)
    hits = [(i + len(s), i) for s in stop if (i := full.find(s)) >= 0]
    expected = full[:min(hits)[1]] if hits else full
    detok = IncrementalDetokenizer(tokenizer, stop=stop)
    emitted = ""
    pieces, stopped = feed(detok, ids, chunks)
    for piece in pieces:
        emitted += piece
        assert expected.startswith(emitted)
    # text ending in U+FFFD (bytes this vocabulary cannot complete) waits for flush(), which
    # still cuts the stop string
    assert stopped == bool(hits) or full.endswith("\ufffd")
    emitted += detok.flush()
    assert emitted == expected == detok.text


def test_stop_strings_split_across_tokens(tokenizer) -> None:
    text = "The quick brown fox jumps over the lazy dog. 日本語のテキスト 😀👍 end"
    ids = tokenizer.encode(text, add_special_tokens=False)
    pieces = [tokenizer.decode([i]) for i in ids]
    assert "ck brown f" not in pieces and "テキ" not in pieces  # they really span tokens
    for stop in (["ck brown f"], ["テキ"], ["lazy", "jumps"], ["😀👍"], ["nowhere"], [" end"]):
        check_stop(tokenizer, text, stop)
        check_stop(tokenizer, text, stop, chunks=[len(ids)])  # all at once: same result


def test_the_stop_string_that_ends_first_fires(tokenizer) -> None:
    """Generation stops as soon as a stop string is complete: "1" in "01" ends before "010"
    does, whether the ids come one at a time or all at once."""
    text = "x 010 y"
    ids = tokenizer.encode(text, add_special_tokens=False)
    for chunks in (None, [len(ids)]):
        detok = IncrementalDetokenizer(tokenizer, stop=["010", "1"])
        pieces, stopped = feed(detok, ids, chunks)
        assert stopped and "".join(pieces) == detok.text == "x 0"


def test_nothing_comes_after_a_stop_string(tokenizer) -> None:
    ids = tokenizer.encode("abc STOP def ghi", add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, stop=["STOP"])
    _, stopped = feed(detok, ids)
    assert stopped and detok.text == "abc "
    assert detok.add_tokens(ids) == ("", True)
    assert detok.flush() == "" and detok.text == "abc "


def test_flush_releases_text_held_back_for_a_possible_stop_string(tokenizer) -> None:
    ids = tokenizer.encode("a b c d", add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, stop=["d e f g h"])
    pieces, stopped = feed(detok, ids)
    assert not stopped and "".join(pieces) == ""  # all of it could still start the stop
    assert detok.flush() == "a b c d" == detok.text


TEXT = st.text(st.characters(exclude_categories=("Cs",)), max_size=80)


@settings(max_examples=300, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=TEXT, data=st.data())
def test_property_random_texts(tokenizer, text: str, data: st.DataObject) -> None:
    full = tokenizer.decode(tokenizer.encode(text, add_special_tokens=False),
                            skip_special_tokens=True)
    stops = []
    if full and data.draw(st.booleans()):
        start = data.draw(st.integers(0, len(full) - 1))
        stops.append(full[start:start + data.draw(st.integers(1, 6))])
    stops += data.draw(st.lists(st.text(min_size=1, max_size=4), max_size=2))
    chunks = data.draw(st.lists(st.integers(1, 3), max_size=40))
    check_stop(tokenizer, text, stops, chunks)
