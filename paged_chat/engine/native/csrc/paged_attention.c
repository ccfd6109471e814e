/* Paged attention on the CPU, float32, over the head-major cache of attention/backend.py:
 * each layer's key (value) cache is [kv_heads, num_blocks, block_size, dim], so one KV
 * head's rows of a block are one contiguous run of block_size rows. A bfloat16 cache
 * (PA_KV_BFLOAT16) holds half the bytes, an int8 one (PA_KV_INT8) about a quarter: K/V are
 * rounded to it as they are stored, and an item widens each block it reads into its
 * workspace once, then attends the floats as a float32 cache's (bfloat16's widening is
 * exact: a bfloat16 is a float32's high half).
 *
 * pa_attention first stores the step's new K/V in their slots (slot -1: nothing stored),
 * then attends: one work item per (sequence, KV head, tile of up to QUERY_TILE query
 * tokens), spread over OpenMP threads. An item walks the blocks its queries can see once,
 * in table order, reading each K/V block in place (no gather), and keeps for each of its
 * rows (query token x query head of the KV head's group) a running max, a running sum and
 * an unnormalised output: the online softmax, rescaled when the max grows. A row reads
 * only the keys it sees (causal, inside its sliding window), so table entries behind every
 * window (released blocks, pointing at the null block 0) and keys past a sequence's end
 * are never read, let alone multiplied by a zero probability.
 *
 * Query token j of a sequence of seq_len tokens with n new ones sits at position
 * seq_len - n + j and sees the keys k with p - window < k <= p (window 0: all k <= p). */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "paged_attention.h"
#include "vector_exp.h"

#define QUERY_TILE 16
/* Rows of an item from which its blocks' keys are transposed first (prefill tiles). */
#define TRANSPOSE_MIN_ROWS 8
/* Key rows a call reads (over sequences and KV heads) from which it runs on threads: one
 * chat's decode from about 340 tokens of context at 3 KV heads (SmolLM2-135M's 30 layers,
 * 2 threads: 1.59 -> 1.22 ms at 400 tokens, 2.84 -> 2.14 ms at 1000, where 8192 kept such
 * a decode on one thread; benchmarks/cpu_attention_probe.py's shapes). */
#define PARALLEL_MIN_KEYS 1024

/* A float32's bfloat16, rounded to nearest even as torch rounds it (NaN: a quiet NaN). */
static inline uint16_t to_bfloat16(float x) {
    uint32_t bits;
    memcpy(&bits, &x, sizeof bits);
    if (isnan(x)) return 0x7FC0;
    return (uint16_t)((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16);
}

/* n bfloat16 values widened to float32: each one's bits shifted into a float's high half. */
static inline void widen_bfloat16(const uint16_t *from, float *to, int64_t n) {
    int64_t i = 0;
#if defined(__AVX512F__)
    for (; i + 16 <= n; i += 16) {
        const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(from + i)));
        _mm512_storeu_ps(to + i, _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16)));
    }
#elif defined(__AVX2__)
    for (; i + 8 <= n; i += 8) {
        const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(from + i)));
        _mm256_storeu_ps(to + i, _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16)));
    }
#endif
    for (; i < n; i++) {
        const uint32_t bits = (uint32_t)from[i] << 16;
        memcpy(to + i, &bits, sizeof bits);
    }
}

/* n int8 codes times their row's scale, widened to float32. */
static inline void widen_int8(const int8_t *from, float scale, float *to, int64_t n) {
    int64_t i = 0;
#if defined(__AVX2__)
    const __m256 factor = _mm256_set1_ps(scale);
    for (; i + 8 <= n; i += 8) {
        const __m256i wide = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(from + i)));
        _mm256_storeu_ps(to + i, _mm256_mul_ps(_mm256_cvtepi32_ps(wide), factor));
    }
#endif
    for (; i < n; i++) to[i] = (float)from[i] * scale;
}

