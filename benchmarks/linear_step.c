/* A decode step's linear layers run back to back from C, by the kernel LayerMatmul picks
 * (pc_matmul up to stream_max_rows rows of x, pc_gemm above), with nothing between them:
 * what benchmarks/quant_kernel_probe.py times as its "fused" row, the rate at which the
 * step's products read their weights without the per-call Python of the "engine" row.
 * The probe builds it with the engine's C sources into one library (engine/native/build.py),
 * through their headers. */
#include <stdint.h>

#include "decode_layer.h"
#include "quant_kernels.h"

void ls_products(const dl_linear *linears, int64_t count, int64_t tokens,
                 int64_t stream_max_rows, const float *x, float *out, int threads) {
    for (int64_t i = 0; i < count; i++) {
        const dl_linear *w = &linears[i];
        for (int64_t p = 0; p < w->parts; p++) {
#ifdef __AVX2__
            if (tokens > stream_max_rows) {
                pc_gemm(x, tokens, w->low[p], w->high[p], w->scale[p], w->offset[p], w->rows[p],
                        w->in_features, w->group[p], out + w->column[p], w->out_features,
                        threads);
                continue;
            }
#endif
            pc_matmul(x, tokens, w->low[p], w->high[p], w->scale[p], w->offset[p], w->rows[p],
                      w->in_features, w->group[p], out + w->column[p], w->out_features, threads);
        }
    }
}
