"""`paged-chat serve` against clients nobody here wrote: the official `openai` client, httpx
and prometheus-client's own text parser, on the tiny chat model."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
from pathlib import Path

import httpx
import openai
import pytest
from helpers import wait_for
from prometheus_client.parser import text_string_to_metric_families
from server_fixtures import engine_child, serving, start_server
from typer.testing import CliRunner

from paged_chat.cli.main import app as cli_app
from paged_chat.engine import SamplingParams
from paged_chat.server import UnsafeBindError, check_bind

SYSTEM = ("You are a careful assistant. You answer in short sentences, you check your facts, "
          "and you say when you do not know something. Keep every answer brief and friendly.")
SAMPLING = {"temperature": 0.0, "extra_body": {"ignore_eos": True}}


def client_for(api, **options) -> openai.OpenAI:
    return openai.OpenAI(base_url=api.url, api_key="unused", max_retries=0, **options)


def chat(content: str) -> list[dict]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": content}]


def engine_reply(api, prompt_ids: list[int], max_tokens: int) -> list[int]:
    """What the engine itself answers (greedy) for these prompt ids, not over HTTP."""
    async def run() -> list[int]:
        async for output in api.client.stream(prompt_ids, SamplingParams(
                temperature=0.0, max_tokens=max_tokens, ignore_eos=True)):
            pass
        return output.token_ids
    return asyncio.run(run())


def test_chat_completion_matches_the_engine_and_reports_usage(api):
    reply = client_for(api).chat.completions.create(
        model=api.model, messages=chat("Hello"), max_tokens=6, temperature=0.0,
        extra_body={"ignore_eos": True, "return_token_ids": True})
    tokenizer = api.client.info.tokenizer
    prompt = tokenizer.apply_chat_template(chat("Hello"), tokenize=False, add_generation_prompt=True)
    prompt_ids = tokenizer.encode(prompt, add_special_tokens=False)
    [choice] = reply.choices
    assert choice.message.role == "assistant" and choice.finish_reason == "length"
    assert choice.model_extra["token_ids"] == engine_reply(api, prompt_ids, 6)
    assert choice.message.content == tokenizer.decode(choice.model_extra["token_ids"])
    assert reply.usage.prompt_tokens == len(prompt_ids) and reply.usage.completion_tokens == 6
    assert reply.usage.total_tokens == len(prompt_ids) + 6


def test_streams_chat_and_completions_with_usage(api):
    client = client_for(api)
    chunks = list(client.chat.completions.create(
        model=api.model, messages=chat("Stream please"), max_tokens=5, stream=True,
        stream_options={"include_usage": True}, **SAMPLING))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks[1:-1]][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 5
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    whole = client.chat.completions.create(model=api.model, messages=chat("Stream please"),
                                           max_tokens=5, **SAMPLING)
    assert text == whole.choices[0].message.content

    ids_prompt = [1, 520, 9531, 198, 30, 40, 50]
    streamed = list(client.completions.create(model=api.model, prompt=ids_prompt, max_tokens=4,
                                              stream=True, **SAMPLING))
    complete = client.completions.create(model=api.model, prompt=ids_prompt, max_tokens=4, **SAMPLING)
    assert "".join(c.choices[0].text for c in streamed) == complete.choices[0].text
    assert complete.usage.prompt_tokens == len(ids_prompt)
    text_prompt = client.completions.create(model=api.model, prompt="Once upon a time",
                                            max_tokens=3, **SAMPLING)
    assert text_prompt.choices[0].finish_reason == "length"


def test_n_choices_share_the_prompt_blocks(api):
    reply = client_for(api).chat.completions.create(
        model=api.model, messages=chat("Two answers"), max_tokens=4, n=3, temperature=1.0, seed=7,
        extra_body={"ignore_eos": True})
    assert [c.index for c in reply.choices] == [0, 1, 2]
    assert reply.usage.completion_tokens == 12
    hits_before = api.client.stats().prefix_cache_hit_tokens
    again = client_for(api).chat.completions.create(
        model=api.model, messages=chat("Two answers"), max_tokens=4, n=3, temperature=1.0, seed=7,
        extra_body={"ignore_eos": True})
    assert [c.message.content for c in again.choices] == [c.message.content for c in reply.choices]
    assert len({c.message.content for c in reply.choices}) > 1, "seeded choices must differ"
    wait_for(lambda: api.client.stats().prefix_cache_hit_tokens > hits_before)


def test_requests_sharing_a_system_prompt_report_cached_tokens(api):
    client = client_for(api)
    first = client.chat.completions.create(model=api.model, messages=chat("First question"),
                                           max_tokens=2, **SAMPLING)
    second = client.chat.completions.create(model=api.model, messages=chat("Second question"),
                                            max_tokens=2, **SAMPLING)
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached >= 16 and cached % 16 == 0 and cached < second.usage.prompt_tokens
    assert first.usage.prompt_tokens_details.cached_tokens <= cached


def test_errors_are_openai_errors_and_the_engine_lives_on(api):
    client = client_for(api)
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.completions.create(model="no-such-model", prompt="hi", max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.completions.create(model=api.model, prompt="hi", temperature=-1)
    with pytest.raises(openai.BadRequestError, match="top_p"):
        client.chat.completions.create(model=api.model, messages=chat("x"), top_p=0)
    with pytest.raises(openai.BadRequestError, match="max_model_len|at most"):
        client.completions.create(model=api.model, prompt=[5] * 5000, max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="vocabulary"):
        client.completions.create(model=api.model, prompt=[10**9], max_tokens=2, stream=True)
    with pytest.raises(openai.BadRequestError, match="messages"):
        client.chat.completions.create(model=api.model, messages=[])
    for body, status in ((b"{not json", 400), (b'{"prompt": "x", "n": 0}', 400),
                         (json.dumps({"prompt": "x" * (5 * 2**20)}).encode(), 413)):
        response = httpx.post(f"{api.url}/completions", content=body,
                              headers={"Content-Type": "application/json"}, timeout=60)
        assert response.status_code == status
        error = response.json()["error"]
        assert error["code"] == status and error["message"] and "Traceback" not in response.text
    missing = httpx.get(f"{api.url}/nowhere")
    assert missing.status_code == 404 and missing.json()["error"]["type"] == "not_found_error"
    after = client.completions.create(model=api.model, prompt="still alive?", max_tokens=2, **SAMPLING)
    assert after.choices[0].finish_reason == "length"


def test_a_method_a_path_does_not_take_is_a_405_the_callers_error(api):
    """A 4xx is the caller's error (it was typed server_error)."""
    wrong = httpx.put(f"{api.url}/chat/completions", json={"messages": []}, timeout=60)
    assert wrong.status_code == 405
    assert wrong.json()["error"] == {"message": "Method Not Allowed", "type": "invalid_request_error",
                                     "param": None, "code": 405}


