"""Hostile and broken model files: refused at once, with one line naming the file and the
key, before anything is allocated or looped on from the numbers they claim.

The hostile GGUFs are built here with the `gguf` writer (then one count patched where the
writer cannot lie); each load runs in a subprocess under a memory limit and a timeout, so
a regression shows up as a failure, not as a machine out of memory.
"""

from __future__ import annotations

import errno
import json
import os
import queue
import struct
import subprocess
import sys
import tempfile
import threading
import time
import types
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from helpers import REPO
from tiny_models import hf_folder, tiny_gguf

from paged_chat.engine.core.errors import ModelLoadError, PagedChatError
from paged_chat.engine.models.loader import load_model_source

MEMORY_LIMIT = 6 << 30  # address space: torch's own mappings fit, a hostile allocation not
TIMEOUT_S = 60

# One loader process serves the module's loads (its imports take seconds; a load of these
# files, a fraction of one): a path per line in, one line of verdict out per path.
_LOADER_UNDER_LIMIT = """
import gc, resource, sys
resource.setrlimit(resource.RLIMIT_AS, ({limit}, {limit}))
from paged_chat.engine import Engine, EngineConfig
from paged_chat.engine.core.errors import PagedChatError
for line in sys.stdin:
    try:
        engine = Engine(EngineConfig(model=line.rstrip("\\n"), device="cpu", dtype="float32",
                                     kv_cache_memory="1MiB"))
    except PagedChatError as error:
        print("REFUSED", error, flush=True)
    else:
        print("LOADED", engine.max_model_len, engine.runner.model.rope_cos.shape[0], flush=True)
        del engine
        gc.collect()
"""


