"""A step's decoder layers as one C call (native/csrc/decode_layer.c), where the step is
what that code computes exactly as the layers' Python forward does: float32 on the CPU
with the fused ops, quantized linear layers without biases, Llama layers without q/k
norms, and paged attention by the native kernel over every sequence of the step (the
backend says so: `native_attends_step`). The results are bit for bit the Python path's
(the same kernels in the same order); the Python, dispatch and ctypes work between the
~20 calls of a layer is what goes, and one call for all the layers, not one each: between
the weights' reads, the host's code runs with cold caches. Its threads take the step's
work in chunks rather than even shares that each op's end waits for, so a thread another
process deschedules holds the step up for one chunk, not for every op (decode_layer.c).

What a layer holds (weights' addresses, shapes, its KV cache) is written once into a C
struct; what a step shares (metadata, scratch rows) into another, once per step.
"""

from __future__ import annotations

import ctypes

import torch

from paged_chat.engine.attention.backend import AttentionBackend
from paged_chat.engine.attention.metadata import AttentionMetadata
from paged_chat.engine.core.dtypes import dtype_name
from paged_chat.engine.models.quant import kernels
from paged_chat.engine.models.quant.linear import QuantizedLinear
from paged_chat.engine.native import bindings
from paged_chat.engine.native.bindings import (
    KV_DTYPE_CODES,
    MAX_PARTS,
    LayerStruct,
    LinearStruct,
    StepStruct,
)


def linear_struct(layer: QuantizedLinear) -> LinearStruct:
    """A layer's parts as decode_layer.c takes them: the addresses and sizes its
    LayerMatmul already reads, and each part's first output column."""
    linear = LinearStruct(parts=len(layer.parts), in_features=layer.in_features,
                          out_features=layer.out_features)
    for index, (args, column) in enumerate(zip(layer.matmul.args, layer.matmul.columns)):
        low, high, scale, offset, rows, _, group = args
        linear.low[index], linear.high[index] = low, high
        linear.scale[index], linear.offset[index] = scale, offset
        linear.rows[index], linear.group[index], linear.column[index] = rows, group, column
    return linear


def _fits(layer) -> bool:
    """Whether decode_layer.c computes `layer`, a llama DecoderLayer, as its Python forward
    does (its fused flags are use_fused_ops' to set, and it sets none on Gemma's layers)."""
    attn, mlp = layer.self_attn, layer.mlp
    linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
    return (not layer.local_rope and attn.fused_rope and mlp.fused
            and layer.input_layernorm.fused and layer.post_attention_layernorm.fused
            and all(isinstance(linear, QuantizedLinear) and linear.bias is None
                    and len(linear.parts) <= MAX_PARTS for linear in linears))


class FusedDecode:
    """The model's layers as one C call, for the steps `applies` accepts."""

    def __init__(self, layers, lib: ctypes.CDLL) -> None:
        self.layers = layers
        self.lib = lib
        self._structs: list[LayerStruct] = []
        self._addresses = (ctypes.c_void_p * len(layers))()
        self._kv_cache_address: int | None = None
        first = layers[0]
        self.hidden = first.self_attn.o_proj.out_features
        self.qkv_width = first.self_attn.qkv_proj.out_features
        self.attended_width = first.self_attn.o_proj.in_features
        self.gate_up_width = first.mlp.gate_up_proj.out_features

    @classmethod
    def for_model(cls, layers) -> FusedDecode | None:
        """The fused step for `layers` (fused ops already on), or None where it does not
        compute them exactly: a layer it does not fit, or no AVX2 build (it is built for
        AVX2 only: its products are LayerMatmul's AVX2 kernels)."""
        lib = bindings.library()
        if (lib is None or not hasattr(lib, "dl_decode_layers")
                or not all(_fits(layer) for layer in layers)):
            return None
        return cls(layers, lib)

    @staticmethod
    def applies(attention: AttentionBackend, meta: AttentionMetadata) -> bool:
        """Whether a step is one it computes: the native kernel attends every sequence."""
        return attention.native_attends_step(meta)

    def _layer_structs(self, kv_cache: torch.Tensor, attention: AttentionBackend
                       ) -> ctypes.Array:
        """The layers' structs' addresses, in order, the structs rebuilt only when the KV
        pool is a new tensor."""
        if kv_cache.data_ptr() == self._kv_cache_address:
            return self._addresses
        assert kv_cache.is_contiguous()
        kv_dtype = KV_DTYPE_CODES[dtype_name(kv_cache.dtype)]
        structs = []
        for layer, layer_cache in zip(self.layers, kv_cache):
            attn, mlp = layer.self_attn, layer.mlp
            structs.append(LayerStruct(
                qkv=linear_struct(attn.qkv_proj), o=linear_struct(attn.o_proj),
                gate_up=linear_struct(mlp.gate_up_proj), down=linear_struct(mlp.down_proj),
                input_norm=layer.input_layernorm.weight.data_ptr(),
                post_norm=layer.post_attention_layernorm.weight.data_ptr(),
                eps=layer.input_layernorm.eps, scale=attention.scale,
                heads=attention.num_heads, kv_heads=attention.num_kv_heads,
                head_dim=attention.head_dim, window=attn.window or 0,
                key_cache=layer_cache[0].data_ptr(), value_cache=layer_cache[1].data_ptr(),
                kv_dtype=kv_dtype, num_blocks=layer_cache.shape[2], block_size=layer_cache.shape[3]))
        self._structs, self._kv_cache_address = structs, kv_cache.data_ptr()
        self._addresses[:] = [ctypes.addressof(struct) for struct in structs]
        return self._addresses

    def __call__(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 kv_cache: torch.Tensor, meta: AttentionMetadata, attention: AttentionBackend
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """Every layer on the embeddings `x` [tokens, hidden] (which becomes the residual
        stream, in place); returns (the last layer's output, the residual stream)."""
        assert x.dtype == torch.float32 and x.is_contiguous()
        assert cos.is_contiguous() and sin.is_contiguous()
        tokens = x.shape[0]
        widths = (self.hidden, self.qkv_width, self.attended_width, self.gate_up_width,
                  self.gate_up_width // 2)   # normed, qkv, attended, gate_up, mid
        scratch = torch.empty(tokens * sum(widths))
        rows_at = [scratch.data_ptr() + 4 * tokens * sum(widths[:i]) for i in range(len(widths))]
        tables = meta.block_tables
        assert tables.is_contiguous() and meta.slot_mapping.dtype == torch.int64
        step = StepStruct(tokens, meta.num_seqs, tables.shape[1], kernels.STREAM_MAX_ROWS,
                     cos.data_ptr(), sin.data_ptr(), meta.slot_mapping.data_ptr(),
                     meta.query_start_loc.data_ptr(), meta.seq_lens.data_ptr(),
                     tables.data_ptr(), *rows_at,
                     torch.get_num_threads())
        out = torch.empty(tokens, self.hidden)
        layers = self._layer_structs(kv_cache, attention)
        if self.lib.dl_decode_layers(layers, len(layers), ctypes.addressof(step), x.data_ptr(),
                                     out.data_ptr()) != 0:
            raise MemoryError("no memory for the fused decode step's schedule")
        return out, x
