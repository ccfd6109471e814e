/* CPU kernels over the quantized layout of layout.py (see there): every weight is
 * scale * code + offset, code = low nibble | high nibble << 4, one scale and offset per
 * group of G weights of a row. In each group of G, byte i of a plane holds the nibble of
 * weight i (bits 0-3) and of weight i + G/2 (bits 4-7).
 *
 * pc_dequantize writes rows as float32; pc_matmul computes out = x @ W.T for a few rows
 * of x, reading each weight byte once per 4 rows of x; pc_gemm (AVX2 only) for many rows,
 * from tiles of weight rows dequantized once per call. With AVX2 + FMA, 32 codes at a
 * time are unpacked in registers: for one row of x they are multiplied into the row
 * before the group's scale is applied (code_dot), for more rows they are dequantized
 * first (FMA of code and scale plus offset: exact, as the product is) and shared by up
 * to four rows. Elsewhere, four weight rows at a time are dequantized into a buffer that
 * stays in L1, in loops written for the compiler to vectorize. Rows of W are split over
 * OpenMP threads: torch's own runtime, already loaded (same soname), so its thread count
 * and pool are shared.
 *
 * The row kernels are written once over a group size and whether the high plane exists,
 * and compiled for each format family of layout.py (FORMAT_VARIANTS), so the compiler
 * knows both: the group of a weight is a shift and the high plane's test is gone. As
 * run-time values they cost a 64-bit division and two branches per 32 weights: at one
 * row 6.2 against 5.2 TSC ticks per 32 weights (benchmarks/quant_kernel_cycles.c). */
#include <stdint.h>
#include <stdlib.h>

#ifdef __AVX2__
#include <immintrin.h>
#endif

#include "quant_kernels.h"

#define ROWS_PER_TILE 4

#ifdef __AVX2__
/* The codes of the 32 weights from byte `at` of a row's planes, as four vectors of eight
 * floats: c[0] and c[1] from the low nibbles of bytes 0-7 and 8-15, c[2] and c[3] from
 * their high nibbles. Bytes are widened to 32 bits straight from memory, then split, so
 * the widening loads are the only shuffles. */
static inline __attribute__((always_inline)) void codes_32(
        const uint8_t *low, const uint8_t *high, const int has_high, int64_t at, __m256 c[4]) {
    const __m256i mask = _mm256_set1_epi32(15);
    const __m256i first = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(low + at)));
    const __m256i second = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(low + at + 8)));
    __m256i q[4] = {_mm256_and_si256(first, mask), _mm256_and_si256(second, mask),
                    _mm256_srli_epi32(first, 4), _mm256_srli_epi32(second, 4)};
    if (has_high) {
        const __m256i upper_first = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(high + at)));
        const __m256i upper_second = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(high + at + 8)));
        const __m256i top = _mm256_set1_epi32(0xF0);
        q[0] = _mm256_or_si256(q[0], _mm256_slli_epi32(_mm256_and_si256(upper_first, mask), 4));
        q[1] = _mm256_or_si256(q[1], _mm256_slli_epi32(_mm256_and_si256(upper_second, mask), 4));
        q[2] = _mm256_or_si256(q[2], _mm256_and_si256(upper_first, top));
        q[3] = _mm256_or_si256(q[3], _mm256_and_si256(upper_second, top));
    }
    for (int j = 0; j < 4; j++) c[j] = _mm256_cvtepi32_ps(q[j]);
}

/* The 32 weights from byte `at` of a row's planes, as four vectors of eight floats
 * ordered as the row holds them: scale * code + offset, one FMA each (exact, as the
 * product is). */
