"""Tiny random models of every supported family, built with transformers and saved as HF
folders or written as GGUF files as llama.cpp writes them; our decoder loaded from such a
folder, and run over a paged KV cache against transformers.

Random models with the default init have nearly flat logits, so greedy near-ties flip on
rounding; a larger `initializer_range` gives them clear preferences.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

import gguf
import numpy as np
import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import GenerationConfig, PreTrainedTokenizerFast

from paged_chat.engine.attention.metadata import AttentionMetadata
from paged_chat.engine.attention.torch_backend import TorchAttention
from paged_chat.engine.models.checkpoint import Checkpoint, SafetensorsFile
from paged_chat.engine.models.llama import LlamaForCausalLM
from paged_chat.engine.models.loader import stream_weights
from paged_chat.engine.models.model_config import ModelConfig

ARCHITECTURES = ("llama", "qwen2", "qwen3", "mistral", "gemma3_text")

_CONFIGS = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
    "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
    "gemma3_text": (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM),
}
# Mistral windows every layer by default: off unless a test asks for a window.
_DEFAULTS = {"mistral": {"sliding_window": None}}
# Vision-language models: the wrapper around a text config of the family above, with a
# SigLIP tower as small as transformers allows (one layer, a 2x2 grid of patches).
VISION_LANGUAGE = {
    "gemma3": (transformers.Gemma3ForConditionalGeneration, "gemma3_text",
               lambda text: transformers.Gemma3Config(
                   text_config=text, mm_tokens_per_image=4,
                   tie_word_embeddings=text.tie_word_embeddings,
                   vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=2, image_size=32, patch_size=16))),
}


def build_tiny_model(architecture: str, folder: Path, *, vocab_size: int = 512,
                     num_heads: int = 6, num_kv_heads: int = 2, head_dim: int = 16,
                     num_layers: int = 2, tie_word_embeddings: bool = False, seed: int = 0,
                     **overrides) -> transformers.PreTrainedModel:
    """Save a tiny random model of `architecture` (or of VISION_LANGUAGE, with the text
    decoder these arguments describe) to `folder` and return it (fp32, eval)."""
    wrapper_cls, architecture, wrap = VISION_LANGUAGE.get(architecture, (None, architecture, None))
    config_cls, model_cls = _CONFIGS[architecture]
    config = config_cls(
        vocab_size=vocab_size, hidden_size=num_heads * head_dim, intermediate_size=96,
        num_hidden_layers=num_layers, num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads, head_dim=head_dim, max_position_embeddings=1024,
        initializer_range=0.25, tie_word_embeddings=tie_word_embeddings, bos_token_id=1,
        eos_token_id=2, pad_token_id=0, **(_DEFAULTS.get(architecture, {}) | overrides))
    if wrapper_cls is not None:
        config, model_cls = wrap(config), wrapper_cls
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder, safe_serialization=True)
    return model


def load_decoder(folder: Path, dtype: torch.dtype = torch.float32,
                 max_positions: int = 1024) -> LlamaForCausalLM:
    """Our decoder with the weights of a folder `build_tiny_model` saved."""
    config = ModelConfig.from_hf(json.loads((folder / "config.json").read_text()))
    model = LlamaForCausalLM.empty(config, dtype, "cpu")
    stream_weights(model, Checkpoint(SafetensorsFile(folder / "model.safetensors").tensors))
    model.build_rope_tables(max_positions)
    return model


# ---- running our decoder over a paged KV cache, against transformers

PAGED_BLOCK_SIZE = 8  # the paged sequences' blocks


class PagedSequence:
    """One sequence run through the decoder with a shuffled (non-contiguous) block table."""

    def __init__(self, model: LlamaForCausalLM, max_tokens: int,
                 kv_dtype: torch.dtype = torch.float32) -> None:
        config = model.config
        num_blocks = 2 * -(-max_tokens // PAGED_BLOCK_SIZE)
        self.model = model
        self.attention = TorchAttention(config.num_heads, config.num_kv_heads, config.head_dim,
                                        config.attention_scale)
        self.cache = torch.zeros(config.num_layers, 2,
                                 *self.attention.kv_cache_shape(num_blocks, PAGED_BLOCK_SIZE,
                                                                kv_dtype),
                                 dtype=kv_dtype)
        self.table = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(1))
        self.length = 0

    @torch.inference_mode()
    def feed(self, token_ids: list[int]) -> torch.Tensor:
        """Append tokens; return the logits of every one of them."""
        count = len(token_ids)
        positions = torch.arange(self.length, self.length + count)
        block, offset = positions // PAGED_BLOCK_SIZE, positions % PAGED_BLOCK_SIZE
        slots = self.table[block] * PAGED_BLOCK_SIZE + offset
        self.length += count
        meta = AttentionMetadata.build([count], [self.length], self.table[None], PAGED_BLOCK_SIZE,
                                       torch.device("cpu"), slot_mapping=slots)
        return self.model(torch.tensor(token_ids), positions, self.cache, meta, self.attention,
                          torch.arange(count))


def greedy_reference(reference, prompt: torch.Tensor, steps: int) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' greedy continuation of `prompt` and its logits at every position."""
    with torch.inference_mode():
        expected = reference.generate(prompt[None], generation_config=GenerationConfig(
            max_new_tokens=steps, do_sample=False, eos_token_id=None, pad_token_id=0))[0]
        return expected, reference(expected[None]).logits[0]


