/* CPU kernels over the quantized layout of layout.py (see there): every weight is
 * scale * code + offset, code = low nibble | high nibble << 4, one scale and offset per
 * group of G weights of a row. In each group of G, byte i of a plane holds the nibble of
 * weight i (bits 0-3) and of weight i + G/2 (bits 4-7).
 *
 * pc_dequantize writes rows as float32; pc_matmul computes out = x @ W.T for a few rows
 * of x, reading each weight byte once per 4 rows of x. With AVX2 + FMA, 32 weights at a
 * time are dequantized in registers (FMA of code and scale plus offset: exact, as the
 * product is) and multiplied into two accumulators per row of x; elsewhere, four weight
 * rows at a time are dequantized into a buffer that stays in L1, in loops written for
 * the compiler to vectorize. Rows of W are split over OpenMP threads: torch's own
 * runtime, already loaded (same soname), so its thread count and pool are shared. */
#include <stdint.h>
#include <stdlib.h>

#ifdef __AVX2__
#include <immintrin.h>
#endif

#define ROWS_PER_TILE 4

#ifdef __AVX2__
/* The 32 weights from byte `at` of a row's planes, as four vectors of eight floats
 * ordered as the row holds them. */
static inline __attribute__((always_inline)) void dequantize_32(
        const uint8_t *low, const uint8_t *high, const float *scale, const float *offset,
        int64_t at, int64_t group, __m256 w[4]) {
    const __m128i mask = _mm_set1_epi8(15);
    const __m128i bytes = _mm_loadu_si128((const __m128i *)(low + at));
    __m128i lo = _mm_and_si128(bytes, mask);
    __m128i hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), mask);
    if (high) {
        const __m128i upper = _mm_loadu_si128((const __m128i *)(high + at));
        lo = _mm_or_si128(lo, _mm_slli_epi16(_mm_and_si128(upper, mask), 4));
        hi = _mm_or_si128(hi, _mm_andnot_si128(mask, upper));
    }
    const __m256 a = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo));
    const __m256 b = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8)));
    const __m256 c = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi));
    const __m256 d = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8)));
    const int64_t g = at * 2 / group;
    if (group == 32) {  /* lo: weights 0-15, hi: 16-31, one scale */
        const __m256 s = _mm256_set1_ps(scale[g]), o = _mm256_set1_ps(offset[g]);
        w[0] = _mm256_fmadd_ps(a, s, o); w[1] = _mm256_fmadd_ps(b, s, o);
        w[2] = _mm256_fmadd_ps(c, s, o); w[3] = _mm256_fmadd_ps(d, s, o);
    } else {  /* two groups of 16: bytes 0-7 hold the first, 8-15 the second */
        const __m256 s0 = _mm256_set1_ps(scale[g]), o0 = _mm256_set1_ps(offset[g]);
        const __m256 s1 = _mm256_set1_ps(scale[g + 1]), o1 = _mm256_set1_ps(offset[g + 1]);
        w[0] = _mm256_fmadd_ps(a, s0, o0); w[1] = _mm256_fmadd_ps(c, s0, o0);
        w[2] = _mm256_fmadd_ps(b, s1, o1); w[3] = _mm256_fmadd_ps(d, s1, o1);
    }
}

