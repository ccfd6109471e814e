"""A `paged-chat serve` in the test process: the tiny chat model on a thread client, the API
on a free loopback port, served by uvicorn on a thread of its own (so a test's own event
loop, a Pilot's included, can be a client). Loaded as a pytest plugin (tests/conftest.py)."""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
import pytest
from helpers import engine_config, wait_for

from paged_chat.engine import ClientSpec, EngineConfig, LocalClient, make_client

if TYPE_CHECKING:
    from paged_chat.server import ApiServer


def free_port() -> int:
    """A local TCP port nothing listens on now."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def answers_health(port: int) -> bool:
    """Whether a server on this machine's `port` answers /health with 200."""
    try:
        return httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


@dataclass
class Served:
    client: LocalClient
    server: ApiServer
    thread: threading.Thread

    @property
    def url(self) -> str:
        return self.server.url + "/v1"

    @property
    def model(self) -> str:
        return self.client.info.name

    def stop(self) -> None:
        self.server.stop()
        self.thread.join(30)



@contextmanager
def serving(model_dir: Path, env: dict[str, str] | None = None
            ) -> Iterator[tuple[subprocess.Popen, int]]:
    """`paged-chat serve` on `model_dir` as deployed, in a process of its own, once it answers
    /health: (the process, its port); killed on the way out whatever happened."""
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "paged_chat", "serve", "--model", str(model_dir),
         "--port", str(port)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    try:
        wait_for(lambda: server.poll() is not None or answers_health(port), timeout=180,
                 what="the server to answer /health")
        assert server.poll() is None, server.communicate()[1].decode()
        yield server, port
    finally:
        server.kill()
        server.wait()


def engine_child(server: subprocess.Popen) -> int:
    """The pid of the engine process `server` spawned."""
    [engine] = [int(child) for task in Path(f"/proc/{server.pid}/task").iterdir()
                for child in (task / "children").read_text().split()
                if b"spawn_main" in Path(f"/proc/{child}/cmdline").read_bytes()]
    return engine

def start_server(client: LocalClient, **options) -> Served:
    # Imported here: the server needs fastapi, which the GPU image's tests (tests/gpu) lack.
    from paged_chat.server import ApiServer

    server = ApiServer(client, port=0, **options)
    thread = threading.Thread(target=lambda: asyncio.run(server.serve()), daemon=True)
    thread.start()
    wait_for(lambda: server.started, what="the server to start")
    return Served(client, server, thread)


def chat_engine_config(model_dir, **overrides) -> EngineConfig:
    """engine_config with room for the many streams a server's tests open at once."""
    return engine_config(model_dir, **{"max_num_seqs": 64, "max_num_batched_tokens": 1024, **overrides})


@pytest.fixture(scope="module")
def served(chat_model_dir, new_engine) -> Iterator[Served]:
    """One engine and server for a module's tests; each test must leave no block in use."""
    client = make_client(ClientSpec(engine=new_engine(chat_engine_config(chat_model_dir))))
    running = start_server(client, model_names=[str(chat_model_dir)])
    yield running
    running.stop()
    client.shutdown()


@pytest.fixture
def api(served) -> Iterator[Served]:
    yield served
    wait_for(lambda: served.client.stats().blocks_in_use == 0, what="every block back")


# What `serve` gives requests that omit them, with the default settings (Settings.request_defaults).
CHAT_DEFAULTS = {"temperature": 0.2, "top_p": 0.9, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0}


@pytest.fixture(scope="session")
def default_api(smollm2_source) -> Iterator[Served]:
    """The default model served with `serve`'s request defaults, for the session's tests of
    what real clients (openai, llm) get from it; each test leaves no request running."""
    from paged_chat.engine import Engine

    config = EngineConfig(device="cpu", dtype="float32", num_blocks=512, max_num_seqs=32)
    client = make_client(ClientSpec(engine=Engine(config, source=smollm2_source)))
    running = start_server(client, model_names=["smollm2-135m"], defaults=CHAT_DEFAULTS)
    yield running
    running.stop()
    client.shutdown()