def run_paged(model: LlamaForCausalLM, expected: torch.Tensor,
              prompt_chunks: list[torch.Tensor]) -> torch.Tensor:
    """Our logits for `expected`: the prompt fed in chunks, then one token at a time."""
    sequence = PagedSequence(model, len(expected))
    num_prompt = sum(len(chunk) for chunk in prompt_chunks)
    logits = [sequence.feed(chunk.tolist()) for chunk in prompt_chunks]
    logits += [sequence.feed([token]) for token in expected[num_prompt:-1].tolist()]
    return torch.cat(logits)


# ---- a tiny tokenizer, and HF folders that use it

# A byte-level BPE vocabulary small enough to build in milliseconds, shaped like SmolLM2's.
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = [("h", "e"), ("l", "l"), ("he", "ll")]
VOCAB = SPECIAL_TOKENS + sorted(pre_tokenizers.ByteLevel.alphabet()) + ["he", "ll", "hell"]
BOS_ID, EOS_ID = 1, 2  # build_tiny_model's ids too
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


# Qwen3's chat template, tools left out: an assistant turn's thinking (its
# reasoning_content, or what its content holds before </think>) is rendered only after the
# last user message, and `enable_thinking=False` closes an empty thinking section in the
# generation prompt.
QWEN3_THINKING_TEMPLATE = (
    "{%- if messages[0].role == 'system' %}"
    "{{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}{%- endif %}"
    "{%- set ns = namespace(last_query_index=messages|length - 1) %}"
    "{%- for message in messages %}{%- if message.role == 'user' %}"
    "{%- set ns.last_query_index = loop.index0 %}{%- endif %}{%- endfor %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}"
    "{{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' }}"
    "{%- elif message.role == 'assistant' %}"
    "{%- set content = message.content %}{%- set reasoning_content = '' %}"
    "{%- if message.reasoning_content is defined and message.reasoning_content is not none %}"
    "{%- set reasoning_content = message.reasoning_content %}"
    "{%- elif '</think>' in message.content %}"
    "{%- set content = message.content.split('</think>')[-1].lstrip('\n') %}"
    "{%- set reasoning_content = message.content.split('</think>')[0].rstrip('\n')"
    ".split('<think>')[-1].lstrip('\n') %}{%- endif %}"
    "{%- if loop.index0 > ns.last_query_index and (loop.last or reasoning_content) %}"
    "{{- '<|im_start|>' + message.role + '\n<think>\n' + reasoning_content.strip('\n')"
    " + '\n</think>\n\n' + content.lstrip('\n') }}"
    "{%- else %}{{- '<|im_start|>' + message.role + '\n' + content }}{%- endif %}"
    "{{- '<|im_end|>\n' }}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\n\n</think>\n\n' }}{%- endif %}{%- endif %}"
)
THINK_TOKENS = ["<think>", "</think>"]  # added tokens, not special: they stay in the text


def thinking_tokenizer() -> PreTrainedTokenizerFast:
    """The VOCAB tokenizer with <think> and </think> as tokens of their own and Qwen3's
    thinking chat template."""
    tokenizer = tiny_tokenizer()
    tokenizer.add_tokens(THINK_TOKENS)
    tokenizer.chat_template = QWEN3_THINKING_TEMPLATE
    return tokenizer


def thinking_qwen3_folder(folder: Path) -> Path:
    """A tiny random Qwen3 whose tokenizer is `thinking_tokenizer()`."""
    tokenizer = thinking_tokenizer()
    build_tiny_model("qwen3", folder, **(TINY | {"vocab_size": len(tokenizer)}))
    tokenizer.save_pretrained(folder)
    return folder


def hf_folder(folder: Path, arch: str, **overrides: Any) -> dict[str, torch.Tensor]:
    """A tiny random HF model folder with a template-less tokenizer; returns its state dict."""
    model = build_tiny_model(arch, folder, **(TINY | overrides))
    tiny_tokenizer().save_pretrained(folder)
    return model.state_dict()


# ---- GGUF files

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
