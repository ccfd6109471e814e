"""Tools, JSON-schema outputs and logprobs through the official `openai` client against
`paged-chat serve` on the default model; the tool-call parser on its own."""

from __future__ import annotations

import json
import math

import httpx
import jsonschema
import openai
import pytest
from helpers import wait_for
from server_fixtures import CHAT_DEFAULTS

from paged_chat.server.tool_calls import Tool, ToolCallParser, default_tool_choice

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city.",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city"],
                   "properties": {"city": {"type": "string", "maxLength": 40}}}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The local time in a city.",
    "parameters": {"type": "object", "required": ["city"],
                   "properties": {"city": {"type": "string", "maxLength": 40}}}}}
PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age"],
          "properties": {"name": {"type": "string", "maxLength": 30},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120}}}
ASK_WEATHER = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.mark.parametrize("pieces", [1, 3, 7])
def test_the_parser_finds_calls_however_the_text_is_cut(pieces):
    text = ('Let me check.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
            '</tool_call> <tool_call>{"name": "nope", "arguments": {}}</tool_call> Done.')
    parser = ToolCallParser({"get_weather"})
    size = -(-len(text) // pieces)
    chunks = [text[i:i + size] for i in range(0, len(text), size)]
    shown = "".join(parser.feed(chunk, final=i == len(chunks) - 1)[0] for i, chunk in enumerate(chunks))
    [call] = parser.calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}
    assert shown == 'Let me check. <tool_call>{"name": "nope", "arguments": {}}</tool_call> Done.'


