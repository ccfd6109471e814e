/* A Llama decoder layer's whole step in one C call (float32, CPU, quantized linear layers,
 * paged attention by paged_attention.c), for steps whose every sequence the
 * attention kernel attends itself. It runs the bodies of the kernels the layer's Python
 * forward calls one at a time (llama.py: DecoderLayer with fused ops), in the same order
 * on the same rows, so its results are bit for bit theirs. What it saves:
 *
 * - the Python, torch dispatch and ctypes work between those calls, about twenty a layer,
 *   most of a batch-1 decode step's time besides the weights' reads;
 * - the barrier at the end of each one. Each kernel splits its work evenly over the
 *   threads and waits for all of them: where another process takes a core for a few
 *   milliseconds (the app's UI beside its engine), the thread it descheduled stalls every
 *   region, ~300 a step, and the step runs at a fraction of one thread's speed. Here the
 *   step's work is chunks that any thread takes (dl_schedule): the others take a
 *   descheduled thread's share and wait only for the chunk it is in.
 *
 * Per layer, for x the previous layer's output (NULL for the first layer, whose input is
 * the residual stream itself):
 *     residual += x; normed = rms_norm(residual)              input_layernorm
 *     qkv = normed @ Wqkv.T; RoPE on Q and K in place         self_attn
 *     attended = attention(q, k, v) (new K/V stored first)
 *     residual += attended @ Wo.T; normed = rms_norm(residual) post_attention_layernorm
 *     out = silu_and_mul(normed @ Wgate_up.T) @ Wdown.T        mlp
 */
#include <stdint.h>
#include <stdlib.h>
#include <time.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#ifdef __linux__
#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>
#else
#include <sched.h>
#endif

#include "decode_layer.h"
#include "fused_ops.h"
#include "paged_attention.h"
#include "quant_kernels.h"

int64_t dl_linear_size(void) { return (int64_t)sizeof(dl_linear); }
int64_t dl_layer_size(void) { return (int64_t)sizeof(dl_layer); }
int64_t dl_step_size(void) { return (int64_t)sizeof(dl_step); }

#ifdef __AVX2__
/* The phases of a layer's step, in order: every chunk of one reads what the chunks of the
 * phases before it wrote, and each phase's chunks write disjoint rows (or columns). */
enum { INPUT_NORM, QKV, ROPE_STORE, ATTEND, O_PROJ, POST_NORM, GATE_UP, SILU, DOWN, PHASES };

/* Chunks of a pointwise phase per thread: rows split finer than the threads, for the
 * balance, not so fine that a chunk is less than its claim. */
#define ROW_CHUNKS_PER_THREAD 4
/* How long a thread that waits for a phase spins before it sleeps: longer than a chunk, so
 * on a quiet machine it never sleeps, short beside the time slice of a process that took
 * the other core, for which it lets its core go (the scheduler may move the descheduled
 * thread there). */
#define SPIN_NS 50000

/* One step's work as chunks, handed out without a barrier that waits for every thread:
 *
 * - Phase i of the step (layer i / PHASES, phase i % PHASES) has chunks[i] chunks. Thread
 *   t owns the range ranges[t * stride + i] of them (front in the low 32 bits, back in the
 *   high), an even share set before the threads start. It takes chunks from the front of
 *   its own range, then from the back of every other thread's, each by a compare-and-swap
 *   of the range, so a chunk runs exactly once and a thread that is descheduled (or starts
 *   late) holds up no chunk but the one it is in: the others take the rest of its share.
 * - A thread adds the chunks it ran of phase i to done[i] when none is left to take, then
 *   waits until done[i] == chunks[i] before phase i + 1: only the chunks in flight are
 *   waited for. The release of that add and the acquire of the wait order every chunk's
 *   writes before the next phase's reads.
 * - A waiting thread spins SPIN_NS, then sleeps on done[i] (a futex), counted in
 *   `sleepers` first, so the thread whose add ends the phase wakes it exactly when one may
 *   sleep.
 *
 * Invariant: for every i and t, front <= back within phase i's chunks, and the ranges of
 * phase i partition [0, chunks[i]) minus the chunks taken. */
typedef struct {
    const dl_layer *const *layers;
    const dl_step *step;
    float *residual, *out;
    const int64_t *first_item;   /* pa_items of the step's sequences, the same in every layer */
    int64_t phases, stride, row_chunk;
    int64_t *chunks;
    uint64_t *ranges;
    int32_t *done;
    int32_t sleepers;
} dl_schedule;

/* What one thread keeps: a tile for pc_gemm's chunks, x's group sums for pc_matmul's at one
 * row (for the phase and part in sums_of), an attention work item's workspace. */
