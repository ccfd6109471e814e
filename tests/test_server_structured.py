"""Structured output over the API that the grammar library cannot enforce (issue 48,
item 8): each is a 400 naming what, before any token, and the engine serves on."""

from __future__ import annotations

import httpx
import pytest

RECURSIVE = {"$defs": {"a": {"allOf": [{"$ref": "#/$defs/a"}]}}, "$ref": "#/$defs/a"}


def chat(api, output: dict, stream: bool = False) -> httpx.Response:
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "stream": stream,
            **output}
    return httpx.post(f"{api.url}/chat/completions", json=body, timeout=120)


def schema_format(schema: dict) -> dict:
    return {"response_format": {"type": "json_schema",
                                "json_schema": {"name": "x", "schema": schema}}}


@pytest.mark.parametrize("output, problem", [
    (schema_format({"not": {}}), 'json_schema: "not" at # cannot be enforced'),
    (schema_format({"allOf": [{"type": "string"}, {"type": "integer"}]}),
     'json_schema: "allOf" with 2 schemas at # cannot be enforced'),
    ({"structured_outputs": {"json": {"type": "array", "items": {"type": "integer"},
                                      "uniqueItems": True}}},
     'json_schema: "uniqueItems" at # cannot be enforced'),
    ({"structured_outputs": {"regex": "a^b"}}, "regex: '^' at position 1 can never match there"),
    ({"structured_outputs": {"json": RECURSIVE}}, "json_schema: no output can satisfy it"),
    ({"structured_outputs": {"json": {"type": "string"}, "regex": "a+"}},
     "give one of json, regex, choice, not json and regex"),
])
@pytest.mark.parametrize("stream", [False, True])
def test_unenforceable_structured_output_is_a_400_naming_it(api, output, problem, stream) -> None:
    response = chat(api, output, stream)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert problem in error["message"] and error["type"] == "invalid_request_error"
    assert chat(api, {"structured_outputs": {"regex": "[a-z]+"}}).status_code == 200
