"""The core emits ids only; one output processor on the client side turns them into text,
applies stop strings and builds every RequestOutput; make_client picks the transport the
spec names, and each client states its capabilities."""

from __future__ import annotations

import asyncio

import pytest
from helpers import generate

from paged_chat.app.client_spec import client_spec
from paged_chat.engine import (
    ClientSpec,
    EngineCoreOutput,
    LocalClient,
    OutputProcessor,
    SamplingParams,
    make_client,
)
from paged_chat.engine.clients.thread_transport import ThreadTransport

TEXT = "The quick brown fox jumps over the lazy dog, and then it naps."


def core(request_id: str, ids: list[int], finished: bool = False, reason=None) -> EngineCoreOutput:
    return EngineCoreOutput(request_id, ids, finished, reason, 4, 0, 0)


def test_text_is_the_decode_of_the_ids(tokenizer):
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    processor = OutputProcessor(tokenizer)
    processor.add_request("r", SamplingParams())
    outputs = [out for index, token in enumerate(ids)
               for out in processor.process([core("r", [token], index == len(ids) - 1,
                                                  "length" if index == len(ids) - 1 else None)]
                                            ).outputs]
    final = outputs[-1]
    assert final.finished and final.finish_reason == "length"
    assert final.token_ids == ids and final.text == tokenizer.decode(ids, skip_special_tokens=True)
    assert "".join(out.new_text for out in outputs) == final.text
    assert [t for out in outputs for t in out.new_token_ids] == ids
    assert len(processor) == 0


def test_a_stop_string_across_tokens_stops_and_drops_what_the_core_sends_after(tokenizer):
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    pieces = [tokenizer.decode(ids[:n], skip_special_tokens=True) for n in range(len(ids) + 1)]
    # a stop string of two characters of token cut - 1 and two of token cut
    cut = next(n for n in range(1, len(ids) - 1) if len(pieces[n + 1]) - len(pieces[n]) >= 3
               and len(pieces[n]) - len(pieces[n - 1]) >= 3)
    stop = pieces[cut + 1][len(pieces[cut]) - 2:len(pieces[cut]) + 2]
    processor = OutputProcessor(tokenizer)
    processor.add_request("r", SamplingParams(stop=[stop]))
    shown, aborted = [], []
    for token in ids[:cut + 1]:
        processed = processor.process([core("r", [token])])
        shown += processed.outputs
        aborted += processed.to_abort
    final = shown[-1]
    assert final.finished and final.finish_reason == "stop" and aborted == ["r"]
    assert final.text == TEXT[:TEXT.index(stop)] == "".join(out.new_text for out in shown)
    assert not any(out.finished for out in shown[:-1])
    # the core stepped it once more before the abort landed, then sent the abort's end
    assert processor.process([core("r", [ids[cut + 1]])]).outputs == []
    assert processor.process([core("r", [], True, "abort")]).outputs == []
    # the id is free again: a new request under it gets its own outputs
    processor.add_request("r", SamplingParams())
    [again] = processor.process([core("r", [ids[0]])]).outputs
    assert again.token_ids == [ids[0]] and not again.finished


def test_a_request_reopened_while_draining_waits_for_the_old_ones_end(tokenizer):
    processor = OutputProcessor(tokenizer)
    processor.add_request("r", SamplingParams())
    processor.abort_request("r")        # its stream was left; the core's abort is on its way
    processor.add_request("r", SamplingParams())
    assert processor.process([core("r", [5])]).outputs == []             # the old request's
    assert processor.process([core("r", [], True, "abort")]).outputs == []
    [new] = processor.process([core("r", [6])]).outputs
    assert new.token_ids == [6]


def test_a_detokenizer_fault_fails_that_request_alone(tokenizer):
    processor = OutputProcessor(tokenizer)
    for request_id in ("bad", "good"):
        processor.add_request(request_id, SamplingParams())
    state = processor._states["bad"]

    def broken(token_id):
        raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected")

    state.detokenizer.add_token = broken
    [token] = tokenizer.encode("hello", add_special_tokens=False)
    processed = processor.process([core("bad", [token]), core("good", [token])])
    bad, good = processed.outputs
    assert bad.finished and bad.finish_reason == "error" and "injected" in bad.error
    assert processed.to_abort == ["bad"] and not good.finished and good.text == "hello"


