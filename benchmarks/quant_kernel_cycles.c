/* Cycles per 32 weights of pc_matmul (engine/native/csrc/quant_kernels.c) on one thread, for a
 * weight matrix small enough to stay in L2: the best of 3000 calls by the time-stamp
 * counter, so a shared, loaded machine still shows the kernel's own speed (the TSC ticks
 * at the nominal clock, not the boosted one: compare figures from one machine only).
 *
 *   cc -O3 -march=native -o /tmp/cycles benchmarks/quant_kernel_cycles.c \
 *       -Ipaged_chat/engine/native/csrc paged_chat/engine/native/csrc/quant_kernels.c
 *   /tmp/cycles ROWS_OF_W K HIGH_PLANE(0|1) ROWS_OF_X     e.g. /tmp/cycles 64 1024 0 1
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <x86intrin.h>

#include "quant_kernels.h"

int main(int argc, char **argv) {
    if (argc != 5) {
        fprintf(stderr, "usage: %s ROWS_OF_W K HIGH_PLANE ROWS_OF_X\n", argv[0]);
        return 2;
    }
    const int64_t n = atoll(argv[1]), k = atoll(argv[2]), rows = atoll(argv[4]);
    const int with_high = atoi(argv[3]);
    const int64_t codes = n * k / 2, groups = n * k / 32;
    uint8_t *low = malloc(codes), *high = with_high ? malloc(codes) : NULL;
    float *scale = malloc(groups * sizeof(float)), *offset = malloc(groups * sizeof(float));
    float *x = malloc(rows * k * sizeof(float)), *out = malloc(rows * n * sizeof(float));
    for (int64_t i = 0; i < codes; i++) {
        low[i] = rand();
        if (high) high[i] = rand();
    }
    for (int64_t g = 0; g < groups; g++) scale[g] = 0.01f, offset[g] = -0.1f;
    for (int64_t i = 0; i < rows * k; i++) x[i] = (rand() % 100) / 100.0f;
    uint64_t best = UINT64_MAX;
    for (int repeat = 0; repeat < 3000; repeat++) {
        const uint64_t start = __rdtsc();
        pc_matmul(x, rows, low, high, scale, offset, n, k, 32, out, n, 1);
        const uint64_t ticks = __rdtsc() - start;
        if (ticks < best) best = ticks;
    }
    printf("W %lld x %lld, %s, %lld rows of x: %.2f TSC ticks per 32 weights\n",
           (long long)n, (long long)k, high ? "8-bit codes" : "4-bit codes", (long long)rows,
           32.0 * best / ((double)n * k));
    return 0;
}
