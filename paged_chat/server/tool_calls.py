"""Tool calling on chat completions: the tools into the prompt, the grammar that forces a
call, and the calls out of the model's text (whole, or as a stream's deltas).

Prompt: the tools go through the model's own chat template (`tools=`; the templates of
Qwen2.5/3, Llama 3.x, Mistral and SmolLM3 have a tool section). A template without one
(it renders the same with and without tools, e.g. SmolLM2's) gets them in the system
message instead, with the call format this module parses.

Calls: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks (the Hermes format
Qwen and SmolLM3 write), or a whole reply that is one such JSON object (Llama 3's, with
"parameters" for "arguments"). `tool_choice` "required" or a named function compiles a JSON
schema of the call (the tools' names and parameter schemas) that the engine enforces, so
the reply is exactly one call's JSON; "auto" lets the model choose; "none" leaves the tools
out of the prompt.

Streams: a forced call's arguments stream as the model writes them (the grammar fixes the
JSON's shape, so where they begin and end is known); a free-text call goes out whole once
its block closes (ToolCallParser).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

OPEN, CLOSE = "<tool_call>", "</tool_call>"
WHITESPACE = " \t\n\r"


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="ignore")

    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    parameters: dict[str, Any] = Field(default_factory=lambda: {"type": "object", "properties": {}})


class Tool(BaseModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    type: Literal["function"] = "function"
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice
DefaultToolChoice = Literal["auto", "required"]


class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


def template_tool_call(call: ToolCall) -> dict[str, Any]:
    """An assistant message's tool call as chat templates take it (arguments as a dict)."""
    try:
        arguments = json.loads(call.function.arguments)
    except json.JSONDecodeError:
        arguments = call.function.arguments
    return {"type": "function", "function": {"name": call.function.name, "arguments": arguments}}


def call_text(call: dict[str, Any]) -> str:
    """A tool call (template form) as this module's format writes it into a prompt."""
    function = call["function"]
    return f"{OPEN}\n{json.dumps({'name': function['name'], 'arguments': function['arguments']})}\n{CLOSE}"


def tools_system_text(tools: list[Tool]) -> str:
    """The tool section for a template without one: the functions and the call format."""
    listed = "\n".join(json.dumps(tool.model_dump(exclude_none=True)) for tool in tools)
    return ("You can call these functions (JSON signatures):\n" + listed + "\n\nTo call one, "
            f"answer with {OPEN}\n{{\"name\": \"<function name>\", \"arguments\": "
            f"{{<arguments as JSON>}}}}\n{CLOSE} and nothing else.")


def with_tools_in_system(messages: list[dict[str, Any]], tools: list[Tool]) -> list[dict[str, Any]]:
    """The messages for a template without a tool section: the tools' text joins the system
    message (or opens the chat as one); calls and tool results become text."""
    section = tools_system_text(tools)
    plain = [{"role": m["role"], "content": (m.get("content") or "") + "".join(
        ("\n" if m.get("content") else "") + call_text(call) for call in m.get("tool_calls") or ())}
        for m in messages]
    if plain and plain[0]["role"] == "system":
        return [{"role": "system", "content": plain[0]["content"] + "\n\n" + section}, *plain[1:]]
    return [{"role": "system", "content": section}, *plain]


def default_tool_choice(messages: list[dict[str, Any]], tools: list[Tool] | None,
                        default: DefaultToolChoice) -> ToolChoice:
    """The tool_choice of a request that omits it: "none" without tools; with tools,
    OpenAI's "auto", or the server's `default`. "required" (`serve --tool-choice required`)
    is for clients that never send a tool_choice, such as `llm`, with a model too small to
    call on its own: a turn that answers the user must call, and one that answers tool
    results must not ("none"), else a small model copies the call in its history and the
    client's chain of calls never ends."""
    if not tools:
        return "none"
    if default == "auto":
        return "auto"
    return "none" if messages and messages[-1]["role"] == "tool" else "required"


def forced_call_schema(tools: list[Tool], choice: ToolChoice) -> dict[str, Any] | None:
    """The JSON schema one call must follow under `choice`; None where nothing is forced."""
    if isinstance(choice, NamedToolChoice):
        chosen = [tool for tool in tools if tool.function.name == choice.function.name]
        if not chosen:
            raise ValueError(f"tool_choice: no tool is named {choice.function.name!r}")
    elif choice == "required":
        chosen = tools
    else:
        return None
    calls = [{"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
              "properties": {"name": {"const": tool.function.name},
                             "arguments": tool.function.parameters}} for tool in chosen]
    return calls[0] if len(calls) == 1 else {"anyOf": calls}


def _new_call(name: str, arguments: str) -> ToolCall:
    return ToolCall(id=f"call_{uuid.uuid4().hex[:24]}",
                    function=FunctionCall(name=name, arguments=arguments))


