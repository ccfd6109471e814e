"""Soak runs on the tiny random llama: small ones in CI, the long one behind `-m soak`.

    PAGED_CHAT_SOAK_S=600 .venv/bin/pytest -m soak tests/test_soak.py -s

runs the 64-chat soak for that many seconds (default 600) and prints its figures.
"""

from __future__ import annotations

import os

import pytest
from soak import SoakReport, run_soak, soak_config

from paged_chat.engine.kv.block_pool import BlockPool

SOAK_S = float(os.environ.get("PAGED_CHAT_SOAK_S", "600"))


def check(report: SoakReport, min_requests: int) -> None:
    print(report.summary())
    assert report.ok, report.summary()
    assert report.requests >= min_requests
    assert report.leaked_blocks == 0
    assert report.aborts > 0 and report.finish_reasons["abort"] == report.aborts
    assert report.preemptions > 0 and report.evictions > 0
    assert report.greedy_checked > 0 and report.greedy_mismatches == 0


@pytest.mark.timeout(600)
def test_small_soak_through_the_engine(tiny_model_dir):
    report = run_soak(soak_config(str(tiny_model_dir)), duration_s=0, num_chats=16, seed=0,
                      verify_greedy=30)
    check(report, min_requests=16 * 3)
    # no starvation: the scheduler is first come first served, so the worst wait is about one
    # pool's worth of replies, far below the length of the run
    assert report.worst_wait_steps < report.steps / 4


@pytest.mark.timeout(600)
def test_small_soak_through_the_async_engine(tiny_model_dir):
    report = run_soak(soak_config(str(tiny_model_dir)), duration_s=0, num_chats=16, seed=1,
                      use_async=True, verify_greedy=30)
    check(report, min_requests=16 * 3)


@pytest.mark.timeout(300)
def test_a_seed_replays_the_same_soak(tiny_model_dir):
    config = soak_config(str(tiny_model_dir))
    first, second = (run_soak(config, duration_s=0, num_chats=6, seed=7, verify_greedy=0)
                     for _ in range(2))
    figures = ("requests", "finish_reasons", "aborts", "aborts_by_state", "preemptions",
               "evictions", "steps", "worst_wait_steps")
    assert [getattr(first, f) for f in figures] == [getattr(second, f) for f in figures]


@pytest.mark.timeout(300)
def test_the_soak_catches_a_leaked_block(tiny_model_dir, monkeypatch):
    """The checks are live: a pool that forgets one freed block fails the soak."""
    free = BlockPool.free
    leaked = []

    def leaky_free(self, blocks):
        if blocks and not leaked:
            leaked.append(blocks[-1])
            blocks = blocks[:-1]
        free(self, blocks)

    monkeypatch.setattr(BlockPool, "free", leaky_free)
    report = run_soak(soak_config(str(tiny_model_dir)), duration_s=0, num_chats=4, seed=0,
                      verify_greedy=0)
    assert not report.ok and report.leaked_blocks == 1
    assert any(f"block {leaked[0].block_id}" in problem for problem in report.problems)


@pytest.mark.soak
@pytest.mark.timeout(SOAK_S + 3600)
def test_long_soak(tiny_model_dir, request):
    if "soak" not in (request.config.getoption("markexpr") or ""):
        pytest.skip("a long soak: select it with -m soak (PAGED_CHAT_SOAK_S sets its length)")
    report = run_soak(soak_config(str(tiny_model_dir)), duration_s=SOAK_S, num_chats=64,
                      seed=0, verify_greedy=300)
    check(report, min_requests=64 * 3)
