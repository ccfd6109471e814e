"""ModelRunner: turns a scheduled step into flat batch tensors, runs the model, samples.

The KV cache is one preallocated tensor `[layers, 2, *attention.kv_cache_shape(...)]`
(keys and values of every layer, in the attention backend's layout); the runner owns it. Per step it builds, on the host and in one transfer:
token ids, positions, slot mapping, query offsets, context lengths and block tables; the
model computes logits only for the rows that sample (the last token of each sequence
whose known tokens are all computed after this step).

Sampling faults stay with their request: a row whose logits are not finite, or a batch
whose sampling raises, yields an exception in that row's place (the batch is then sampled
row by row to find the culprits) and the engine finishes only those requests with an error.
"""

from __future__ import annotations

import itertools
import time

import torch

from paged_chat.engine.attention.metadata import AttentionMetadata
from paged_chat.engine.attention.backend import AttentionBackend
from paged_chat.engine.models.llama import LlamaForCausalLM
from paged_chat.engine.sampler import SamplingBatch, sample
from paged_chat.engine.scheduler import ScheduledRequest


# The cache is [layers, 2, kv_heads, blocks, block_size, head_dim] (AttentionBackend.kv_cache_shape).
_BLOCK_AXIS = 3


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

    @torch.inference_mode()
    def execute(self, scheduled: list[ScheduledRequest],
                block_tables: list[list[int]]) -> list[int | Exception]:
        """Run one step; return the sampled token of each scheduled item that samples, in order,
        or the exception that sampling that item raised.

        `scheduled` must list single-token items first (the scheduler sorts it so). An
        exception from the forward propagates: it concerns the whole batch.
        """
        input_ids, positions, meta = self._prepare(scheduled, block_tables)
        samplers = [item for item in scheduled if item.samples]
        ends = torch.tensor(meta.query_start_loc_list[1:])
        sample_mask = torch.tensor([item.samples for item in scheduled])
        logits_indices = (ends[sample_mask] - 1).to(self.device)
        started = time.perf_counter()
        logits = self.model(input_ids, positions, self.kv_cache, meta, self.attention,
                            logits_indices)
        self.last_forward_s = time.perf_counter() - started
        if not samplers:
            return []
        try:
            return self._sample(logits, samplers)
        except Exception:  # find the rows at fault; the others keep their tokens
            return [self._sample_row(logits[row:row + 1], item)
                    for row, item in enumerate(samplers)]

    def read_blocks(self, block_ids: list[int]) -> torch.Tensor:
        """A copy of whole blocks' KV on the CPU, [blocks, layers, 2, kv_heads, block_size,
        head_dim], that no later step touches (a KV tier keeps it)."""
        index = torch.tensor(block_ids, device=self.device)
        return self.kv_cache.movedim(_BLOCK_AXIS, 0)[index].cpu()

    def write_blocks(self, block_ids: list[int], kv: torch.Tensor) -> None:
        """Put whole blocks' KV (as `read_blocks` returns it) into the cache."""
        index = torch.tensor(block_ids, device=self.device)
        blocks = self.kv_cache.movedim(_BLOCK_AXIS, 0)
        blocks.index_copy_(0, index, kv.to(self.device, self.kv_cache.dtype))

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
                 ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        starts = [item.request.num_computed_tokens for item in scheduled]
        counts = [item.num_new_tokens for item in scheduled]
        token_ids = list(itertools.chain.from_iterable(
            item.request.all_token_ids[start:start + count]
            for item, start, count in zip(scheduled, starts, counts)))
        query_start_loc = [0, *itertools.accumulate(counts)]
        seq_lens = [start + count for start, count in zip(starts, counts)]
        width = max(len(table) for table in block_tables)
        padded_tables = [table + [0] * (width - len(table)) for table in block_tables]

        counts_t = torch.tensor(counts)
        seq_index = torch.repeat_interleave(torch.arange(len(scheduled)), counts_t)
        offsets = torch.repeat_interleave(torch.tensor(starts) - torch.tensor(query_start_loc[:-1]),
                                          counts_t)
        positions = torch.arange(len(token_ids)) + offsets
        tables = torch.tensor(padded_tables, dtype=torch.int32)
        slots = (tables[seq_index, positions // self.block_size].long() * self.block_size
                 + positions % self.block_size)
        meta = AttentionMetadata(
            slot_mapping=slots.to(self.device),
            query_start_loc=torch.tensor(query_start_loc, dtype=torch.int32, device=self.device),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=self.device),
            block_tables=tables.to(self.device),
            num_decodes=sum(1 for count in counts if count == 1),
            query_start_loc_list=query_start_loc,
            seq_lens_list=seq_lens,
            block_size=self.block_size,
        )
        input_ids = torch.tensor(token_ids, dtype=torch.long, device=self.device)
        return input_ids, positions.to(self.device), meta

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
