"""ModelRunner: loads and owns the model and the KV cache; turns a scheduled step into flat
batch tensors, runs the model, samples; copies whole blocks in and out for the KV tier.

Set-up, in nano-vllm's ModelRunner order: load the weights (model_loading.py, which
describes them for the engine before anything packs them), size the pool (on CUDA by
profiling the largest step: the warm-up that measures what a step takes), allocate it, then,
for a backend whose kernels compile (Triton on CUDA), compile every variant and capture the
decode graphs; on the CPU, pack the weights for oneDNN and switch the model to its fused C
ops (`EngineConfig.fused_ops`).

The KV cache is one preallocated tensor `[layers, 2, *attention.kv_cache_shape(...)]`
(keys and values of every layer, in the attention backend's layout and
`EngineConfig.kv_cache_dtype`) of `num_blocks + 1` blocks: block 0 is the null block
(`block_pool.NULL_BLOCK`), where padding and released table entries point. Per step the
runner builds, on the host with numpy and sent in one copy (`AttentionMetadata.build`):
token ids, positions, slot mapping, query offsets, context lengths, block tables and the
rows to compute logits for: the model computes them only for the rows that sample (the
last token of each sequence whose known tokens are all computed after this step).

Sampling faults stay with their request: a row whose logits are not finite, or a batch
whose sampling raises, yields an exception in that row's place (the batch is then sampled
row by row to find the culprits) and the engine finishes only those requests with an error.
"""

from __future__ import annotations

import functools
import itertools
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from paged_chat.engine.attention.metadata import AttentionMetadata, StagingBuffer
from paged_chat.engine.attention.selector import select_attention
from paged_chat.engine.core.config import EngineConfig
from paged_chat.engine.core.dtypes import dtype_name, resolve_kv_cache_dtype
from paged_chat.engine.core.errors import PagedChatError, out_of_memory
from paged_chat.engine.core.outputs import ModelRunnerOutput, TokenLogprob
from paged_chat.engine.core.scheduler import ScheduledRequest
from paged_chat.engine.kv.block_id_rows import BlockIdRows
from paged_chat.engine.kv.pool_sizing import (
    KVCacheSpec,
    allocate_kv_cache,
    longest_sequence,
    size_kv_pool,
)
from paged_chat.engine.models.loader import ModelSource, ProgressHook
from paged_chat.engine.native.build import use_cache_dir
from paged_chat.engine.worker.device_to_host import DeviceToHost
from paged_chat.engine.worker.input_batch import SamplingRows
from paged_chat.engine.worker.model_loading import (
    LoadedModel,
    load_weights,
    prepare_for_cpu,
    use_triton_ops,
)
from paged_chat.engine.worker.rejection_sampler import verify_greedy, verify_sampled
from paged_chat.engine.worker.sampler import SamplingBatch, logprob_entries, sample
from paged_chat.engine.worker.structured_output import fill_token_bitmask

# Batch sizes a decode step's CUDA graph is captured for (plus max_num_seqs); a step runs in
# the smallest that holds it.
GRAPH_BATCH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)


# How far under the eager step's best logit a replayed step's pick may sit and still count as
# the same token, relative to the row's largest logit: a graph plans its attention splits for
# the longest context, so its sums run in another order than an eager step's, and a near-tie
# may flip in half precision.
_GRAPH_CHECK_TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 4e-3}

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class _DecodeGraph:
    """A captured decode step: `meta`'s tensors are its inputs, `logits` its output, which
    each `replay()` rewrites."""

    replay: Callable[[], object]
    meta: AttentionMetadata
    logits: torch.Tensor


class GraphMismatch(Exception):
    """A decode step replayed from its CUDA graph picks other tokens than the eager step."""


class CudaGraphCapture:
    """Captures forwards as CUDA graphs that share one memory pool."""

    def __init__(self) -> None:
        self._pool = torch.cuda.graph_pool_handle()

    def __call__(self, forward: Callable[[], torch.Tensor]
                 ) -> tuple[Callable[[], object], torch.Tensor]:
        """The replay of `forward` captured, and the output tensor each replay rewrites.
        `forward` runs eagerly first: lazy initialisation (cuBLAS handles, the split
        workspace, which the graph then reuses) must not happen during a capture."""
        forward()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            output = forward()
        return graph.replay, output


