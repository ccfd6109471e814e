/* A decode step's linear layers run back to back from C, as the fused step runs them
 * (dl_matmul of models/decode_layer.c, the kernel LayerMatmul picks), with nothing
 * between them: what benchmarks/quant_kernel_probe.py times as its "fused" row, the rate
 * at which the step's products read their weights without the per-call Python of the
 * "engine" row. Built by the probe with engine/native/build.py (the engine folder is on the
 * include path). */
#include "models/decode_layer.c"

void ls_products(const dl_linear *linears, int64_t count, int64_t tokens,
                 int64_t stream_max_rows, const float *x, float *out, int threads) {
    const dl_step step = {.tokens = tokens, .stream_max_rows = stream_max_rows,
                          .threads = threads};
    for (int64_t i = 0; i < count; i++) dl_matmul(&linears[i], &step, x, out);
}