typedef struct {
    float *tile, *sums, *attention;
    int64_t sums_of, seq;
} dl_worker;

/* The attention problem of `layer` in this step. */
static pa_problem dl_problem(const dl_layer *layer, const dl_step *step) {
    const int64_t q_size = layer->heads * layer->head_dim;
    const int64_t kv_size = layer->kv_heads * layer->head_dim, width = layer->qkv.out_features;
    const pa_problem problem = {
        step->qkv, step->qkv + q_size, step->qkv + q_size + kv_size, width, width, width,
        layer->key_cache, layer->value_cache, layer->kv_dtype, layer->num_blocks,
        layer->block_size,
        step->slot_mapping, step->tokens, step->query_start, step->seq_lens,
        step->block_tables, step->table_width, step->num_seqs, layer->heads,
        layer->kv_heads, layer->head_dim, layer->scale, layer->window, step->attended};
    return problem;
}

static int dl_gemm(const dl_step *step) { return step->tokens > step->stream_max_rows; }

/* Weight rows of a chunk of a product: STREAM_CHUNK_ROWS where pc_matmul's kernel computes
 * it, a tile of GEMM_TILE_ROWS where pc_gemm's does. */
static int64_t dl_chunk_rows(const dl_step *step) {
    return dl_gemm(step) ? GEMM_TILE_ROWS : STREAM_CHUNK_ROWS;
}

/* The chunks of part `p` of a product by `w`. */
static int64_t dl_part_chunks(const dl_linear *w, int64_t p, const dl_step *step) {
    return (w->rows[p] + dl_chunk_rows(step) - 1) / dl_chunk_rows(step);
}

/* The chunks of a product by `w`: each part's in turn. */
static int64_t dl_matmul_chunks(const dl_linear *w, const dl_step *step) {
    int64_t chunks = 0;
    for (int64_t p = 0; p < w->parts; p++) chunks += dl_part_chunks(w, p, step);
    return chunks;
}

/* Chunk `chunk` of out [tokens, out_features] = x @ W.T, by the kernel LayerMatmul picks
 * for the step's rows; `phase` names the product for the worker's cached group sums. */
static void dl_matmul_chunk(const dl_linear *w, const dl_step *step, const float *x,
                            float *out, int64_t chunk, int64_t phase, dl_worker *worker) {
    const int64_t rows = dl_chunk_rows(step), k = w->in_features;
    int64_t p = 0;
    for (; chunk >= dl_part_chunks(w, p, step); p++) chunk -= dl_part_chunks(w, p, step);
    if (dl_gemm(step)) {
        pc_gemm_tile(x, step->tokens, w->low[p], w->high[p], w->scale[p], w->offset[p],
                     w->rows[p], k, w->group[p], chunk, worker->tile, out + w->column[p],
                     w->out_features);
        return;
    }
    if (step->tokens == 1 && worker->sums_of != phase * DL_MAX_PARTS + p) {
        pc_x_group_sums(x, k, w->group[p], worker->sums);
        worker->sums_of = phase * DL_MAX_PARTS + p;
    }
    const int64_t begin = chunk * rows;
    const int64_t end = begin + rows < w->rows[p] ? begin + rows : w->rows[p];
    pc_matmul_rows[FORMAT_INDEX(w->group[p], w->high[p])](
        x, worker->sums, step->tokens, w->low[p], w->high[p], w->scale[p], w->offset[p],
        begin, end, k, out + w->column[p], w->out_features);
}

static int64_t dl_row_chunks(const dl_schedule *schedule) {
    return (schedule->step->tokens + schedule->row_chunk - 1) / schedule->row_chunk;
}

/* How many chunks phase `phase` of `layer` has. */
static int64_t dl_phase_chunks(const dl_schedule *schedule, const dl_layer *layer,
                               int64_t phase, int64_t items) {
    const dl_step *step = schedule->step;
    switch (phase) {
    case QKV: return dl_matmul_chunks(&layer->qkv, step);
    case ATTEND: return items;
    case O_PROJ: return dl_matmul_chunks(&layer->o, step);
    case GATE_UP: return dl_matmul_chunks(&layer->gate_up, step);
    case DOWN: return dl_matmul_chunks(&layer->down, step);
    default: return dl_row_chunks(schedule);
    }
}

/* Chunk `chunk` of phase `at` of the step: the layer's ops as the layer's Python forward
 * runs them (see the top of this file), on the chunk's rows, columns or work item. */
