"""Incremental detokenization with stop strings.

Each step decodes only a short window of ids (vLLM's prefix/read offsets): a few tokens
already turned into text, then the new ones. The new text is the window's text minus the
text of its already-read part, so a decoder that treats the first token of a decode
specially (sentencepiece strips its leading space) does so in both and the difference is
what a full decode would add. The cost per token stays flat however long the output grows.

Most decoders allow a faster way for most tokens. A byte-level one (GPT-2's BPE: SmolLM2,
Llama 3, Qwen) turns each id into bytes on its own and decodes their concatenation; a
sentencepiece one (Llama 2, Mistral, Gemma) turns each into text on its own ("▁" to a
space, byte tokens to bytes) and strips the space that starts the whole text. So after
some text that ends on a whole character, an id whose bytes are whole characters adds
exactly what it adds after any other such text. `TokenTexts` keeps that per id, so a step
looks up most of its tokens instead of decoding two windows each.
"""

from __future__ import annotations

import json
import weakref
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

_REPLACEMENT = "\ufffd"  # what a byte-level decoder shows for an incomplete UTF-8 sequence


class IncrementalDetokenizer:
    """Turns one request's generated ids into text deltas and spots stop strings.

    The pieces returned by `add_token(s)` plus `flush()` concatenate to exactly
    `tokenizer.decode(output_ids, skip_special_tokens=...)` when no stop string is hit.
    The prompt is deliberately not used as decoding context: a sentencepiece decoder would
    then keep the leading space it strips from the first output token, and the text would
    no longer equal that decode.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, stop: list[str],
                 skip_special_tokens: bool = True) -> None:
        texts = TokenTexts.of(tokenizer, skip_special_tokens)
        self._decode_ids = texts.decode
        self._skipped_ids = texts.skipped_ids
        self._texts = texts.known  # read first: most ids are known after a few requests
        self._text_of = texts.text_of
        self._stop = list(stop)
        self._held_chars = max(map(len, self._stop), default=1) - 1
        self._ids: list[int] = []
        self._prefix_offset = 0  # window start: emitted tokens that give the decoder context
        self._read_offset = 0  # tokens before this are already turned into text
        self._held = ""  # decoded text not yet emitted: a stop string may be starting in it
        self._text = ""
        self._stopped = False

    @property
    def text(self) -> str:
        """All output text emitted so far (a stop string and anything after it excluded)."""
        return self._text

    @property
    def stopped(self) -> bool:
        """Whether a stop string was hit: by `add_token(s)`, or by `flush` in the text it held."""
        return self._stopped

    def add_token(self, token_id: int) -> tuple[str, bool]:
        """Feed one newly generated id; return (new_text, hit_stop_string).

        After a stop string was hit, further ids are ignored and ("", True) comes back.
        """
        if self._stopped:
            return "", True
        if token_id in self._skipped_ids:
            return "", False
        # the text so far is not empty (a leading space is stripped only from the start of
        # the whole text) and ends on a whole character
        after_text = (self._text or self._held) and self._read_offset == len(self._ids)
        self._ids.append(token_id)
        if after_text and (text := self._texts.get(token_id) or self._text_of(token_id)) is not None:
            self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
            return self._release(text)
        return self._release(self._decode_new(final=False))

    def add_tokens(self, token_ids: list[int]) -> tuple[str, bool]:
        """Feed several ids: the same as feeding them one at a time, the texts joined."""
        pieces = []
        for token_id in token_ids:
            text, stopped = self.add_token(token_id)
            pieces.append(text)
            if stopped:
                break
        return "".join(pieces), self._stopped

    def flush(self) -> str:
        """At finish, return the text still held back (nothing if a stop string was hit)."""
        if self._stopped:
            return ""
        text, stopped = self._release(self._decode_new(final=True))
        if stopped:
            return text
        rest, self._held = self._held, ""
        self._text += rest
        return text + rest

    def _decode(self, start: int, end: int | None = None) -> str:
        """Decode ids[start:end] exactly as a full decode of the output would treat them."""
        return self._decode_ids(self._ids[start:end])

    def _decode_new(self, final: bool) -> str:
        """Text added by the ids after the read offset, or "" while it ends mid-character.

        Unless `final`, an incomplete UTF-8 sequence at the end (shown as U+FFFD) is held back
        until the next ids complete it; the window grows meanwhile and shrinks once it is out.
        """
        context = self._decode(self._prefix_offset, self._read_offset)
        window = self._decode(self._prefix_offset)
        if len(window) <= len(context) or (window.endswith(_REPLACEMENT) and not final):
            return ""
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        return window[len(context):]

    def _release(self, new: str) -> tuple[str, bool]:
        """Emit `new` after the held text, keeping back the last (longest stop - 1) characters,
        which could be the start of a stop string.

        The stop string that fires is the one that ends first (the longest of those ending
        there), as if the text arrived one character at a time, so how the ids were split
        into calls does not change the result.
        """
        if not self._stop:  # nothing to look for, nothing held back: every step at batch size
            self._text += new
            return new, False
        pending = self._held + new
        hits = [(i + len(s), i) for s in self._stop if (i := pending.find(s)) >= 0]
        if hits:
            out, self._held, self._stopped = pending[:min(hits)[1]], "", True
        else:
            cut = max(0, len(pending) - self._held_chars)
            out, self._held = pending[:cut], pending[cut:]
        self._text += out
        return out, self._stopped


class TokenTexts:
    """What one tokenizer's decode needs, worked out once instead of per request: the
    decode function, the ids it skips, and (for a decoder that treats each token on its
    own) what each id adds to text.

    `text_of(id)` is the text the id adds after any non-empty text that ends on a whole
    character: what decoding it after an anchor id adds to the anchor's text. It is None
    when that depends on its neighbours: a decoder that joins or cleans up across tokens,
    an id whose bytes are not whole characters (a fragment of an emoji), or one that adds
    nothing. The texts are filled in as ids first occur, so a 150k vocabulary costs
    nothing at start-up.
    """

    _cache: weakref.WeakKeyDictionary[object, dict[bool, TokenTexts]] = weakref.WeakKeyDictionary()

    def __init__(self, tokenizer: PreTrainedTokenizerBase, skip_special_tokens: bool) -> None:
        self.decode = _fast_decoder(tokenizer, skip_special_tokens)
        # decode() drops these anyway; dropping them up front keeps them out of the window,
        # where they could hide the first token from a decoder that strips a leading space
        self.skipped_ids = ({i for i, t in tokenizer.added_tokens_decoder.items() if t.special}
                            if skip_special_tokens else set())
        self.known: dict[int, str | None] = {}
        self._anchor = _anchor(tokenizer, self.decode) if _token_by_token(tokenizer) else None
        if self._anchor is None:
            self.text_of = _no_text
        else:
            self._anchor_text = self.decode([self._anchor])

    @classmethod
    def of(cls, tokenizer: PreTrainedTokenizerBase, skip_special_tokens: bool) -> TokenTexts:
        try:
            by_skip = cls._cache.setdefault(tokenizer, {})
        except TypeError:  # neither hashable nor weakly referable: no sharing
            return cls(tokenizer, skip_special_tokens)
        if skip_special_tokens not in by_skip:
            by_skip[skip_special_tokens] = cls(tokenizer, skip_special_tokens)
        return by_skip[skip_special_tokens]

    def text_of(self, token_id: int) -> str | None:
        try:
            return self.known[token_id]
        except KeyError:
            both = self.decode([self._anchor, token_id])
            text = both[len(self._anchor_text):] if both.startswith(self._anchor_text) else ""
            self.known[token_id] = text if text and _REPLACEMENT not in text else None
            return self.known[token_id]


def _no_text(token_id: int) -> None:
    return None


# Decoders that turn each token into text on its own (Strip only at the start of the text,
# which the detokenizer's lookups never reach), as tokenizer.json names them.
_TOKEN_BY_TOKEN = {"ByteLevel", "Metaspace", "Replace", "ByteFallback", "Fuse"}


def _token_by_token(tokenizer: PreTrainedTokenizerBase) -> bool:
    """Whether `_fast_decoder` is the Rust decoder alone (transformers would clean up
    spaces afterwards) and that decoder treats each token on its own."""
    steps = decoder_steps(tokenizer)
    if steps is None or getattr(tokenizer, "clean_up_tokenization_spaces", True):
        return False
    return all(step.get("stop") == 0 if step.get("type") == "Strip"
               else step.get("type") in _TOKEN_BY_TOKEN for step in steps)


def decoder_steps(tokenizer: PreTrainedTokenizerBase) -> list[dict] | None:
    """The fast tokenizer's decoder as its steps in order, a Sequence flattened, each as
    tokenizer.json spells it; None where the tokenizer has no such decoder."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or backend.decoder is None:
        return None

    def steps(spec: dict) -> list[dict]:
        if spec.get("type") == "Sequence":
            return [step for child in spec.get("decoders", ()) for step in steps(child)]
        return [spec]

    return steps(json.loads(backend.decoder.__getstate__()))


def _anchor(tokenizer: PreTrainedTokenizerBase, decode: Callable[[list[int]], str]) -> int | None:
    """An id whose own text is a whole, non-empty one ("a"), to decode other ids after."""
    ids = tokenizer.encode("a", add_special_tokens=False)
    if len(ids) != 1:
        return None
    text = decode(ids)
    return ids[0] if text and _REPLACEMENT not in text else None


def _fast_decoder(tokenizer: PreTrainedTokenizerBase, skip_special_tokens: bool
                  ) -> Callable[[list[int]], str]:
    """`tokenizer.decode` for a list of ids, through the Rust tokenizer directly when that
    gives the same text (a fast tokenizer that cleans up no spaces).

    transformers' `decode` first walks the ids in Python to normalise their types, which
    costs far more than the Rust call it ends in, and a step detokenizes every running
    request.
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and not getattr(tokenizer, "clean_up_tokenization_spaces", True):
        return partial(backend.decode, skip_special_tokens=skip_special_tokens)
    return partial(tokenizer.decode, skip_special_tokens=skip_special_tokens)