class LoaderUnderLimit:
    """A process that builds an engine on each path it is sent, under MEMORY_LIMIT; started
    again after a load that killed it or ran past TIMEOUT_S."""

    def __init__(self) -> None:
        self.process: subprocess.Popen | None = None
        self.lines: queue.Queue[str] = queue.Queue()   # its stdout, read on a thread
        self.errors = None   # its stderr, in a file: never a full pipe that blocks it

    def _start(self) -> None:
        env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
        self.errors = tempfile.TemporaryFile("w+")
        self.process = subprocess.Popen(
            [sys.executable, "-c", _LOADER_UNDER_LIMIT.format(limit=MEMORY_LIMIT)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.errors, text=True, env=env)
        self.lines = queue.Queue()
        threading.Thread(target=self._read, args=(self.process.stdout, self.lines), daemon=True).start()

    @staticmethod
    def _read(stdout, lines: queue.Queue) -> None:
        for line in stdout:
            lines.put(line)
        lines.put("")   # it exited

    def load(self, path: Path) -> str:
        """Build an engine on `path`; the loader's one line about it (no newline in the path)."""
        if self.process is None or self.process.poll() is not None:
            self._start()
        self.process.stdin.write(f"{path}\n")
        self.process.stdin.flush()
        deadline = time.monotonic() + TIMEOUT_S
        line = "printed by the load, not its verdict"
        try:
            while line and not line.startswith(("REFUSED", "LOADED")):
                line = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            line = None
        if not line:
            self.process.kill()
            self.process.wait()
            self.errors.seek(0)
            pytest.fail(f"the load of {path} {'hung' if line is None else 'died'}: "
                        f"{self.errors.read()[-2000:]}")
        return line.strip()

    def close(self) -> None:
        if self.process is not None:
            self.process.stdin.close()
            self.process.wait(30)
            self.errors.close()


@pytest.fixture(scope="module")
def loader() -> LoaderUnderLimit:
    shared = LoaderUnderLimit()
    yield shared
    shared.close()


def minimal_gguf(path: Path, build) -> Path:
    writer = gguf.GGUFWriter(path, "llama")
    build(writer)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_metadata_array_claiming_2_to_the_40_items_is_refused_at_once(tmp_path: Path, loader) -> None:
    """A 133-byte file whose array claims 2^40 items hung `ask -m` and `paged-chat models`."""
    path = _hostile_array_gguf(tmp_path / "array.gguf")
    assert len(path.read_bytes()) < 200
    line = loader.load(path)
    assert line.startswith("REFUSED") and "not a readable GGUF file" in line
    assert "array of 1099511627776 items" in line


def test_tensor_claiming_more_bytes_than_the_file_holds_is_refused(tmp_path: Path, loader) -> None:
    path = minimal_gguf(tmp_path / "tensor.gguf", lambda w: w.add_tensor(
        "token_embd.weight", np.zeros((4, 32), dtype=np.float32)))
    data = path.read_bytes()
    dims = struct.pack("<IQQ", 2, 32, 4)
    assert data.count(dims) == 1
    path.write_bytes(data.replace(dims, struct.pack("<IQQ", 2, 32, 1 << 40)))
    line = loader.load(path)
    assert line.startswith("REFUSED") and "past the end" in line


@pytest.mark.parametrize("key, value, named", [
    ("block_count", 2**32 - 1, "num_hidden_layers=4294967295"),
    ("attention.head_count", 0, "num_attention_heads=0"),
])
def test_gguf_header_numbers_out_of_bounds_are_refused(tmp_path: Path, loader, key: str,
                                                        value: int, named: str) -> None:
    path, _, _ = tiny_gguf(tmp_path, tokenizer=False)
    data = path.read_bytes()
    old = _u32_field(f"llama.{key}", _read_u32(data, f"llama.{key}"))
    assert data.count(old) == 1
    path.write_bytes(data.replace(old, _u32_field(f"llama.{key}", value)))
    line = loader.load(path)
    assert line.startswith("REFUSED") and str(path) in line and named in line


def test_rope_tables_are_sized_from_the_effective_max_model_len(tmp_path: Path, loader) -> None:
    """context_length 2^31 sized the RoPE tables (tens of GB) before the pool capped
    max_model_len; they follow the engine's max_model_len now."""
    path, _, _ = tiny_gguf(tmp_path)
    data = path.read_bytes()
    old = _u32_field("llama.context_length", _read_u32(data, "llama.context_length"))
    path.write_bytes(data.replace(old, _u32_field("llama.context_length", 2**31)))
    verdict, max_model_len, table = loader.load(path).split()
    assert verdict == "LOADED" and int(table) == int(max_model_len) < 2**20


def _u32_field(key: str, value: int) -> bytes:
    encoded = key.encode()
    return struct.pack("<Q", len(encoded)) + encoded + struct.pack(
        "<II", gguf.GGUFValueType.UINT32, value)


def _read_u32(data: bytes, key: str) -> int:
    encoded = key.encode()
    start = data.index(struct.pack("<Q", len(encoded)) + encoded) + 8 + len(encoded)
    value_type, value = struct.unpack_from("<II", data, start)
    assert value_type == gguf.GGUFValueType.UINT32
    return value


# ---------------------------------------------------------------- HF folders

@pytest.mark.parametrize("file, content, named", [
    ("config.json", [1, 2, 3], "config.json holds list, not a JSON object"),
    ("config.json", None, "config.json holds NoneType, not a JSON object"),
    ("model.safetensors.index.json", [], "model.safetensors.index.json holds list"),
])
def test_model_folder_json_of_the_wrong_shape(tmp_path: Path, file: str, content: object,
                                              named: str) -> None:
    hf_folder(tmp_path, "llama")
    (tmp_path / file).write_text(json.dumps(content))
    with pytest.raises(ModelLoadError, match=named) as info:
        load_model_source(str(tmp_path))
    assert "\n" not in str(info.value) and str(tmp_path) in str(info.value)


@pytest.mark.parametrize("key, value", [
    ("num_attention_heads", 0), ("num_key_value_heads", 0), ("max_position_embeddings", -5),
    ("max_position_embeddings", 0), ("max_position_embeddings", 10**12),
    ("num_hidden_layers", 10**9), ("hidden_size", "64"), ("rms_norm_eps", "tiny"),
    ("num_attention_heads", 3),
])
def test_model_folder_config_numbers_name_the_file_and_key(tmp_path: Path, key: str,
                                                           value: object) -> None:
    hf_folder(tmp_path, "llama")
    config_file = tmp_path / "config.json"
    config_file.write_text(json.dumps(json.loads(config_file.read_text()) | {key: value}))
    with pytest.raises(ModelLoadError, match=f"{config_file}: {key}=") as info:
        load_model_source(str(tmp_path))
    assert "\n" not in str(info.value)


# ---------------------------------------------------------------- memory at start-up

def test_cpu_allocation_failure_is_one_line_naming_the_setting(make_engine, monkeypatch):
    """torch's CPU allocator fails with a RuntimeError, which the OOM handler missed; the KV
    pool's mapping fails with ENOMEM."""
    def cpu_out_of_memory(*args, **kwargs):
        raise RuntimeError("[enforce fail at alloc_cpu.cpp:117] data. DefaultCPUAllocator: "
                           "can't allocate memory: you tried to allocate 1073741824 bytes.")

    with monkeypatch.context() as patch:
        patch.setattr("paged_chat.engine.worker.model_loading.load_model", cpu_out_of_memory)
        with pytest.raises(PagedChatError, match="out of memory while loading the weights"):
            make_engine(num_blocks=64)

    def refused(*args, **kwargs):
        raise OSError(errno.ENOMEM, os.strerror(errno.ENOMEM))

    monkeypatch.setattr("paged_chat.engine.kv.pool_sizing.mmap",
                        types.SimpleNamespace(mmap=refused))
    with pytest.raises(PagedChatError, match="out of memory while allocating the KV cache.*"
                                             "lower num_blocks"):
        make_engine(num_blocks=64)


def test_the_cpu_kv_cache_is_checked_against_available_ram(make_engine, monkeypatch):
    monkeypatch.setattr("paged_chat.engine.kv.pool_sizing.available_ram", lambda: 1 << 16)
    with pytest.raises(PagedChatError, match="larger than this machine's 0.0 GiB of available "
                                             "RAM: lower num_blocks"):
        make_engine(num_blocks=64)


# ---------------------------------------------------------------- paged-chat models

def test_models_marks_a_hostile_gguf_unreadable_and_lists_converted_weights(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import huggingface_hub.constants

    from paged_chat.app.catalog import find_models
    from paged_chat.engine.models.loader import load_model

    snapshot = tmp_path / "hub" / "models--org--bad" / "snapshots" / "abc"
    snapshot.mkdir(parents=True)
    hostile = _hostile_array_gguf(snapshot / "bad.gguf")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    path, _, _ = tiny_gguf(tmp_path / "tiny")
    cache = tmp_path / "cache"
    load_model(load_model_source(str(path), cache_dir=cache), torch.bfloat16,
               torch.device("cpu"), cache, 1 << 30)

    entries = {entry.name: entry for entry in find_models(cache)[0]}
    assert entries[str(hostile)].architecture == "unreadable"
    converted = entries[str(path)]
    assert (converted.kind, converted.architecture) == ("converted", "llama")
    assert converted.status.startswith("converted, last used ")


def _hostile_array_gguf(path: Path) -> Path:
    """A GGUF whose metadata array claims 2^40 items in a file of under 200 bytes."""
    minimal_gguf(path, lambda w: w.add_array("test.items", [1, 2, 3]))
    data = path.read_bytes()
    count = struct.pack("<IIQ", gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.INT32, 3)
    assert data.count(count) == 1
    path.write_bytes(data.replace(count, count[:8] + struct.pack("<Q", 1 << 40)))
    return path