def test_api_key_is_required_when_set(served):
    keyed = start_server(served.client, api_key="s3cret")
    try:
        with pytest.raises(openai.AuthenticationError):
            client_for(keyed).models.list()
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=keyed.url, api_key="wrong", max_retries=0).models.list()
        assert httpx.get(f"{keyed.server.url}/metrics").status_code == 401
        assert httpx.get(f"{keyed.server.url}/health").status_code == 200
        good = openai.OpenAI(base_url=keyed.url, api_key="s3cret", max_retries=0)
        assert [m.id for m in good.models.list()] == [served.model]
    finally:
        keyed.stop()


def test_binding_beyond_loopback_needs_a_key():
    check_bind("127.0.0.1", None)
    check_bind("::1", None)
    check_bind("0.0.0.0", "key")
    for host in ("0.0.0.0", "192.168.1.4", "example.org"):
        with pytest.raises(UnsafeBindError, match="--api-key"):
            check_bind(host, None)
    result = CliRunner().invoke(cli_app, ["serve", "--host", "0.0.0.0"])
    assert result.exit_code == 1
    [line] = result.stderr.strip().splitlines()
    assert line.startswith("Error: refusing to serve on 0.0.0.0 without --api-key")


@pytest.mark.parametrize("signum, status", [(signal.SIGINT, 130), (signal.SIGTERM, 143),
                                            (signal.SIGHUP, 129)])
def test_serve_steps_its_engine_in_a_child_it_shuts_down_on_a_stop_signal(
        tiny_model_dir, signum, status):
    """The engine runs in a child process, so the HTTP event loop and the engine share no
    GIL, and it answers. Ctrl+C, a supervisor's SIGTERM or a closed terminal's SIGHUP: the
    child is shut down and reaped before serve exits 128 + the signal (uvicorn raised the
    signal again after its own shutdown, which ended serve before its engine: a child left
    to init). Once that child dies the server exits: test_server_security.py."""
    with serving(tiny_model_dir) as (server, port):
        engine = engine_child(server)
        reply = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=60, json={
            "prompt": [5, 6, 7], "max_tokens": 4, "temperature": 0, "ignore_eos": True}).json()
        assert reply.get("usage", {}).get("completion_tokens") == 4, reply
        server.send_signal(signum)
        _, errors = server.communicate(timeout=60)
        assert server.returncode == status and b"Traceback" not in errors, errors.decode()
        assert not Path(f"/proc/{engine}").exists()


