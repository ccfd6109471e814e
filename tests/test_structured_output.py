"""Constrained decoding: the bitmask step against xgrammar's own kernel, the grammar cache,
refused schemas, output that parses on the default model, and a matcher that stays right
through preemption and beside unconstrained requests."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch
import xgrammar as xgr

from paged_chat.app.conversation import Conversation
from paged_chat.engine import GrammarError, SamplingParams
from paged_chat.engine.worker.sampler import SamplingBatch, apply_token_bitmask, sample
from paged_chat.engine.worker.structured_output import StructuredOutputManager

PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "city"],
          "properties": {"name": {"type": "string", "maxLength": 24},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "city": {"type": "string", "maxLength": 24}}}
SUBJECTS = ["a baker", "an astronaut", "a teacher", "a pilot", "a doctor", "a farmer", "a poet",
            "a child", "a sailor", "a chef", "a nurse", "a painter", "a miner", "a singer",
            "a judge", "a student", "a soldier", "a fisherman", "a writer", "a dancer"]


def test_bitmask_step_matches_xgrammars_kernel() -> None:
    torch.manual_seed(0)
    vocab = 1000  # not a multiple of 32: the last word is partly past the vocabulary
    logits = torch.randn(5, vocab)
    rows = torch.tensor([0, 3])
    bitmask = torch.randint(-2**31, 2**31 - 1, (2, (vocab + 31) // 32), dtype=torch.int32)
    expected = logits.clone()  # xgrammar's bitmask has a row per logits row: the others allow all
    full = torch.full((5, bitmask.shape[1]), -1, dtype=torch.int32)
    full[rows] = bitmask
    xgr.apply_token_bitmask_inplace(expected, full)
    got = apply_token_bitmask(logits.clone(), bitmask, rows)
    assert torch.equal(got, expected)
    assert torch.equal(got[[1, 2, 4]], logits[[1, 2, 4]])
    assert got[0].isneginf().any() and not got[0].isneginf().all()


def test_sample_draws_only_allowed_tokens() -> None:
    torch.manual_seed(1)
    logits = torch.randn(4, 64)
    allowed = [5, 40]
    bitmask = torch.zeros(4, 2, dtype=torch.int32)
    for token in allowed:
        bitmask[:, token // 32] |= 1 << (token % 32)
    params = [SamplingParams(temperature=0), SamplingParams(temperature=1.5, seed=1),
              SamplingParams(temperature=1.0, top_p=0.5, seed=2), SamplingParams(temperature=0)]
    batch = SamplingBatch.build(params, [0, 1, 2, 3], [0] * 4, None, None, 64, torch.device("cpu"))
    batch.bitmask_rows, batch.token_bitmask = torch.arange(4), bitmask
    assert set(sample(logits.clone(), batch).tolist()) <= set(allowed)


def test_params_take_one_kind_of_structured_output() -> None:
    with pytest.raises(ValueError, match="at most one of json_schema"):
        SamplingParams(regex="a+", choice=["a"])
    with pytest.raises(ValueError, match="top_logprobs"):
        SamplingParams(top_logprobs=21)
    assert SamplingParams(json_schema={"type": "integer"}).structured_spec == \
        ("json_schema", '{"type": "integer"}')


@pytest.fixture(scope="module")
def manager(tokenizer) -> StructuredOutputManager:
    return StructuredOutputManager(tokenizer, len(tokenizer), [tokenizer.eos_token_id])


def test_compiled_grammars_are_cached_by_spec(manager) -> None:
    spec = SamplingParams(json_schema=PERSON).structured_spec
    assert manager.compile(spec) is manager.compile(spec)
    assert manager.compile(("regex", "x+")) is not manager.compile(("regex", "y+"))


class CountingCompiler:
    """A GrammarCompiler that counts the grammars it compiles."""

    def __init__(self, compiler: xgr.GrammarCompiler) -> None:
        self.compiler, self.compilations = compiler, 0

    def __getattr__(self, name: str):
        method = getattr(self.compiler, name)

        def counted(*args, **kwargs):
            self.compilations += 1
            return method(*args, **kwargs)
        return counted if name.startswith("compile") else method


@pytest.fixture
def counted(tokenizer, monkeypatch) -> tuple[StructuredOutputManager, CountingCompiler]:
    """A manager with an empty cache whose compilations are counted."""
    fresh = StructuredOutputManager(tokenizer, len(tokenizer), [tokenizer.eos_token_id])
    counter = CountingCompiler(fresh._compiler)
    monkeypatch.setattr(fresh, "_compiler", counter)
    return fresh, counter


def test_a_grammar_compiled_for_one_cache_salt_is_compiled_anew_for_another(counted) -> None:
    """Issue 48 item 1: caller B, sending caller A's schema, must not find A's compiled
    grammar (its compile time would tell B what A sent); callers of one salt share it."""
    manager, counter = counted
    schema = {"type": "object", "properties": {"patient_hiv_status": {"type": "string"}}}
    alice, bob = (SamplingParams(json_schema=schema, cache_salt=f"api-key:k/{name}")
                  for name in ("alice", "bob"))
    manager.new_matcher(alice)
    manager.new_matcher(alice)
    assert counter.compilations == 1
    manager.new_matcher(bob)
    assert counter.compilations == 2
    manager.new_matcher(SamplingParams(json_schema=schema))  # no salt: the TUI's own
    assert counter.compilations == 3


def test_the_grammar_cache_is_bounded_in_bytes(tokenizer) -> None:
    one = StructuredOutputManager(tokenizer, len(tokenizer), [tokenizer.eos_token_id])
    size = one.compile(("regex", "[a-z]{3}")).memory_size_bytes
    bounded = StructuredOutputManager(tokenizer, len(tokenizer), [tokenizer.eos_token_id],
                                      cache_bytes=int(size * 2.5))
    first = bounded.compile(("regex", "[a-z]{3}"))
    for pattern in ("[a-z]{4}", "[a-z]{5}", "[a-z]{6}"):
        bounded.compile(("regex", pattern))
        assert bounded.kept_bytes <= bounded.cache_bytes
    assert bounded.compile(("regex", "[a-z]{3}")) is not first  # the oldest went first
    huge = StructuredOutputManager(tokenizer, len(tokenizer), [tokenizer.eos_token_id], cache_bytes=1)
    huge.compile(("regex", "x+"))
    assert huge.kept_bytes == 0


RECURSIVE = '{"$defs":{"a":{"allOf":[{"$ref":"#/$defs/a"}]}},"$ref":"#/$defs/a"}'


@pytest.mark.parametrize("spec, problem", [
    (("json_schema", '{"not": {}}'), '"not" at # cannot be enforced'),
    (("json_schema", '{"allOf": [{"type": "string"}, {"type": "integer"}]}'),
     '"allOf" with 2 schemas at # cannot be enforced'),
    (("json_schema", json.dumps({"type": "object", "properties": {"tags": {
        "type": "array", "items": {"type": "integer"}, "uniqueItems": True}}})),
     '"uniqueItems" at #/properties/tags cannot be enforced'),
    (("json_schema", json.dumps({"type": "object", "properties": {"a": {"type": "integer"}},
                                 "if": {"required": ["a"]}, "then": {"required": ["b"]}})),
     '"if" at # cannot be enforced'),
    (("json_schema", '{"type": "array", "contains": {"const": 1}}'), '"contains" at #'),
    (("json_schema", RECURSIVE), "no output can satisfy it"),
    (("json_schema", '{"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}'),
     "no output can satisfy it"),
    (("regex", "a^b"), "'^' at position 1 can never match there"),
    (("regex", "a$b"), "'$' at position 1 can never match there"),
    (("regex", r"a\Zb"), r"'\Z' at position 1 is not supported"),
])
def test_structured_output_that_cannot_be_enforced_is_refused(manager, spec, problem) -> None:
    """Issue 48 item 8: each compiled to a grammar that ignored the constraint (or, for
    the recursive schemas, allowed no token, a 500 mid-reply); now a GrammarError names it."""
    with pytest.raises(GrammarError, match=re.escape(f"{spec[0]}: ") + ".*" + re.escape(problem)):
        manager.compile(spec)


@pytest.mark.parametrize("spec", [
    ("json_schema", json.dumps({"type": "object", "properties": {  # names, not keywords
        "not": {"type": "integer"}, "uniqueItems": {"type": "boolean"}}})),
    ("json_schema", '{"type": "array", "items": {"type": "integer"}, "uniqueItems": false}'),
    ("json_schema", '{"allOf": [{"type": "object"}]}'),
    ("json_schema", '{"type": "object", "properties": {"child": {"$ref": "#"}}}'),
    ("regex", "^(ab|cd)+$"), ("regex", "(^a|b)"), ("regex", r"[$^]\^\$"),
])
def test_enforceable_look_alikes_still_compile(manager, spec) -> None:
    manager.compile(spec)


def test_an_unsatisfiable_schema_fails_add_request(make_engine) -> None:
    engine = make_engine()
    with pytest.raises(GrammarError, match="no output can satisfy it"):
        engine.add_request([1, 2, 3], SamplingParams(json_schema=RECURSIVE))
    assert not engine.has_unfinished()


@pytest.mark.parametrize("spec, problem", [
    (("json_schema", '{"type": "frobnicate"}'), 'Unsupported type "frobnicate"'),
    (("json_schema", '{"type": '), "json_schema"),
    (("regex", "(a"), "parenthesis is not closed"),
])
def test_a_refused_grammar_names_the_problem(manager, spec, problem) -> None:
    with pytest.raises(GrammarError, match=re.escape(problem)) as caught:
        manager.compile(spec)
    assert not str(caught.value).startswith("[")  # xgrammar's time and source line are cut


def test_a_refused_schema_fails_add_request(make_engine) -> None:
    engine = make_engine()
    with pytest.raises(GrammarError, match="frobnicate"):
        engine.add_request([1, 2, 3], SamplingParams(json_schema='{"type": "frobnicate"}'))
    assert not engine.has_unfinished()


@pytest.mark.slow
def test_greedy_json_parses_on_twenty_prompts_of_the_default_model(smollm2_engine) -> None:
    engine = smollm2_engine
    prompts = [Conversation(engine.tokenizer, engine.chat_template).next_prompt_ids(
        f"Describe {subject} as JSON with a name, an age and a city.") for subject in SUBJECTS]
    params = [SamplingParams(temperature=0, max_tokens=64, json_schema=PERSON, seed=seed)
              for seed in range(len(prompts))]
    outputs = engine.generate(prompts, params)
    for output in outputs:
        assert output.finish_reason == "stop", output.text
        jsonschema.validate(json.loads(output.text), PERSON)
    assert len({output.text for output in outputs}) > 1  # the prompts, not a fixed string


@pytest.mark.slow
def test_choice_regex_and_json_object_on_the_default_model(smollm2_engine) -> None:
    engine = smollm2_engine
    prompt = Conversation(engine.tokenizer, engine.chat_template).next_prompt_ids(
        "Which colour is the sky? Then give a code.")
    choice, regex, any_json = engine.generate([prompt] * 3, [
        SamplingParams(temperature=0.8, seed=3, max_tokens=16, choice=["red", "blue", "green"]),
        SamplingParams(temperature=0.8, seed=4, max_tokens=16, regex=r"[A-Z]{3}-[0-9]{4}"),
        SamplingParams(temperature=0, max_tokens=48, json_object=True)])
    assert choice.text in ("red", "blue", "green") and choice.finish_reason == "stop"
    assert re.fullmatch(r"[A-Z]{3}-[0-9]{4}", regex.text) and regex.finish_reason == "stop"
    if any_json.finish_reason == "stop":
        assert isinstance(json.loads(any_json.text), dict)
    else:  # cut by max_tokens, but every token so far was a JSON object's
        assert any_json.text.lstrip().startswith("{")


def test_constrained_output_is_the_same_through_preemption(make_engine) -> None:
    """A pool too small for the batch preempts (recomputes) requests mid-reply; their
    matchers stay with their output, so each reply is what it is with room to spare."""
    patterns = [r"[a-z]{20}", r"(ab|cd){10}", r"[0-9]{20}", r"x[a-z0-9]{19}"] * 2
    params = [SamplingParams(temperature=0.9, seed=seed, max_tokens=40, regex=pattern)
              for seed, pattern in enumerate(patterns)]
    prompts = [[seed + 1] * 30 for seed in range(len(params))]
    roomy = make_engine().generate(prompts, params)
    tight = make_engine(num_blocks=20, block_size=8)
    for p in params:  # cached: the batch starts together, not as each compile ends
        tight.structured_output.compile(p.structured_spec, p.cache_salt)
    squeezed = tight.generate(prompts, params)
    assert tight.stats().num_preemptions > 0
    for pattern, a, b in zip(patterns, roomy, squeezed):
        assert a.token_ids == b.token_ids
        assert re.fullmatch(pattern, b.text), (pattern, b.text)


def test_unconstrained_rows_are_untouched_by_constrained_ones(make_engine) -> None:
    engine = make_engine()
    plain = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    alone = engine.generate([[5, 6, 7], [8, 9]], plain)
    mixed = engine.generate([[5, 6, 7], [1, 2], [8, 9]],
                            [plain, SamplingParams(temperature=0, max_tokens=12, regex="[0-9]+"), plain])
    assert [o.token_ids for o in alone] == [mixed[0].token_ids, mixed[2].token_ids]
    assert re.fullmatch("[0-9]+", mixed[1].text)
