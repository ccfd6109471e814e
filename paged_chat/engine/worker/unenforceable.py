"""What structured output the grammar library would not enforce, found before a request
runs: a constraint it silently drops, a regex anchor it ignores, a grammar no output can
complete. Each is a GrammarError naming it, as a refused schema is; without these checks
a request would get output its schema rejects, or fail mid-reply on logits masked to
nothing.

The keyword list is xgrammar's (0.2): each compiles to the same grammar as the schema
without it, or (allOf with more than one part) loses the whole schema.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

# JSON schema keywords whose constraint xgrammar drops, with the value that constrains nothing.
_DROPPED = {"not": None, "uniqueItems": False, "if": None, "then": None, "else": None,
            "contains": None, "minContains": None, "maxContains": None,
            "dependentRequired": None, "dependentSchemas": None, "dependencies": None,
            "unevaluatedProperties": None, "unevaluatedItems": None, "additionalItems": None,
            "$dynamicRef": None, "$recursiveRef": None}
# Keywords whose value is a schema, a list of schemas, or a map of name -> schema.
_SCHEMA = ("not", "if", "then", "else", "contains", "items", "additionalProperties",
           "propertyNames", "unevaluatedProperties", "unevaluatedItems", "additionalItems")
_SCHEMA_LIST = ("allOf", "anyOf", "oneOf", "prefixItems", "items")
_SCHEMA_MAP = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


class Unenforceable(ValueError):
    """Structured output the grammar library would not enforce; the message says what."""


def check_json_schema(schema_text: str) -> None:
    """Raise Unenforceable naming the first keyword of the schema that xgrammar drops."""
    try:
        schema = json.loads(schema_text)
    except json.JSONDecodeError:
        return  # the compiler refuses it with its own message
    for pointer, node in _subschemas(schema, "#"):
        for keyword, inert in _DROPPED.items():
            if keyword in node and node[keyword] != inert:
                raise Unenforceable(f'"{keyword}" at {pointer} cannot be enforced; '
                                    "remove it from the schema")
        if isinstance(node.get("allOf"), list) and len(node["allOf"]) > 1:
            raise Unenforceable(f'"allOf" with {len(node["allOf"])} schemas at {pointer} cannot '
                                "be enforced; merge them into one schema")


def _subschemas(schema: Any, pointer: str) -> Iterator[tuple[str, dict[str, Any]]]:
    """Every schema within `schema` (itself included) with its JSON pointer; a loop, not
    recursion, as a hostile schema may nest as deep as the JSON parser allows."""
    stack = [(pointer, schema)]
    while stack:
        pointer, node = stack.pop()
        if not isinstance(node, dict):
            continue
        yield pointer, node
        for keyword in _SCHEMA:
            if isinstance(node.get(keyword), dict):
                stack.append((f"{pointer}/{keyword}", node[keyword]))
        for keyword in _SCHEMA_LIST:
            if isinstance(node.get(keyword), list):
                stack.extend((f"{pointer}/{keyword}/{index}", item)
                             for index, item in enumerate(node[keyword]))
        for keyword in _SCHEMA_MAP:
            if isinstance(node.get(keyword), dict):
                stack.extend((f"{pointer}/{keyword}/{name}", item)
                             for name, item in node[keyword].items())


# An escape, a character class, an anchor, or any other character of a regex.
_REGEX_PART = re.compile(r"\\.|\[(?:\\.|[^\]\\])*\]|[\^$]|.", re.DOTALL)
# What may stand before a leading `^` or after a trailing `$`: group brackets only.
_OPENING, _CLOSING = re.compile(r"(\((\?:)?)*"), re.compile(r"\)*")


def check_regex(pattern: str) -> None:
    """Raise Unenforceable for an anchor xgrammar ignores: `^` or `$` inside the pattern
    (the output is matched whole, so there it can never match) or `\\A`, `\\Z`, `\\z`
    (which it reads as letters)."""
    for match in _REGEX_PART.finditer(pattern):
        part, start, end = match.group(), match.start(), match.end()
        if part in (r"\A", r"\Z", r"\z"):
            raise Unenforceable(f"'{part}' at position {start} is not supported; the output "
                                "is matched whole, so leave it out")
        if part == "^" and not _OPENING.fullmatch(pattern, 0, start):
            raise Unenforceable(f"'^' at position {start} can never match there; the output "
                                "is matched whole, so '^' belongs only at the start")
        if part == "$" and not _CLOSING.fullmatch(pattern, end):
            raise Unenforceable(f"'$' at position {start} can never match there; the output "
                                "is matched whole, so '$' belongs only at the end")


# One token of xgrammar's printed EBNF: a string, a character class, Regex(...), a rule
# name, a repetition count, or punctuation.
_EBNF_TOKEN = re.compile(r'"(?:\\.|[^"\\])*"|\[(?:\\.|[^\]\\])*\]|Regex\("(?:\\.|[^"\\])*"[^)]*\)'
                         r"|\{\s*\d+\s*,\s*-?\d+\s*\}|[A-Za-z_][\w.]*|\(=|\S")
_RULE_NAME = re.compile(r"[A-Za-z_][\w.]*")
_COUNT = re.compile(r"\{\s*(\d+)")

# A rule body as a tree: ("all", parts) a sequence, ("any", parts) alternatives, ("rule",
# name) a reference; None is an atom that always derives (a literal, a class, an optional
# or starred part, a lookahead, or a form this module does not read, so that an unread
# form never refuses a grammar).
_Node = tuple[str, Any] | None


def check_satisfiable(grammar_text: str) -> None:
    """Raise Unenforceable when no output completes the grammar (xgrammar's printed EBNF:
    `name ::= body` per line, `root` the start): its root derives no finite string."""
    bodies: dict[str, _Node] = {}
    for line in grammar_text.splitlines():
        name, separator, body = line.partition(" ::= ")
        if separator:
            bodies[name.strip()] = _BodyParser(_EBNF_TOKEN.findall(body)).parse()
    if "root" in bodies and "root" not in _productive_rules(bodies):
        raise Unenforceable("no output can satisfy it (every way through it recurses forever "
                            "or meets a contradiction)")


def _productive_rules(bodies: dict[str, _Node]) -> set[str]:
    """The rules that derive a finite string: found from the rules without references
    outward, each rule looked at again only when one it references turns out productive."""
    dependents: dict[str, set[str]] = {name: set() for name in bodies}
    for name, body in bodies.items():
        for referenced in _references(body):
            if referenced in dependents:
                dependents[referenced].add(name)
    productive: set[str] = set()
    pending = list(bodies)
    while pending:
        name = pending.pop()
        if name not in productive and _derives(bodies[name], productive, bodies):
            productive.add(name)
            pending.extend(dependents[name] - productive)
    return productive


def _references(node: _Node) -> Iterator[str]:
    stack = [node]
    while stack:
        node = stack.pop()
        if node is None:
            continue
        kind, value = node
        if kind == "rule":
            yield value
        else:
            stack.extend(value)


def _derives(node: _Node, productive: set[str], bodies: dict[str, _Node]) -> bool:
    if node is None:
        return True
    kind, value = node
    if kind == "rule":
        return value in productive or value not in bodies
    parts = (_derives(part, productive, bodies) for part in value)
    return all(parts) if kind == "all" else any(parts)


class _BodyParser:
    """One rule body's tokens to its tree (see _Node)."""

    def __init__(self, tokens: list[str]) -> None:
        self.tokens, self.position = tokens, 0

    def parse(self) -> _Node:
        return self._alternatives()

    def _peek(self) -> str | None:
        return self.tokens[self.position] if self.position < len(self.tokens) else None

    def _alternatives(self) -> _Node:
        options = [self._sequence()]
        while self._peek() == "|":
            self.position += 1
            options.append(self._sequence())
        return options[0] if len(options) == 1 else ("any", options)

    def _sequence(self) -> _Node:
        parts = []
        while self._peek() not in (None, "|", ")"):
            part = self._repeated()
            if part is not None:
                parts.append(part)
        return ("all", parts) if parts else None

    def _repeated(self) -> _Node:
        token = self._peek()
        self.position += 1
        if token == "(=":  # a lookahead assertion consumes nothing
            self._alternatives()
            self.position += 1
            return None
        if token == "(":
            part = self._alternatives()
            self.position += 1
        elif _RULE_NAME.fullmatch(token):
            part = ("rule", token)
        else:
            part = None
        suffix = self._peek()
        if suffix in ("*", "?"):
            self.position += 1
            return None
        if suffix == "+":
            self.position += 1
        elif suffix is not None and suffix.startswith("{"):
            self.position += 1
            return None if int(_COUNT.match(suffix).group(1)) == 0 else part
        return part
