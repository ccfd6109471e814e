"""The request fields that shape the output rather than the sampling: OpenAI's
`response_format` (json_object, json_schema) and vLLM's `structured_outputs` (json, regex,
choice), and logprobs in the chat (`logprobs` + `top_logprobs`) and completions
(`logprobs: N`) forms. Each turns into SamplingParams fields here; a schema the grammar
library refuses or would not enforce is refused by the engine when the request is added
(a 400 naming it).
"""

from __future__ import annotations

from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, model_validator

from paged_chat.engine.core.detokenizer import IncrementalDetokenizer
from paged_chat.engine.core.outputs import TokenLogprob
from paged_chat.engine.core.sampling_params import MAX_TOP_LOGPROBS
from paged_chat.engine.core.token_bytes import TokenBytes

T = TypeVar("T")


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    name: str = "response"
    schema_: dict[str, Any] = Field(default_factory=dict, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError('type "json_schema" needs a "json_schema" object with its "schema"')
        return self


class StructuredOutputs(BaseModel):
    """vLLM's `structured_outputs`: one of a JSON schema, a regex, a list of choices."""

    model_config = ConfigDict(extra="ignore")

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None

    @model_validator(mode="after")
    def _supported(self) -> StructuredOutputs:
        if self.grammar is not None:
            raise ValueError("grammar: EBNF grammars are not supported here; use json, regex or choice")
        given = [name for name, value in (("json", self.json_), ("regex", self.regex),
                                          ("choice", self.choice)) if value is not None]
        if len(given) > 1:
            raise ValueError(f"give one of json, regex, choice, not {' and '.join(given)}: "
                             "only one can be enforced")
        return self


def structured_output_fields(response_format: ResponseFormat | None,
                             structured: StructuredOutputs | None) -> dict[str, Any]:
    """The SamplingParams fields of `response_format` and `structured_outputs` (the latter
    wins where both are given)."""
    if structured is not None and (structured.json_ is not None or structured.regex is not None
                                   or structured.choice is not None):
        if structured.json_ is not None:
            return {"json_schema": structured.json_}
        return {"regex": structured.regex} if structured.regex is not None else {"choice": structured.choice}
    if response_format is None or response_format.type == "text":
        return {}
    if response_format.type == "json_object":
        return {"json_object": True}
    return {"json_schema": response_format.json_schema.schema_ or {"type": "object"}}


class ChatLogprobsFields(BaseModel):
    """Chat: `logprobs: true` for the sampled tokens', `top_logprobs: N` for N alternatives."""

    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)

    def logprob_fields(self) -> dict[str, Any]:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs: needs logprobs: true")
        return {"logprobs": self.logprobs, "top_logprobs": self.top_logprobs or 0}


class CompletionLogprobsFields(BaseModel):
    """Completions: `logprobs: N` asks for the sampled tokens' and N alternatives each."""

    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)

    def logprob_fields(self) -> dict[str, Any]:
        return {"logprobs": self.logprobs is not None, "top_logprobs": self.logprobs or 0}


def _shown(tokenizer: Any, token_ids: list[int], items: list[T]) -> list[tuple[int, T]]:
    """The tokens the reply's text shows, with their items (logprobs): an end-of-turn or
    other special token the text leaves out is left out here too."""
    special = set(tokenizer.all_special_ids)
    return [(token_id, item) for token_id, item in zip(token_ids, items) if token_id not in special]


def chat_logprobs(tokenizer: Any, token_ids: list[int], logprobs: list[TokenLogprob],
                  num_top: int) -> dict[str, Any]:
    """OpenAI's chat `logprobs` object for these tokens: per token its text, the model's
    logprob, its own UTF-8 bytes (a part of a character's included) and its `num_top`
    likeliest alternatives."""
    token_bytes = TokenBytes.of(tokenizer)

    def entry(token_id: int, logprob: float) -> dict[str, Any]:
        return {"token": tokenizer.decode([token_id]), "logprob": logprob,
                "bytes": list(token_bytes(token_id))}

    return {"content": [
        entry(token_id, item.logprob) | {"top_logprobs": [
            entry(top_id, top) for top_id, top in zip(item.top_token_ids[:num_top],
                                                      item.top_logprobs[:num_top])]}
        for token_id, item in _shown(tokenizer, token_ids, logprobs)]}


def completion_logprobs(tokenizer: Any, token_ids: list[int], logprobs: list[TokenLogprob],
                        num_top: int, text: IncrementalDetokenizer) -> dict[str, Any]:
    """The completions API's `logprobs` object (tokens, token_logprobs, top_logprobs as
    token -> logprob, text_offset). `text` has read the choice's tokens before these, and
    reads these on: a token's offset is the length of the text before it, so each indexes
    the choice's text (the tokens of one character split over several start where it does)."""
    offsets = []
    for token_id in token_ids:
        offsets.append(len(text.text))
        text.add_token(token_id)
    shown = _shown(tokenizer, token_ids, list(zip(logprobs, offsets)))
    return {"tokens": [tokenizer.decode([token_id]) for token_id, _ in shown],
            "token_logprobs": [item.logprob for _, (item, _) in shown],
            "top_logprobs": [{tokenizer.decode([top_id]): top for top_id, top
                              in zip(item.top_token_ids[:num_top], item.top_logprobs[:num_top])}
                             for _, (item, _) in shown],
            "text_offset": [offset for _, (_, offset) in shown]}