def test_client_disconnect_mid_stream_frees_the_blocks(api):
    body = {"model": api.model, "prompt": "Go on forever", "max_tokens": 5000, "stream": True,
            "ignore_eos": True, "temperature": 0.0, "user": "leaver"}
    with httpx.stream("POST", f"{api.url}/completions", json=body, timeout=60) as response:
        events = response.iter_lines()
        received = [line for line, _ in zip(events, range(6)) if line.startswith("data:")]
        assert len(received) >= 2
        assert api.client.stats().blocks_in_use > 0 or api.client.transport.engine.requests
        owners = api.client.stats().blocks.request_owners
        assert "leaver" in owners or api.client.transport.engine.requests
    wait_for(lambda: not api.client.transport.engine.requests, timeout=60, what="the request to be aborted")
    wait_for(lambda: api.client.stats().blocks_in_use == 0, timeout=60, what="its blocks back")


def test_a_hang_up_on_a_non_streaming_request_is_one_line_and_aborts_it(api, caplog):
    """A client that leaves before its whole reply is ready: its request is aborted and the
    server logs one line, not a ~60-line traceback per hang-up."""
    body = {"model": api.model, "prompt": "Go on forever", "max_tokens": 5000,
            "ignore_eos": True, "temperature": 0.0}
    with caplog.at_level(logging.WARNING):
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{api.url}/completions", json=body, timeout=httpx.Timeout(60, read=1.0))
        wait_for(lambda: not api.client.transport.engine.requests, timeout=60,
                 what="the request to be aborted")
        wait_for(lambda: caplog.records, timeout=30, what="the hang-up to be logged")
    assert [(record.getMessage(), record.exc_info) for record in caplog.records] == [
        ("a client hung up before its reply was ready: POST /v1/completions", None)]


def test_metrics_parse_with_vllm_names_and_types(api):
    client_for(api).completions.create(model=api.model, prompt="count me", max_tokens=3, **SAMPLING)
    text = httpx.get(f"{api.server.url}/metrics").text
    families = {family.name: family for family in text_string_to_metric_families(text)}
    kinds = {"vllm:num_requests_running": "gauge", "vllm:num_requests_waiting": "gauge",
             "vllm:kv_cache_usage_perc": "gauge", "vllm:prefix_cache_queries": "counter",
             "vllm:prefix_cache_hits": "counter", "vllm:prompt_tokens": "counter",
             "vllm:generation_tokens": "counter", "vllm:num_preemptions": "counter",
             "vllm:spec_decode_num_draft_tokens": "counter",
             "vllm:spec_decode_num_accepted_tokens": "counter"}
    for name, kind in kinds.items():
        assert families[name].type == kind, name
        [sample] = [s for s in families[name].samples if not s.name.endswith("_created")]
        assert sample.labels == {"model_name": api.model}
    value = {name: families[name].samples[0].value for name in kinds}
    assert value["vllm:generation_tokens"] >= 3 and value["vllm:prompt_tokens"] >= 3
    assert value["vllm:prefix_cache_queries"] >= value["vllm:prefix_cache_hits"] >= 0
    assert 0.0 <= value["vllm:kv_cache_usage_perc"] <= 1.0


def scrape(api) -> dict[str, float]:
    text = httpx.get(f"{api.server.url}/metrics").text
    return {family.name: family.samples[0].value for family in text_string_to_metric_families(text)}


def test_token_counters_count_requests_that_did_not_come_through_the_api(api):
    """A TUI tab under `--serve` submits to the engine directly, not over HTTP."""
    before = scrape(api)
    prompt_ids = [1, 520, 9531, 198, 30]
    engine_reply(api, prompt_ids, max_tokens=5)
    wait_for(lambda: scrape(api)["vllm:generation_tokens"] >= before["vllm:generation_tokens"] + 5,
             what="the in-process request in the counters")
    after = scrape(api)
    assert after["vllm:generation_tokens"] == before["vllm:generation_tokens"] + 5
    assert after["vllm:prompt_tokens"] == before["vllm:prompt_tokens"] + len(prompt_ids)


def test_models_and_health(api):
    assert httpx.get(f"{api.server.url}/health").status_code == 200
    models = client_for(api).models.list()
    assert models.data[0].id == api.model


def test_a_request_without_max_tokens_takes_the_chat_settings(tiny_model_dir, tmp_path):
    """The README: omitted fields take [chat]'s values. Without max_tokens a request ran to
    the end of the context (8,141 tokens, 7 minutes), and `llm`, which sends none, looped."""
    config = tmp_path / "config.toml"
    config.write_text("[chat]\nmax_tokens = 3\n")
    with serving(tiny_model_dir, {**os.environ, "PAGED_CHAT_CONFIG": str(config)}) as (_, port):
        base = f"http://127.0.0.1:{port}/v1"
        reply = httpx.post(f"{base}/completions", timeout=60, json={
            "prompt": [5, 6, 7], "temperature": 0, "ignore_eos": True}).json()
        assert reply.get("usage", {}).get("completion_tokens") == 3, reply
        reply = httpx.post(f"{base}/completions", timeout=60, json={
            "prompt": [5, 6, 7], "max_tokens": 5, "temperature": 0, "ignore_eos": True}).json()
        assert reply.get("usage", {}).get("completion_tokens") == 5, reply
