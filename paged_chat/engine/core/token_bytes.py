"""Each token's own bytes: what it adds to the UTF-8 text, even a part of one character.

Decoding one token alone turns a fragment of an emoji or a CJK character into U+FFFD, so
its bytes are read from its vocabulary piece instead, as the tokenizer's decoder would turn
it into bytes: a byte-level BPE piece (GPT-2's: SmolLM2, Llama 3, Qwen) maps each character
back to one byte; a sentencepiece byte token ("<0xE2>") is that byte, any other piece its
text with "▁" as a space. An added token (<|im_start|>) is its own text, as is every token
of a tokenizer whose decoder is neither.
"""

from __future__ import annotations

import re
import weakref
from typing import TYPE_CHECKING, ClassVar

from paged_chat.engine.core.detokenizer import decoder_steps

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


class TokenBytes:
    """`TokenBytes.of(tokenizer)(token_id)`: the token's bytes (see the module docstring)."""

    _cache: ClassVar[weakref.WeakKeyDictionary[object, TokenBytes]] = weakref.WeakKeyDictionary()

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self._tokenizer = tokenizer
        self._added = {token_id: token.content
                       for token_id, token in tokenizer.added_tokens_decoder.items()}
        kinds = {step.get("type", "") for step in decoder_steps(tokenizer) or ()}
        self._byte_level = "ByteLevel" in kinds
        self._byte_fallback = "ByteFallback" in kinds
        self._metaspace = bool(kinds & {"Metaspace", "Replace"})
        if self._byte_level:
            from transformers.convert_slow_tokenizer import bytes_to_unicode

            self._byte_of = {char: byte for byte, char in bytes_to_unicode().items()}

    @classmethod
    def of(cls, tokenizer: PreTrainedTokenizerBase) -> TokenBytes:
        try:
            known = cls._cache.get(tokenizer)
        except TypeError:  # neither hashable nor weakly referable: no sharing
            return cls(tokenizer)
        if known is None:
            known = cls._cache[tokenizer] = cls(tokenizer)
        return known

    def __call__(self, token_id: int) -> bytes:
        if token_id in self._added:
            return self._added[token_id].encode()
        piece = self._tokenizer.convert_ids_to_tokens(token_id)
        if piece is None:
            return self._tokenizer.decode([token_id]).encode()
        if self._byte_level and all(char in self._byte_of for char in piece):
            return bytes(self._byte_of[char] for char in piece)
        if self._byte_fallback and (byte := _BYTE_PIECE.fullmatch(piece)):
            return bytes([int(byte.group(1), 16)])
        if self._metaspace:
            return piece.replace("\u2581", " ").encode()
        return self._tokenizer.decode([token_id]).encode()