# The cache is [layers, 2, kv_heads, blocks, block_size, head_dim] (AttentionBackend.kv_cache_shape).
_BLOCK_AXIS = 3


class SamplingError(Exception):
    """One request's sampling went wrong; the engine finishes that request with an error."""


class ModelRunner:
    def __init__(self, source: ModelSource, config: EngineConfig, device: torch.device,
                 dtype: torch.dtype, on_progress: ProgressHook | None = None) -> None:
        """Load `source`'s model in `dtype` on `device`, size and allocate the KV pool for it
        and make it ready to serve (see the module docstring); nothing of `source` is kept.
        `loaded` describes the weights; `num_blocks` and `max_model_len` say what came of
        the pool: the blocks requests can use, and the longest sequence, which the model
        and the pool both bound."""
        if config.cache_dir is not None:  # the native kernels build under it too
            use_cache_dir(config.cache_dir)
        model, loaded = load_weights(source, config, device, dtype, on_progress)
        self.loaded: LoadedModel = loaded
        model_config = source.config
        self.model = model
        self.vocab_size = model_config.vocab_size
        self.block_size = config.block_size
        self.attention = select_attention(
            config.attention_backend, num_heads=model_config.num_heads,
            num_kv_heads=model_config.num_kv_heads, head_dim=model_config.head_dim,
            scale=model_config.attention_scale, device=device, dtype=dtype)
        if device.type == "cuda" and config.fused_ops:
            use_triton_ops(model, self.attention)
        self.device = device
        self.max_num_batched_tokens = config.max_num_batched_tokens
        kv_dtype = resolve_kv_cache_dtype(config.kv_cache_dtype, dtype)
        if kv_dtype != dtype and self.attention.compiles_kernels:
            raise PagedChatError(
                f"kv_cache_dtype={config.kv_cache_dtype!r} differs from the model's dtype "
                f"({dtype_name(dtype)}), which the Triton attention kernels need: use "
                "kv_cache_dtype='auto', or attention_backend='torch'")
        spec = KVCacheSpec(model_config.num_layers, self.block_size, self.attention, kv_dtype,
                           device)
        model_len = min(config.max_model_len or model_config.max_position_embeddings,
                        model_config.max_position_embeddings)
        with out_of_memory("profiling a step to size the KV cache",
                           "lower max_num_batched_tokens (the largest step)"):
            self.num_blocks = config.num_blocks or size_kv_pool(spec, config, model, model_len)
        # A request can never outgrow the pool: it is the one bound nothing can preempt. With
        # a sliding window on every layer the pool holds only the window of each request.
        longest = longest_sequence(self.num_blocks, self.block_size,
                                   model_config.window_of_every_layer, self.max_num_batched_tokens)
        self.max_model_len = model_len if longest is None else min(model_len, longest)
        model.build_rope_tables(self.max_model_len)
        self.kv_cache = allocate_kv_cache(spec, self.num_blocks, config)
        self.last_forward_s = 0.0
        # The stepping thread's CPU time in the sampler's math last step (on a GPU, its
        # launches): what `bench --host-overhead` takes away to leave the host's own work.
        self.last_sample_cpu_s = 0.0
        # The last step's TokenLogprobs per sampled item (as `execute` returns tokens), None
        # for one that asked for none; None when none did.
        self._step_logprobs: list[TokenLogprob | None] | None = None
        # Whether sampling may read tensors on the host (sampler.SamplingBatch.host_reads).
        self.sample_on_host = device.type == "cpu"
        # Whether the sampling kernel samples (sampling_kernel.py): the CUDA path's fused ops.
        self.sampling_kernel = device.type == "cuda" and config.fused_ops
        self._to_host = DeviceToHost(device)
        self._sampling_rows = SamplingRows(self.vocab_size, device)
        self._sampling_staging = StagingBuffer(device)
        # Every request's block table as ids, written by the KV manager as tables change.
        self.block_id_rows = BlockIdRows()
        self._staging = StagingBuffer(self.device)
        self._graphs: dict[int, _DecodeGraph] = {}
        self._graph_width = 0
        self._graph_staging: StagingBuffer | None = None
        if self.attention.compiles_kernels and device.type == "cuda":
            self.warm_up(on_progress)
            if not config.enforce_eager:
                self.use_decode_graphs(config.max_num_seqs, on_progress or _no_progress)
        if device.type == "cpu":
            prepare_for_cpu(model, config.fused_ops)

    @torch.inference_mode()
    def execute(self, scheduled: list[ScheduledRequest]) -> ModelRunnerOutput:
        """Run one step; return the sampled token of each scheduled item that samples, in order,
        or the exception that sampling that item raised, with their logprobs where asked.

        `scheduled` must list single-token items first (the scheduler sorts it so). An
        exception from the forward propagates: it concerns the whole batch.
        """
        samplers = [item for item in scheduled if item.samples]
        block_tables = self.block_id_rows.array([item.request.request_id for item in scheduled])
        self.last_sample_cpu_s = 0.0
        self._step_logprobs = None
        started = time.perf_counter()
        graph_batch = self._graph_batch(scheduled)
        if graph_batch is None:
            meta = self._prepare(scheduled, block_tables)
            input_ids, logits_indices = meta.extra
            logits = self.model(input_ids, meta.positions, self.kv_cache, meta, self.attention,
                                logits_indices)
        else:
            logits = self._replay(graph_batch, scheduled, block_tables)
        self.last_forward_s = time.perf_counter() - started
        if not samplers:
            return ModelRunnerOutput([])
        if any(item.draft_token_ids for item in samplers):
            return self._verify_drafts(logits, samplers)
        try:
            sampled = self._sample(logits, samplers)
        except Exception:  # find the rows at fault; the others keep their tokens
            sampled = self._sample_rows(logits, samplers)
        return ModelRunnerOutput(sampled, self._step_logprobs)

    @torch.inference_mode()
    def run_dummy_step(self, query_lens: list[int], seq_lens: list[int]) -> None:
        """A forward over made-up tokens, no sampling: what warm-up and profiling run. Its
        K/V go to blocks 0, 1, 2... of the pool, which holds nothing yet: every block is
        written by the request that owns it before anything reads it."""
        num_blocks = self.kv_cache.shape[_BLOCK_AXIS]
        tables = [[block % num_blocks for block in range(-(-length // self.block_size))]
                  for length in seq_lens]
        meta = AttentionMetadata.build(query_lens, seq_lens, tables, self.block_size,
                                       self.device, staging=self._staging)
        self.model(torch.zeros_like(meta.positions), meta.positions, self.kv_cache, meta,
                   self.attention, meta.query_start_loc[1:].long() - 1)

    def warm_up(self, on_progress: ProgressHook | None = None) -> None:
        """Compile every kernel variant this configuration can reach before serving, so none
        compiles mid-chat (a pause of a second or more each on a GPU).

        The Triton kernels take the split count and the sliding window at run time, so a
        launch's variant depends only on its kind (decode or prefill) and on whether a
        split merge runs; two steps reach them all: the largest prefill the token budget
        allows, and one decode at the longest context (split when a GPU would split it).
        """
        report = on_progress or _no_progress
        longest = self.max_model_len
        budget = min(self.max_num_batched_tokens, longest)
        steps = [([budget], [budget]), ([1], [longest])]
        report("compiling kernels", 0, len(steps))
        for done, (query_lens, seq_lens) in enumerate(steps, 1):
            self.run_dummy_step(query_lens, seq_lens)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            report("compiling kernels", done, len(steps))

    # ---- CUDA graphs of decode steps -------------------------------------------------

    def use_decode_graphs(self, max_batch: int, on_progress: ProgressHook) -> bool:
        """Capture the decode graphs (`capture_decode_graphs`) and check them against eager
        steps (`check_decode_graphs`); when a capture raises or a check fails, drop them,
        log why, and run every step eagerly. Returns whether graphs are on."""
        try:
            self.capture_decode_graphs(max_batch, on_progress)
            self.check_decode_graphs()
        except (RuntimeError, GraphMismatch) as error:
            self._graphs.clear()
            logger.warning("CUDA graphs are off, every step runs eagerly: %s", error)
            return False
        return True

    def capture_decode_graphs(self, max_batch: int, on_progress: ProgressHook) -> None:
        """Capture one CUDA graph of a whole decode step (every layer, logits of every row) per
        batch-size bucket up to `max_batch`, largest first, in one shared memory pool.

        A graph replays fixed kernels on fixed addresses: its inputs are the views of a
        staging buffer of its own (`_graph_meta` lays a bucket's arrays out the same way at
        every step, the tables `ceil(max_model_len / block_size)` wide, the batch padded
        with decodes that store nothing), and its splits are planned for `max_model_len`.
        Only a backend that reads a step's lengths on the device qualifies (Triton on CUDA;
        the torch backend reads them on the host).
        """
        self._graph_width = -(-self.max_model_len // self.block_size)
        self._graph_staging = StagingBuffer(self.device)
        buckets = sorted({b for b in GRAPH_BATCH_SIZES if b < max_batch} | {max_batch},
                         reverse=True)
        capture = CudaGraphCapture()
        for done, batch in enumerate(buckets):
            on_progress("capturing CUDA graphs", done, len(buckets))
            meta = self._graph_meta(batch, [], [], [])
            self.attention.plan_graph(meta, self.kv_cache, self.max_model_len)
            input_ids, logits_indices = meta.extra
            with torch.inference_mode():
                replay, logits = capture(functools.partial(
                    self.model, input_ids, meta.positions, self.kv_cache, meta, self.attention,
                    logits_indices))
            self._graphs[batch] = _DecodeGraph(replay, meta, logits)
        on_progress("capturing CUDA graphs", len(buckets), len(buckets))

    @torch.inference_mode()
    def check_decode_graphs(self) -> None:
        """Run a made-up decode step in every captured bucket both ways, replayed and eager;
        raise GraphMismatch where a row's replayed token is not the eager step's (but for a
        near-tie, `_GRAPH_CHECK_TOLERANCE`). Each step is one row short of its bucket (but
        in bucket 1), so the padding runs too; each row's context spans a few blocks of its
        own in the empty pool, so both ways read and write the same KV; the first row's
        runs to max_model_len where the pool has room, so the splits planned for it run too."""
        num_blocks = self.kv_cache.shape[_BLOCK_AXIS] - 1
        for batch in sorted(self._graphs):
            rows = max(1, batch - 1)
            blocks_per_row = max(1, min(4, num_blocks // rows))
            longest = min(self.max_model_len, blocks_per_row * self.block_size)
            seq_lens = [1 + (37 * row + 5) % longest for row in range(rows)]
            starts = [row * blocks_per_row for row in range(rows)]
            long = min(self.max_model_len, (num_blocks - rows * blocks_per_row) * self.block_size)
            if long > seq_lens[0]:  # in the blocks no other row has
                seq_lens[0], starts[0] = long, rows * blocks_per_row
            tables = [[1 + (start + block) % num_blocks
                       for block in range(-(-length // self.block_size))]
                      for start, length in zip(starts, seq_lens)]
            tokens = [(7919 * row + 11) % self.vocab_size for row in range(rows)]
            meta = AttentionMetadata.build(
                [1] * rows, seq_lens, tables, self.block_size, self.device,
                extra=(np.array(tokens, dtype=np.int64), np.arange(rows, dtype=np.int64)),
                staging=self._staging)
            input_ids, logits_indices = meta.extra
            eager = self.model(input_ids, meta.positions, self.kv_cache, meta, self.attention,
                               logits_indices).float()
            replayed = self._replay_decode(batch, seq_lens, tables, tokens)[:rows].float()
            picked = eager.gather(1, replayed.argmax(dim=-1, keepdim=True)).squeeze(1)
            slack = _GRAPH_CHECK_TOLERANCE[self.kv_cache.dtype] * eager.abs().amax(dim=-1)
            off = picked < eager.amax(dim=-1) - slack
            if bool(off.any()):  # once per bucket, at start-up
                raise GraphMismatch(
                    f"the decode graph of batch {batch} picks other tokens than an eager step "
                    f"in rows {off.nonzero().flatten().tolist()}")

    def _graph_batch(self, scheduled: list[ScheduledRequest]) -> int | None:
        """The captured bucket this step replays in: every item a single token, and few enough."""
        if not self._graphs or len(scheduled) > max(self._graphs) or any(
                item.num_new_tokens != 1 for item in scheduled):
            return None
        return min(batch for batch in self._graphs if batch >= len(scheduled))

    def _graph_meta(self, batch: int, seq_lens: list[int], block_tables: Sequence[Sequence[int]],
                    token_ids: list[int]) -> AttentionMetadata:
        """A decode step's inputs in bucket `batch`'s fixed layout of the graph staging buffer."""
        tokens = np.zeros(batch, dtype=np.int64)
        tokens[:len(token_ids)] = token_ids
        return AttentionMetadata.build(
            [1] * len(seq_lens), seq_lens, block_tables, self.block_size, self.device,
            table_width=self._graph_width, pad_to=batch,
            extra=(tokens, np.arange(batch, dtype=np.int64)), staging=self._graph_staging)

    def _replay(self, batch: int, scheduled: list[ScheduledRequest],
                block_tables: Sequence[Sequence[int]]) -> torch.Tensor:
        """Logits of the sampling rows of a decode step, by replaying its bucket's graph."""
        requests = [item.request for item in scheduled]
        logits = self._replay_decode(batch, [r.num_computed_tokens + 1 for r in requests],
                                     block_tables,
                                     [r.all_token_ids[r.num_computed_tokens] for r in requests])
        samples = [row for row, item in enumerate(scheduled) if item.samples]
        if len(samples) == len(scheduled):
            return logits[:len(samples)]
        rows = torch.from_numpy(np.array(samples, dtype=np.int64))
        return logits[rows.to(self.device, non_blocking=True)]  # the host does not wait

    def _replay_decode(self, batch: int, seq_lens: list[int],
                       block_tables: Sequence[Sequence[int]], token_ids: list[int]
                       ) -> torch.Tensor:
        """The logits of every row of bucket `batch`'s graph replayed over these decodes
        (the rows past them are padding)."""
        captured = self._graphs[batch]
        meta = self._graph_meta(batch, seq_lens, block_tables, token_ids)
        assert meta.block_tables.data_ptr() == captured.meta.block_tables.data_ptr(), \
            "a graph's inputs moved: the staging buffer grew after capture"
        captured.replay()
        return captured.logits

    # ---- whole blocks, for the KV tier (kv_transfer) ---------------------------------

    def read_blocks(self, block_ids: list[int]) -> torch.Tensor:
        """A copy of whole blocks' KV on the cache's device, [blocks, layers, 2, kv_heads,
        block_size, head_dim], that no later step touches (a KV tier copies it to the host
        without waiting: kv_transfer). Queued on the device's stream, never waited for."""
        on_cuda = self.device.type == "cuda"
        index = torch.tensor(block_ids, pin_memory=on_cuda).to(self.device, non_blocking=on_cuda)
        return self.kv_cache.movedim(_BLOCK_AXIS, 0)[index]

    def write_blocks(self, block_ids: list[int], kv: torch.Tensor) -> None:
        """Put whole blocks' KV (as `read_blocks` returns it) into the cache."""
        index = torch.tensor(block_ids, device=self.device)
        blocks = self.kv_cache.movedim(_BLOCK_AXIS, 0)
        blocks.index_copy_(0, index, kv.to(self.device, self.kv_cache.dtype))

    def _verify_drafts(self, logits: torch.Tensor, samplers: list[ScheduledRequest]
                       ) -> ModelRunnerOutput:
        """`execute`'s output for a step with drafts: `logits` has 1 + len(drafts) rows per
        sampling item (`_prepare`); the items with drafts are verified (`_verified`), the
        others sampled as in any step."""
        row_counts = np.array([1 + len(item.draft_token_ids) for item in samplers])
        first_rows = np.cumsum(row_counts) - row_counts
        drafting = row_counts > 1
        verified = iter(self._verified(logits, [
            (item, np.arange(first, first + count)) for item, first, count
            in zip(samplers, first_rows, row_counts) if item.draft_token_ids]))
        plain = [item for item in samplers if not item.draft_token_ids]
        plain_tokens: list[int | Exception] = []
        plain_logprobs: list[TokenLogprob | None] | None = None
        if plain:
            plain_logits = logits[torch.from_numpy(first_rows[~drafting]).to(self.device)]
            try:
                plain_tokens = self._sample(plain_logits, plain)
            except Exception:  # find the rows at fault; the others keep their tokens
                plain_tokens = self._sample_rows(plain_logits, plain)
            plain_logprobs = self._step_logprobs
        tokens, logprobs = iter(plain_tokens), iter(plain_logprobs or ())
        sampled = [next(verified) if draft else next(tokens) for draft in drafting]
        self._step_logprobs = (None if plain_logprobs is None
                               else [None if draft else next(logprobs) for draft in drafting])
        return ModelRunnerOutput(sampled, self._step_logprobs)

    def _verified(self, logits: torch.Tensor,
                  drafted: list[tuple[ScheduledRequest, np.ndarray]]
                  ) -> list[list[int] | Exception]:
        """Each item's accepted drafts and next token, from its rows of `logits`: the
        greedy items together (rejection_sampler.verify_greedy), each sampled one by the
        rejection rule (verify_sampled); a SamplingError where its logits are not finite."""
        results: list[list[int] | None] = [None] * len(drafted)
        greedy = [index for index, (item, _) in enumerate(drafted) if item.request.params.greedy]
        if greedy:
            rows = np.concatenate([drafted[index][1] for index in greedy])
            for index, tokens in zip(greedy, verify_greedy(
                    logits[torch.from_numpy(rows).to(self.device)],
                    [drafted[index][0].draft_token_ids for index in greedy],
                    self._to_host.fetch)):
                results[index] = tokens
        for index, (item, rows) in enumerate(drafted):
            request = item.request
            if not request.params.greedy:
                results[index] = verify_sampled(
                    logits[torch.from_numpy(rows).to(self.device)], item.draft_token_ids,
                    request.params.temperature, request.sampling_seed, request.num_output_tokens)
        return [SamplingError("the model's logits for this request are not finite (NaN or inf)")
                if tokens is None else tokens for tokens in results]

    def _sample_rows(self, logits: torch.Tensor, samplers: list[ScheduledRequest]
                     ) -> list[int | Exception]:
        """Sample row by row, each row's fault in its place; logprobs as `_sample`'s."""
        tokens: list[int | Exception] = []
        logprobs: list[TokenLogprob | None] = []
        for row, item in enumerate(samplers):
            self._step_logprobs = None
            try:
                tokens.append(self._sample(logits[row:row + 1], [item])[0])
            except Exception as error:
                tokens.append(error)
            logprobs.append(self._step_logprobs[0] if self._step_logprobs else None)
        self._step_logprobs = logprobs if any(logprobs) else None
        return tokens

    def _sample(self, logits: torch.Tensor, samplers: list[ScheduledRequest]
                ) -> list[int | Exception]:
        """Sample the rows together. A row whose logits hold NaN or inf (an overflowing model)
        gets a SamplingError instead of a token (`sample` gives it -1): fed back as input it
        would fail the next forward for the whole batch.

        The tokens (-1 for such a row) and the logprobs asked for come to the host in the
        step's one device-to-host copy (`DeviceToHost.fetch`).
        """
        batch = self._sampling_batch(samplers, logits.shape[-1])
        started = time.thread_time()
        tokens = sample(logits, batch)
        packed = (tokens.double() if batch.logprobs is None
                  else torch.cat([part.flatten().double() for part in (tokens, *batch.logprobs)]))
        self.last_sample_cpu_s = time.thread_time() - started
        host = self._to_host.fetch(packed)
        num_rows = len(samplers)
        if batch.logprobs is not None:
            wanting = [row for row, item in enumerate(samplers)
                       if item.request.params.wants_logprobs]
            width = batch.num_top_logprobs
            chosen_at, top_at = num_rows + len(wanting), num_rows + len(wanting) * (1 + width)
            entries = logprob_entries(
                host[num_rows:chosen_at], host[chosen_at:top_at].reshape(len(wanting), width),
                host[top_at:].reshape(len(wanting), width))
            self._step_logprobs = [None] * num_rows
            for row, entry in zip(wanting, entries):
                self._step_logprobs[row] = entry
        return [SamplingError("the model's logits for this request are not finite (NaN or inf)")
                if token < 0 else token for token in host[:num_rows].astype(np.int64).tolist()]

    def _prepare(self, scheduled: list[ScheduledRequest], block_tables: Sequence[Sequence[int]]
                 ) -> AttentionMetadata:
        """The step's metadata, its token ids and logits rows (`meta.extra`) on the device,
        built with numpy on the host and sent in one copy through the runner's staging
        buffer (whose device side, block tables included, is rewritten in place)."""
        starts = [item.request.num_computed_tokens for item in scheduled]
        counts = [item.num_new_tokens for item in scheduled]
        token_ids = np.fromiter(itertools.chain.from_iterable(
            itertools.chain(item.request.all_token_ids[start:start + count
                                                       - len(item.draft_token_ids)],
                            item.draft_token_ids)
            for item, start, count in zip(scheduled, starts, counts)), dtype=np.int64)
        samples = np.fromiter((item.samples for item in scheduled), dtype=bool,
                              count=len(scheduled))
        # A sampling item's last row, and for one with drafts the row before each draft.
        num_rows = np.fromiter((1 + len(item.draft_token_ids) for item in scheduled),
                               dtype=np.int64, count=len(scheduled))[samples]
        ends = np.cumsum(counts)[samples]
        logits_indices = np.repeat(ends - num_rows, num_rows) + _ragged_arange(num_rows)
        return AttentionMetadata.build(
            counts, [start + count for start, count in zip(starts, counts)], block_tables,
            self.block_size, self.device, extra=(token_ids, logits_indices),
            staging=self._staging)

    def _sampling_batch(self, samplers: list[ScheduledRequest], vocab_size: int) -> SamplingBatch:
        """The sampling items' batch. Its small index arrays (the constrained rows, the rows
        that want logprobs, the rows of the persistent settings and their output positions)
        reach the device in one asynchronous copy: from a Python list, each would be a copy
        the host waits on behind the forward."""
        requests = [item.request for item in samplers]
        params = [request.params for request in requests]
        constrained = np.array([row for row, request in enumerate(requests)
                                if request.grammar is not None], dtype=np.int64)
        wanting = np.array([row for row, p in enumerate(params) if p.wants_logprobs],
                           dtype=np.int64)
        # The sampling kernel takes greedy rows in its one launch; the torch ops' argmax alone
        # needs no settings.
        batch = None if self.sampling_kernel else SamplingBatch.greedy_only(params,
                                                                            self.sample_on_host)
        if batch is None:  # the other columns are read: gather them
            assert vocab_size == self._sampling_rows.vocab_size, "the logits are not the model's"
            rows = self._sampling_rows.rows(requests)
            output_indices = np.fromiter((request.num_output_tokens for request in requests),
                                         dtype=np.int64, count=len(requests))
            constrained_rows, logprob_rows, on_device, indices = self._sampling_staging.transfer(
                [constrained, wanting, rows, output_indices])
            batch = (self._sampling_rows.kernel_batch(rows, on_device, indices)
                     if self.sampling_kernel else
                     self._sampling_rows.batch(rows, on_device, indices, self.sample_on_host))
            if batch.repetition_penalty is not None:
                batch.count_tokens([request.all_token_ids for request in requests],
                                   [request.num_prompt_tokens for request in requests],
                                   vocab_size, self.device)
        elif len(constrained) or len(wanting):
            constrained_rows, logprob_rows = self._sampling_staging.transfer([constrained, wanting])
        if len(constrained):
            batch.bitmask_rows = constrained_rows
            batch.token_bitmask = fill_token_bitmask([requests[row].grammar for row in constrained],
                                                     vocab_size, self.device)
        if len(wanting):
            batch.logprob_rows = logprob_rows
            batch.num_top_logprobs = max(params[row].top_logprobs for row in wanting)
        return batch


def _ragged_arange(counts: np.ndarray) -> np.ndarray:
    """0..count-1 for each count, concatenated."""
    total = int(counts.sum())
    return np.arange(total) - np.repeat(np.cumsum(counts) - counts, counts)


def _no_progress(stage: str, done: int, total: int) -> None:
    """A ProgressHook that hears nothing."""
