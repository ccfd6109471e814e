/* The decoder's pointwise row kernels (fused_ops.c runs them over rows on OpenMP threads,
 * decode_layer.c inside its own schedule): one definition, inlined into both. */
#ifndef PAGED_CHAT_FUSED_OPS_H
#define PAGED_CHAT_FUSED_OPS_H

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

#endif
