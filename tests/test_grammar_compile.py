"""Grammars compile off the engine loop (issue 48, item 2): a request whose grammar is not
cached waits, holding nothing, while the others step; an abort drops its wait and ends its
trial compile's child process; a compile past its time or memory limit fails the request
naming the limit (a 400 over the API); a cached grammar starts at once."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import xgrammar as xgr
from helpers import wait_for

from paged_chat.engine import Engine, SamplingParams
from paged_chat.engine.core.outputs import EngineCoreOutput
from paged_chat.engine.core.request import RequestStatus
from paged_chat.engine.worker import grammar_trial, structured_output
from paged_chat.engine.worker.structured_output import REFUSED

CHOICES = ["yes", "no"]


def patterned_object(properties: int) -> str:
    """A JSON schema whose compile takes time and memory that grow with `properties` (the
    issue's hostile schemas had thousands)."""
    return json.dumps({"type": "object", "properties": {
        f"p{n}": {"type": "string", "pattern": f"[a-z]{{{n % 7 + 1}}}x[0-9]+"}
        for n in range(properties)}})


class GatedCompiler:
    """A GrammarCompiler whose compiles wait for `gate`, and are refused on the thread
    that made it (the engine's): a compile there would stall every request."""

    def __init__(self, compiler: xgr.GrammarCompiler) -> None:
        self.compiler, self.gate, self.compilations = compiler, threading.Event(), 0
        self.engine_thread = threading.current_thread()

    def compile_grammar(self, grammar: xgr.Grammar) -> xgr.CompiledGrammar:
        assert threading.current_thread() is not self.engine_thread, "compiled on the engine thread"
        self.compilations += 1
        assert self.gate.wait(60), "the test never opened the gate"
        return self.compiler.compile_grammar(grammar)


@pytest.fixture
def gated(monkeypatch) -> Iterator:
    """gated(engine): the engine's grammar compiles wait for the returned compiler's gate,
    which opens at the test's end at the latest."""
    compilers: list[GatedCompiler] = []

    def gate(engine: Engine) -> GatedCompiler:
        manager = engine.structured_output
        compiler = GatedCompiler(manager._compiler)
        monkeypatch.setattr(manager, "_compiler", compiler)
        compilers.append(compiler)
        return compiler

    yield gate
    for compiler in compilers:
        compiler.gate.set()


def step_until(engine: Engine, done: str, finals: dict[str, EngineCoreOutput],
               tokens: dict[str, list[int]]) -> None:
    """Step until request `done` has finished, gathering every request's tokens and finals."""
    while done not in finals:
        assert engine.has_unfinished(), f"{done} never finished"
        for output in engine.step():
            tokens.setdefault(output.request_id, []).extend(output.new_token_ids)
            if output.finished:
                finals[output.request_id] = output


def test_other_requests_finish_while_a_grammar_compiles(make_engine, gated) -> None:
    engine = make_engine()
    compiler = gated(engine)
    slow = engine.add_request([1, 2, 3], SamplingParams(temperature=0, max_tokens=8, choice=CHOICES))
    fast = engine.add_request([4, 5, 6], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    finals: dict[str, EngineCoreOutput] = {}
    tokens: dict[str, list[int]] = {}
    step_until(engine, fast, finals, tokens)
    assert finals[fast].finish_reason == "length" and len(tokens[fast]) == 8
    assert slow not in finals and slow not in tokens
    assert engine.requests[slow].status is RequestStatus.WAITING_FOR_GRAMMAR
    assert engine.stats().num_waiting == 1  # the panel and /metrics count it as waiting
    assert engine.kv_cache.tables.keys() == set()  # the waiting request holds no block
    compiler.gate.set()
    step_until(engine, slow, finals, tokens)
    assert finals[slow].finish_reason == "stop"
    assert engine.tokenizer.decode(tokens[slow], skip_special_tokens=True) in CHOICES


def test_an_abort_while_the_grammar_compiles_frees_everything(make_engine, gated) -> None:
    engine = make_engine()
    compiler = gated(engine)
    slow = engine.add_request([1, 2, 3], SamplingParams(max_tokens=8, choice=CHOICES))
    compile_done = engine.requests[slow].pending_grammar.future
    wait_for(lambda: compiler.compilations == 1, what="the compile to start")
    engine.abort(slow)
    assert [(o.request_id, o.finish_reason) for o in engine.step()] == [(slow, "abort")]
    compiler.gate.set()
    compile_done.result(timeout=60)
    engine.step()
    assert not engine.has_unfinished() and not engine.requests
    assert engine.stats().blocks_in_use == 0 and not engine.kv_cache.tables
    assert engine.structured_output.kept_bytes == 0  # nobody waited for it: not kept


def test_a_compile_past_its_limit_fails_the_request_naming_the_limit(make_engine, gated,
                                                                     monkeypatch) -> None:
    engine = make_engine()
    gated(engine)
    monkeypatch.setattr(structured_output, "COMPILE_TIMEOUT_S", 0.05)
    slow = engine.add_request([1, 2, 3], SamplingParams(max_tokens=8, regex="[a-z]+"))
    finals: dict[str, EngineCoreOutput] = {}
    step_until(engine, slow, finals, {})
    assert finals[slow].finish_reason == "error" and not finals[slow].new_token_ids
    assert finals[slow].error.startswith(REFUSED)
    assert "did not compile within 0.05 s, the limit on a grammar's compile" in finals[slow].error
    assert not engine.has_unfinished() and engine.stats().blocks_in_use == 0


def test_a_cached_grammar_starts_at_once(make_engine, gated) -> None:
    engine = make_engine()
    compiler = gated(engine)
    compiler.gate.set()
    params = SamplingParams(temperature=0, max_tokens=4, choice=CHOICES, cache_salt="alice")
    first = engine.add_request([1, 2, 3], params)
    step_until(engine, first, {}, {})
    again = engine.add_request([1, 2, 3], params)
    assert engine.requests[again].status is RequestStatus.WAITING
    assert engine.requests[again].grammar is not None
    assert [o.request_id for o in engine.step()] == [again]  # scheduled on the next step
    assert compiler.compilations == 1
    engine.abort(again)
    engine.step()


@pytest.mark.parametrize("stream", [False, True])
def test_a_compile_past_its_limit_is_a_400_over_the_api(api, gated, monkeypatch, stream) -> None:
    compiler = gated(api.client.transport.engine)
    monkeypatch.setattr(structured_output, "COMPILE_TIMEOUT_S", 0.05)
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "stream": stream,
            "structured_outputs": {"regex": f"[a-z]{{{3 + stream}}}"}}
    response = httpx.post(f"{api.url}/chat/completions", json=body, timeout=120)
    assert response.status_code == 400, response.text
    assert "the limit on a grammar's compile" in response.json()["error"]["message"]
    compiler.gate.set()


def test_an_abort_during_a_compile_ends_its_child_process(make_engine) -> None:
    engine = make_engine()
    slow = engine.add_request([1, 2, 3], SamplingParams(max_tokens=8,
                                                        json_schema=patterned_object(400)))
    compiling = engine.requests[slow].pending_grammar.compile
    wait_for(lambda: compiling.trial is not None, what="the trial compile to start")
    child = Path(f"/proc/{compiling.trial.pid}")
    assert child.exists()
    engine.abort(slow)
    assert [(o.request_id, o.finish_reason) for o in engine.step()] == [(slow, "abort")]
    wait_for(lambda: not child.exists(), timeout=60, what="the trial's child process to end")
    wait_for(lambda: compiling.future.done(), timeout=60, what="the compile to end")
    assert compiling.future.exception() is not None  # it ended with its child, unfinished
    engine.step()
    assert not engine.has_unfinished() and engine.stats().blocks_in_use == 0
    assert engine.structured_output.kept_bytes == 0


def test_a_compile_past_its_time_limit_ends_its_child_process(make_engine, monkeypatch) -> None:
    monkeypatch.setattr(structured_output, "COMPILE_TIMEOUT_S", 0.5)
    engine = make_engine()
    slow = engine.add_request([1, 2, 3], SamplingParams(max_tokens=8,
                                                        json_schema=patterned_object(400)))
    compiling = engine.requests[slow].pending_grammar.compile
    wait_for(lambda: compiling.trial is not None, what="the trial compile to start")
    child = compiling.trial.pid
    finals: dict[str, EngineCoreOutput] = {}
    step_until(engine, slow, finals, {})
    assert "did not compile within 0.5 s, the limit on a grammar's compile" in finals[slow].error
    wait_for(lambda: process_ended(child), timeout=60, what="the trial's child process to end")


def test_a_compile_past_its_memory_limit_fails_the_request_naming_the_limit(
        make_engine, monkeypatch) -> None:
    monkeypatch.setattr(structured_output, "COMPILE_MEMORY_BYTES", 2**20)
    engine = make_engine()
    request = engine.add_request([1, 2, 3], SamplingParams(max_tokens=8,
                                                           json_schema=patterned_object(1000)))
    finals: dict[str, EngineCoreOutput] = {}
    step_until(engine, request, finals, {})
    assert finals[request].finish_reason == "error" and not finals[request].new_token_ids
    assert finals[request].error.startswith(REFUSED)
    assert "needs more than 1 MiB, the limit on a grammar's compile memory" in finals[request].error
    assert not engine.has_unfinished() and engine.structured_output.kept_bytes == 0


def test_a_compile_past_its_memory_limit_is_a_400_over_the_api(api, monkeypatch) -> None:
    monkeypatch.setattr(structured_output, "COMPILE_MEMORY_BYTES", 2**20)
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4,
            "response_format": {"type": "json_schema", "json_schema": {
                "name": "big", "schema": json.loads(patterned_object(1001))}}}
    response = httpx.post(f"{api.url}/chat/completions", json=body, timeout=120)
    assert response.status_code == 400, response.text
    assert "the limit on a grammar's compile memory" in response.json()["error"]["message"]


def process_ended(pid: int) -> bool:
    """Gone, or a zombie its parent has not reaped yet."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def test_an_idle_trial_child_exits_and_the_next_compile_starts_another(make_engine,
                                                                       monkeypatch) -> None:
    monkeypatch.setattr(grammar_trial, "IDLE_EXIT_S", 0.5)
    engine = make_engine()
    first = engine.add_request([1, 2, 3], SamplingParams(temperature=0, max_tokens=16,
                                                         choice=CHOICES))
    compiling = engine.requests[first].pending_grammar.compile
    wait_for(lambda: compiling.trial is not None, what="the trial compile to start")
    child = compiling.trial.pid
    finals: dict[str, EngineCoreOutput] = {}
    step_until(engine, first, finals, {})
    assert finals[first].finish_reason == "stop"
    wait_for(lambda: process_ended(child), timeout=60, what="the idle child to exit")
    second = engine.add_request([1, 2, 3], SamplingParams(temperature=0, max_tokens=16,
                                                          choice=["maybe", "never"]))
    step_until(engine, second, finals, {})
    assert finals[second].finish_reason == "stop", finals[second].error
