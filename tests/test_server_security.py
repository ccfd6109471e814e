"""`paged-chat serve` against callers it must not trust (issue 31, items 1, 5 and 7): web
pages and foreign Host names on a keyless server, a caller probing other callers' prompts
through `cached_tokens`, bodies that would stall the event loop, clients that never finish
their headers or hang up mid-body, an engine that dies, and client input that used to be
a server fault. Each is sent as an attacker or a careless client would, over real HTTP."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import httpx
import pytest
import torch
from helpers import wait_for
from server_fixtures import answers_health, engine_child, serving, start_server
from typer.testing import CliRunner

from paged_chat.app.settings import SettingsError, load_settings
from paged_chat.cli.main import app as cli_app
from paged_chat.engine import SamplingParams
from paged_chat.engine.core.errors import PagedChatError
from paged_chat.engine.worker.sampler import SamplingBatch, apply_top_k_top_p

JSON = {"Content-Type": "application/json"}
HI = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}


def post(base: str, path: str, body: dict | bytes, headers: dict | None = None, **options) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(f"{base}{path}", content=content, headers=headers or {}, timeout=120, **options)


def error_of(response: httpx.Response) -> str:
    error = response.json()["error"]
    assert error["code"] == response.status_code and "Traceback" not in response.text
    return error["message"]


def prompt_tokens_seen(api) -> int:
    return api.client.stats().prompt_tokens_total


# ---- item 1: a keyless server serves this machine's programs, not web pages --------------


def test_a_keyless_server_refuses_web_pages_foreign_hosts_and_bodies_that_are_not_json(api):
    """The issue's curls: each was a 200 with a completion; now none reaches the engine."""
    base, before = api.server.url, prompt_tokens_seen(api)
    text = json.dumps(HI).encode()
    refused = [
        post(base, "/v1/chat/completions", text, {"Origin": "http://evil.example",
                                                   "Content-Type": "text/plain"}),
        post(base, "/v1/chat/completions", text, {"Content-Type": "text/plain"}),
        post(base, "/v1/chat/completions", text),   # no content type at all
        post(base, "/v1/chat/completions", text, {"Content-Type": "application/x-www-form-urlencoded"}),
        post(base, "/v1/completions", text, {**JSON, "Host": "evil.example"}),
        post(base, "/v1/chat/completions", text, {**JSON, "Origin": "null"}),
        httpx.get(f"{base}/v1/models", headers={"Host": "evil.example"}),
        httpx.get(f"{base}/metrics", headers={"Host": f"evil.example:{api.server.port}"}),
        httpx.get(f"{base}/health", headers={"Host": "0.0.0.0"}),
        httpx.get(f"{base}/v1/models", headers={"Origin": "https://evil.example"}),
        httpx.get(f"{base}/v1/models", headers={"Sec-Fetch-Site": "cross-site"}),
        httpx.options(f"{base}/v1/chat/completions", headers={
            "Origin": "http://evil.example", "Access-Control-Request-Method": "POST"}),
    ]
    assert [r.status_code for r in refused] == [403, 415, 415, 415, 403, 403, 403, 403, 403, 403, 403, 403]
    messages = [error_of(response) for response in refused]
    assert "'http://evil.example' are not allowed" in messages[0] and "allowed_origins" in messages[0]
    assert messages[1] == "send the body as JSON with `Content-Type: application/json` (got 'text/plain')"
    assert "(it had none)" in messages[2]
    assert "Host 'evil.example' is not a loopback name" in messages[4]
    assert all("access-control-allow-origin" not in r.headers for r in refused)
    assert prompt_tokens_seen(api) == before, "a refused request reached the engine"

    served = [post(base, "/v1/chat/completions", HI, {**JSON, "Origin": "http://localhost:3000"}),
              post(base, "/v1/chat/completions", HI, {"Content-Type": "application/json; charset=utf-8",
                                                       "Host": f"localhost:{api.server.port}"}),
              httpx.get(f"{base}/v1/models", headers={"Host": f"[::1]:{api.server.port}"}),
              httpx.get(f"{base}/health", headers={"Host": "127.0.0.1"})]
    assert [r.status_code for r in served] == [200, 200, 200, 200]
    assert served[0].headers["access-control-allow-origin"] == "http://localhost:3000"
    assert served[0].json()["choices"][0]["finish_reason"] == "length"


