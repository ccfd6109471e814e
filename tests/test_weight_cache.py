"""The load path: weights streamed into the decoder, the converted-weights cache for GGUF
files (second start, corrupt and stale entries, the size bound), the progress hook, and
the tokenizer cache key."""

from __future__ import annotations

import gc
import os
import weakref
from pathlib import Path

import pytest
import torch
from tiny_models import SYSTEM_CHATML, tiny_gguf

from paged_chat.engine import Engine, EngineConfig
from paged_chat.engine.models.file_digest import HASHING_STAGE
from paged_chat.engine.models.loader import load_model, load_model_source
from paged_chat.engine.models.weight_cache import list_cached_weights

GIB = 1 << 30


class Progress:
    """Records what an on_progress hook hears."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, int, int]] = []

    def __call__(self, stage: str, done: int, total: int) -> None:
        self.calls.append((stage, done, total))

    def stages(self) -> list[str]:
        return list(dict.fromkeys(stage for stage, _, _ in self.calls))


def load(source, cache_dir: Path | None, dtype=torch.float32, cache_bytes: int = GIB):
    progress = Progress()
    model = load_model(source, dtype, torch.device("cpu"), cache_dir, cache_bytes, progress)
    return model, progress


def parameters(model) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def assert_same_parameters(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


def test_second_load_reads_the_converted_weights(tmp_path: Path) -> None:
    path, _, _ = tiny_gguf(tmp_path)
    cache = tmp_path / "cache"
    source = load_model_source(str(path), cache_dir=cache)
    first, progress = load(source, cache)
    assert progress.stages() == [HASHING_STAGE, "converting weights"]
    stage, done, total = progress.calls[-1]
    assert done == total == len(source.checkpoint.tensors)
    [entry] = list_cached_weights(cache / "weights")
    assert entry.source == str(path) and entry.dtype == "F32"

    second, progress = load(source, cache)
    assert progress.stages() == ["loading cached weights"]
    assert_same_parameters(parameters(first), parameters(second))


@pytest.mark.parametrize("damage", ["flip a byte", "truncate", "garbage header"])
def test_corrupt_entry_is_rebuilt_never_trusted(tmp_path: Path, damage: str) -> None:
    path, _, _ = tiny_gguf(tmp_path)
    cache = tmp_path / "cache"
    source = load_model_source(str(path), cache_dir=cache)
    expected = parameters(load(source, cache)[0])
    [entry] = list_cached_weights(cache / "weights")
    data = bytearray(entry.path.read_bytes())
    if damage == "flip a byte":
        data[-5] ^= 0x40
    elif damage == "truncate":
        data = data[:len(data) // 2]
    else:
        data[8:40] = b"\xff" * 32
    entry.path.write_bytes(bytes(data))

    rebuilt, progress = load(source, cache)
    assert "converting weights" in progress.stages()
    assert_same_parameters(expected, parameters(rebuilt))
    assert load(source, cache)[1].stages() == ["loading cached weights"]


def test_dtype_is_part_of_the_key(tmp_path: Path) -> None:
    path, _, _ = tiny_gguf(tmp_path)
    cache = tmp_path / "cache"
    source = load_model_source(str(path), cache_dir=cache)
    load(source, cache, torch.float32)
    model, progress = load(source, cache, torch.bfloat16)
    assert progress.stages() == ["converting weights"]
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    assert sorted(e.dtype for e in list_cached_weights(cache / "weights")) == ["BF16", "F32"]


def test_edited_gguf_is_a_new_entry(tmp_path: Path) -> None:
    path, _, _ = tiny_gguf(tmp_path)
    cache = tmp_path / "cache"
    load(load_model_source(str(path), cache_dir=cache), cache)
    edited, _, _ = tiny_gguf(tmp_path / "edited", extra=lambda w: w.add_string("general.name", "x"))
    edited.replace(path)
    _, progress = load(load_model_source(str(path), cache_dir=cache), cache)
    assert progress.stages() == [HASHING_STAGE, "converting weights"]


def test_size_bound_evicts_the_least_recently_used(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    sources = []
    for name in ("a", "b"):
        path, _, _ = tiny_gguf(tmp_path / name, extra=lambda w, n=name: w.add_string("general.name", n))
        sources.append(load_model_source(str(path), cache_dir=cache))
    load(sources[0], cache)
    [first] = list_cached_weights(cache / "weights")
    load(sources[1], cache, cache_bytes=first.size * 3 // 2)
    [entry] = list_cached_weights(cache / "weights")
    assert entry.source == str(sources[1].path)
    # An entry larger than the whole bound is never written.
    load(sources[0], cache, cache_bytes=1024)
    assert [e.source for e in list_cached_weights(cache / "weights")] == [str(sources[1].path)]


def test_without_a_cache_dir_nothing_is_written(tmp_path: Path) -> None:
    path, _, _ = tiny_gguf(tmp_path)
    source = load_model_source(str(path))
    _, progress = load(source, None)
    assert progress.stages() == ["loading weights"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf", path.name]


def test_engine_reports_progress_and_keeps_no_checkpoint(tmp_path: Path) -> None:
    path, _, _ = tiny_gguf(tmp_path)
    config = EngineConfig(model=str(path), device="cpu", dtype="float32", num_blocks=8,
                          cache_dir=str(tmp_path / "cache"))
    source = load_model_source(str(path), cache_dir=config.cache_dir)
    checkpoint = weakref.ref(source.checkpoint)
    progress = Progress()
    engine = Engine(config, source=source, on_progress=progress)
    del source
    gc.collect()
    assert checkpoint() is None, "the engine keeps the checkpoint (and its file) alive"
    assert "converting weights" in progress.stages()
    stage, done, total = progress.calls[-1]
    assert done == total
    assert engine.generate([[3, 4, 5]])[0].finished

    progress = Progress()
    Engine(config, on_progress=progress)
    assert progress.stages()[-1] == "loading cached weights"


def test_template_edited_in_place_is_not_served_from_a_stale_tokenizer(tmp_path: Path) -> None:
    """The old key hashed the size and the first and last MiB: a template in the middle of
    a header, edited to the same length, kept the stale tokenizer."""
    def padding(where: str):
        # 1.2 MB of metadata on each side of the template
        return lambda writer: writer.add_string(f"test.padding_{where}", "x" * 1_200_000)

    path, _, _ = tiny_gguf(tmp_path, extra=padding("before"), after=padding("after"))
    cache = tmp_path / "cache"
    assert load_model_source(str(path), cache_dir=cache).chat_template == SYSTEM_CHATML
    edited = SYSTEM_CHATML.replace("Be brief.", "Be funny.")
    assert len(edited) == len(SYSTEM_CHATML)
    data = path.read_bytes()
    assert data.count(SYSTEM_CHATML.encode()) == 1
    path.write_bytes(data.replace(SYSTEM_CHATML.encode(), edited.encode()))
    assert load_model_source(str(path), cache_dir=cache).chat_template == edited


def test_an_unwritable_cache_costs_the_cache_not_the_load(tmp_path: Path) -> None:
    path, _, _ = tiny_gguf(tmp_path)
    source = load_model_source(str(path))
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "weights").write_text("a file where the entries' folder should be")
    model, progress = load(source, cache)
    assert progress.stages() == [HASHING_STAGE, "converting weights"]
    assert_same_parameters(parameters(model), parameters(load(source, None)[0]))


def overwrite_tensor_data(path: Path, source) -> None:
    """Zeros (finite in every tensor format) over the middle of the file's tensor data:
    header and size unchanged."""
    data_start = min(t.offset for t in source.checkpoint.tensors.values())
    size = path.stat().st_size
    middle = (data_start + size) // 2
    length = (size - data_start) // 4
    with open(path, "r+b") as file:
        file.seek(middle - length // 2)
        file.write(bytes(length))


def test_a_file_changed_in_its_data_alone_is_not_served_stale_weights(tmp_path: Path) -> None:
    """The old key hashed the header and the data's size: a GGUF whose tensor data was
    overwritten in place (two fine-tunes with equal metadata) loaded the old weights."""
    path, _, _ = tiny_gguf(tmp_path)
    cache = tmp_path / "cache"
    source = load_model_source(str(path), cache_dir=cache)
    old = parameters(load(source, cache)[0])
    overwrite_tensor_data(path, source)

    changed, progress = load(load_model_source(str(path), cache_dir=cache), cache)
    assert "converting weights" in progress.stages()
    fresh = parameters(load(load_model_source(str(path)), None)[0])
    assert_same_parameters(fresh, parameters(changed))
    assert any(not torch.equal(old[name], fresh[name]) for name in old)


def test_an_unchanged_file_is_hashed_once(tmp_path: Path) -> None:
    path, _, _ = tiny_gguf(tmp_path)
    cache = tmp_path / "cache"
    source = load_model_source(str(path), cache_dir=cache)
    assert load(source, cache)[1].stages() == [HASHING_STAGE, "converting weights"]
    assert load(source, cache)[1].stages() == ["loading cached weights"]
    # touched (a new mtime), the same bytes: hashed again, the same entry
    os.utime(path, ns=(path.stat().st_atime_ns, path.stat().st_mtime_ns + 10**9))
    assert load(source, cache)[1].stages() == [HASHING_STAGE, "loading cached weights"]
    assert load(source, cache)[1].stages() == ["loading cached weights"]