def _parse_call(text: str, names: set[str]) -> ToolCall | None:
    """The call a JSON text holds, or None where it holds none of the tools'."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return None
    if not isinstance(value, dict) or value.get("name") not in names:
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    return _new_call(value["name"], arguments if isinstance(arguments, str) else json.dumps(arguments))


# The head of a forced call's JSON, up to where its arguments begin: the grammar writes the
# schema's properties in order (forced_call_schema: "name", then "arguments").
_FORCED_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"([^"\\]*)"\s*,\s*"arguments"\s*:\s*')


def _opening_delta(index: int, call: ToolCall) -> dict[str, Any]:
    return {"index": index, "id": call.id, "type": "function",
            "function": {"name": call.function.name, "arguments": ""}}


def _arguments_delta(index: int, text: str) -> dict[str, Any]:
    return {"index": index, "function": {"arguments": text}}


@dataclass(slots=True)
class ToolCallParser:
    """Splits a reply, as it streams, into content and tool calls.

    `feed` returns the content that can be shown now and the stream's `delta.tool_calls`
    (OpenAI's form: per call first its index, id and name, then its arguments' text in
    pieces the client joins by index); `calls` holds the calls completed so far.

    Free text: a `<tool_call>` block (or a reply that is one bare JSON call) is held until
    it closes, then sent as one call; text that may begin one (a prefix of `<tool_call>` at
    the end, a reply that opens with "{") waits until it resolves, and is content if it is
    none. `forced` (a grammar makes the reply exactly one call's JSON): the call streams as
    its tokens come: its id and name once the name is written, then its arguments' raw text
    as it grows, less a tail of "}" and whitespace that may be the call's own closing.
    """

    names: set[str]
    forced: bool = False
    held: str = ""
    shown_content: bool = False
    calls: list[ToolCall] = field(default_factory=list)
    streaming: ToolCall | None = None  # forced: the call whose arguments are streaming

    def feed(self, text: str, final: bool) -> tuple[str, list[dict[str, Any]]]:
        self.held += text
        if self.forced:
            content, deltas = self._stream_forced(final)
            if self.streaming is not None or not final:
                return content, deltas
        content, calls = "", []
        while not self.forced:
            start = self.held.find(OPEN)
            if start < 0:
                keep = self._undecided_tail()
                content += self.held[:len(self.held) - keep]
                self.held = self.held[len(self.held) - keep:]
                break
            end = self.held.find(CLOSE, start)
            if end < 0:
                content += self.held[:start]
                self.held = self.held[start:]
                break
            call = _parse_call(self.held[start + len(OPEN):end], self.names)
            content += self.held[:start] if call is not None else self.held[:end + len(CLOSE)]
            calls += [call] if call is not None else []
            self.held = self.held[end + len(CLOSE):]
        if final:
            rest, self.held = self.held, ""
            body = rest.strip().removeprefix(OPEN).removesuffix(CLOSE)
            call = _parse_call(body, self.names) if rest.strip() else None
            if call is not None:
                calls.append(call)
            else:
                content += rest
        self.shown_content = self.shown_content or bool(content.strip())
        deltas = [delta for index, call in enumerate(calls, len(self.calls)) for delta in
                  (_opening_delta(index, call), _arguments_delta(index, call.function.arguments))]
        self.calls += calls
        return content, deltas

    def _stream_forced(self, final: bool) -> tuple[str, list[dict[str, Any]]]:
        """The forced call's content and deltas for the text held so far (all of it after
        the head is the arguments' text, their closing and the call's). A head that never
        matches (a name the pattern does not read) is left to the end, parsed whole. A call
        cut off (max_tokens) is no call; its text is content unless some of it went out as
        the call's already."""
        deltas, text, opened_now = [], self.held, self.streaming is None
        if opened_now:
            head = _FORCED_HEAD.match(self.held)
            if head is None or head.group(1) not in self.names:
                return "", deltas
            self.streaming = _new_call(head.group(1), "")
            self.held = self.held[head.end():]
            deltas.append(_opening_delta(0, self.streaming))
        sent, whole = self.streaming.function.arguments, self.held.strip()
        if final:  # the whole reply: the call's closing "}" ends it
            arguments = whole.removesuffix("}").rstrip()
            try:
                json.loads(arguments)
            except json.JSONDecodeError:
                return (text, []) if opened_now else ("", [])
            self.calls.append(self.streaming)
        else:
            arguments = whole.rstrip("}" + WHITESPACE)
        if len(arguments) > len(sent):
            assert arguments.startswith(sent), "a forced call's arguments only grow"
            self.streaming.function.arguments = arguments
            deltas.append(_arguments_delta(0, arguments[len(sent):]))
        return "", deltas

    def _undecided_tail(self) -> int:
        """How much of the held text's end may still begin a call."""
        if not self.shown_content and not self.calls and self.held.lstrip()[:1] in ("", "{"):
            return len(self.held)  # nothing but maybe a bare JSON call so far
        for size in range(min(len(OPEN) - 1, len(self.held)), 0, -1):
            if OPEN.startswith(self.held[-size:]):
                return size
        return 0