def test_the_core_emits_ids_and_ignores_stop_strings(make_engine):
    engine = make_engine()
    free = engine.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=12,
                                                       ignore_eos=True))[0]
    stop = free.text[len(free.text) // 3:len(free.text) // 3 + 2]
    assert stop.strip(), free.text
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop=[stop])
    engine.add_request([5, 6, 7], params)
    outputs = []
    while engine.has_unfinished():
        outputs += engine.step()
    assert all(isinstance(out, EngineCoreOutput) for out in outputs)
    assert not hasattr(outputs[0], "text") and not hasattr(outputs[0], "new_text")
    assert outputs[-1].finish_reason == "length"          # stop strings are the client's
    assert [t for out in outputs for t in out.new_token_ids] == free.token_ids
    stopped = engine.generate([[5, 6, 7]], params)[0]   # generate runs a processor
    assert stopped.finish_reason == "stop" and stopped.text == free.text[:free.text.index(stop)]
    assert len(stopped.token_ids) < len(free.token_ids)


async def test_a_thread_client_stops_at_a_stop_string_and_the_core_lets_go(make_engine):
    engine = make_engine()
    free = engine.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=24,
                                                       ignore_eos=True))[0]
    stop = free.text[len(free.text) // 2:len(free.text) // 2 + 2]
    client = make_client(ClientSpec("thread", engine=engine, stats_interval_s=0.01))
    try:
        final = await asyncio.wait_for(generate(client, [5, 6, 7], SamplingParams(
            temperature=0, max_tokens=24, ignore_eos=True, stop=[stop])), 60)
        assert final.finish_reason == "stop" and final.text == free.text[:free.text.index(stop)]

        async def idle():
            while engine.has_unfinished() or client.stats().blocks_in_use:
                await asyncio.sleep(0.01)
        await asyncio.wait_for(idle(), 30)
        assert len(client._processor) == 0
    finally:
        client.shutdown()


def test_make_client_builds_a_thread_client_with_a_block_map(make_engine):
    client = make_client(ClientSpec("thread", engine=make_engine()))
    try:
        assert isinstance(client, LocalClient) and isinstance(client.transport, ThreadTransport)
        capabilities = client.capabilities
        assert capabilities.block_map and capabilities.metrics
        assert capabilities.where == "on a thread of this process"
        assert client.running and client.stats().num_blocks == client.info.num_blocks == 256
    finally:
        client.shutdown()
    assert not client.running


def test_a_spec_names_a_transport_and_what_it_can_take(make_engine, tmp_path):
    with pytest.raises(ValueError, match="transport='ftp://x' is invalid"):
        ClientSpec("ftp://x")
    with pytest.raises(ValueError, match="cannot cross to a child process"):
        ClientSpec("process", engine=make_engine())
    with pytest.raises(ValueError, match="a config or an engine"):
        ClientSpec("thread")


def test_the_app_turns_its_options_into_one_spec(tmp_path):
    from paged_chat.engine import EngineConfig

    config = EngineConfig(model="m")
    remote = client_spec(config, "process", server="localhost:8000", api_key="k", model="x")
    assert (remote.transport, remote.api_key, remote.remote_model) == (
        "http://localhost:8000", "k", "x")
    assert client_spec(config, "process", server="https://h/v1").transport == "https://h/v1"
    built = []
    injected = client_spec(config, "process", make_engine=built.append)
    assert injected.transport == "thread" and injected.config is None
    injected.engine()
    assert built == [config]   # the factory gets the config, on the engine thread when it runs
    local = client_spec(config, "process", log_path=tmp_path / "e.log", leave_cores=1)
    assert (local.transport, local.config, local.log_path, local.leave_cores) == (
        "process", config, tmp_path / "e.log", 1)
