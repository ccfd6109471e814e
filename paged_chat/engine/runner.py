"""ModelRunner: turns a scheduled step into flat batch tensors, runs the model, samples.

The KV cache is one preallocated tensor `[layers, 2, *attention.kv_cache_shape(...)]`
(keys and values of every layer, in the attention backend's layout); the runner owns it.
Per step it builds, on the host with numpy and sent in one copy (`AttentionMetadata.build`):
token ids, positions, slot mapping, query offsets, context lengths, block tables and the
rows to compute logits for: the model computes them only for the rows that sample (the
last token of each sequence whose known tokens are all computed after this step).

Sampling faults stay with their request: a row whose logits are not finite, or a batch
whose sampling raises, yields an exception in that row's place (the batch is then sampled
row by row to find the culprits) and the engine finishes only those requests with an error.
"""

from __future__ import annotations

import itertools
import time

import numpy as np
import torch

from paged_chat.engine.attention.backend import AttentionBackend
from paged_chat.engine.attention.metadata import AttentionMetadata, StagingBuffer
from paged_chat.engine.models.llama import LlamaForCausalLM
from paged_chat.engine.sampler import SamplingBatch, sample
from paged_chat.engine.scheduler import ScheduledRequest


class SamplingError(Exception):
    """One request's sampling went wrong; the engine finishes that request with an error."""


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, kv_cache: torch.Tensor, block_size: int,
                 attention: AttentionBackend) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.block_size = block_size
        self.attention = attention
        self.device = kv_cache.device
        self.last_forward_s = 0.0
        self._staging = StagingBuffer(self.device)

    @torch.inference_mode()
    def execute(self, scheduled: list[ScheduledRequest],
                block_tables: list[list[int]]) -> list[int | Exception]:
        """Run one step; return the sampled token of each scheduled item that samples, in order,
        or the exception that sampling that item raised.

        `scheduled` must list single-token items first (the scheduler sorts it so). An
        exception from the forward propagates: it concerns the whole batch.
        """
        meta = self._prepare(scheduled, block_tables)
        input_ids, logits_indices = meta.extra
        samplers = [item for item in scheduled if item.samples]
        started = time.perf_counter()
        logits = self.model(input_ids, meta.positions, self.kv_cache, meta, self.attention,
                            logits_indices)
        self.last_forward_s = time.perf_counter() - started
        if not samplers:
            return []
        try:
            return self._sample(logits, samplers)
        except Exception:  # find the rows at fault; the others keep their tokens
            return [self._sample_row(logits[row:row + 1], item)
                    for row, item in enumerate(samplers)]

    @torch.inference_mode()
    def run_dummy_step(self, query_lens: list[int], seq_lens: list[int]) -> None:
        """A forward over made-up tokens, no sampling: what warm-up and profiling run. Its
        K/V go to blocks 0, 1, 2... of the pool, which holds nothing yet: every block is
        written by the request that owns it before anything reads it."""
        num_blocks = self.kv_cache.shape[3]
        tables = [[block % num_blocks for block in range(-(-length // self.block_size))]
                  for length in seq_lens]
        meta = AttentionMetadata.build(query_lens, seq_lens, tables, self.block_size,
                                       self.device, staging=self._staging)
        self.model(torch.zeros_like(meta.positions), meta.positions, self.kv_cache, meta,
                   self.attention, meta.query_start_loc[1:].long() - 1)

    def _sample_row(self, logits: torch.Tensor, item: ScheduledRequest) -> int | Exception:
        try:
            return self._sample(logits, [item])[0]
        except Exception as error:
            return error

    def _sample(self, logits: torch.Tensor, samplers: list[ScheduledRequest]
                ) -> list[int | Exception]:
        """Sample the rows together. A row whose logits hold NaN or inf (an overflowing model)
        gets a SamplingError instead of a token: its draw is meaningless (NaN probabilities
        give an id past the vocabulary), and fed back as input it would fail the next forward
        for the whole batch. Checking the chosen logit finds it at the cost of one gather:
        argmax picks a NaN or +inf when there is one, and a draw over NaN leaves the vocabulary.
        """
        vocab_size = logits.shape[-1]
        tokens = sample(logits, self._sampling_batch(samplers, vocab_size))
        chosen = logits.gather(1, tokens.clamp(max=vocab_size - 1)[:, None]).squeeze(1)
        bad = (tokens >= vocab_size) | ~torch.isfinite(chosen)
        return [SamplingError("the model's logits for this request are not finite (NaN or inf)")
                if token < 0 else token for token in torch.where(bad, -1, tokens).tolist()]

    def _prepare(self, scheduled: list[ScheduledRequest], block_tables: list[list[int]]
                 ) -> AttentionMetadata:
        """The step's metadata, its token ids and logits rows (`meta.extra`) on the device,
        built with numpy on the host and sent in one copy through the runner's staging
        buffer (whose device side, block tables included, is rewritten in place)."""
        starts = [item.request.num_computed_tokens for item in scheduled]
        counts = [item.num_new_tokens for item in scheduled]
        token_ids = np.fromiter(itertools.chain.from_iterable(
            item.request.all_token_ids[start:start + count]
            for item, start, count in zip(scheduled, starts, counts)), dtype=np.int64)
        samples = np.fromiter((item.samples for item in scheduled), dtype=bool,
                              count=len(scheduled))
        logits_indices = np.cumsum(counts)[samples] - 1
        return AttentionMetadata.build(
            counts, [start + count for start, count in zip(starts, counts)], block_tables,
            self.block_size, self.device, extra=(token_ids, logits_indices),
            staging=self._staging)

    def _sampling_batch(self, samplers: list[ScheduledRequest], vocab_size: int) -> SamplingBatch:
        requests = [item.request for item in samplers]
        penalised = any(request.params.uses_penalties for request in requests)
        return SamplingBatch.build(
            params=[request.params for request in requests],
            seeds=[request.sampling_seed for request in requests],
            output_indices=[request.num_output_tokens for request in requests],
            token_histories=[request.all_token_ids for request in requests] if penalised else None,
            prompt_lens=[request.num_prompt_tokens for request in requests] if penalised else None,
            vocab_size=vocab_size,
            device=self.device,
        )