static inline __attribute__((always_inline)) void dequantize_32(
        const uint8_t *low, const uint8_t *high, const float *scale, const float *offset,
        int64_t at, const int64_t group, const int has_high, __m256 w[4]) {
    __m256 c[4];
    codes_32(low, high, has_high, at, c);
    const int64_t g = at * 2 / group;
    if (group == 32) {  /* in byte i: weights i and i + 16, one scale */
        const __m256 s = _mm256_set1_ps(scale[g]), o = _mm256_set1_ps(offset[g]);
        w[0] = _mm256_fmadd_ps(c[0], s, o); w[1] = _mm256_fmadd_ps(c[1], s, o);
        w[2] = _mm256_fmadd_ps(c[2], s, o); w[3] = _mm256_fmadd_ps(c[3], s, o);
    } else {  /* two groups of 16: bytes 0-7 hold the first, 8-15 the second */
        const __m256 s0 = _mm256_set1_ps(scale[g]), o0 = _mm256_set1_ps(offset[g]);
        const __m256 s1 = _mm256_set1_ps(scale[g + 1]), o1 = _mm256_set1_ps(offset[g + 1]);
        w[0] = _mm256_fmadd_ps(c[0], s0, o0); w[1] = _mm256_fmadd_ps(c[2], s0, o0);
        w[2] = _mm256_fmadd_ps(c[1], s1, o1); w[3] = _mm256_fmadd_ps(c[3], s1, o1);
    }
}

/* A row of W, dequantized into `out` (k floats). */
static inline __attribute__((always_inline)) void dequantize_row(
        const uint8_t *lo, const uint8_t *hi, const float *scale, const float *offset,
        int64_t k, const int64_t group, const int has_high, float *out) {
    for (int64_t i = 0; i < k; i += 32) {
        __m256 w[4];
        dequantize_32(lo, hi, scale, offset, i / 2, group, has_high, w);
        for (int j = 0; j < 4; j++) _mm256_storeu_ps(out + i + 8 * j, w[j]);
    }
}

#else
static inline __attribute__((always_inline)) void dequantize_row(
        const uint8_t *low, const uint8_t *high, const float *scale, const float *offset,
        int64_t k, const int64_t group, const int has_high, float *out) {
    const int64_t half = group / 2;
    for (int64_t g = 0; g < k / group; g++) {
        const uint8_t *lo = low + g * half;
        const float s = scale[g], o = offset[g];
        float *w = out + g * group;
        if (has_high) {
            const uint8_t *hi = high + g * half;
#pragma omp simd
            for (int64_t i = 0; i < half; i++) {
                w[i] = s * (float)((lo[i] & 15) | ((hi[i] & 15) << 4)) + o;
                w[i + half] = s * (float)((lo[i] >> 4) | ((hi[i] >> 4) << 4)) + o;
            }
        } else {
#pragma omp simd
            for (int64_t i = 0; i < half; i++) {
                w[i] = s * (float)(lo[i] & 15) + o;
                w[i + half] = s * (float)(lo[i] >> 4) + o;
            }
        }
    }
}
#endif

typedef void (*dequantize_row_fn)(const uint8_t *, const uint8_t *, const float *,
                                  const float *, int64_t, float *);
#define DEQUANTIZE_ROW(G, H)                                                                \
    static void dequantize_row_##G##_##H(const uint8_t *lo, const uint8_t *hi,             \
                                         const float *scale, const float *offset,          \
                                         int64_t k, float *out) {                          \
        dequantize_row(lo, hi, scale, offset, k, G, H, out);                               \
    }
FORMAT_VARIANTS(DEQUANTIZE_ROW)
#define DEQUANTIZE_ROW_ENTRY(G, H) dequantize_row_##G##_##H,
static const dequantize_row_fn dequantize_rows[] = {FORMAT_VARIANTS(DEQUANTIZE_ROW_ENTRY)};

/* Rows [n0, n0 + count) of W dequantized into `w` (row-major, k floats a row), then zero
 * rows up to `padded`: the tiles of pc_gemm and of the portable pc_matmul. */
static void dequantize_tile(const uint8_t *low, const uint8_t *high, const float *scale,
                            const float *offset, int64_t n0, int64_t count, int64_t padded,
                            int64_t k, int64_t group, float *w) {
    const int64_t plane = k / 2, groups = k / group;
    const dequantize_row_fn row = dequantize_rows[FORMAT_INDEX(group, high)];
    for (int64_t r = 0; r < count; r++) {
        const int64_t n = n0 + r;
        row(low + n * plane, high ? high + n * plane : NULL, scale + n * groups,
            offset + n * groups, k, w + r * k);
    }
    for (int64_t i = count * k; i < padded * k; i++) w[i] = 0.0f;
}

#ifdef __AVX2__
static inline float horizontal_sum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* *total += the scaled dot product of 32 weights' codes, from byte `at` of a row's
 * planes, with the same 32 entries of x. The dot is summed as two halves, so its chain
 * of dependent FMAs is half as long. */
