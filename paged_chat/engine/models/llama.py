"""One decoder for the llama family: Llama 2/3, Mistral, SmolLM, Qwen2, Qwen3.

The forward takes a flat, unpadded batch: the step's new tokens of every sequence, their
positions, and the attention metadata that says which tokens belong to which sequence and
where their K/V live in the paged cache. It returns logits only for the rows the caller
samples from. Numerics follow Hugging Face transformers (RMSNorm in fp32, rotate-half
RoPE from an fp32 table) so greedy tokens match `generate` on the same weights.

Q/K/V and gate/up projections are fused at load time: one matmul instead of three (two).
"""

from __future__ import annotations

import math
import torch
import torch.nn.functional as F
from torch import nn

from paged_chat.engine.attention.backend import AttentionBackend
from paged_chat.engine.attention.metadata import AttentionMetadata
from paged_chat.engine.errors import UnsupportedModelError
from paged_chat.engine.models.model_config import ModelConfig



class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rope_inverse_frequencies(config: ModelConfig) -> torch.Tensor:
    """Per-pair rotation frequencies, with linear or Llama 3 scaling applied."""
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq
    kind = scaling.get("rope_type", scaling.get("type"))
    factor = float(scaling.get("factor", 1.0))
    if kind == "linear":
        return inv_freq / factor
    if kind == "llama3":
        low_factor = float(scaling["low_freq_factor"])
        high_factor = float(scaling["high_freq_factor"])
        old_context = float(scaling["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_context / low_factor, inv_freq / factor, inv_freq)
        smooth = (old_context / wavelen - low_factor) / (high_factor - low_factor)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = (wavelen >= old_context / high_factor) & (wavelen <= old_context / low_factor)
        return torch.where(is_medium, smoothed, scaled)
    raise UnsupportedModelError(
        f"rope scaling {kind!r} is not supported: paged-chat implements default, linear and llama3")


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        q_size = self.num_heads * self.head_dim
        kv_size = self.num_kv_heads * self.head_dim
        self.split_sizes = (q_size, kv_size, kv_size)
        self.qkv_proj = nn.Linear(config.hidden_size, q_size + 2 * kv_size, bias=config.attention_bias)
        self.o_proj = nn.Linear(q_size, config.hidden_size, bias=False)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if config.qk_norm else None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                key_cache: torch.Tensor, value_cache: torch.Tensor, meta: AttentionMetadata,
                attention: AttentionBackend) -> torch.Tensor:
        num_tokens = x.shape[0]
        q, k, v = self.qkv_proj(x).split(self.split_sizes, dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        out = attention(q, k, v, key_cache, value_cache, meta)
        return self.o_proj(out.reshape(num_tokens, -1))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                key_cache: torch.Tensor, value_cache: torch.Tensor, meta: AttentionMetadata,
                attention: AttentionBackend) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, key_cache, value_cache, meta,
                               attention)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaForCausalLM(nn.Module):
    """The decoder. Build it with `from_weights`; call it with a flat batch."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = None if config.tie_word_embeddings else nn.Linear(
            config.hidden_size, config.vocab_size, bias=False)

    @classmethod
    def from_weights(cls, config: ModelConfig, weights: dict[str, torch.Tensor],
                     dtype: torch.dtype, device: torch.device, max_positions: int) -> "LlamaForCausalLM":
        """Build without random init (meta device), then take every parameter from `weights`."""
        with torch.device("meta"):
            model = cls(config)
        model.to_empty(device=device)
        model.to(dtype)
        model._load(weights)
        model._build_rope_table(max_positions, dtype, device)
        return model.eval()

    def _load(self, weights: dict[str, torch.Tensor]) -> None:
        def take(name: str) -> torch.Tensor:
            if name not in weights:
                raise UnsupportedModelError(f"the checkpoint has no tensor {name!r}")
            return weights[name]

        own = dict(self.named_parameters())
        loaded: set[str] = set()

        def put(name: str, tensor: torch.Tensor) -> None:
            param = own[name]
            if tuple(param.shape) != tuple(tensor.shape):
                raise UnsupportedModelError(f"tensor {name!r} has shape {tuple(tensor.shape)}, "
                                            f"the config implies {tuple(param.shape)}")
            param.data.copy_(tensor)
            loaded.add(name)

        put("embed_tokens.weight", take("model.embed_tokens.weight"))
        put("norm.weight", take("model.norm.weight"))
        if self.lm_head is not None:
            put("lm_head.weight", take("lm_head.weight"))
        for i in range(self.config.num_layers):
            src, dst = f"model.layers.{i}.", f"layers.{i}."
            projections = [take(f"{src}self_attn.{p}_proj.weight") for p in "qkv"]
            put(f"{dst}self_attn.qkv_proj.weight", torch.cat(projections))
            if self.config.attention_bias:
                biases = [take(f"{src}self_attn.{p}_proj.bias") for p in "qkv"]
                put(f"{dst}self_attn.qkv_proj.bias", torch.cat(biases))
            put(f"{dst}self_attn.o_proj.weight", take(f"{src}self_attn.o_proj.weight"))
            if self.config.qk_norm:
                put(f"{dst}self_attn.q_norm.weight", take(f"{src}self_attn.q_norm.weight"))
                put(f"{dst}self_attn.k_norm.weight", take(f"{src}self_attn.k_norm.weight"))
            gate_up = [take(f"{src}mlp.{p}_proj.weight") for p in ("gate", "up")]
            put(f"{dst}mlp.gate_up_proj.weight", torch.cat(gate_up))
            put(f"{dst}mlp.down_proj.weight", take(f"{src}mlp.down_proj.weight"))
            for norm in ("input_layernorm", "post_attention_layernorm"):
                put(f"{dst}{norm}.weight", take(f"{src}{norm}.weight"))
        missing = set(own) - loaded
        assert not missing, f"parameters left uninitialised: {sorted(missing)}"

    def _build_rope_table(self, max_positions: int, dtype: torch.dtype, device: torch.device) -> None:
        inv_freq = rope_inverse_frequencies(self.config).to(device)
        positions = torch.arange(max_positions, device=device, dtype=torch.float32)
        freqs = positions[:, None] * inv_freq[None, :]
        angles = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("rope_cos", angles.cos().to(dtype), persistent=False)
        self.register_buffer("rope_sin", angles.sin().to(dtype), persistent=False)

    def output_weight(self) -> torch.Tensor:
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_cache: torch.Tensor, meta: AttentionMetadata, attention: AttentionBackend,
                logits_indices: torch.Tensor) -> torch.Tensor:
        """input_ids, positions: [num_tokens]; kv_cache: [layers, 2, ...] in the attention
        backend's layout; returns fp32 logits [len(logits_indices), vocab]."""
        cos = self.rope_cos[positions].unsqueeze(1)
        sin = self.rope_sin[positions].unsqueeze(1)
        x = self.embed_tokens(input_ids)
        for layer, layer_cache in zip(self.layers, kv_cache):
            x = layer(x, cos, sin, layer_cache[0], layer_cache[1], meta, attention)
        x = self.norm(x[logits_indices])
        return F.linear(x, self.output_weight()).float()
