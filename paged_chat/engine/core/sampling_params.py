"""SamplingParams: how to pick tokens for one request, validated on construction."""

from __future__ import annotations

import json
import math
import numbers
from dataclasses import dataclass, field
from typing import Any

# What constrains a request's output: ("json_schema", schema text), ("json_object", ""),
# ("regex", pattern) or ("choice", a JSON list of the strings); hashable, the grammar cache's key.
StructuredSpec = tuple[str, str]
# The most top logprobs a request may ask for per token (OpenAI's limit).
MAX_TOP_LOGPROBS = 20
# Below this a temperature is greedy (as in vLLM): dividing logits by ~1e-38 overflows them
# to inf, and the draw over the NaN probabilities that follow would leave the vocabulary.
GREEDY_BELOW_TEMPERATURE = 1e-5
# The penalty divides or multiplies float32 logits: outside this range a logit of a few
# hundred overflows to inf (1e-300 is 0 in float32) and the draw over it is NaN.
REPETITION_PENALTY_RANGE = (0.01, 100.0)



@dataclass(slots=True)
class SamplingParams:
    """How to pick tokens for one request. `temperature=0` (or below 1e-5) is greedy.

    Every field is validated on construction; a bad value (of the wrong type too: a bool
    is no number here, nor "1") is a `ValueError` that names the field. `top_k=0` and
    `top_p=1` disable those filters; `min_p=0` disables min-p.

    Structured output: at most one of `json_schema` (a JSON schema, as text or a dict),
    `json_object` (any JSON object), `regex`, `choice` (the output is one of these
    strings). `logprobs` asks for each sampled token's log-probability; `top_logprobs` (0
    to 20) for that many likeliest tokens too, both from the logits the sampler used.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int = 256
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    cache_salt: str | None = None
    json_schema: str | dict[str, Any] | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    logprobs: bool = False
    top_logprobs: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        _check(_is_number(self.temperature) and math.isfinite(self.temperature)
               and self.temperature >= 0, "temperature", self.temperature, "a number >= 0 (0 is greedy)")
        _check(_is_number(self.top_p) and 0 < self.top_p <= 1, "top_p", self.top_p, "a number in (0, 1]")
        _check(_is_integer(self.top_k) and self.top_k >= 0,
               "top_k", self.top_k, "an integer >= 0 (0 disables it)")
        _check(_is_number(self.min_p) and 0 <= self.min_p <= 1, "min_p", self.min_p, "a number in [0, 1]")
        low, high = REPETITION_PENALTY_RANGE
        _check(_is_number(self.repetition_penalty) and low <= self.repetition_penalty <= high,
               "repetition_penalty", self.repetition_penalty,
               f"a number in [{low}, {high:g}] (1 disables it)")
        for name in ("frequency_penalty", "presence_penalty"):
            value = getattr(self, name)
            _check(_is_number(value) and math.isfinite(value) and -2 <= value <= 2,
                   name, value, "a number in [-2, 2]")
        _check(_is_integer(self.max_tokens) and self.max_tokens >= 1,
               "max_tokens", self.max_tokens, "an integer >= 1")
        _check(self.seed is None or (_is_integer(self.seed) and self.seed >= 0),
               "seed", self.seed, "an integer >= 0 or None")
        _check(all(isinstance(s, str) and s for s in self.stop),
               "stop", self.stop, "a list of non-empty strings")
        _check(all(_is_integer(t) and t >= 0 for t in self.stop_token_ids),
               "stop_token_ids", self.stop_token_ids, "a list of token ids >= 0")
        _check(self.cache_salt is None or (isinstance(self.cache_salt, str) and self.cache_salt),
               "cache_salt", self.cache_salt, "a non-empty string or None")
        self._check_structured_output()

    def _check_structured_output(self) -> None:
        if isinstance(self.json_schema, dict):  # as text: the grammar cache keys on it
            self.json_schema = json.dumps(self.json_schema)
        _check(self.json_schema is None or isinstance(self.json_schema, str),
               "json_schema", self.json_schema, "a JSON schema (text or a dict)")
        _check(isinstance(self.json_object, bool), "json_object", self.json_object, "a bool")
        _check(self.regex is None or (isinstance(self.regex, str) and self.regex),
               "regex", self.regex, "a non-empty pattern")
        _check(self.choice is None or (isinstance(self.choice, list) and self.choice and
                                       all(isinstance(c, str) and c for c in self.choice)),
               "choice", self.choice, "a non-empty list of non-empty strings")
        given = [name for name in ("json_schema", "regex", "choice") if getattr(self, name)]
        given += ["json_object"] if self.json_object else []
        _check(len(given) <= 1, "structured output", given,
               "at most one of json_schema, json_object, regex, choice")
        _check(isinstance(self.logprobs, bool), "logprobs", self.logprobs, "a bool")
        _check(_is_integer(self.top_logprobs) and 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS,
               "top_logprobs", self.top_logprobs, f"an integer in [0, {MAX_TOP_LOGPROBS}]")

    @property
    def structured_spec(self) -> StructuredSpec | None:
        """What constrains the output, as the grammar cache's key; None when nothing does."""
        if self.json_schema is not None:
            return "json_schema", self.json_schema
        if self.json_object:
            return "json_object", ""
        if self.regex is not None:
            return "regex", self.regex
        if self.choice is not None:
            return "choice", json.dumps(self.choice)
        return None

    @property
    def wants_logprobs(self) -> bool:
        return self.logprobs or self.top_logprobs > 0

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW_TEMPERATURE

    @property
    def uses_penalties(self) -> bool:
        return (self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0
                or self.presence_penalty != 0.0)


def _is_number(value: object) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _is_integer(value: object) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _check(ok: bool, name: str, value: object, allowed: str) -> None:
    if not ok:
        raise ValueError(f"SamplingParams.{name}={value!r} is invalid: expected {allowed}")
