/* The quantized kernels of quant_kernels.c: the entry points kernels.py calls, and the
 * pieces decode_layer.c runs chunk by chunk inside its own schedule. */
#ifndef PAGED_CHAT_QUANT_KERNELS_H
#define PAGED_CHAT_QUANT_KERNELS_H

#include <stdint.h>

/* (group, has_high) of every format family: Q4_0, Q4_1, Q4_K; Q5_0, Q5_1, Q5_K, Q8_0; Q6_K
 * (kernels.py's KERNEL_FORMATS, which it checks every weight against). */
#define FORMAT_VARIANTS(X) X(32, 0) X(32, 1) X(16, 1)
#define FORMAT_INDEX(group, high) ((group) == 16 ? 2 : (high) != NULL)

/* Weight rows of a chunk of pc_matmul's: ~40 KB of 8-bit weights at the default model's
 * widths, a few microseconds. Chunks, not even shares, go to the threads: a thread that
 * another process deschedules holds the product up for its chunk, not for its share. */
#define STREAM_CHUNK_ROWS 64

/* Dequantized weight rows per tile of pc_gemm: a multiple of GEMM_NR, about 55-150 KB of
 * float32 at the default model's widths, so a tile stays in L2 while every row of x
 * passes over it. */
#define GEMM_TILE_ROWS 24

/* out[m, n] (row stride out_stride) = sum_k x[m, k] * W[n, k], for m < rows_x; k is a
 * multiple of 32. */
void pc_matmul(const float *x, int64_t rows_x, const uint8_t *low, const uint8_t *high,
               const float *scale, const float *offset, int64_t n_rows, int64_t k,
               int64_t group, float *out, int64_t out_stride, int threads);

/* Rows of W as float32 (see quant_kernels.c); -1, writing nothing, where an id is not a
 * row of W. */
int pc_dequantize(const uint8_t *low, const uint8_t *high, const float *scale,
                  const float *offset, int64_t rows, const int64_t *ids, int64_t count,
                  int64_t k, int64_t group, float *out, int threads);

#ifdef __AVX2__
/* pc_matmul for many rows of x (compute-bound), by tiles of GEMM_TILE_ROWS weight rows. */
void pc_gemm(const float *x, int64_t rows_x, const uint8_t *low, const uint8_t *high,
             const float *scale, const float *offset, int64_t n_rows, int64_t k,
             int64_t group, float *out, int64_t out_stride, int threads);

/* pc_matmul's work on weight rows [begin, end), one function per format variant, indexed
 * by FORMAT_INDEX; x_sums is pc_x_group_sums of x where rows_x is 1. */
typedef void (*pc_matmul_rows_fn)(const float *x, const float *x_sums, int64_t rows_x,
                                  const uint8_t *low, const uint8_t *high, const float *scale,
                                  const float *offset, int64_t begin, int64_t end, int64_t k,
                                  float *out, int64_t out_stride);
extern const pc_matmul_rows_fn pc_matmul_rows[3];

/* The sums of x's groups of `group` floats (k / group of them). */
void pc_x_group_sums(const float *x, int64_t k, int64_t group, float *sums);

/* Tile `t` of pc_gemm into out, dequantized into `w` (GEMM_TILE_ROWS * k floats). */
void pc_gemm_tile(const float *x, int64_t rows_x, const uint8_t *low, const uint8_t *high,
                  const float *scale, const float *offset, int64_t n_rows, int64_t k,
                  int64_t group, int64_t t, float *w, float *out, int64_t out_stride);
#endif

#endif
