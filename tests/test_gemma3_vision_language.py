"""Gemma 3 vision-language folders (4B, 12B, 27B) run as their text decoder, exact against
transformers' Gemma3ForConditionalGeneration on the same files and a text-only prompt."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny_models import (
    SYSTEM_CHATML,
    TINY,
    build_tiny_model,
    greedy_reference,
    run_paged,
    tiny_tokenizer,
)
from transformers import Gemma3ForConditionalGeneration

from paged_chat.engine.core.errors import ModelLoadError, UnsupportedModelError
from paged_chat.engine.models.loader import load_model, load_model_source

WINDOW = 7  # not a multiple of tiny_models.PAGED_BLOCK_SIZE
# Global layers scale RoPE linearly by 8 as the 4B/12B/27B do; a query scale that is not
# head_dim's, as the 27B's.
GLOBAL_ROPE = {"rope_type": "linear", "factor": 8.0, "rope_theta": 1_000_000.0}
TEXT = dict(num_layers=6, sliding_window=WINDOW, query_pre_attn_scalar=24,
            rope_parameters={"full_attention": GLOBAL_ROPE,
                             "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}})
VISION_PREFIXES = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.",
                   "model.multi_modal_projector.")


def vision_language_folder(folder: Path, tied: bool) -> None:
    """A tiny random Gemma3ForConditionalGeneration as transformers saves it, with a tokenizer
    that carries a chat template."""
    build_tiny_model("gemma3", folder, **TINY, **TEXT, tie_word_embeddings=tied)
    tokenizer = tiny_tokenizer()
    tokenizer.chat_template = SYSTEM_CHATML
    tokenizer.save_pretrained(folder)


def rename_to_module_names(folder: Path) -> None:
    """Store the tensors under the model's own module names (`model.language_model.*`,
    `model.vision_tower.*`, `lm_head.*`) instead of the names transformers saves."""
    renames = (("language_model.model.", "model.language_model."),
               ("language_model.lm_head.", "lm_head."), ("vision_tower.", "model.vision_tower."),
               ("multi_modal_projector.", "model.multi_modal_projector."))
    tensors = load_file(folder / "model.safetensors")
    renamed = {}
    for name, tensor in tensors.items():
        prefix, ours = next((p, o) for p, o in renames if name.startswith(p))
        renamed[ours + name.removeprefix(prefix)] = tensor
    save_file(renamed, folder / "model.safetensors", metadata={"format": "pt"})


def write_transformers4_config(folder: Path, tied: bool) -> None:
    """config.json as transformers 4.x writes it for Google's checkpoints: `text_config`
    without the values equal to Gemma3TextConfig's defaults (token ids, eps, RoPE bases,
    the layer pattern), RoPE scaling under its 4.x key, the end-of-turn id at the top; and
    Google's generation_config.json."""
    saved = json.loads((folder / "config.json").read_text())
    text = {key: saved["text_config"][key] for key in (
        "model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
        "num_attention_heads", "num_key_value_heads", "head_dim", "query_pre_attn_scalar",
        "sliding_window")}
    text["rope_scaling"] = {"factor": 8.0, "rope_type": "linear"}
    untied = {} if tied else {"tie_word_embeddings": False}
    config = {key: saved[key] for key in (
        "architectures", "model_type", "vision_config", "mm_tokens_per_image", "boi_token_index",
        "eoi_token_index", "image_token_index")}
    config |= {"text_config": text | untied, "eos_token_id": [1, 106]} | untied
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": 2, "eos_token_id": [1, 106], "pad_token_id": 0}))


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("layout", ["as saved", "module names, transformers 4 config"])
def test_text_decoder_runs_like_transformers_and_vision_is_never_read(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, layout: str, tied: bool) -> None:
    vision_language_folder(tmp_path, tied)
    if layout != "as saved":
        rename_to_module_names(tmp_path)
        write_transformers4_config(tmp_path, tied)
    reference = Gemma3ForConditionalGeneration.from_pretrained(tmp_path).eval()

    with pytest.warns(UserWarning, match="vision-language model: paged-chat runs its text "
                                         "decoder only, images are not supported"):
        src = load_model_source(str(tmp_path))
    decoder_names = {name.replace("model.language_model.", "model.")
                     for name in reference.state_dict()
                     if name.startswith("model.language_model.") or (
                         name == "lm_head.weight" and not tied)}
    assert set(src.checkpoint.tensors) == decoder_names
    c = src.config
    assert (c.model_type, src.hf_config["model_type"], c.tie_word_embeddings) == (
        "gemma3_text", "gemma3_text", tied)
    assert c.layer_windows == (WINDOW,) * 5 + (None,)
    assert (c.rope_theta, c.local_rope_theta, c.attention_scale) == (1e6, 1e4, 24 ** -0.5)
    assert c.rope_scaling["rope_type"] == "linear" and c.rope_scaling["factor"] == 8.0
    assert src.chat_template == SYSTEM_CHATML
    if layout != "as saved":  # Gemma 3's own: <eos>, and <end_of_turn> from the top level
        assert (c.bos_token_id, c.eos_token_ids) == (2, (1, 106))

    read = []
    read_into = src.checkpoint.read_into
    monkeypatch.setattr(src.checkpoint, "read_into",
                        lambda name, out: read.append(name) or read_into(name, out))
    model = load_model(src, torch.float32, torch.device("cpu"))
    assert sorted(read) == sorted(decoder_names - ({"lm_head.weight"} if tied else set()))
    assert not any(name.startswith(VISION_PREFIXES) for name in read)

    model.build_rope_tables(64)
    prompt = torch.randint(3, c.vocab_size, (30,), generator=torch.Generator().manual_seed(6))
    expected, reference_logits = greedy_reference(reference, prompt, steps=16)
    ours = run_paged(model, expected, [prompt[:10], prompt[10:23], prompt[23:]])
    scale = reference_logits.abs().max()
    assert (ours - reference_logits[:-1]).abs().max() / scale < 1e-4
    assert torch.equal(ours[len(prompt) - 1:].argmax(-1), expected[len(prompt):])