static void dl_run_chunk(const dl_schedule *schedule, int64_t at, int64_t chunk,
                         dl_worker *worker) {
    const dl_step *step = schedule->step;
    const int64_t index = at / PHASES, phase = at % PHASES;
    const dl_layer *layer = schedule->layers[index];
    const int64_t hidden = layer->o.out_features, width = layer->qkv.out_features;
    const int64_t size = layer->gate_up.out_features / 2, dim = layer->head_dim;
    const int64_t first = chunk * schedule->row_chunk;
    const int64_t last = first + schedule->row_chunk < step->tokens
                         ? first + schedule->row_chunk : step->tokens;
    float *residual = schedule->residual, *out = schedule->out;
    switch (phase) {
    case INPUT_NORM:   /* the first layer's input is the residual stream itself */
        for (int64_t r = first; r < last; r++)
            add_rms_norm_row(index == 0 ? NULL : out + r * hidden, residual + r * hidden,
                             layer->input_norm, layer->eps, hidden, step->normed + r * hidden);
        break;
    case QKV:
        dl_matmul_chunk(&layer->qkv, step, step->normed, step->qkv, chunk, at, worker);
        break;
    case ROPE_STORE: {
        const pa_problem problem = dl_problem(layer, step);
        for (int64_t t = first; t < last; t++)
            rope_row(step->qkv + t * width, layer->heads + layer->kv_heads, dim,
                     step->cos + t * dim, step->sin + t * dim);
        pa_store(&problem, first, last);
        break;
    }
    case ATTEND: {
        const pa_problem problem = dl_problem(layer, step);
        pa_attend_item(&problem, schedule->first_item, chunk, &worker->seq, worker->attention);
        break;
    }
    case O_PROJ:
        dl_matmul_chunk(&layer->o, step, step->attended, out, chunk, at, worker);
        break;
    case POST_NORM:
        for (int64_t r = first; r < last; r++)
            add_rms_norm_row(out + r * hidden, residual + r * hidden, layer->post_norm,
                             layer->eps, hidden, step->normed + r * hidden);
        break;
    case GATE_UP:
        dl_matmul_chunk(&layer->gate_up, step, step->normed, step->gate_up, chunk, at, worker);
        break;
    case SILU:
        for (int64_t r = first; r < last; r++)
            silu_and_mul_row(step->gate_up + r * 2 * size, size, step->mid + r * size);
        break;
    case DOWN:
        dl_matmul_chunk(&layer->down, step, step->mid, out, chunk, at, worker);
        break;
    }
}

/* The front of `range`, taken (its owner's end), or -1 where it is empty. */
static int64_t dl_take_front(uint64_t *range) {
    uint64_t seen = __atomic_load_n(range, __ATOMIC_RELAXED);
    while ((uint32_t)seen < (uint32_t)(seen >> 32))
        if (__atomic_compare_exchange_n(range, &seen, seen + 1, 0, __ATOMIC_ACQ_REL,
                                        __ATOMIC_RELAXED))
            return (uint32_t)seen;
    return -1;
}

/* The back of `range`, taken (another thread's end), or -1 where it is empty. */
static int64_t dl_take_back(uint64_t *range) {
    uint64_t seen = __atomic_load_n(range, __ATOMIC_RELAXED);
    while ((uint32_t)seen < (uint32_t)(seen >> 32)) {
        const uint64_t back = (seen >> 32) - 1;
        if (__atomic_compare_exchange_n(range, &seen, back << 32 | (uint32_t)seen, 0,
                                        __ATOMIC_ACQ_REL, __ATOMIC_RELAXED))
            return (int64_t)back;
    }
    return -1;
}

static int64_t dl_now_ns(void) {
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    return (int64_t)now.tv_sec * 1000000000 + now.tv_nsec;
}

/* Until done[at] == chunks[at]: spin, then sleep (see dl_schedule). */
static void dl_wait_phase(dl_schedule *schedule, int64_t at) {
    int32_t *done = schedule->done + at;
    const int32_t total = (int32_t)schedule->chunks[at];
    int32_t seen = __atomic_load_n(done, __ATOMIC_ACQUIRE);
    if (seen == total) return;
    const int64_t give_up = dl_now_ns() + SPIN_NS;
    for (int spins = 0; seen != total; seen = __atomic_load_n(done, __ATOMIC_ACQUIRE)) {
        if (++spins % 64 != 0 || dl_now_ns() < give_up) {
            _mm_pause();
            continue;
        }
        __atomic_add_fetch(&schedule->sleepers, 1, __ATOMIC_SEQ_CST);
        seen = __atomic_load_n(done, __ATOMIC_SEQ_CST);
        if (seen != total) {
#ifdef __linux__
            syscall(SYS_futex, done, FUTEX_WAIT_PRIVATE, seen, NULL, NULL, 0);
#else
            sched_yield();
#endif
        }
        __atomic_sub_fetch(&schedule->sleepers, 1, __ATOMIC_SEQ_CST);
    }
}

