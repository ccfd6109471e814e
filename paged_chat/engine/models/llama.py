"""One decoder for the llama family (Llama 2/3, Mistral, SmolLM, Qwen2, Qwen3) and Gemma 3.

The forward takes a flat, unpadded batch: the step's new tokens of every sequence, their
positions, and the attention metadata that says which tokens belong to which sequence and
where their K/V live in the paged cache. It returns logits only for the rows the caller
samples from. Numerics follow Hugging Face transformers (RMSNorm in fp32, rotate-half
RoPE from an fp32 table) so greedy tokens match `generate` on the same weights.

Q/K/V and gate/up projections are fused: one matmul instead of three (two). Checkpoint
tensors are copied into their slice of the fused parameter one at a time (`destination`),
so loading never holds a second copy of the model.

Gemma 3 differs in a few places, each switched by `ModelConfig.gemma`: embeddings scaled
by sqrt(hidden), RMSNorm by (1 + weight) in fp32, norms after attention and after the MLP
too, GELU-tanh, and its sliding-window layers with their own RoPE base.
"""

from __future__ import annotations

import math
from types import ModuleType

import torch
import torch.nn.functional as F
from torch import nn

from paged_chat.engine.attention.backend import AttentionBackend
from paged_chat.engine.attention.metadata import AttentionMetadata
from paged_chat.engine.core.errors import UnsupportedModelError
from paged_chat.engine.models import fused_ops
from paged_chat.engine.models.fused_decode import FusedDecode
from paged_chat.engine.models.model_config import ModelConfig
from paged_chat.engine.models.packed_linear import PackedLinear
from paged_chat.engine.models.quant.layout import QuantizedWeight
from paged_chat.engine.models.quant.linear import QuantizedEmbedding, QuantizedLinear
from paged_chat.engine.models.tensor_names import LAYER_TENSORS, TOP_TENSORS, split_hf_name

_LOGITS_SLICE = 1024  # vocabulary rows per output-projection matmul on the CPU