# The text_config of Google's gemma-3-{4b,12b,27b}-it config.json: every other value is
# Gemma3TextConfig's default.
GOOGLE_TEXT_CONFIGS = {
    "4b": dict(hidden_size=2560, intermediate_size=10240, num_hidden_layers=34),
    "12b": dict(hidden_size=3840, intermediate_size=15360, num_attention_heads=16,
                num_hidden_layers=48, num_key_value_heads=8),
    "27b": dict(head_dim=128, hidden_size=5376, intermediate_size=21504, num_attention_heads=32,
                num_hidden_layers=62, num_key_value_heads=16, query_pre_attn_scalar=168),
}


@pytest.mark.parametrize("size", GOOGLE_TEXT_CONFIGS)
def test_google_configs_read_as_transformers_reads_them(size: str) -> None:
    from transformers import Gemma3Config

    from paged_chat.engine.models.model_config import ModelConfig

    text = GOOGLE_TEXT_CONFIGS[size] | {
        "model_type": "gemma3_text", "sliding_window": 1024,
        "rope_scaling": {"factor": 8.0, "rope_type": "linear"}}
    hf = {"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
          "eos_token_id": [1, 106], "text_config": text,
          "vision_config": {"model_type": "siglip_vision_model"}}
    ours = ModelConfig.from_hf(hf)
    theirs = Gemma3Config(**hf).text_config
    rope = theirs.rope_parameters
    assert (ours.vocab_size, ours.hidden_size, ours.intermediate_size, ours.num_layers,
            ours.num_heads, ours.num_kv_heads, ours.head_dim, ours.rms_norm_eps,
            ours.max_position_embeddings, ours.tie_word_embeddings, ours.bos_token_id) == (
        theirs.vocab_size, theirs.hidden_size, theirs.intermediate_size,
        theirs.num_hidden_layers, theirs.num_attention_heads, theirs.num_key_value_heads,
        theirs.head_dim, theirs.rms_norm_eps, theirs.max_position_embeddings,
        theirs.tie_word_embeddings, theirs.bos_token_id)
    assert ours.attention_scale == theirs.query_pre_attn_scalar ** -0.5
    assert ours.layer_windows == tuple(theirs.sliding_window if kind == "sliding_attention"
                                       else None for kind in theirs.layer_types)
    assert (ours.rope_theta, ours.rope_scaling["factor"], ours.local_rope_theta) == (
        rope["full_attention"]["rope_theta"], rope["full_attention"]["factor"],
        rope["sliding_attention"]["rope_theta"])
    assert ours.eos_token_ids == (1, 106)


def test_vision_language_config_without_text_config_is_one_line(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(
        {"model_type": "gemma3", "architectures": ["Gemma3ForConditionalGeneration"]}))
    with pytest.raises(ModelLoadError, match="lacks text_config") as info:
        load_model_source(str(tmp_path))
    assert "\n" not in str(info.value)


def test_other_vision_language_models_are_refused_in_one_line(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(
        {"model_type": "paligemma", "architectures": ["PaliGemmaForConditionalGeneration"],
         "text_config": {"model_type": "gemma2"}}))
    with pytest.raises(UnsupportedModelError, match="'paligemma' is not supported") as info:
        load_model_source(str(tmp_path))
    assert "\n" not in str(info.value)


def test_models_list_shows_a_vision_language_folder_as_text_only(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from huggingface_hub import constants as hub_constants

    from paged_chat.app.catalog import find_models

    snapshot = tmp_path / "hub" / "models--org--gemma-3-tiny-it" / "snapshots" / ("0" * 40)
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text(json.dumps({"model_type": "gemma3"}))
    (snapshot / "model.safetensors").write_bytes(b"\0" * 16)
    monkeypatch.setattr(hub_constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    entries = {entry.name: entry for entry in find_models(tmp_path / "cache")[0]}
    assert entries["org/gemma-3-tiny-it"].status == "ready (text only)"