/* Bytes of one cached row of `dim` elements: an int8 row's codes, then its float32 scale. */
static inline int64_t row_bytes(int64_t kv_dtype, int64_t dim) {
    return kv_dtype == PA_KV_INT8 ? dim + (int64_t)sizeof(float)
           : kv_dtype == PA_KV_BFLOAT16 ? dim * (int64_t)sizeof(uint16_t)
           : dim * (int64_t)sizeof(float);
}

/* One row of `dim` K or V floats into its cache row of `kv_dtype`. int8: the codes are
 * round-half-even(x / scale), scale = max |x| / 127 (1 where the row is all zeros, so no
 * division by zero), as attention/torch_backend.py quantizes. */
static inline void store_row(char *slot, const float *row, int64_t dim, int64_t kv_dtype) {
    if (kv_dtype == PA_KV_BFLOAT16) {
        uint16_t *to = (uint16_t *)slot;
        for (int64_t d = 0; d < dim; d++) to[d] = to_bfloat16(row[d]);
    } else if (kv_dtype == PA_KV_INT8) {
        float top = 0.0f;
        for (int64_t d = 0; d < dim; d++) top = fmaxf(top, fabsf(row[d]));
        const float scale = top / 127.0f, divisor = scale > 0.0f ? scale : 1.0f;
        int8_t *to = (int8_t *)slot;
        for (int64_t d = 0; d < dim; d++) to[d] = (int8_t)nearbyintf(row[d] / divisor);
        memcpy(slot + dim, &scale, sizeof scale);
    } else {
        memcpy(slot, row, (size_t)dim * sizeof(float));
    }
}

/* `rows` cached rows of `kv_dtype` as float32 rows of `dim`. */
static inline void widen_rows(const char *from, float *to, int64_t rows, int64_t dim,
                              int64_t kv_dtype) {
    if (kv_dtype == PA_KV_BFLOAT16) {
        widen_bfloat16((const uint16_t *)from, to, rows * dim);
        return;
    }
    const int64_t stride = row_bytes(kv_dtype, dim);
    for (int64_t r = 0; r < rows; r++) {
        float scale;
        memcpy(&scale, from + r * stride + dim, sizeof scale);
        widen_int8((const int8_t *)(from + r * stride), scale, to + r * dim, dim);
    }
}

static inline float dot(const float *a, const float *b, int64_t dim) {
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t d = 0; d < dim; d++) sum += a[d] * b[d];
    return sum;
}

/* scores[o] = exp(scores[o] - top) for o in [first, last]; returns their sum. */
static inline float exponentiate(float *scores, int64_t first, int64_t last, float top) {
    float sum = 0.0f;
    int64_t o = first;
#ifdef __AVX2__
    __m256 total = _mm256_setzero_ps();
    for (; o + 8 <= last + 1; o += 8) {
        const __m256 p = exp8(_mm256_sub_ps(_mm256_loadu_ps(scores + o), _mm256_set1_ps(top)));
        _mm256_storeu_ps(scores + o, p);
        total = _mm256_add_ps(total, p);
    }
    float lanes[8];
    _mm256_storeu_ps(lanes, total);
    for (int i = 0; i < 8; i++) sum += lanes[i];
#endif
    for (; o <= last; o++) {
        scores[o] = expf(scores[o] - top);
        sum += scores[o];
    }
    return sum;
}

/* One row's scores against the keys [first, last] of a block (offsets in it): dot products
 * for a few rows, or, where `transposed` holds the block's keys as [dim, block_size], one
 * broadcast FMA per dimension over all the block's keys (no horizontal sums). */