def test_allowed_origins_get_cors_and_a_keyed_server_keeps_its_old_rules(api):
    web = start_server(api.client, allowed_origins=["HTTPS://Chat.Example:443"])
    keyed = start_server(api.client, api_key="k3y")
    try:
        preflight = httpx.options(f"{web.server.url}/v1/chat/completions", headers={
            "Origin": "https://chat.example", "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "content-type"})
        assert preflight.status_code == 200
        assert preflight.headers["access-control-allow-origin"] == "https://chat.example"
        allowed = post(web.server.url, "/v1/chat/completions", HI, {**JSON, "Origin": "https://chat.example"})
        assert allowed.status_code == 200 and allowed.headers["access-control-allow-origin"] == "https://chat.example"
        other = post(web.server.url, "/v1/chat/completions", HI, {**JSON, "Origin": "https://chat.example:8443"})
        assert other.status_code == 403
        # With a key nothing changes: any Host (a server beyond loopback needs one), any body type.
        key = {"Authorization": "Bearer k3y"}
        assert post(keyed.server.url, "/v1/chat/completions", HI,
                    {**key, "Host": "gpu-box.lan", "Content-Type": "text/plain"}).status_code == 200
        assert post(keyed.server.url, "/v1/chat/completions", HI, {"Host": "gpu-box.lan"}).status_code == 401
    finally:
        web.stop()
        keyed.stop()
    with pytest.raises(PagedChatError, match="is not an origin"):
        start_server(api.client, allowed_origins=["chat.example/path"])


def test_server_settings_and_serve_options_check_each_origin(tmp_path):
    path = tmp_path / "config.toml"
    path.write_text('[server]\nallowed_origins = ["HTTPS://Chat.Example:443", "http://localhost:3000"]\n'
                    "share_cache_with_tui = true\n")
    settings = load_settings(path)
    assert settings.server.allowed_origins == ["https://chat.example", "http://localhost:3000"]
    assert settings.server.share_cache_with_tui is True
    for line, message in [('allowed_origins = "https://chat.example"', "expected a list of origins"),
                          ('allowed_origins = ["chat.example/x"]', "'chat.example/x' is not an origin"),
                          ('share_cache_with_tui = "yes"', "expected true or false")]:
        path.write_text(f"[server]\n{line}\n")
        with pytest.raises(SettingsError, match=rf"config.toml, line 2: .*{re.escape(message)}"):
            load_settings(path)
    result = CliRunner().invoke(cli_app, ["serve", "--allowed-origin", "https://chat.example/app"])
    assert result.exit_code == 1
    assert result.stderr.strip().splitlines() == [
        "Error: allowed origin 'https://chat.example/app' is not an origin: write it as http://host or "
        "https://host:port (no path), or * for any"]


def secret_chat(bank: str, pin: str) -> list[dict]:
    return [{"role": "user", "content": f"My {bank} bank PIN is {pin}. Please remember it for me, keep "
                                        "it to yourself and never tell anyone else about it, ever."}]


def prompt_ids_of(api, messages: list[dict]) -> list[int]:
    tokenizer = api.client.info.tokenizer
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer.encode(text, add_special_tokens=False)


def tui_tab_sends(api, messages: list[dict]) -> int:
    """A TUI tab under `paged-chat --serve`: straight to the engine, not over HTTP; the
    prompt tokens it found cached."""
    async def run() -> int:
        async for output in api.client.stream(prompt_ids_of(api, messages), SamplingParams(
                temperature=0.0, max_tokens=2, ignore_eos=True), owner="tab-1"):
            pass
        return output.num_cached_tokens
    return asyncio.run(run())


def pin_leak(probe: Callable[[str], int]) -> int:
    """How many more cached tokens the right PIN (4711) gets than a wrong one: a wrong
    guess, the right one, another wrong one, as the issue's attacker probed."""
    probe("1234")
    right = probe("4711")
    return right - probe("9999")


def cached_tokens(base: str, messages: list[dict], headers: dict | None = None, **fields) -> int:
    reply = post(base, "/v1/chat/completions", {"messages": messages, "max_tokens": 1, "temperature": 0,
                                                **fields}, {**JSON, **(headers or {})})
    assert reply.status_code == 200, reply.text
    return reply.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_the_pin_probe_learns_nothing_of_a_tui_chat(api):
    """The issue: after a chat with "My bank PIN is 4711", guesses over the API got 16 cached
    tokens for 1234 and 32 for 4711. API requests now never hit the TUI's blocks."""
    tui_tab_sends(api, secret_chat("city", "4711"))
    assert tui_tab_sends(api, secret_chat("city", "4711")) >= 32, "the tab's own prefix is cached"
    assert pin_leak(lambda pin: cached_tokens(api.server.url, secret_chat("city", pin))) == 0
    # the API's callers still share what they send themselves
    again = cached_tokens(api.server.url, secret_chat("city", "4711"))
    assert again > cached_tokens(api.server.url, secret_chat("city", "5555"))


def test_sharing_with_the_tui_is_the_users_choice(api):
    """`[server] share_cache_with_tui = true` lets API requests hit the tabs' blocks: the probe
    above then finds the PIN, which shows it can."""
    shared = start_server(api.client, share_cache_with_tui=True)
    try:
        tui_tab_sends(api, secret_chat("river", "4711"))
        assert pin_leak(lambda pin: cached_tokens(shared.server.url, secret_chat("river", pin))) >= 16
    finally:
        shared.stop()


def test_callers_of_different_keys_or_cache_salts_share_no_prefix(api):
    alice = start_server(api.client, api_key="alice-key")
    mallory = start_server(api.client, api_key="mallory-key")
    try:
        def as_(server, key: str) -> Callable[[str], int]:
            return lambda pin: cached_tokens(server.server.url, secret_chat("harbour", pin),
                                             {"Authorization": f"Bearer {key}"})
        as_(alice, "alice-key")("4711")
        assert pin_leak(as_(mallory, "mallory-key")) == 0
        assert as_(alice, "alice-key")("4711") > as_(alice, "alice-key")("5555")
    finally:
        alice.stop()
        mallory.stop()
    # vLLM's per-request `cache_salt`: the same salt shares, another does not
    cached_tokens(api.server.url, secret_chat("forest", "4711"), cache_salt="alice-salt")
    assert pin_leak(lambda pin: cached_tokens(api.server.url, secret_chat("forest", pin),
                                              cache_salt="mallory-salt")) == 0
    assert cached_tokens(api.server.url, secret_chat("forest", "4711"), cache_salt="alice-salt") > \
        cached_tokens(api.server.url, secret_chat("forest", "5555"), cache_salt="alice-salt")
    assert post(api.server.url, "/v1/completions", {"prompt": "x", "cache_salt": ""}, JSON).status_code == 400


def test_a_cache_salt_enters_the_first_blocks_hash(make_engine):
    """In the engine: a salted prefix matches only its own salt's blocks, unsalted ones only
    unsalted ones; a salt counts as a prefix hit nowhere else."""
    engine = make_engine()
    prompt = list(range(100, 164))
    params = {salt: SamplingParams(temperature=0.0, max_tokens=1, cache_salt=salt)
              for salt in (None, "a", "b")}

    def cached(salt: str | None) -> int:
        [output] = engine.generate([prompt], params[salt])
        return output.num_cached_tokens

    assert [cached(None), cached("a"), cached("b"), cached("a"), cached(None)] == [0, 0, 0, 48, 48]
    with pytest.raises(ValueError, match="cache_salt"):
        SamplingParams(cache_salt="")


# ---- item 5: no request stalls the server ---------------------------------------------------


@contextmanager
def health_latencies(base: str) -> Iterator[list[float]]:
    """/health, polled on a thread of its own while the block runs: each answer's latency."""
    latencies: list[float] = []
    done = threading.Event()

    def poll() -> None:
        with httpx.Client(timeout=60) as client:
            while not done.is_set():
                started = time.monotonic()
                assert client.get(f"{base}/health").status_code == 200
                latencies.append(time.monotonic() - started)
                time.sleep(0.05)
    poller = threading.Thread(target=poll, daemon=True)
    poller.start()
    wait_for(lambda: latencies, what="a first /health answer")
    try:
        yield latencies
    finally:
        done.set()
        poller.join(60)


@pytest.mark.perf
def test_a_huge_body_is_refused_by_its_size_and_health_stays_fast(api):
    """The issue's 3.9 MB body took 9 s to tokenize on the event loop, and /health 2.9 s."""
    body = json.dumps({"messages": [{"role": "user", "content": "word " * 780_000}]}).encode()
    assert len(body) > 3_900_000
    with health_latencies(api.server.url) as latencies:
        for declared in (True, False):  # with a Content-Length, and chunked without one
            content = body if declared else iter([body[i:i + 2**16] for i in range(0, len(body), 2**16)])
            response = httpx.post(f"{api.url}/chat/completions", content=content, headers=JSON, timeout=120)
            assert response.status_code == 413
            limit = max(2**20, 64 * api.client.info.max_model_len)
            assert error_of(response) == (f"the request body is over this server's limit of {limit} bytes "
                                          f"(sized from the model's context of {api.client.info.max_model_len} "
                                          "tokens)")
    assert max(latencies) < 1.0, latencies


@pytest.mark.perf
def test_tokenizing_runs_off_the_event_loop(api):
    """A body under the limit that takes seconds to tokenize: /health answers all along."""
    roomy = start_server(api.client, max_body_bytes=16 * 2**20)
    try:
        body = {"messages": [{"role": "user", "content": "word another thing, " * 100_000}]}
        with health_latencies(roomy.server.url) as latencies:
            started = time.monotonic()
            response = post(roomy.server.url, "/v1/chat/completions", body, JSON)
            took = time.monotonic() - started
        assert response.status_code == 400 and "this model takes at most" in error_of(response)
        assert max(latencies) < 1.0 and len(latencies) >= 2, (took, latencies)
    finally:
        roomy.stop()


def raw_connection(port: int, data: bytes) -> socket.socket:
    connection = socket.create_connection(("127.0.0.1", port), timeout=60)
    connection.sendall(data)
    return connection


def closed_within(connection: socket.socket, seconds: float) -> bool:
    """Whether the server closes the connection (after any answer) within `seconds`."""
    connection.settimeout(seconds)
    try:
        while connection.recv(65536):
            pass
        return True
    except TimeoutError:
        return False
    finally:
        connection.close()


def test_connections_that_never_finish_their_headers_are_closed(api):
    server = start_server(api.client, header_timeout_s=1.0)
    try:
        stalled = [raw_connection(server.server.port, b"GET /health HTTP/1.1\r\nHost: loc")
                   for _ in range(20)]
        assert httpx.get(f"{server.server.url}/health").status_code == 200
        # a kept-alive connection that starts a second request and never ends its headers
        kept = raw_connection(server.server.port, b"GET /health HTTP/1.1\r\nHost: localhost\r\n\r\n")
        assert kept.recv(65536).startswith(b"HTTP/1.1 200")
        kept.sendall(b"GET /health HTTP/1.1\r\nHo")
        assert all(closed_within(connection, 30) for connection in [*stalled, kept])
    finally:
        server.stop()


def test_serve_exits_when_its_engine_dies_and_a_hang_up_is_one_line(tiny_model_dir):
    """As deployed: a client that hangs up mid-body costs one log line (it was a traceback);
    a client that never ends its headers is dropped (it was held for good); and once the
    engine process dies the server exits 1 with one line (it answered 503 forever)."""
    with serving(tiny_model_dir) as (server, port):
        stalled = raw_connection(port, b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-")
        leaver = raw_connection(port, b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: "
                                      b"application/json\r\nContent-Length: 1000\r\n\r\n{\"prompt\": ")
        time.sleep(0.2)  # its headers in, the body under way: then it hangs up
        leaver.close()
        assert closed_within(stalled, 60)
        os.kill(engine_child(server), signal.SIGKILL)
        _, errors = server.communicate(timeout=60)
        lines = errors.decode().strip().splitlines()
        assert server.returncode == 1, lines
        assert lines[1:] == ["a client hung up before its request body was in: POST /v1/completions",
                             "Error: the engine stopped (the engine process exited unexpectedly (exit "
                             "code -9)), so the server did too"], lines
        assert not answers_health(port)


def test_health_is_503_with_the_reason_while_the_engine_process_is_stopped(tiny_model_dir):
    """`kill -STOP` on the engine child: requests would wait for good, so /health says 503
    and why (it said 200), and 200 again once the child goes on."""
    with serving(tiny_model_dir) as (server, port):
        engine = engine_child(server)
        os.kill(engine, signal.SIGSTOP)
        try:
            wait_for(lambda: not answers_health(port), timeout=60,
                     what="/health to see the engine stopped")
            health = httpx.get(f"http://127.0.0.1:{port}/health", timeout=10)
            assert health.status_code == 503
            assert error_of(health).startswith("the engine is not responding"), health.text
        finally:
            os.kill(engine, signal.SIGCONT)
        wait_for(lambda: answers_health(port), timeout=60, what="/health to be 200 again")


# ---- item 7: client input is a 400 naming the field ---------------------------------------


@pytest.mark.parametrize("field, value", [("n", "2"), ("stream", "yes"), ("prompt", [True]),
                                          ("max_tokens", "2"), ("temperature", "0.5"),
                                          ("ignore_eos", 1), ("stop_token_ids", [2.0])])
def test_loose_types_are_400s_naming_the_field(api, field, value):
    response = post(api.url, "/completions", {"prompt": "hi", "max_tokens": 2, field: value}, JSON)
    assert response.status_code == 400
    assert error_of(response).startswith(field), response.text


def test_a_message_of_the_wrong_type_is_a_400(api):
    response = post(api.url, "/chat/completions", {"messages": [{"role": "user", "content": 5}]}, JSON)
    assert response.status_code == 400 and error_of(response).startswith("messages.0.content")


@pytest.mark.parametrize("value", [1e-300, 1e300, 0.001])
def test_a_repetition_penalty_that_would_overflow_the_logits_is_a_400(api, value):
    response = post(api.url, "/completions", {"prompt": "hi", "max_tokens": 2, "repetition_penalty": value}, JSON)
    assert response.status_code == 400
    assert error_of(response) == (f"SamplingParams.repetition_penalty={value!r} is invalid: expected a "
                                  "number in [0.01, 100] (1 disables it)")


def test_a_tiny_top_p_keeps_the_most_likely_token(api):
    """top_p 1e-300 was a 500 ("logits are not finite"): it is 0 in float32, which dropped
    every token. The nucleus always holds the most likely token, so it is greedy."""
    def token_ids(**sampling) -> list[int]:
        response = post(api.url, "/completions", {"prompt": "Once upon", "max_tokens": 4, "ignore_eos": True,
                                                  "return_token_ids": True, **sampling}, JSON)
        assert response.status_code == 200, response.text
        return response.json()["choices"][0]["token_ids"]
    assert token_ids(top_p=1e-300, temperature=1.0, seed=3) == token_ids(temperature=0.0)


def test_the_sampler_keeps_the_top_token_under_any_top_p():
    logits = torch.randn(2, 300, generator=torch.Generator().manual_seed(0))
    batch = SamplingBatch.build([SamplingParams(top_p=1e-300), SamplingParams(top_p=1e-30, top_k=5)],
                                seeds=[1, 2], output_indices=[0, 0], token_histories=None,
                                prompt_lens=None, vocab_size=logits.shape[-1], device=logits.device)
    kept = apply_top_k_top_p(logits, batch).isfinite()
    assert kept.sum(dim=-1).tolist() == [1, 1]
    assert kept.float().argmax(dim=-1).tolist() == logits.argmax(dim=-1).tolist()
