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


def _subschemas(node: Any, pointer: str) -> Iterator[tuple[str, dict[str, Any]]]:
    if not isinstance(node, dict):
        return
    yield pointer, node
    for keyword in _SCHEMA:
        if isinstance(node.get(keyword), dict):
            yield from _subschemas(node[keyword], f"{pointer}/{keyword}")
    for keyword in _SCHEMA_LIST:
        if isinstance(node.get(keyword), list):
            for index, item in enumerate(node[keyword]):
                yield from _subschemas(item, f"{pointer}/{keyword}/{index}")
    for keyword in _SCHEMA_MAP:
        if isinstance(node.get(keyword), dict):
            for name, item in node[keyword].items():
                yield from _subschemas(item, f"{pointer}/{keyword}/{name}")


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
            raise Unenforceable(f"{part!r} at position {start} is not supported; the output "
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
                         r"|\{\s*\d+\s*,\s*-?\d+\s*\}|[A-Za-z_][\w.]*|\(=|::=|\S")
_COUNT = re.compile(r"\{\s*(\d+)")


def check_satisfiable(grammar_text: str) -> None:
    """Raise Unenforceable when no output completes the grammar (xgrammar's printed EBNF:
    `name ::= body` per line, `root` the start): its root derives no finite string."""
    rules: dict[str, list[str]] = {}
    for line in grammar_text.splitlines():
        name, separator, body = line.partition(" ::= ")
        if separator:
            rules[name.strip()] = _EBNF_TOKEN.findall(body)
    productive: set[str] = set()
    grew = True
    while grew:  # a rule is productive once one alternative has only productive parts
        grew = False
        for name, tokens in rules.items():
            if name not in productive and _Derives(tokens, productive, rules).parse():
                productive.add(name)
                grew = True
    if "root" in rules and "root" not in productive:
        raise Unenforceable("no output can satisfy it (every way through it recurses forever "
                            "or meets a contradiction)")


class _Derives:
    """Whether one rule body derives a finite string, given the rules known to: a reference
    does when its rule is in `productive`; a literal, class or regex always does (an atom
    this does not know counts as one, so an unread form never refuses a grammar)."""

    def __init__(self, tokens: list[str], productive: set[str], rules: dict[str, list[str]]) -> None:
        self.tokens, self.position = tokens, 0
        self.productive, self.rules = productive, rules

    def parse(self) -> bool:
        return self._alternatives()

    def _peek(self) -> str | None:
        return self.tokens[self.position] if self.position < len(self.tokens) else None

    def _alternatives(self) -> bool:
        derives = self._sequence()
        while self._peek() == "|":
            self.position += 1
            derives = self._sequence() or derives
        return derives

    def _sequence(self) -> bool:
        derives = True
        while self._peek() not in (None, "|", ")"):
            derives = self._repeated() and derives
        return derives

    def _repeated(self) -> bool:
        token = self._peek()
        self.position += 1
        if token == "(=":  # a lookahead assertion consumes nothing
            self._alternatives()
            self.position += 1
            derives = True
        elif token == "(":
            derives = self._alternatives()
            self.position += 1
        else:
            derives = token not in self.rules or token in self.productive
        suffix = self._peek()
        if suffix in ("*", "?"):
            self.position += 1
            return True
        if suffix == "+":
            self.position += 1
        elif suffix is not None and suffix.startswith("{"):
            self.position += 1
            return derives or int(_COUNT.match(suffix).group(1)) == 0
        return derives