static inline void score_block(const float *q, const float *keys, const float *transposed,
                               int64_t block_size, int64_t first, int64_t last, int64_t dim,
                               float scale, float *scores) {
    if (transposed == NULL) {
        int64_t o = first;
#ifdef __AVX2__
        /* Four keys at a time: four independent FMA chains where one dot's chain would
         * wait on each FMA's latency, and one horizontal sum for the four. */
        if (dim % 8 == 0)
            for (; o + 4 <= last + 1; o += 4) {
                const float *k0 = keys + o * dim;
                __m256 s0 = _mm256_setzero_ps(), s1 = s0, s2 = s0, s3 = s0;
                for (int64_t d = 0; d < dim; d += 8) {
                    const __m256 qd = _mm256_loadu_ps(q + d);
                    s0 = _mm256_fmadd_ps(qd, _mm256_loadu_ps(k0 + d), s0);
                    s1 = _mm256_fmadd_ps(qd, _mm256_loadu_ps(k0 + dim + d), s1);
                    s2 = _mm256_fmadd_ps(qd, _mm256_loadu_ps(k0 + 2 * dim + d), s2);
                    s3 = _mm256_fmadd_ps(qd, _mm256_loadu_ps(k0 + 3 * dim + d), s3);
                }
                /* lanes [s0 s1 s2 s3] of each 128-bit half, then the halves added */
                const __m256 sums = _mm256_hadd_ps(_mm256_hadd_ps(s0, s1), _mm256_hadd_ps(s2, s3));
                const __m128 four = _mm_add_ps(_mm256_castps256_ps128(sums),
                                               _mm256_extractf128_ps(sums, 1));
                _mm_storeu_ps(scores + o, _mm_mul_ps(four, _mm_set1_ps(scale)));
            }
#endif
        for (; o <= last; o++) scores[o] = dot(q, keys + o * dim, dim) * scale;
        return;
    }
#ifdef __AVX2__
    if (block_size == 16) {  /* the default: the block's scores stay in two registers */
        __m256 low = _mm256_setzero_ps(), high = _mm256_setzero_ps();
        for (int64_t d = 0; d < dim; d++) {
            const __m256 qd = _mm256_set1_ps(q[d] * scale);
            low = _mm256_fmadd_ps(qd, _mm256_loadu_ps(transposed + d * 16), low);
            high = _mm256_fmadd_ps(qd, _mm256_loadu_ps(transposed + d * 16 + 8), high);
        }
        _mm256_storeu_ps(scores, low);
        _mm256_storeu_ps(scores + 8, high);
        return;
    }
#endif
#pragma omp simd
    for (int64_t o = 0; o < block_size; o++) scores[o] = 0.0f;
    for (int64_t d = 0; d < dim; d++) {
        const float qd = q[d] * scale;
        const float *column = transposed + d * block_size;
#pragma omp simd
        for (int64_t o = 0; o < block_size; o++) scores[o] += qd * column[o];
    }
}

/* One row's online-softmax update by its `scores` of the keys [first, last] of a block. */
static inline void attend_block(const float *values, int64_t first, int64_t last, int64_t dim,
                                float *scores, float *max, float *sum, float *acc) {
    float top = *max;
    for (int64_t o = first; o <= last; o++)
        if (scores[o] > top) top = scores[o];
    if (top > *max) {  /* rescale what was summed under the old max (exp(-inf) = 0) */
        const float alpha = expf(*max - top);
        *sum *= alpha;
#pragma omp simd
        for (int64_t d = 0; d < dim; d++) acc[d] *= alpha;
        *max = top;
    }
    *sum += exponentiate(scores, first, last, top);
#ifdef __AVX2__
    if (dim % 64 == 0) {  /* 64 of the row's outputs in registers: eight FMA chains */
        for (int64_t d = 0; d < dim; d += 64) {
            __m256 a[8];
            for (int i = 0; i < 8; i++) a[i] = _mm256_loadu_ps(acc + d + 8 * i);
            for (int64_t o = first; o <= last; o++) {
                const __m256 p = _mm256_set1_ps(scores[o]);
                const float *v = values + o * dim + d;
                for (int i = 0; i < 8; i++) a[i] = _mm256_fmadd_ps(p, _mm256_loadu_ps(v + 8 * i), a[i]);
            }
            for (int i = 0; i < 8; i++) _mm256_storeu_ps(acc + d + 8 * i, a[i]);
        }
        return;
    }
    if (dim % 32 == 0) {  /* 32 of the row's outputs in registers over the block's keys */
        for (int64_t d = 0; d < dim; d += 32) {
            __m256 a0 = _mm256_loadu_ps(acc + d), a1 = _mm256_loadu_ps(acc + d + 8);
            __m256 a2 = _mm256_loadu_ps(acc + d + 16), a3 = _mm256_loadu_ps(acc + d + 24);
            for (int64_t o = first; o <= last; o++) {
                const __m256 p = _mm256_set1_ps(scores[o]);
                const float *v = values + o * dim + d;
                a0 = _mm256_fmadd_ps(p, _mm256_loadu_ps(v), a0);
                a1 = _mm256_fmadd_ps(p, _mm256_loadu_ps(v + 8), a1);
                a2 = _mm256_fmadd_ps(p, _mm256_loadu_ps(v + 16), a2);
                a3 = _mm256_fmadd_ps(p, _mm256_loadu_ps(v + 24), a3);
            }
            _mm256_storeu_ps(acc + d, a0);
            _mm256_storeu_ps(acc + d + 8, a1);
            _mm256_storeu_ps(acc + d + 16, a2);
            _mm256_storeu_ps(acc + d + 24, a3);
        }
        return;
    }
#endif
    for (int64_t o = first; o <= last; o++) {
        const float p = scores[o];
        const float *v = values + o * dim;
#pragma omp simd
        for (int64_t d = 0; d < dim; d++) acc[d] += p * v[d];
    }
}