static inline float horizontal_sum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* out[m, n] for m < ROWS (at most 4 rows of x), one weight row n. */
static inline __attribute__((always_inline)) void row_dots(
        const float *x, const int rows, const uint8_t *low, const uint8_t *high,
        const float *scale, const float *offset, int64_t k, int64_t group, float *out,
        int64_t out_stride) {
    __m256 even[4], odd[4];
    for (int m = 0; m < rows; m++) even[m] = odd[m] = _mm256_setzero_ps();
    for (int64_t i = 0; i < k; i += 32) {
        __m256 w[4];
        dequantize_32(low, high, scale, offset, i / 2, group, w);
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

/* out[m, n] (row stride out_stride) = sum_k x[m, k] * W[n, k], for m < rows_x; k is a
 * multiple of 32. Each weight is dequantized in registers once per 4 rows of x. */
void pc_matmul(const float *x, int64_t rows_x, const uint8_t *low, const uint8_t *high,
               const float *scale, const float *offset, int64_t n_rows, int64_t k,
               int64_t group, float *out, int64_t out_stride, int threads) {
    const int64_t plane = k / 2, groups = k / group;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t n = 0; n < n_rows; n++) {
        const uint8_t *lo = low + n * plane, *hi = high ? high + n * plane : NULL;
        const float *s = scale + n * groups, *o = offset + n * groups;
        for (int64_t m = 0; m < rows_x; m += 4) {
            const float *xm = x + m * k;
            float *om = out + m * out_stride + n;
            switch (rows_x - m < 4 ? rows_x - m : 4) {
            case 1: row_dots(xm, 1, lo, hi, s, o, k, group, om, out_stride); break;
            case 2: row_dots(xm, 2, lo, hi, s, o, k, group, om, out_stride); break;
            case 3: row_dots(xm, 3, lo, hi, s, o, k, group, om, out_stride); break;
            default: row_dots(xm, 4, lo, hi, s, o, k, group, om, out_stride); break;
            }
        }
    }
}
#else
static void dequantize_row(const uint8_t *low, const uint8_t *high, const float *scale,
                           const float *offset, int64_t k, int64_t group, float *out) {
    const int64_t half = group / 2;
    for (int64_t g = 0; g < k / group; g++) {
        const uint8_t *lo = low + g * half;
        const float s = scale[g], o = offset[g];
        float *w = out + g * group;
        if (high) {
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


/* out[m, n] (row stride out_stride) = sum_k x[m, k] * W[n, k], for m < rows_x. */
void pc_matmul(const float *x, int64_t rows_x, const uint8_t *low, const uint8_t *high,
               const float *scale, const float *offset, int64_t n_rows, int64_t k,
               int64_t group, float *out, int64_t out_stride, int threads) {
    const int64_t plane = k / 2, groups = k / group;
    const int64_t tiles = (n_rows + ROWS_PER_TILE - 1) / ROWS_PER_TILE;
#pragma omp parallel num_threads(threads)
    {
        float *w = aligned_alloc(64, ((ROWS_PER_TILE * k * sizeof(float)) + 63) / 64 * 64);
#pragma omp for schedule(static)
        for (int64_t t = 0; t < tiles; t++) {
            const int64_t n0 = t * ROWS_PER_TILE;
            const int64_t count = n_rows - n0 < ROWS_PER_TILE ? n_rows - n0 : ROWS_PER_TILE;
            for (int64_t r = 0; r < count; r++) {
                const int64_t n = n0 + r;
                dequantize_row(low + n * plane, high ? high + n * plane : NULL,
                               scale + n * groups, offset + n * groups, k, group, w + r * k);
            }
            for (int64_t r = count; r < ROWS_PER_TILE; r++)
                for (int64_t i = 0; i < k; i++) w[r * k + i] = 0.0f;
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

void pc_dequantize(const uint8_t *low, const uint8_t *high, const float *scale,
                   const float *offset, int64_t rows, int64_t k, int64_t group, float *out,
                   int threads) {
    const int64_t plane = k / 2, groups = k / group;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t n = 0; n < rows; n++) {
        const uint8_t *lo = low + n * plane, *hi = high ? high + n * plane : NULL;
#ifdef __AVX2__
        for (int64_t i = 0; i < k; i += 32) {
            __m256 w[4];
            dequantize_32(lo, hi, scale + n * groups, offset + n * groups, i / 2, group, w);
            float *o = out + n * k + i;
            for (int j = 0; j < 4; j++) _mm256_storeu_ps(o + 8 * j, w[j]);
        }
#else
        dequantize_row(lo, hi, scale + n * groups, offset + n * groups, k, group, out + n * k);
#endif
    }
}