static inline __attribute__((always_inline)) void accumulate_codes_32(
        const float *x, const uint8_t *low, const uint8_t *high, const int has_high,
        const float *scale, const int64_t group, int64_t at, __m256 *total) {
    __m256 c[4];
    codes_32(low, high, has_high, at, c);
    const int64_t i = 2 * at, g = i / group;
    __m256 first = _mm256_mul_ps(_mm256_loadu_ps(x + i), c[0]);
    if (group == 32) {  /* c[1], c[2], c[3]: weights 8-15, 16-23, 24-31 */
        __m256 second = _mm256_mul_ps(_mm256_loadu_ps(x + i + 8), c[1]);
        first = _mm256_fmadd_ps(_mm256_loadu_ps(x + i + 16), c[2], first);
        second = _mm256_fmadd_ps(_mm256_loadu_ps(x + i + 24), c[3], second);
        *total = _mm256_fmadd_ps(_mm256_add_ps(first, second), _mm256_set1_ps(scale[g]), *total);
    } else {  /* groups of 16: c[0], c[2] the first; c[1], c[3] the second */
        __m256 second = _mm256_mul_ps(_mm256_loadu_ps(x + i + 16), c[1]);
        first = _mm256_fmadd_ps(_mm256_loadu_ps(x + i + 8), c[2], first);
        second = _mm256_fmadd_ps(_mm256_loadu_ps(x + i + 24), c[3], second);
        *total = _mm256_fmadd_ps(first, _mm256_set1_ps(scale[g]), *total);
        *total = _mm256_fmadd_ps(second, _mm256_set1_ps(scale[g + 1]), *total);
    }
}

/* x . W[n] for one row of x, as
 *     sum_g scale[g] * (x_g . code_g) + sum_g offset[g] * sum(x_g):
 * each code vector costs one FMA, where dequantizing it first costs two; the group sums
 * of x are the caller's, shared by every weight row. Alternate blocks of 32 go to two
 * accumulators, or one FMA's latency per block would bound the loop. Measured at one row
 * (benchmarks/quant_kernel_cycles.c, 64 x 1024 4-bit codes, 2-core AVX2 EPYC): 6.3 cycles per
 * 32 weights, against 8.0 for dequantize-then-FMA; at four rows, where the dequantizing
 * FMA is shared by the rows, the other way round (20 against 13). */
static inline __attribute__((always_inline)) float code_dot(
        const float *x, const float *x_sums, const uint8_t *low, const uint8_t *high,
        const float *scale, const float *offset, int64_t k, const int64_t group,
        const int has_high) {
    __m256 even = _mm256_setzero_ps(), odd = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 64 <= k; i += 64) {
        accumulate_codes_32(x, low, high, has_high, scale, group, i / 2, &even);
        accumulate_codes_32(x, low, high, has_high, scale, group, i / 2 + 16, &odd);
    }
    if (i < k) accumulate_codes_32(x, low, high, has_high, scale, group, i / 2, &even);
    const int64_t groups = k / group;
    __m256 offsets = _mm256_setzero_ps();
    int64_t g = 0;
    for (; g + 8 <= groups; g += 8)
        offsets = _mm256_fmadd_ps(_mm256_loadu_ps(offset + g), _mm256_loadu_ps(x_sums + g),
                                  offsets);
    float rest = 0.0f;
    for (; g < groups; g++) rest += offset[g] * x_sums[g];
    return horizontal_sum(_mm256_add_ps(_mm256_add_ps(even, odd), offsets)) + rest;
}

/* out[m, n] for m < rows (at most 4 rows of x), one weight row n: each weight is
 * dequantized once and multiplied into two accumulators per row of x. */