void pa_store(const pa_problem *p, int64_t first, int64_t last) {
    const int64_t row = row_bytes(p->kv_dtype, p->dim);
    const int64_t head_stride = p->num_blocks * p->block_size * row;
    for (int64_t t = first; t < last; t++) {
        if (p->slot_mapping[t] < 0) continue;
        const int64_t at = p->slot_mapping[t] * row;
        for (int64_t h = 0; h < p->kv_heads; h++) {
            store_row((char *)p->key_cache + h * head_stride + at,
                      p->key + t * p->k_stride + h * p->dim, p->dim, p->kv_dtype);
            store_row((char *)p->value_cache + h * head_stride + at,
                      p->value + t * p->v_stride + h * p->dim, p->dim, p->kv_dtype);
        }
    }
}

/* The work items: first_item[s] is sequence s's first (num_seqs + 1 entries, the last the
 * count), a sequence's items its tiles of QUERY_TILE new tokens times its KV heads. */
int64_t pa_items(const pa_problem *p, int64_t *first_item) {
    first_item[0] = 0;
    for (int64_t s = 0; s < p->num_seqs; s++) {
        const int64_t new_tokens = p->query_start[s + 1] - p->query_start[s];
        first_item[s + 1] = first_item[s]
                            + (new_tokens + QUERY_TILE - 1) / QUERY_TILE * p->kv_heads;
    }
    return first_item[p->num_seqs];
}

int64_t pa_workspace_floats(const pa_problem *p) {
    const int64_t rows = QUERY_TILE * (p->heads / p->kv_heads);
    const int64_t widened = p->kv_dtype == PA_KV_FLOAT32 ? 0 : 2 * p->block_size * p->dim;
    return rows * p->dim + 2 * rows + (1 + p->dim) * p->block_size + widened;
}

/* Work item `item` into p->out; `*seq` is where the search for its sequence starts (the
 * last item's, as items come in order on a thread). */
