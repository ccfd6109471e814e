/* The decoder's pointwise work on the CPU, float32, each one pass over its rows instead of
 * a chain of torch ops (each a full read and write of the activations, a dispatch and an
 * OpenMP fork/join): residual add + RMSNorm, rotate-half RoPE in place in the fused QKV
 * output, SiLU-and-mul. Rows are split over OpenMP threads. Numerics follow the torch
 * reference in llama.py: RMSNorm as weight * (x * 1/sqrt(mean(x^2) + eps)); RoPE as
 * x * cos + rotate_half(x) * sin from the same tables; SiLU as g / (1 + exp(-g)). */
#include <stddef.h>

#include "fused_ops.h"

/* add_rms_norm_row over `rows` rows. */
void fo_add_rms_norm(const float *delta, float *residual, const float *weight, float eps,
                     int64_t rows, int64_t hidden, float *out, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (rows > 1)
    for (int64_t r = 0; r < rows; r++)
        add_rms_norm_row(delta ? delta + r * hidden : NULL, residual + r * hidden, weight, eps,
                         hidden, out + r * hidden);
}

/* rope_row over each token's row (row stride `stride`), by its cos/sin rows ([tokens, dim]). */
void fo_rope(float *rows, int64_t stride, int64_t tokens, int64_t heads, int64_t dim,
             const float *cos_rows, const float *sin_rows, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (tokens > 1)
    for (int64_t t = 0; t < tokens; t++)
        rope_row(rows + t * stride, heads, dim, cos_rows + t * dim, sin_rows + t * dim);
}

/* silu_and_mul_row over `rows` rows. */
void fo_silu_and_mul(const float *gate_up, int64_t rows, int64_t size, float *out,
                     int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (rows > 1)
    for (int64_t r = 0; r < rows; r++)
        silu_and_mul_row(gate_up + r * 2 * size, size, out + r * size);
}
