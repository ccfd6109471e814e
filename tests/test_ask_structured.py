"""`paged-chat ask --json-schema FILE` and `--choice a,b,c`: what it prints parses and the
schema accepts it, even from a tiny random model; bad options are one line each."""

from __future__ import annotations

import json

import jsonschema
import pytest

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["ok", "size", "tag"],
          "properties": {"ok": {"type": "boolean"},
                         "size": {"type": "integer", "minimum": 0, "maximum": 99},
                         "tag": {"type": "string", "enum": ["small", "large"]}}}


def test_ask_json_schema_prints_json_the_schema_accepts(cli, tmp_path):
    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps(SCHEMA))
    for seed in ("1", "2"):
        result = cli("ask", "--no-save", "--json-schema", str(schema), "--max-tokens", "64",
                     "--temperature", "1.0", "--seed", seed, "Describe a box")
        assert result.exit_code == 0, result.stderr
        jsonschema.validate(json.loads(result.stdout), SCHEMA)


def test_ask_choice_prints_one_of_them(cli):
    answers = set()
    for seed in ("1", "2", "3", "4"):
        result = cli("ask", "--no-save", "--choice", "yes, no,maybe", "--temperature", "1.0",
                     "--seed", seed, "Well?")
        assert result.exit_code == 0, result.stderr
        answers.add(result.stdout.strip())
    assert answers <= {"yes", "no", "maybe"}


@pytest.mark.parametrize("args, message", [
    (["--choice", "a,,b"], "--choice 'a,,b': expected comma-separated non-empty strings"),
    (["--choice", "a", "--json-schema", "SCHEMA"], "give --json-schema or --choice, not both"),
    (["--json-schema", "NOTJSON"], "not JSON"),
    (["--json-schema", "LIST"], "a JSON schema is an object, not list"),
    (["--json-schema", "REFUSED"], 'Unsupported type "frobnicate"'),
    (["--json-schema", "UNENFORCEABLE"], '"uniqueItems" at # cannot be enforced'),
])
def test_bad_structured_options_are_one_line(cli, tmp_path, args, message):
    files = {"SCHEMA": json.dumps(SCHEMA), "NOTJSON": "{oops", "LIST": "[1]",
             "REFUSED": '{"type": "frobnicate"}', "UNENFORCEABLE": '{"type": "array", "uniqueItems": true}'}
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    args = [str(tmp_path / arg) if arg in files else arg for arg in args]
    result = cli("ask", "--no-save", *args, "Hi")
    assert result.exit_code != 0
    assert message in result.stderr and result.stderr.count("\n") == 1, result.stderr
