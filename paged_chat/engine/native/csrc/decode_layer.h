/* The fused decode step's structs (decode_layer.c), mirrored by bindings.py's LinearStruct,
 * LayerStruct and StepStruct and checked against dl_*_size at load. */
#ifndef PAGED_CHAT_DECODE_LAYER_H
#define PAGED_CHAT_DECODE_LAYER_H

#include <stdint.h>

#define DL_MAX_PARTS 3

/* One quantized linear layer: its parts (quant_kernels.c's layout), output columns side by
 * side. */
typedef struct {
    const uint8_t *low[DL_MAX_PARTS], *high[DL_MAX_PARTS];
    const float *scale[DL_MAX_PARTS], *offset[DL_MAX_PARTS];
    int64_t rows[DL_MAX_PARTS], group[DL_MAX_PARTS], column[DL_MAX_PARTS];
    int64_t parts, in_features, out_features;
} dl_linear;

/* What a layer holds: weights, shapes, its KV cache. */
typedef struct {
    dl_linear qkv, o, gate_up, down;
    const float *input_norm, *post_norm;
    float eps, scale;
    int64_t heads, kv_heads, head_dim, window;
    void *key_cache, *value_cache;
    int64_t kv_dtype;   /* paged_attention.h's PA_KV_* */
    int64_t num_blocks, block_size;
} dl_layer;

/* What one step shares over its layers: the batch's metadata and scratch rows. */
typedef struct {
    int64_t tokens, num_seqs, table_width, stream_max_rows;
    const float *cos, *sin;
    const int64_t *slot_mapping;
    const int32_t *query_start, *seq_lens, *block_tables;
    float *normed, *qkv, *attended, *gate_up, *mid;
    int threads;
} dl_step;

int64_t dl_linear_size(void);
int64_t dl_layer_size(void);
int64_t dl_step_size(void);

#endif
