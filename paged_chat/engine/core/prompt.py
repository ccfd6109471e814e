"""A prompt as the engine takes it (text or token ids), turned into validated token ids."""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Any


def prompt_token_ids(prompt: str | Sequence[int], tokenizer: Any, vocab_size: int) -> list[int]:
    """Token ids of a prompt, validated: the model would index its embedding with them.

    Ids must be integers proper: `int()` would turn 3.7 into 3 and "12" into 12, bytes
    iterate as ints and True is 1, so each of those would be a different prompt than meant.
    A bad prompt is a ValueError that says what is wrong with it.
    """
    if isinstance(prompt, str):
        token_ids = tokenizer.encode(prompt, add_special_tokens=True)
    elif isinstance(prompt, (bytes, bytearray)):
        raise ValueError("the prompt is bytes: decode it to text, or pass token ids")
    else:
        try:
            token_ids = [_token_id(t) for t in prompt]
        except TypeError as error:
            raise ValueError("the prompt must be text or a sequence of integer token ids "
                             f"({error})") from None
        bad = next((t for t in token_ids if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise ValueError(f"token id {bad} is outside the vocabulary [0, {vocab_size})")
    if not token_ids:
        raise ValueError("the prompt is empty: give at least one token")
    return token_ids


def _token_id(value: object) -> int:
    if isinstance(value, bool):
        raise TypeError("a bool is not a token id")
    return operator.index(value)
