/* Paged attention on the CPU (paged_attention.c): one call's problem, the call
 * (attention/cpu_backend.py), and the pieces decode_layer.c runs inside its own schedule. */
#ifndef PAGED_CHAT_PAGED_ATTENTION_H
#define PAGED_CHAT_PAGED_ATTENTION_H

#include <stdint.h>

/* What a KV cache's rows are (its kv_dtype): float32 as computed; bfloat16, rounded to
 * nearest even as stored (as torch's conversion) and widened as read; or int8: dim codes
 * then the row's float32 scale (dim + 4 bytes a row), dequantized as read. Mirrored by
 * bindings.py's KV_DTYPE_CODES. */
enum { PA_KV_FLOAT32 = 0, PA_KV_BFLOAT16 = 1, PA_KV_INT8 = 2 };

/* One call's attention: query [T, heads, dim] (token stride q_stride), key/value
 * [T, kv_heads, dim] (token strides k_stride, v_stride), out [T, heads, dim] contiguous;
 * the caches hold kv_dtype rows.
 * Mirrored by bindings.py's PagedAttentionProblem (checked against pa_problem_size). */
typedef struct {
    const float *query, *key, *value;
    int64_t q_stride, k_stride, v_stride;
    void *key_cache, *value_cache;
    int64_t kv_dtype;
    int64_t num_blocks, block_size;
    const int64_t *slot_mapping;
    int64_t num_tokens;
    const int32_t *query_start, *seq_lens, *block_tables;
    int64_t table_width, num_seqs, heads, kv_heads, dim;
    float scale;
    int64_t window;
    float *out;
} pa_problem;

int64_t pa_problem_size(void);

/* The problem's new K/V stored in their slots, then every sequence attended, on up to
 * `threads` OpenMP threads. */
void pa_attention(const pa_problem *p, int threads);

/* The step's new K/V of tokens [first, last) into their slots (slot -1: nothing stored). */
void pa_store(const pa_problem *p, int64_t first, int64_t last);

/* The work items: first_item[s] is sequence s's first (num_seqs + 1 entries, the last the
 * count); returns the count. */
int64_t pa_items(const pa_problem *p, int64_t *first_item);

/* Floats of an item's workspace (pa_attend_item). */
int64_t pa_workspace_floats(const pa_problem *p);

/* Work item `item` into p->out; `*seq` is where the search for its sequence starts. */
void pa_attend_item(const pa_problem *p, const int64_t *first_item, int64_t item,
                    int64_t *seq, float *workspace);

#endif