/* Chunks `ran` of phase `at` are done: add them, and wake the sleepers where that ends it. */
static void dl_finish_chunks(dl_schedule *schedule, int64_t at, int32_t ran) {
    if (ran == 0) return;
    const int32_t done = __atomic_add_fetch(schedule->done + at, ran, __ATOMIC_SEQ_CST);
    if (done == (int32_t)schedule->chunks[at]
            && __atomic_load_n(&schedule->sleepers, __ATOMIC_SEQ_CST) > 0) {
#ifdef __linux__
        syscall(SYS_futex, schedule->done + at, FUTEX_WAKE_PRIVATE, INT32_MAX, NULL, NULL, 0);
#endif
    }
}

/* One thread's part of the step: every phase in order, its own chunks, then others'. */
static void dl_run_phases(dl_schedule *schedule, int me, int threads, dl_worker *worker) {
    for (int64_t at = 0; at < schedule->phases; at++) {
        int32_t ran = 0;
        for (int other = 0; other < threads; other++) {
            const int owner = (me + other) % threads;
            uint64_t *range = schedule->ranges + owner * schedule->stride + at;
            for (int64_t chunk; (chunk = other == 0 ? dl_take_front(range) : dl_take_back(range)) >= 0; ran++)
                dl_run_chunk(schedule, at, chunk, worker);
        }
        dl_finish_chunks(schedule, at, ran);
        dl_wait_phase(schedule, at);
    }
}

/* Every layer's step, in order: the first on the residual stream itself, each next one on
 * the output of the one before. The residual stream ends in `residual`, the last layer's
 * output in `out`. Returns -1 (nothing computed) where memory for the schedule is short. */
int dl_decode_layers(const dl_layer *const *layers, int64_t count, const dl_step *step,
                     float *residual, float *out) {
    const int threads = step->threads > 0 ? step->threads : 1;
    const int64_t phases = count * PHASES, stride = (phases + 7) / 8 * 8;
    int64_t widest = 0, attention_floats = 0;   /* the longest row of x a product reads */
    for (int64_t i = 0; i < count; i++) {
        const dl_layer *layer = layers[i];
        const dl_linear *linears[] = {&layer->qkv, &layer->o, &layer->gate_up, &layer->down};
        for (int l = 0; l < 4; l++)
            if (linears[l]->in_features > widest) widest = linears[l]->in_features;
        const pa_problem problem = dl_problem(layer, step);
        if (pa_workspace_floats(&problem) > attention_floats)
            attention_floats = pa_workspace_floats(&problem);
    }
    const int64_t row_chunk = (step->tokens + ROW_CHUNKS_PER_THREAD * threads - 1)
                              / (ROW_CHUNKS_PER_THREAD * threads);
    /* A tile, group sums, attention's workspace; whole cache lines, so no two threads
     * write one. */
    const int64_t tile_floats = GEMM_TILE_ROWS * widest;
    const int64_t worker_floats = (tile_floats + widest + attention_floats + 15) / 16 * 16;
    int64_t *chunks = malloc((size_t)phases * sizeof(int64_t));
    int64_t *first_item = malloc((size_t)(step->num_seqs + 1) * sizeof(int64_t));
    uint64_t *ranges = aligned_alloc(64, (size_t)(threads * stride) * sizeof(uint64_t));
    int32_t *done = calloc((size_t)phases, sizeof(int32_t));
    float *buffers = aligned_alloc(64, (size_t)(threads * worker_floats) * sizeof(float));
    int status = -1;
    if (chunks && first_item && ranges && done && buffers) {
        dl_schedule schedule = {layers, step, residual, out, first_item, phases, stride,
                                row_chunk, chunks, ranges, done, 0};
        const pa_problem first = dl_problem(layers[0], step);
        const int64_t items = pa_items(&first, first_item);
        for (int64_t at = 0; at < phases; at++) {
            chunks[at] = dl_phase_chunks(&schedule, layers[at / PHASES], at % PHASES, items);
            for (int t = 0; t < threads; t++)
                ranges[t * stride + at] = (uint64_t)(chunks[at] * (t + 1) / threads) << 32
                                          | (uint64_t)(chunks[at] * t / threads);
        }
#pragma omp parallel num_threads(threads)
        {
#ifdef _OPENMP
            const int me = omp_get_thread_num();
#else
            const int me = 0;
#endif
            float *own = buffers + me * worker_floats;
            dl_worker worker = {own, own + tile_floats, own + tile_floats + widest, -1, 0};
            dl_run_phases(&schedule, me, threads, &worker);
        }
        status = 0;
    }
    free(chunks); free(first_item); free(ranges); free(done); free(buffers);
    return status;
}
#endif