static inline __attribute__((always_inline)) void dequantized_dots(
        const float *x, const int rows, const uint8_t *low, const uint8_t *high,
        const float *scale, const float *offset, int64_t k, const int64_t group,
        const int has_high, float *out, int64_t out_stride) {
    __m256 even[4], odd[4];
    for (int m = 0; m < rows; m++) even[m] = odd[m] = _mm256_setzero_ps();
    for (int64_t i = 0; i < k; i += 32) {
        __m256 w[4];
        dequantize_32(low, high, scale, offset, i / 2, group, has_high, w);
        for (int m = 0; m < rows; m++) {
            const float *xm = x + m * k + i;
            even[m] = _mm256_fmadd_ps(_mm256_loadu_ps(xm), w[0], even[m]);
            odd[m] = _mm256_fmadd_ps(_mm256_loadu_ps(xm + 8), w[1], odd[m]);
            even[m] = _mm256_fmadd_ps(_mm256_loadu_ps(xm + 16), w[2], even[m]);
            odd[m] = _mm256_fmadd_ps(_mm256_loadu_ps(xm + 24), w[3], odd[m]);
        }
    }
    for (int m = 0; m < rows; m++) out[m * out_stride] = horizontal_sum(_mm256_add_ps(even[m], odd[m]));
}

/* out[m * out_stride] = x[m] . W[n] for m < rows_x, one weight row n: code_dot for one
 * row of x, dequantized_dots on 4 rows of x at a time for more, so each weight is
 * dequantized in registers once per 4 rows. */
static inline __attribute__((always_inline)) void matmul_row(
        const float *x, const float *x_sums, int64_t rows_x, const uint8_t *lo,
        const uint8_t *hi, const float *s, const float *o, int64_t k, const int64_t group,
        const int has_high, float *out, int64_t out_stride) {
    if (rows_x == 1) {
        *out = code_dot(x, x_sums, lo, hi, s, o, k, group, has_high);
        return;
    }
    for (int64_t m = 0; m < rows_x; m += 4) {
        const float *xm = x + m * k;
        float *om = out + m * out_stride;
        switch (rows_x - m < 4 ? rows_x - m : 4) {
        case 1: dequantized_dots(xm, 1, lo, hi, s, o, k, group, has_high, om, out_stride); break;
        case 2: dequantized_dots(xm, 2, lo, hi, s, o, k, group, has_high, om, out_stride); break;
        case 3: dequantized_dots(xm, 3, lo, hi, s, o, k, group, has_high, om, out_stride); break;
        default: dequantized_dots(xm, 4, lo, hi, s, o, k, group, has_high, om, out_stride); break;
        }
    }
}

/* matmul_row over weight rows [begin, end), compiled for each format variant
 * (pc_matmul_rows). */
#define MATMUL_ROWS(G, H)                                                                   \
    static void matmul_rows_##G##_##H(                                                     \
            const float *x, const float *x_sums, int64_t rows_x, const uint8_t *low,       \
            const uint8_t *high, const float *scale, const float *offset, int64_t begin,   \
            int64_t end, int64_t k, float *out, int64_t out_stride) {                      \
        const int64_t plane = k / 2, groups = k / G;                                       \
        for (int64_t n = begin; n < end; n++)                                              \
            matmul_row(x, x_sums, rows_x, low + n * plane, H ? high + n * plane : NULL,    \
                       scale + n * groups, offset + n * groups, k, G, H, out + n,          \
                       out_stride);                                                        \
    }
FORMAT_VARIANTS(MATMUL_ROWS)
#define MATMUL_ROWS_ENTRY(G, H) matmul_rows_##G##_##H,
const pc_matmul_rows_fn pc_matmul_rows[3] = {FORMAT_VARIANTS(MATMUL_ROWS_ENTRY)};

/* What code_dot takes for one row of x, computed once per product, not once per weight
 * row. */
void pc_x_group_sums(const float *x, int64_t k, int64_t group, float *sums) {
    for (int64_t g = 0; g < k / group; g++) {
        float sum = 0.0f;
        for (int64_t i = 0; i < group; i++) sum += x[g * group + i];
        sums[g] = sum;
    }
}

void pc_matmul(const float *x, int64_t rows_x, const uint8_t *low, const uint8_t *high,
               const float *scale, const float *offset, int64_t n_rows, int64_t k,
               int64_t group, float *out, int64_t out_stride, int threads) {
    const pc_matmul_rows_fn rows = pc_matmul_rows[FORMAT_INDEX(group, high)];
    float x_sums[rows_x == 1 ? k / group : 1];
    if (rows_x == 1) pc_x_group_sums(x, k, group, x_sums);
    const int64_t chunks = (n_rows + STREAM_CHUNK_ROWS - 1) / STREAM_CHUNK_ROWS;
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1)
    for (int64_t chunk = 0; chunk < chunks; chunk++) {
        const int64_t begin = chunk * STREAM_CHUNK_ROWS;
        rows(x, x_sums, rows_x, low, high, scale, offset, begin,
             begin + STREAM_CHUNK_ROWS < n_rows ? begin + STREAM_CHUNK_ROWS : n_rows, k, out,
             out_stride);
    }
}

