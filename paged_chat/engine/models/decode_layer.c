/* A Llama decoder layer's whole step in one C call (float32, CPU, quantized linear layers,
 * paged attention by attention/paged_attention.c), for steps whose every sequence the
 * attention kernel attends itself. It calls the same kernels, in the same order and with
 * the same arguments, as the layer's Python forward does one call at a time (llama.py:
 * DecoderLayer with fused ops), so its results are bit for bit theirs; what it saves is
 * the Python, torch dispatch and ctypes work between them: about twenty calls a layer,
 * most of a batch-1 decode step's time besides the weights' reads.
 *
 * Per layer, for x the previous layer's output (NULL for the first layer, whose input is
 * the residual stream itself):
 *     residual += x; normed = rms_norm(residual)              input_layernorm
 *     qkv = normed @ Wqkv.T; RoPE on Q and K in place         self_attn
 *     attended = attention(q, k, v) (new K/V stored first)
 *     residual += attended @ Wo.T; normed = rms_norm(residual) post_attention_layernorm
 *     out = silu_and_mul(normed @ Wgate_up.T) @ Wdown.T        mlp
 */
#include "models/quant/kernels.c"
#include "models/fused_ops.c"
#include "attention/paged_attention.c"

#define DL_MAX_PARTS 3

/* One quantized linear layer: its parts (kernels.c's layout), output columns side by side. */
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
    float *key_cache, *value_cache;
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

/* out [tokens, out_features] = x @ W.T, each part by the kernel LayerMatmul picks. */
static void dl_matmul(const dl_linear *w, const dl_step *step, const float *x, float *out) {
    for (int64_t p = 0; p < w->parts; p++) {
#ifdef __AVX2__
        if (step->tokens > step->stream_max_rows) {
            pc_gemm(x, step->tokens, w->low[p], w->high[p], w->scale[p], w->offset[p],
                    w->rows[p], w->in_features, w->group[p], out + w->column[p],
                    w->out_features, step->threads);
            continue;
        }
#endif
        pc_matmul(x, step->tokens, w->low[p], w->high[p], w->scale[p], w->offset[p],
                  w->rows[p], w->in_features, w->group[p], out + w->column[p],
                  w->out_features, step->threads);
    }
}

/* One layer's step: `residual` [tokens, hidden] in place, the layer's output into `out`
 * (which may be `x`: x is read before out is written). */
static void dl_decode_layer(const dl_layer *layer, const dl_step *step, const float *x,
                            float *residual, float *out) {
    const int64_t tokens = step->tokens, hidden = layer->o.out_features;
    const int64_t q_size = layer->heads * layer->head_dim;
    const int64_t kv_size = layer->kv_heads * layer->head_dim;
    const int64_t qkv_width = layer->qkv.out_features;
    fo_add_rms_norm(x, residual, layer->input_norm, layer->eps, tokens, hidden, step->normed,
                    step->threads);
    dl_matmul(&layer->qkv, step, step->normed, step->qkv);
    fo_rope(step->qkv, qkv_width, tokens, layer->heads + layer->kv_heads, layer->head_dim,
            step->cos, step->sin, step->threads);
    pa_attention(step->qkv, qkv_width, step->qkv + q_size, qkv_width,
                 step->qkv + q_size + kv_size, qkv_width, layer->key_cache,
                 layer->value_cache, layer->num_blocks, layer->block_size, step->slot_mapping,
                 tokens, step->query_start, step->seq_lens, step->block_tables,
                 step->table_width, step->num_seqs, layer->heads, layer->kv_heads,
                 layer->head_dim, layer->scale, layer->window, step->attended, step->threads);
    dl_matmul(&layer->o, step, step->attended, out);
    fo_add_rms_norm(out, residual, layer->post_norm, layer->eps, tokens, hidden, step->normed,
                    step->threads);
    dl_matmul(&layer->gate_up, step, step->normed, step->gate_up);
    fo_silu_and_mul(step->gate_up, tokens, layer->gate_up.out_features / 2, step->mid,
                    step->threads);
    dl_matmul(&layer->down, step, step->mid, out);
}

/* Every layer's step, in order: the first on the residual stream itself, each next one on
 * the output of the one before. The residual stream ends in `residual`, the last layer's
 * output in `out`. */
void dl_decode_layers(const dl_layer *const *layers, int64_t count, const dl_step *step,
                      float *residual, float *out) {
    for (int64_t i = 0; i < count; i++)
        dl_decode_layer(layers[i], step, i == 0 ? NULL : out, residual, out);
}
