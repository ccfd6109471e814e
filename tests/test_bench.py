"""`paged-chat bench` on a tiny model: every system runs the same workload (an OpenAI-compatible
server too: a `paged-chat serve` on the same weights), the report holds the figures the table
prints, and the scenarios measure what they claim."""

from __future__ import annotations

import json
import os
import threading

import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from helpers import wait_for
from server_fixtures import free_port

from paged_chat.bench import BenchOptions, run_bench
from paged_chat.bench.openai_server import run_openai_server
from paged_chat.bench.own_thread import on_own_thread
from paged_chat.bench.report import format_report, write_json
from paged_chat.bench.systems import SYSTEMS
from paged_chat.bench.workload import Workload


@pytest.fixture(scope="module")
def server_system(served) -> str:
    return f"openai:{served.server.url}"


@pytest.fixture(scope="module")
def report(chat_model_dir, server_system):
    # The KV pool in float32 too (the CPU ships bf16): the report's token match is exact.
    options = BenchOptions(model=str(chat_model_dir), num_chats=4, min_output=3, max_output=6,
                           dtype="float32", kv_cache_dtype="auto", threads=1, engine_threads=1,
                           roofline=True, systems=(*SYSTEMS, server_system))
    return run_bench(options, log=lambda line: None)


def test_every_system_produces_the_workload(report, server_system):
    systems = {s["system"]: s for s in report["systems"]}
    assert set(systems) == {"paged-chat", "hf-seq", "hf-static", "hf-cb", server_system}
    for summary in systems.values():
        assert summary["output_tokens"] == report["workload"]["output_tokens"]
        assert summary["output_tokens_per_s"] > 0 and summary["mean_ttft_s"] > 0
    assert systems["hf-seq"]["vs_hf_seq"] == 1.0
    # Same fp32 weights, greedy: the engine reproduces transformers token for token.
    assert systems["paged-chat"]["same_tokens_as_hf_seq"] == 1.0
    assert systems[server_system]["same_tokens_as_hf_seq"] == 1.0
    assert systems[server_system]["served_by"] == "paged-chat"
    assert systems[server_system]["replies_cut_short"] == 0
    assert systems[server_system]["prompts_as"] == "token ids"
    assert systems["hf-static"]["decode_padding_waste"] > 0