@pytest.mark.parametrize("pieces", [1, 4, 90])
def test_a_forced_call_streams_its_name_then_its_arguments_as_they_grow(pieces):
    arguments = '{"city": "Pa}ris", "when": {"day": 2}}'
    text = '{"name": "get_weather", "arguments": ' + arguments + "}"
    size = -(-len(text) // pieces)
    chunks = [text[i:i + size] for i in range(0, len(text), size)]
    parser = ToolCallParser({"get_weather", "get_time"}, forced=True)
    fed = [parser.feed(chunk, final=i == len(chunks) - 1) for i, chunk in enumerate(chunks)]
    assert all(content == "" for content, _ in fed)
    deltas = [delta for _, some in fed for delta in some]
    opening, *rest = deltas
    assert opening["function"] == {"name": "get_weather", "arguments": ""} and opening["index"] == 0
    assert all(delta.keys() == {"index", "function"} for delta in rest)
    pieces_sent = [delta["function"]["arguments"] for delta in rest]
    assert "".join(pieces_sent) == arguments == parser.calls[0].function.arguments
    assert (len(pieces_sent) > 1) == (pieces > 1)
    whole = ToolCallParser({"get_weather"}, forced=True)
    assert whole.feed(text, final=True)[0] == "" and whole.calls[0].function.arguments == arguments


def test_a_forced_call_cut_off_is_no_call():
    cut = '{"name": "get_weather", "arguments": {"city": "Par'
    streamed = ToolCallParser({"get_weather"}, forced=True)
    assert streamed.feed(cut, final=False)[1][1]["function"]["arguments"] == '{"city": "Par'
    assert streamed.feed("", final=True) == ("", []) and streamed.calls == []
    whole = ToolCallParser({"get_weather"}, forced=True)  # nothing went out: the text is content
    assert whole.feed(cut, final=True) == (cut, []) and whole.calls == []


def test_a_bare_json_reply_is_a_call_and_prose_is_content():
    bare = ToolCallParser({"get_time"})
    assert bare.feed(' {"name": "get_time", "parameters": {"city": "Rome"}}', final=True)[0] == ""
    assert json.loads(bare.calls[0].function.arguments) == {"city": "Rome"}
    prose = ToolCallParser({"get_time"})
    assert prose.feed("{not a call} <tool_", final=False)[0] == ""
    assert prose.feed("", final=True) == ("{not a call} <tool_", [])



def test_a_server_that_requires_calls_lets_the_model_answer_tool_results():
    tools = [Tool.model_validate(WEATHER)]
    user = [{"role": "user", "content": "Weather?"}]
    answered = [*user, {"role": "assistant", "content": "", "tool_calls": []},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    assert [default_tool_choice(user, tools, "auto"), default_tool_choice(answered, tools, "auto")
            ] == ["auto", "auto"]
    assert [default_tool_choice(user, tools, "required"),
            default_tool_choice(answered, tools, "required")] == ["required", "none"]
    assert default_tool_choice(user, None, "required") == "none"


@pytest.fixture
def client(default_api):
    yield openai.OpenAI(base_url=default_api.url, api_key="unused", max_retries=0)
    wait_for(lambda: default_api.client.stats().blocks_in_use == 0, what="every block back")


@pytest.mark.slow
def test_tool_round_trip(client):
    first = client.chat.completions.create(
        model="smollm2-135m", messages=ASK_WEATHER, tools=[WEATHER], max_tokens=64,
        tool_choice={"type": "function", "function": {"name": "get_weather"}}, temperature=0)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.function.name == "get_weather" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    history = ASK_WEATHER + [choice.message.model_dump(exclude_none=True),
                             {"role": "tool", "tool_call_id": call.id,
                              "content": json.dumps({"sky": "sunny", "celsius": 21})}]
    final = client.chat.completions.create(model="smollm2-135m", messages=history, tools=[WEATHER],
                                           max_tokens=48, temperature=0)
    assert final.choices[0].finish_reason in ("stop", "length")
    assert final.choices[0].message.content and not final.choices[0].message.tool_calls


@pytest.mark.slow
def test_streamed_tool_call_deltas_reassemble_to_the_whole_call(client):
    request = dict(model="smollm2-135m", messages=ASK_WEATHER, tools=[WEATHER, TIME],
                   tool_choice="required", max_tokens=64, temperature=0)
    whole = client.chat.completions.create(**request).choices[0].message.tool_calls[0]
    calls: dict[int, dict] = {}
    reasons, argument_pieces = [], []
    for chunk in client.chat.completions.create(**request, stream=True):
        for choice in chunk.choices:
            reasons.append(choice.finish_reason)
            assert not choice.delta.content
            for delta in choice.delta.tool_calls or ():
                call = calls.setdefault(delta.index, {"name": "", "arguments": ""})
                assert bool(delta.function.name) == (delta.id is not None) == (call["name"] == "")
                call["name"] += delta.function.name or ""
                call["arguments"] += delta.function.arguments or ""
                argument_pieces += [delta.function.arguments] if delta.function.arguments else []
    assert list(calls.values()) == [{"name": whole.function.name,
                                     "arguments": whole.function.arguments}]
    assert len(argument_pieces) > 1  # the arguments stream as they are generated, not at the end
    assert reasons[-1] == "tool_calls"


@pytest.mark.slow
def test_json_schema_response_is_valid(client):
    reply = client.chat.completions.create(
        model="smollm2-135m", max_tokens=64, temperature=0,
        messages=[{"role": "user", "content": "Invent a person with a name and an age."}],
        response_format={"type": "json_schema",
                         "json_schema": {"name": "person", "schema": PERSON, "strict": True}})
    jsonschema.validate(json.loads(reply.choices[0].message.content), PERSON)
    regex = client.completions.create(model="smollm2-135m", prompt="The year is", max_tokens=8,
                                      extra_body={"structured_outputs": {"regex": "[0-9]{4}"}})
    assert len(regex.choices[0].text) == 4 and regex.choices[0].text.isdigit()


@pytest.mark.slow
def test_a_refused_schema_is_a_400_naming_the_problem(client):
    with pytest.raises(openai.BadRequestError, match='Unsupported type "frobnicate"'):
        client.chat.completions.create(
            model="smollm2-135m", messages=ASK_WEATHER, max_tokens=8,
            response_format={"type": "json_schema",
                             "json_schema": {"name": "x", "schema": {"type": "frobnicate"}}})
    with pytest.raises(openai.BadRequestError, match="no tool is named 'nope'"):
        client.chat.completions.create(model="smollm2-135m", messages=ASK_WEATHER, tools=[WEATHER],
                                       tool_choice={"type": "function", "function": {"name": "nope"}})


@pytest.mark.slow
def test_top_logprobs_sum_to_at_most_one_and_stream_with_their_tokens(client):
    request = dict(model="smollm2-135m", max_tokens=32, logprobs=True, top_logprobs=5, temperature=0,
                   messages=[{"role": "user", "content": "What is the capital of France?"}])
    reply = client.chat.completions.create(**request).choices[0]
    assert reply.finish_reason == "stop"  # its end-of-turn token is no token of the content
    content = reply.logprobs.content
    assert "".join(item.token for item in content) == reply.message.content
    for item in content:
        assert len(item.top_logprobs) == 5
        assert sum(math.exp(top.logprob) for top in item.top_logprobs) <= 1 + 1e-4
        assert item.logprob <= 0 and item.token in [top.token for top in item.top_logprobs] + [item.token]
    streamed_tokens, streamed_text = [], ""
    for chunk in client.chat.completions.create(**request, stream=True):
        for choice in chunk.choices:
            streamed_text += choice.delta.content or ""
            streamed_tokens += [item.token for item in (choice.logprobs.content if choice.logprobs else [])]
    assert "".join(streamed_tokens) == streamed_text == reply.message.content
    completion = client.completions.create(model="smollm2-135m", prompt="Red, green and", max_tokens=5,
                                           logprobs=3, temperature=0)
    logprobs = completion.choices[0].logprobs
    assert "".join(logprobs.tokens) == completion.choices[0].text
    assert all(len(top) <= 3 and max(top.values()) == pytest.approx(lp, abs=1e-5)
               for top, lp in zip(logprobs.top_logprobs, logprobs.token_logprobs))


@pytest.mark.slow
def test_omitted_sampling_fields_get_the_servers_defaults(client, default_api):
    listed = httpx.get(default_api.url + "/models").json()["data"][0]
    assert listed["sampling_defaults"] == CHAT_DEFAULTS
    request = dict(model="smollm2-135m", max_tokens=16, seed=7,
                   messages=[{"role": "user", "content": "Write a word."}])
    omitted = client.chat.completions.create(**request).choices[0].message.content
    explicit = client.chat.completions.create(**request, temperature=0.2, top_p=0.9).choices[0]
    assert omitted == explicit.message.content