void pa_attend_item(const pa_problem *p, const int64_t *first_item, int64_t item,
                    int64_t *seq, float *workspace) {
    const int64_t group = p->heads / p->kv_heads, dim = p->dim, block_size = p->block_size;
    const int64_t rows = QUERY_TILE * group, window = p->window;
    float *acc = workspace, *max = acc + rows * dim, *sum = max + rows, *scores = sum + rows;
    float *transposed = scores + block_size;
    /* a narrow cache's block, widened: its keys, then its values */
    float *widened = transposed + dim * block_size;
    int64_t s = *seq;
    while (first_item[s + 1] <= item) s++;
    while (first_item[s] > item) s--;
    *seq = s;
    const int64_t local = item - first_item[s];
    const int64_t tile = local / p->kv_heads, h = local % p->kv_heads;
    const int64_t new_tokens = p->query_start[s + 1] - p->query_start[s];
    const int64_t seq_len = p->seq_lens[s];
    const int64_t first_token = tile * QUERY_TILE;
    const int64_t count = new_tokens - first_token < QUERY_TILE
                          ? new_tokens - first_token : QUERY_TILE;
    const int64_t first_pos = seq_len - new_tokens + first_token;
    const int64_t last_pos = first_pos + count - 1;
    const int64_t lowest = window > 0 && first_pos - window + 1 > 0 ? first_pos - window + 1 : 0;
    const int32_t *table = p->block_tables + s * p->table_width;
    for (int64_t r = 0; r < count * group; r++) {
        max[r] = -INFINITY;
        sum[r] = 0.0f;
        memset(acc + r * dim, 0, (size_t)dim * sizeof(float));
    }
    for (int64_t b = lowest / block_size; b <= last_pos / block_size; b++) {
        const int64_t at = (h * p->num_blocks + table[b]) * block_size
                           * row_bytes(p->kv_dtype, dim);
        const char *key_rows = (const char *)p->key_cache + at;
        const char *value_rows = (const char *)p->value_cache + at;
        const float *keys = (const float *)key_rows, *values = (const float *)value_rows;
        if (p->kv_dtype != PA_KV_FLOAT32) {
            widen_rows(key_rows, widened, block_size, dim, p->kv_dtype);
            widen_rows(value_rows, widened + block_size * dim, block_size, dim, p->kv_dtype);
            keys = widened;
            values = widened + block_size * dim;
        }
        const int64_t base = b * block_size;
        const float *keys_t = NULL;
        if (count * group >= TRANSPOSE_MIN_ROWS) {
            for (int64_t o = 0; o < block_size; o++)
                for (int64_t d = 0; d < dim; d++)
                    transposed[d * block_size + o] = keys[o * dim + d];
            keys_t = transposed;
        }
        for (int64_t j = 0; j < count; j++) {
            const int64_t pos = first_pos + j;
            const int64_t low = window > 0 && pos - window + 1 > base ? pos - window + 1 : base;
            const int64_t high = pos < base + block_size - 1 ? pos : base + block_size - 1;
            if (low > high) continue;
            const int64_t token = p->query_start[s] + first_token + j;
            for (int64_t g = 0; g < group; g++) {
                const int64_t r = j * group + g;
                score_block(p->query + token * p->q_stride + (h * group + g) * dim, keys,
                            keys_t, block_size, low - base, high - base, dim, p->scale,
                            scores);
                attend_block(values, low - base, high - base, dim, scores, max + r, sum + r,
                             acc + r * dim);
            }
        }
    }
    for (int64_t j = 0; j < count; j++) {
        const int64_t token = p->query_start[s] + first_token + j;
        for (int64_t g = 0; g < group; g++) {
            const int64_t r = j * group + g;
            const float inverse = 1.0f / sum[r];
            float *o = p->out + (token * p->heads + h * group + g) * dim;
#pragma omp simd
            for (int64_t d = 0; d < dim; d++) o[d] = acc[r * dim + d] * inverse;
        }
    }
}

/* Key rows a problem reads over every sequence and KV head: its work, roughly. */
static int64_t pa_keys_read(const pa_problem *p) {
    int64_t keys = 0;
    for (int64_t s = 0; s < p->num_seqs; s++) keys += (int64_t)p->seq_lens[s] * p->kv_heads;
    return keys;
}

int64_t pa_problem_size(void) { return (int64_t)sizeof(pa_problem); }

void pa_attention(const pa_problem *p, int threads) {
    pa_store(p, 0, p->num_tokens);
    int64_t *first_item = malloc((size_t)(p->num_seqs + 1) * sizeof(int64_t));
    const int64_t items = pa_items(p, first_item);
    /* A fork/join costs more than a small step's attention saves; on a loaded machine a
     * region also waits for a descheduled thread. */
#pragma omp parallel num_threads(threads) if (items > 1 && pa_keys_read(p) >= PARALLEL_MIN_KEYS)
    {
        float *workspace = malloc((size_t)pa_workspace_floats(p) * sizeof(float));
        int64_t seq = 0;
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < items; item++)
            pa_attend_item(p, first_item, item, &seq, workspace);
        free(workspace);
    }
    free(first_item);
}