#define GEMM_MR 4
#define GEMM_NR 3

/* out[m, n] = x[m] . w[n] for m < mr rows of x and GEMM_NR rows of w (of which the first
 * `nr` are stored), over all k: MR x NR accumulators, each step's NR weight vectors and
 * MR x vectors loaded once and multiplied pairwise (7 loads per 12 FMAs at 4 x 3, so the
 * FMA units, not the loads, bound it), summed across lanes once at the end. */
static inline __attribute__((always_inline)) void dot_block(
        const float *x, const int mr, const float *w, const int nr, int64_t k, float *out,
        int64_t out_stride) {
    __m256 acc[GEMM_MR][GEMM_NR];
    for (int m = 0; m < mr; m++)
        for (int n = 0; n < GEMM_NR; n++) acc[m][n] = _mm256_setzero_ps();
    for (int64_t i = 0; i < k; i += 8) {
        __m256 wv[GEMM_NR];
        /* Each load held in a register (the empty asm): GCC would otherwise fold it into
         * every FMA that uses it, 15 loads per step where 7 do. */
        for (int n = 0; n < GEMM_NR; n++) {
            wv[n] = _mm256_loadu_ps(w + n * k + i);
            __asm__("" : "+x"(wv[n]));
        }
        for (int m = 0; m < mr; m++) {
            __m256 xv = _mm256_loadu_ps(x + m * k + i);
            __asm__("" : "+x"(xv));
            for (int n = 0; n < GEMM_NR; n++) acc[m][n] = _mm256_fmadd_ps(xv, wv[n], acc[m][n]);
        }
    }
    for (int m = 0; m < mr; m++)
        for (int n = 0; n < nr; n++) out[m * out_stride + n] = horizontal_sum(acc[m][n]);
}

/* dot_block for 1-4 rows of x, each compiled on its own: inlined into pc_gemm's loops,
 * GCC keeps one of the 12 accumulators on the stack (a store and a load in every step's
 * dependency chain: 34 against 88 GFLOP/s a core). */
#define DOT_BLOCK_ROWS(MR)                                                                 \
    static __attribute__((noinline)) void dot_block_##MR(                                \
            const float *x, const float *w, int nr, int64_t k, float *out,              \
            int64_t out_stride) {                                                        \
        dot_block(x, MR, w, nr, k, out, out_stride);                                     \
    }
DOT_BLOCK_ROWS(1)
DOT_BLOCK_ROWS(2)
DOT_BLOCK_ROWS(3)
DOT_BLOCK_ROWS(4)
static void (*const dot_blocks[GEMM_MR])(const float *, const float *, int, int64_t, float *,
                                         int64_t) = {dot_block_1, dot_block_2, dot_block_3,
                                                     dot_block_4};

/* Tile `t` of pc_gemm: weight rows [t * GEMM_TILE_ROWS, +GEMM_TILE_ROWS) dequantized once
 * into `w` (GEMM_TILE_ROWS * k floats, padded with zero rows to a multiple of GEMM_NR),
 * then every block of GEMM_MR rows of x multiplied with it by dot_block. */
void pc_gemm_tile(const float *x, int64_t rows_x, const uint8_t *low, const uint8_t *high,
                  const float *scale, const float *offset, int64_t n_rows, int64_t k,
                  int64_t group, int64_t t, float *w, float *out, int64_t out_stride) {
    const int64_t n0 = t * GEMM_TILE_ROWS;
    const int64_t count = n_rows - n0 < GEMM_TILE_ROWS ? n_rows - n0 : GEMM_TILE_ROWS;
    dequantize_tile(low, high, scale, offset, n0, count,
                    (count + GEMM_NR - 1) / GEMM_NR * GEMM_NR, k, group, w);
    for (int64_t m = 0; m < rows_x; m += GEMM_MR) {
        const float *xm = x + m * k;
        const int mr = rows_x - m < GEMM_MR ? (int)(rows_x - m) : GEMM_MR;
        for (int64_t r = 0; r < count; r += GEMM_NR) {
            const int nr = count - r < GEMM_NR ? (int)(count - r) : GEMM_NR;
            dot_blocks[mr - 1](xm, w + r * k, nr, k, out + m * out_stride + n0 + r, out_stride);
        }
    }
}

