"""A warm start (the TUI restarted: the GGUF's tokenizer and weights converted and cached)
does only what serving needs: no import that a cached GGUF does not use, no memory written
before a request writes it; and the bare command launches the engine child before it loads
Textual, so the two overlap (benchmarks/warm_start_probe.py times it)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest
import torch
from helpers import REPO, engine_config, wait_for
from tmux_app import TmuxApp, needs_tmux, tmux

from paged_chat.engine import ClientSpec, Engine, EngineConfig, SamplingParams, start_client
from paged_chat.engine.attention.torch_backend import TorchAttention
from paged_chat.engine.core.errors import describe_error
from paged_chat.engine.kv.pool_sizing import KVCacheSpec, allocate_kv_cache

# What a warm start of a cached GGUF once imported and never used: sympy (torch's symbolic
# shapes, pulled in by `to_empty` on meta tensors) and AutoTokenizer's mappings of every
# model (for a tokenizer whose class is on file).
NOT_NEEDED = ("sympy", "transformers.models.auto.tokenization_auto")


def test_a_warm_start_imports_nothing_a_cached_gguf_does_not_use(smollm2_source):
    cache_dir = os.environ["PAGED_CHAT_CACHE_DIR"]   # the fixture's converted tokenizer is there
    config = {"model": "smollm2-135m", "device": "cpu", "num_blocks": 64, "cache_dir": cache_dir}
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    cold = Engine(EngineConfig(**config))   # converts and caches the weights if no test has yet
    code = textwrap.dedent(f"""
        import json, sys
        from paged_chat.engine import ClientSpec, Engine, EngineConfig, SamplingParams, start_client
        engine = Engine(EngineConfig(**{config!r}))
        imported = sorted(set({NOT_NEEDED!r}) & set(sys.modules))
        output = engine.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
        print(json.dumps([imported, output[0].token_ids]))
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=600, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert done.returncode == 0, done.stderr
    imported, tokens = json.loads(done.stdout.strip().splitlines()[-1])
    assert imported == []
    assert tokens == cold.generate([[1, 2, 3]], params)[0].token_ids   # as the engine built cold


def _maps_tokenizers(pid: int) -> bool:
    """Whether process `pid` has loaded the tokenizers library (any tokenizer loads it)."""
    with open(f"/proc/{pid}/maps") as maps:
        return "/tokenizers/" in maps.read()


async def test_a_warm_engine_child_leaves_the_tokenizer_to_its_app(smollm2_source):
    """On a warm start the child names the saved tokenizer and the app loads it (the child
    imports torch and loads the weights meanwhile): the child loads none until a text
    prompt needs one, and the app's is the model's, template and all."""
    config = EngineConfig(model="smollm2-135m", device="cpu", num_blocks=64,
                          cache_dir=os.environ["PAGED_CHAT_CACHE_DIR"])
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    client = start_client(ClientSpec("process", config)).result()
    try:
        pid = client.transport.pid
        assert client.info.chat_template == smollm2_source.chat_template
        text = "The capital of France is"
        ids = smollm2_source.tokenizer.encode(text)
        assert client.info.tokenizer.encode(text) == ids
        from_ids = [out async for out in client.stream(ids, params)]
        assert not _maps_tokenizers(pid), "the child loaded a tokenizer no request needed"
        from_text = [out async for out in client.stream(text, params)]   # the child's own, now
        assert _maps_tokenizers(pid)
        assert ([t for out in from_text for t in out.new_token_ids]
                == [t for out in from_ids for t in out.new_token_ids])
    finally:
        client.shutdown()


def _resident_bytes() -> int:
    with open("/proc/self/status") as status:
        line = next(line for line in status if line.startswith("VmRSS:"))
    return int(line.split()[1]) * 1024