def test_paged_chat_figures(report):
    paged = next(s for s in report["systems"] if s["system"] == "paged-chat")
    shared = report["workload"]["shared_system_prompt_tokens"]
    assert paged["prefix_cache_hit_tokens"] >= 3 * (shared // 16 * 16)
    assert paged["peak_batch_size"] == 4
    assert 0 <= paged["kv_waste_at_peak"] < 1 and 0 <= paged["host_overhead"] < 1


def test_scenarios(report):
    scenarios = report["scenarios"]
    assert scenarios["fit"]["paged_chats_resident_at_once"] > scenarios["fit"]["contiguous_chats"]
    # What makes the cached start faster, not the times (too close on a tiny model to order)
    ttft = scenarios["system_prompt_ttft"]
    shared = report["workload"]["shared_system_prompt_tokens"]
    assert ttft["cold_cached_tokens"] == 0 and ttft["cached_tokens"] >= shared // 16 * 16 > 0
    assert ttft["cold_s"] > 0 and ttft["cached_s"] > 0
    turns = scenarios["five_turn_chat"]
    assert len(turns) == 5
    assert all(turn["prefilled"] <= turn["prompt_tokens"] - 100 for turn in turns[1:])
    resumed = scenarios["tier_resume"]  # a new engine: the disk tier serves the whole history
    assert resumed["history_tokens"] >= 512 and resumed["same_reply"]  # half the tiny model's context
    assert resumed["prefilled_without_tier"] == resumed["history_tokens"]
    assert resumed["prefilled_with_tier"] <= 16 + 20
    assert resumed["tier_cached_tokens"] == resumed["history_tokens"] - resumed["prefilled_with_tier"]
    assert resumed["disk_bytes_per_token"] > 0
    roof = report["roofline"]
    assert roof["floor_ms"] > 0
    # the machine's limit is every core's; the steps ran on the one thread the bench pinned
    assert roof["machine_threads"] == len(os.sched_getaffinity(0))
    assert roof["decode_step_threads"] == 1


def test_report_prints_and_saves(report, server_system, tmp_path):
    table = format_report(report)
    assert "paged-chat" in table and "hf-cb" in table and "x" in table
    assert f"{server_system}: paged-chat serving " in table
    assert "KiB on disk per token" in table
    write_json(report, str(tmp_path / "bench.json"))
    assert json.loads((tmp_path / "bench.json").read_text())["workload"]["chats"] == 4


def test_unknown_system_is_rejected(chat_model_dir):
    with pytest.raises(ValueError, match="unknown system"):
        run_bench(BenchOptions(model=str(chat_model_dir), systems=("vllm",)), log=lambda _: None)


def test_bench_command(chat_model_dir, tmp_path):
    from typer.testing import CliRunner

    from paged_chat.cli.main import app

    out = tmp_path / "report.json"
    result = CliRunner().invoke(app, ["bench", "--model", str(chat_model_dir), "--quick",
                                      "--systems", "paged-chat,hf-seq", "--dtype", "float32",
                                      "--no-scenarios", "--json", str(out)])
    assert result.exit_code == 0, result.output
    assert "paged-chat" in result.stdout and "hf-seq" in result.stdout
    assert "dtypes: paged-chat float32, the HF baselines float32" in result.stdout
    assert [s["system"] for s in json.loads(out.read_text())["systems"]] == ["paged-chat", "hf-seq"]
    bad = CliRunner().invoke(app, ["bench", "--model", str(chat_model_dir), "--systems", "vllm"])
    assert bad.exit_code == 1 and "unknown system" in bad.output


def text_only_server(received: list[str]) -> FastAPI:
    """A server the way Ollama's /v1 and llama-server differ from paged-chat's: token-id
    prompts refused (Ollama), no token ids in the chunks, which may carry several tokens'
    text (a character split over tokens), the count in the final `usage`."""
    app = FastAPI()

    @app.get("/v1/models")
    def models() -> dict:
        return {"object": "list", "data": [{"id": "text-only", "object": "model", "created": 0,
                                            "owned_by": "elsewhere"}]}

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        body = await request.json()
        if not isinstance(body["prompt"], str):
            return JSONResponse({"error": {"message": "prompt must be a string"}}, status_code=400)
        received.append(body["prompt"])
        head = {"id": "cmpl-1", "object": "text_completion", "created": 0, "model": "text-only"}
        count = body["max_tokens"]
        pieces = (count + 1) // 2   # two tokens a chunk
        chunks = [{**head, "choices": [{"index": 0, "text": f" w{i}", "logprobs": None,
                                        "finish_reason": "length" if i == pieces - 1 else None}]}
                  for i in range(pieces)]
        chunks.append({**head, "choices": [], "usage": {
            "prompt_tokens": 1, "completion_tokens": count, "total_tokens": count + 1}})
        if not body.get("stream"):
            return JSONResponse(chunks[0])
        return StreamingResponse(iter([f"data: {json.dumps(chunk)}\n\n" for chunk in chunks]
                                      + ["data: [DONE]\n\n"]), media_type="text/event-stream")

    return app


def test_a_server_without_token_ids_gets_text_and_is_counted_by_usage(tokenizer):
    received: list[str] = []
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(text_only_server(received), port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    wait_for(lambda: server.started, what="the server to start")
    prompts = [tokenizer.encode("<|im_start|>user\nHi<|im_end|>"), tokenizer.encode("Hello there")]
    try:
        result = run_openai_server(f"openai:http://127.0.0.1:{port}",
                                   Workload(prompts, [3, 5], 0), tokenizer)
    finally:
        server.should_exit = True
        thread.join(30)
    assert sorted(received) == sorted(tokenizer.decode(p, skip_special_tokens=False) for p in prompts)
    assert result.output_tokens == 8 and result.outputs == []
    assert result.extra["prompts_as"] == "text" and result.extra["replies_cut_short"] == 0
    assert result.extra["served_by"] == "elsewhere" and len(result.ttft_s) == 2


def test_each_system_runs_on_a_thread_that_ends_with_it():
    """A thread that ran torch ops keeps an OpenMP pool while it lives, which slows a system
    stepping on another thread (own_thread.py): the bench's work must not outlive its run."""
    ran_on = []

    def work():
        ran_on.append(threading.current_thread())
        return 7

    assert on_own_thread(work) == 7
    assert ran_on[0] is not threading.current_thread() and not ran_on[0].is_alive()
    with pytest.raises(ValueError, match="bad"):
        on_own_thread(lambda: int("bad"))


def test_hf_seq_on_fewer_requests_is_extrapolated_and_the_report_names_every_system(chat_model_dir, capfd):
    """`bench --quick` runs hf-seq on 2 requests and extrapolates the rest; the table says
    what each system is; transformers' own warnings (EOS off, on purpose) stay out."""
    options = BenchOptions(model=str(chat_model_dir), num_chats=4, min_output=3, max_output=6,
                           dtype="float32", threads=1, engine_threads=1, scenarios=False,
                           systems=("paged-chat", "hf-seq", "hf-cb"), hf_seq_requests=2)
    report = run_bench(options, log=lambda line: None)
    systems = {s["system"]: s for s in report["systems"]}
    seq = systems["hf-seq"]
    assert seq["measured_requests"] == 2 and seq["output_tokens"] == report["workload"]["output_tokens"]
    assert seq["wall_s"] > seq["measured_wall_s"] > 0 and seq["p90_ttft_s"] >= seq["mean_ttft_s"] > 0
    assert systems["paged-chat"]["same_tokens_as_hf_seq"] == 1.0  # over the 2 run
    text = format_report(report)
    assert "hf-seq: transformers generate, one request at a time" in text
    assert "2 requests run in" in text and "the others extrapolated" in text
    assert "hf-cb: transformers' own continuous batching" in text
    assert "paged-chat: this engine" in text
    captured = capfd.readouterr()
    assert "ContinuousBatchingLogger" not in captured.out + captured.err
