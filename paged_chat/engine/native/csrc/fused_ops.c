/* The decoder's pointwise work on the CPU, float32, each one pass over its rows instead of
 * a chain of torch ops (each a full read and write of the activations, a dispatch and an
 * OpenMP fork/join): residual add + RMSNorm, rotate-half RoPE in place in the fused QKV
 * output, SiLU-and-mul. Rows are split over OpenMP threads. Numerics follow the torch
 * reference in llama.py: RMSNorm as weight * (x * 1/sqrt(mean(x^2) + eps)); RoPE as
 * x * cos + rotate_half(x) * sin from the same tables; SiLU as g / (1 + exp(-g)). */
#include <math.h>
#include <stdint.h>

#ifdef __AVX2__
#include <immintrin.h>
#endif

#include "vector_exp.h"

/* residual += delta (when delta is not NULL), then out = weight * norm(residual), for one
 * row of `hidden` floats. */
static inline void add_rms_norm_row(const float *delta, float *residual, const float *weight,
                                    float eps, int64_t hidden, float *out) {
    if (delta) {
#pragma omp simd
        for (int64_t i = 0; i < hidden; i++) residual[i] += delta[i];
    }
    float squares = 0.0f;
#pragma omp simd reduction(+ : squares)
    for (int64_t i = 0; i < hidden; i++) squares += residual[i] * residual[i];
    const float inverse = 1.0f / sqrtf(squares / (float)hidden + eps);
#pragma omp simd
    for (int64_t i = 0; i < hidden; i++) out[i] = weight[i] * (residual[i] * inverse);
}

/* add_rms_norm_row over `rows` rows. */
void fo_add_rms_norm(const float *delta, float *residual, const float *weight, float eps,
                     int64_t rows, int64_t hidden, float *out, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (rows > 1)
    for (int64_t r = 0; r < rows; r++)
        add_rms_norm_row(delta ? delta + r * hidden : NULL, residual + r * hidden, weight, eps,
                         hidden, out + r * hidden);
}

/* Rotate the first `heads` heads of `dim` floats of one token's row in place by its cos/sin
 * rows (`dim` floats each, gathered at its position). */
static inline void rope_row(float *row, int64_t heads, int64_t dim, const float *c,
                            const float *s) {
    const int64_t half = dim / 2;
    for (int64_t h = 0; h < heads; h++) {
        float *x = row + h * dim;
#pragma omp simd
        for (int64_t i = 0; i < half; i++) {
            const float first = x[i], second = x[i + half];
            x[i] = first * c[i] - second * s[i];
            x[i + half] = second * c[i + half] + first * s[i + half];
        }
    }
}

/* rope_row over each token's row (row stride `stride`), by its cos/sin rows ([tokens, dim]). */
void fo_rope(float *rows, int64_t stride, int64_t tokens, int64_t heads, int64_t dim,
             const float *cos_rows, const float *sin_rows, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (tokens > 1)
    for (int64_t t = 0; t < tokens; t++)
        rope_row(rows + t * stride, heads, dim, cos_rows + t * dim, sin_rows + t * dim);
}

/* out[i] = silu(gate_up[i]) * gate_up[size + i], for one row of 2 * size floats. */
static inline void silu_and_mul_row(const float *gate_up, int64_t size, float *out) {
    const float *g = gate_up, *u = gate_up + size;
    int64_t i = 0;
#ifdef __AVX2__
    const __m256 one = _mm256_set1_ps(1.0f);
    for (; i + 8 <= size; i += 8) {
        const __m256 x = _mm256_loadu_ps(g + i);
        const __m256 sigmoid_inverse = _mm256_add_ps(one, exp8(_mm256_sub_ps(
            _mm256_setzero_ps(), x)));
        _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_div_ps(x, sigmoid_inverse),
                                                _mm256_loadu_ps(u + i)));
    }
#endif
    for (; i < size; i++) out[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
}

/* silu_and_mul_row over `rows` rows. */
void fo_silu_and_mul(const float *gate_up, int64_t rows, int64_t size, float *out,
                     int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (rows > 1)
    for (int64_t r = 0; r < rows; r++)
        silu_and_mul_row(gate_up + r * 2 * size, size, out + r * size);
}