def test_the_cpu_kv_pool_is_not_written_before_use():
    """The pool reads as zeros everywhere (the kernels' never-written slots included), yet
    costs no resident memory until blocks are written."""
    spec = KVCacheSpec(num_layers=4, block_size=16, attention=TorchAttention(4, 2, 64, scale=0.125),
                       dtype=torch.float32, device=torch.device("cpu"))
    num_blocks = (256 << 20) // spec.bytes_per_block
    before = _resident_bytes()
    pool = allocate_kv_cache(spec, num_blocks, EngineConfig(num_blocks=num_blocks))
    assert _resident_bytes() - before < 32 << 20      # torch.zeros would write all 256 MiB
    assert pool.shape == spec.shape(num_blocks + 1) and pool.dtype == torch.float32
    assert pool.is_contiguous() and pool.data_ptr() % 64 == 0
    assert not pool.any()
    pool[:, :, :, 7] = 1.5                           # writable in place, block by block
    assert pool[:, :, :, 7].eq(1.5).all() and not pool[:, :, :, 8].any()


# The real CLI, with what it does noted in order: the engine child's launch, and the first
# import of Textual. (Only as __main__: a spawned child imports this file again.)
NOTING_CLI = """
import multiprocessing.process, sys
if __name__ == "__main__":
    notes = open(sys.argv.pop(1), "a", buffering=1)

    class NoteTextual:
        def find_spec(self, name, path=None, target=None):
            if name == "textual":
                notes.write("textual imported\\n")
            return None

    sys.meta_path.insert(0, NoteTextual())
    start = multiprocessing.process.BaseProcess.start

    def noted_start(process):
        if process.name == "paged-chat-engine":
            notes.write("engine launched\\n")
        start(process)

    multiprocessing.process.BaseProcess.start = noted_start
    from paged_chat.cli.main import main
    main()
"""


def _children(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as children:
        return [int(child) for child in children.read().split()]


def _exited(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] == "Z"   # a zombie nobody reaps
    except FileNotFoundError:
        return True


@pytest.mark.timeout(600)
@needs_tmux
def test_the_tui_launches_its_engine_before_it_imports_textual(chat_model_dir, tmp_path):
    """Issue 32 item 16: the engine child's imports and load overlap Textual's; launched that
    early it is forked from the CLI (no interpreter of its own to start), and still exits
    once the app is killed."""
    script, notes = tmp_path / "noting_cli.py", tmp_path / "notes"
    script.write_text(NOTING_CLI)
    app = TmuxApp(chat_model_dir, tmp_path, max_tokens=8, size=(160, 50),
                  command=f"{sys.executable} {script} {notes}")
    try:
        app.wait_for(lambda screen: "blocks × 16" in screen)
        assert notes.read_text().splitlines() == ["engine launched", "textual imported"]
        pid = int(tmux(*app.socket, "display-message", "-p", "-t", app.session, "#{pane_pid}"))
        engines = [child for child in _children(pid)
                   if b"resource_tracker" not in open(f"/proc/{child}/cmdline", "rb").read()]
        assert len(engines) == 1, engines
        assert b"spawn_main" not in open(f"/proc/{engines[0]}/cmdline", "rb").read()   # forked
        os.kill(pid, signal.SIGKILL)
        wait_for(lambda: _exited(engines[0]), 60, what="the engine child outlived its app")
    finally:
        app.kill_server()


@pytest.mark.timeout(300)
@needs_tmux
def test_an_engine_launched_early_that_fails_says_why_in_the_status_line(tmp_path):
    """A bad model name: the child launched before the UI fails, and the status line gives
    the engine's own one line, as when the app started the engine itself."""
    with pytest.raises(Exception) as failure:
        Engine(EngineConfig(model="no-such-model"))
    expected = f"✖ model failed to load: {describe_error(failure.value)}"
    # 250 columns: the status line's whole message ends left of the notification over its
    # end (at 160 it shows whole only once that has gone, 30 s later).
    app = TmuxApp("no-such-model", tmp_path, max_tokens=8, size=(250, 50))
    try:
        app.wait_for(lambda screen: expected in screen, 180)
        app.keys("C-q")
        app.wait_for(lambda screen: "✖" not in screen)
    finally:
        app.kill_server()


@pytest.mark.timeout(120)
def test_a_launched_engine_that_nothing_takes_is_ended(chat_model_dir):
    """The app failed before its worker took the engine the CLI launched: cancel() ends the
    child (it would load a model for nobody)."""
    starting = start_client(ClientSpec("process", engine_config(chat_model_dir)))
    pid = starting.launched.pid
    assert pid is not None and not _exited(pid)
    starting.cancel()
    wait_for(lambda: _exited(pid), 30, what="the launched child outlived cancel()")