class RMSNorm(nn.Module):
    """Llama's `weight * norm(x).to(dtype)`, or Gemma's `(norm(x) * (1 + weight)).to(dtype)`.
    `fused`: one C call (fused_ops.py) instead of the torch ops; `triton_ops`: one Triton
    kernel (triton_fused_ops.py, the CUDA path)."""

    def __init__(self, size: int, eps: float, unit_offset: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(size))
        self.eps = eps
        self.unit_offset = unit_offset
        self.fused = False
        self.triton_ops: ModuleType | None = None

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """norm(x); with `residual`, (norm(x + residual), x + residual): the sum is the new
        residual stream (fused, written into `residual` in place)."""
        if self.triton_ops is not None:
            if residual is None:
                return self.triton_ops.add_rms_norm(None, x, self.weight, self.eps,
                                                    self.unit_offset)
            return self.triton_ops.add_rms_norm(x, residual, self.weight, self.eps,
                                                self.unit_offset), residual
        if self.fused:
            if residual is None:
                return fused_ops.add_rms_norm(None, x, self.weight, self.eps)
            return fused_ops.add_rms_norm(x, residual, self.weight, self.eps), residual
        if residual is not None:
            residual = x + residual
            return self(residual), residual
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.unit_offset:
            return (x * (1.0 + self.weight.float())).to(dtype)
        return self.weight * x.to(dtype)

    def add_normed(self, delta_norm: "RMSNorm", delta: torch.Tensor, residual: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(residual + delta_norm(delta)), residual + delta_norm(delta)): Gemma's norm
        after a block, residual add and norm before the next; one kernel with `triton_ops`
        (the sum written into `residual` in place)."""
        if self.triton_ops is not None:
            return self.triton_ops.add_rms_norm(delta, residual, self.weight, self.eps,
                                                self.unit_offset,
                                                (delta_norm.weight, delta_norm.eps)), residual
        residual = residual + delta_norm(delta)
        return self(residual), residual


def rope_inverse_frequencies(head_dim: int, theta: float,
                             scaling: dict | None) -> torch.Tensor:
    """Per-pair rotation frequencies, with linear or Llama 3 scaling applied."""
    dim = head_dim
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
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
    def __init__(self, config: ModelConfig, window: int | None) -> None:
        super().__init__()
        self.window = window
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        q_size = self.num_heads * self.head_dim
        kv_size = self.num_kv_heads * self.head_dim
        self.split_sizes = (q_size, kv_size, kv_size)
        self.qkv_proj = nn.Linear(config.hidden_size, q_size + 2 * kv_size, bias=config.attention_bias)
        self.o_proj = nn.Linear(q_size, config.hidden_size, bias=False)
        norm = lambda: RMSNorm(self.head_dim, config.rms_norm_eps, config.gemma)  # noqa: E731
        self.q_norm = norm() if config.qk_norm else None
        self.k_norm = norm() if config.qk_norm else None
        self.fused_rope = False  # RoPE in place in the QKV output, one C call (fused_ops.py)
        # The q/k norm, RoPE and the K/V store as one Triton kernel (triton_fused_ops.py),
        # attention by the backend's `attend`: the CUDA path.
        self.triton_ops: ModuleType | None = None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                key_cache: torch.Tensor, value_cache: torch.Tensor, meta: AttentionMetadata,
                attention: AttentionBackend) -> torch.Tensor:
        """cos/sin: each token's rows [T, 1, head_dim]; with `triton_ops`, the whole tables
        [positions, head_dim], which the kernel reads at `meta.positions`."""
        num_tokens = x.shape[0]
        qkv = self.qkv_proj(x)
        if self.triton_ops is not None:
            qk_norm = None if self.q_norm is None else (self.q_norm.weight, self.k_norm.weight)
            eps = 0.0 if self.q_norm is None else self.q_norm.eps
            query = self.triton_ops.rope_and_store(
                qkv, meta.positions, cos, sin, key_cache, value_cache, meta.slot_mapping,
                self.num_heads, self.num_kv_heads, self.head_dim, qk_norm, eps,
                self.q_norm is not None and self.q_norm.unit_offset)
            out = attention.attend(query, key_cache, value_cache, meta, sliding_window=self.window)
            return self.o_proj(out.reshape(num_tokens, -1))
        if self.fused_rope:
            fused_ops.rope_(qkv, self.num_heads + self.num_kv_heads, self.head_dim, cos, sin)
        q, k, v = qkv.split(self.split_sizes, dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        if not self.fused_rope:
            if self.q_norm is not None:
                q, k = self.q_norm(q), self.k_norm(k)
            q = q * cos + rotate_half(q) * sin
            k = k * cos + rotate_half(k) * sin
        out = attention(q, k, v, key_cache, value_cache, meta, sliding_window=self.window)
        return self.o_proj(out.reshape(num_tokens, -1))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.gelu = config.gemma
        self.fused = False  # SiLU-and-mul in one C call (fused_ops.py)
        self.triton_ops: ModuleType | None = None  # the activation in one Triton kernel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.triton_ops is not None:
            return self.down_proj(self.triton_ops.act_and_mul(self.gate_up_proj(x), self.gelu))
        if self.fused:
            return self.down_proj(fused_ops.silu_and_mul(self.gate_up_proj(x)))
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        gate = F.gelu(gate, approximate="tanh") if self.gelu else F.silu(gate)
        return self.down_proj(gate * up)


class DecoderLayer(nn.Module):
    """Llama's layer: x + attn(norm(x)), then x + mlp(norm(x)); as in vLLM, a layer takes
    and returns its output apart from the residual stream (None before the first layer),
    so each residual add happens inside the next norm (one fused op)."""

    def __init__(self, config: ModelConfig, window: int | None) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, config.gemma)
        self.self_attn = Attention(config, window)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps,
                                                config.gemma)
        self.mlp = MLP(config)
        self.local_rope = window is not None and config.local_rope_theta is not None

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor,
                sin: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                meta: AttentionMetadata, attention: AttentionBackend
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        if residual is None:
            x, residual = self.input_layernorm(x), x
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(x, cos, sin, key_cache, value_cache, meta, attention)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class GemmaDecoderLayer(DecoderLayer):
    """Gemma 3's layer: norms before and after both attention and the MLP
    (post_attention_layernorm normalises the attention output here). It returns the whole
    stream, residual None (nothing of it is fused)."""

    def __init__(self, config: ModelConfig, window: int | None) -> None:
        super().__init__(config, window)
        self.pre_feedforward_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, True)
        self.post_feedforward_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, True)

    def forward(self, x: torch.Tensor, residual: None, cos: torch.Tensor, sin: torch.Tensor,
                key_cache: torch.Tensor, value_cache: torch.Tensor, meta: AttentionMetadata,
                attention: AttentionBackend) -> tuple[torch.Tensor, None]:
        attended = self.self_attn(self.input_layernorm(x), cos, sin, key_cache, value_cache,
                                  meta, attention)
        normed, x = self.pre_feedforward_layernorm.add_normed(self.post_attention_layernorm,
                                                              attended, x)
        return x + self.post_feedforward_layernorm(self.mlp(normed)), None


class LlamaForCausalLM(nn.Module):
    """The decoder. Make it with `empty` (quant/transform.py may then swap layers for
    quantized ones), fill it through `destination`, then `build_rope_tables`; call it with a
    flat batch. Packing and fused ops are the worker's to switch on
    (worker/model_loading.py); the forward runs whatever modules and flags it holds."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        windows = config.layer_windows or (None,) * config.num_layers
        layer_cls = GemmaDecoderLayer if config.gemma else DecoderLayer
        # An explicit weight skips the random init: normal_ costs seconds on its first call,
        # even on the meta device, and the checkpoint overwrites it anyway.
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size,
                                         _weight=torch.empty(config.vocab_size, config.hidden_size))
        self.layers = nn.ModuleList(layer_cls(config, window) for window in windows)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, config.gemma)
        self.lm_head = None if config.tie_word_embeddings else nn.Linear(
            config.hidden_size, config.vocab_size, bias=False)
        q_size, kv_size = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
        # Row sizes of the checkpoint tensors each fused parameter stacks, in order.
        self.shard_rows = {"self_attn.qkv_proj": (q_size, kv_size, kv_size),
                           "mlp.gate_up_proj": (config.intermediate_size,) * 2}
        # Each layer's step as one C call, where the worker's fused ops find it exact.
        self.fused_decode: FusedDecode | None = None
        # The CUDA path's Triton kernels (triton_fused_ops.py), set with every module's.
        self.triton_ops: ModuleType | None = None

    @classmethod
    def empty(cls, config: ModelConfig, dtype: torch.dtype,
              device: torch.device | str) -> "LlamaForCausalLM":
        """Parameters allocated in `dtype` on `device`, uninitialised (no random init, no
        float32 detour); on the meta device nothing is allocated at all."""
        with torch.device("meta"):
            model = cls(config).to(dtype)
        if torch.device(device).type != "meta":
            # Not `to_empty`: its `empty_like` of a meta tensor runs torch's Python reference
            # of it, whose first call imports sympy (a second of a warm start on 2 cores).
            model._apply(lambda meta: torch.empty(meta.shape, dtype=meta.dtype, device=device))
        embed_scale = torch.tensor(config.hidden_size ** 0.5 if config.gemma else 1.0)
        model.register_buffer("embed_scale", embed_scale.to(dtype=dtype, device=device),
                              persistent=False)
        return model.eval()

    def checkpoint_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every HF checkpoint tensor this model reads, with its shape."""
        params = dict(self.named_parameters())
        shapes = {f"{t.hf}.weight": tuple(params[f"{t.param}.weight"].shape)
                  for t in TOP_TENSORS if f"{t.param}.weight" in params}
        for i in range(self.config.num_layers):
            for t in LAYER_TENSORS:
                for kind in ("weight", "bias"):
                    param = params.get(f"layers.{i}.{t.param}.{kind}")
                    if param is None:
                        continue
                    rows = self.shard_rows.get(t.param)
                    shape = (rows[t.shard], *param.shape[1:]) if rows else tuple(param.shape)
                    shapes[f"model.layers.{i}.{t.hf}.{kind}"] = shape
        return shapes

    def quantized_layers(self) -> dict[str, QuantizedLinear]:
        """Every quantized layer by module name, a tied table once."""
        return {name: module for name, module in self.named_modules()
                if isinstance(module, QuantizedLinear)}

    def weight_tensors(self) -> dict[str, torch.Tensor]:
        """Every tensor that holds a weight, parameters and quantized buffers alike (what
        the KV tier's model fingerprint samples)."""
        quantized = {f"{name}.{buffer_name}": buffer
                     for name, layer in self.quantized_layers().items()
                     for buffer_name, buffer in layer.named_buffers()}
        return {**dict(self.named_parameters()), **quantized}

    def num_weights(self) -> int:
        """The number of weights the model holds, a quantized one counted as one."""
        dense = sum(p.numel() for p in self.parameters())
        return dense + sum(layer.out_features * layer.in_features
                           for layer in self.quantized_layers().values())

    def weight_bytes(self) -> int:
        """The bytes its weights take in memory, quantized ones as they are held."""
        dense = sum(p.nbytes for p in self.parameters())
        return dense + sum(layer.nbytes for layer in self.quantized_layers().values())

    def quantized_formats(self) -> list[str]:
        """The GGUF formats of its quantized weights, the most bytes first."""
        held: dict[str, int] = {}
        for layer in self.quantized_layers().values():
            for part in layer.parts:
                held[part.format] = held.get(part.format, 0) + part.nbytes
        return sorted(held, key=held.__getitem__, reverse=True)

    def held_formats(self) -> str:
        """What its weights are held as: "Q4_1+Q8_0", "Q4_K+Q6_K+float32", "bfloat16"."""
        dense = any(p.dim() == 2 for p in self.parameters())
        dtype = str(self.norm.weight.dtype).removeprefix("torch.")
        return "+".join(self.quantized_formats() + ([dtype] if dense or not
                                                    self.quantized_layers() else []))

    def destination(self, hf_name: str) -> torch.Tensor | QuantizedWeight | None:
        """The parameter slice an HF checkpoint tensor is copied into (the rows of a
        quantized layer it fills, for a quantized one), or None for one this model does
        not read (a tied lm_head, extras such as rotary tables)."""
        split = split_hf_name(hf_name)
        if split is None:
            return None
        t, layer, kind = split
        module = t.param if layer is None else f"layers.{layer}.{t.param}"
        rows = self.shard_rows.get(t.param)
        try:
            target = self.get_submodule(module)
        except AttributeError:  # a tied lm_head
            target = None
        if kind == "weight" and isinstance(target, QuantizedEmbedding):
            return target.table.rows(0, target.num_embeddings)
        if kind == "weight" and isinstance(target, QuantizedLinear):
            if rows is None:
                return target.rows(0, target.out_features)
            return target.rows(sum(rows[:t.shard]), rows[t.shard])
        try:
            param = self.get_parameter(f"{module}.{kind}")
        except AttributeError:  # no such parameter in this config (a bias, a tied lm_head)
            return None
        if rows is None:
            return param.data
        return param.data.narrow(0, sum(rows[:t.shard]), rows[t.shard])

    def build_rope_tables(self, max_positions: int) -> None:
        """cos/sin tables for positions [0, max_positions): the global one and, where the
        windowed layers have their own base (Gemma 3), a local one. Size them from the
        engine's effective max_model_len, never from the checkpoint's metadata alone."""
        c = self.config
        device, dtype = self.norm.weight.device, self.norm.weight.dtype
        self._register_rope("rope", rope_inverse_frequencies(c.head_dim, c.rope_theta,
                                                             c.rope_scaling), max_positions,
                            device, dtype)
        if c.local_rope_theta is not None:
            self._register_rope("local_rope", rope_inverse_frequencies(
                c.head_dim, c.local_rope_theta, None), max_positions, device, dtype)

    def _register_rope(self, name: str, inv_freq: torch.Tensor, max_positions: int,
                       device: torch.device, dtype: torch.dtype) -> None:
        positions = torch.arange(max_positions, device=device, dtype=torch.float32)
        freqs = positions[:, None] * inv_freq.to(device)[None, :]
        angles = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer(f"{name}_cos", angles.cos().to(dtype), persistent=False)
        self.register_buffer(f"{name}_sin", angles.sin().to(dtype), persistent=False)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_cache: torch.Tensor, meta: AttentionMetadata, attention: AttentionBackend,
                logits_indices: torch.Tensor) -> torch.Tensor:
        """input_ids, positions: [num_tokens]; kv_cache: [layers, 2, ...] in the attention
        backend's layout; returns fp32 logits [len(logits_indices), vocab]. With
        `triton_ops`, the kernel that applies RoPE reads the positions at `meta.positions`."""
        if self.triton_ops is not None:
            rope = (self.rope_cos, self.rope_sin)
            local = rope
            if self.config.local_rope_theta is not None:
                local = (self.local_rope_cos, self.local_rope_sin)
        else:
            rope = (self.rope_cos[positions].unsqueeze(1), self.rope_sin[positions].unsqueeze(1))
            local = rope
            if self.config.local_rope_theta is not None:
                local = (self.local_rope_cos[positions].unsqueeze(1),
                         self.local_rope_sin[positions].unsqueeze(1))
        x, residual = self.embed_tokens(input_ids), None
        if self.config.gemma:
            x = x * self.embed_scale
        if self.fused_decode is not None and self.fused_decode.applies(attention, meta):
            x, residual = self.fused_decode(x, *rope, kv_cache, meta, attention)
        else:
            for layer, layer_cache in zip(self.layers, kv_cache):
                cos, sin = local if layer.local_rope else rope
                x, residual = layer(x, residual, cos, sin, layer_cache[0], layer_cache[1],
                                    meta, attention)
        if residual is None:
            x = self.norm(x[logits_indices])
        elif self.triton_ops is not None:
            x, _ = self.norm(x[logits_indices], residual[logits_indices])
        else:
            x = self.norm(x[logits_indices] + residual[logits_indices])
        return self._logits(x).float()

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        if isinstance(self.lm_head, (PackedLinear, QuantizedLinear)):
            return self.lm_head(x)  # oneDNN does best with the whole vocabulary in one call
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        # The Triton path is the GPU's, under the interpreter (CPU tensors) too.
        if x.device.type == "cpu" and self.triton_ops is None:
            # A few rows against the whole vocabulary at once is a poor shape for MKL's GEMM
            # (~30% slower than in slices, whose outputs stay in cache); each logit is the
            # same dot product either way, so the logits are bit-identical.
            return torch.cat([F.linear(x, rows) for rows in weight.split(_LOGITS_SLICE)], dim=1)
        return F.linear(x, weight)