/* `pc_matmul` for many rows of x (compute-bound), by tiles of GEMM_TILE_ROWS weight rows
 * (pc_gemm_tile), each to the next thread free (as pc_matmul's chunks). */
void pc_gemm(const float *x, int64_t rows_x, const uint8_t *low, const uint8_t *high,
             const float *scale, const float *offset, int64_t n_rows, int64_t k,
             int64_t group, float *out, int64_t out_stride, int threads) {
    const int64_t tiles = (n_rows + GEMM_TILE_ROWS - 1) / GEMM_TILE_ROWS;
#pragma omp parallel num_threads(threads)
    {
        float *w = aligned_alloc(64, GEMM_TILE_ROWS * k * sizeof(float));
#pragma omp for schedule(dynamic, 1)
        for (int64_t t = 0; t < tiles; t++)
            pc_gemm_tile(x, rows_x, low, high, scale, offset, n_rows, k, group, t, w, out,
                         out_stride);
        free(w);
    }
}
#else
void pc_matmul(const float *x, int64_t rows_x, const uint8_t *low, const uint8_t *high,
               const float *scale, const float *offset, int64_t n_rows, int64_t k,
               int64_t group, float *out, int64_t out_stride, int threads) {
    const int64_t tiles = (n_rows + ROWS_PER_TILE - 1) / ROWS_PER_TILE;
#pragma omp parallel num_threads(threads)
    {
        float *w = aligned_alloc(64, ((ROWS_PER_TILE * k * sizeof(float)) + 63) / 64 * 64);
#pragma omp for schedule(static)
        for (int64_t t = 0; t < tiles; t++) {
            const int64_t n0 = t * ROWS_PER_TILE;
            const int64_t count = n_rows - n0 < ROWS_PER_TILE ? n_rows - n0 : ROWS_PER_TILE;
            dequantize_tile(low, high, scale, offset, n0, count, ROWS_PER_TILE, k, group, w);
            const float *w0 = w, *w1 = w + k, *w2 = w + 2 * k, *w3 = w + 3 * k;
            for (int64_t m = 0; m < rows_x; m++) {
                const float *xm = x + m * k;
                float a0 = 0.0f, a1 = 0.0f, a2 = 0.0f, a3 = 0.0f;
#pragma omp simd reduction(+ : a0, a1, a2, a3)
                for (int64_t i = 0; i < k; i++) {
                    const float v = xm[i];
                    a0 += v * w0[i];
                    a1 += v * w1[i];
                    a2 += v * w2[i];
                    a3 += v * w3[i];
                }
                float *o = out + m * out_stride + n0;
                const float acc[ROWS_PER_TILE] = {a0, a1, a2, a3};
                for (int64_t r = 0; r < count; r++) o[r] = acc[r];
            }
        }
        free(w);
    }
}
#endif

/* Rows of W (`rows` of them) as float32 into `out` (k floats a row): row ids[i] into row
 * i, for i < count, or rows 0..count-1 where ids is NULL (an embedding lookup gathers, a
 * tile does not). Returns -1, writing nothing, where an id is not a row of W. */
int pc_dequantize(const uint8_t *low, const uint8_t *high, const float *scale,
                  const float *offset, int64_t rows, const int64_t *ids, int64_t count,
                  int64_t k, int64_t group, float *out, int threads) {
    const int64_t plane = k / 2, groups = k / group;
    const dequantize_row_fn row = dequantize_rows[FORMAT_INDEX(group, high)];
    for (int64_t i = 0; ids && i < count; i++)
        if (ids[i] < 0 || ids[i] >= rows) return -1;
#pragma omp parallel for num_threads(threads) schedule(static) if (count > 1)
    for (int64_t i = 0; i < count; i++) {
        const int64_t n = ids ? ids[i] : i;
        row(low + n * plane, high ? high + n * plane : NULL, scale + n * groups,
            offset + n * groups, k, out + i * k);
    }
    return 0;
}
