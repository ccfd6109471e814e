"""Batched token sampling: penalties, greedy, temperature, min-p / top-k / top-p, seeded draws.

One pass of torch ops over the whole batch, no Python loop over requests in `sample`, and on
a device no read of a tensor on the host (each would stall the step until the device caught
up): what depends on the rows' settings is decided from them on the host, when the batch is
built (`SamplingBatch.host_reads`). The order follows vLLM: penalties -> grammar bitmask
(constrained rows) -> greedy argmax -> temperature -> min-p, top-k, top-p -> draw. The rows
that ask for logprobs get the model's own: the log-softmax of their logits as the model gave
them, before any of that (OpenAI's and vLLM's default), so a logprob never depends on the
request's sampling settings.

Randomness is counter-based: a row's draw is a splitmix64 hash of (seed, output_index), so a
request's tokens depend only on its own seed and position, never on which other requests
share the batch, and a preempted request that recomputes a step draws the same token again.

On CUDA one Triton launch does the filters and the draw (sampling_kernel.py, with
`SamplingBatch.settings`), picking what these ops pick.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import TypeVar

import numpy as np
import torch

from paged_chat.engine.core.outputs import TokenLogprob
from paged_chat.engine.core.sampling_params import SamplingParams

_GOLDEN = 0x9E3779B97F4A7C15  # splitmix64's stream increment
_MUL1 = 0xBF58476D1CE4E5B9
_MUL2 = 0x94D049BB133111EB
_MIN_CANDIDATES = 64  # first guess at how many top tokens hold every row's top-p nucleus
_GROWTH = 16  # then 1024 candidates, then (past a quarter of the vocabulary) all of them
# exp() below this is a float32 denormal (or 0), which x86 computes ~100x slower (microcode
# assists): at temperature 0.2 most of a 49,152-token vocabulary lands there, and one exp
# over [8, vocab] took ~6 ms, two thirds of the sampler's time. Such a term is under float32's
# resolution of any row's sum (whose largest term is 1): a sum takes it as exp(_EXP_FLOOR), a
# CDF as 0.
_EXP_FLOOR = -87.0


def as_int64(x: int) -> int:
    """Reinterpret the low 64 bits of `x` as a signed int64 (torch has no uint64 math)."""
    x &= (1 << 64) - 1
    return x - (1 << 64) if x >= 1 << 63 else x


# 64-bit words: int64 tensors on any device, or int64 numpy arrays (a row's seed, once).
Words = TypeVar("Words", torch.Tensor, np.ndarray)


def _shr(z: Words, bits: int) -> Words:
    """Logical right shift: torch's `>>` on int64 is arithmetic, so mask off the sign copies."""
    return (z >> bits) & ((1 << (64 - bits)) - 1)


def _mix64(z: Words) -> Words:
    """splitmix64's output function: a bijection on 64-bit words with full avalanche.

    int64 multiplication wraps modulo 2^64, which is exactly the unsigned arithmetic wanted.
    """
    z = z + as_int64(_GOLDEN)
    z = (z ^ _shr(z, 30)) * as_int64(_MUL1)
    z = (z ^ _shr(z, 27)) * as_int64(_MUL2)
    return z ^ _shr(z, 31)


def counter_uniforms(seeds: torch.Tensor, output_indices: torch.Tensor) -> torch.Tensor:
    """One uniform strictly inside (0, 1) per (seed, output_index) pair, float64.

    Hashing twice keeps distinct pairs apart (seed s at index i+1 is not seed s+1 at index i).
    52 bits plus a half step give values in [2^-53, 1 - 2^-53], each exact in float64.
    """
    return stream_uniforms(_mix64(seeds), output_indices)


def seed_streams(seeds: np.ndarray) -> np.ndarray:
    """The first of `counter_uniforms`' two hashes, which depends on the seed alone (int64
    words): worked out on the host once per request rather than on the device every step."""
    return _mix64(seeds)


def stream_uniforms(streams: torch.Tensor, output_indices: torch.Tensor) -> torch.Tensor:
    """`counter_uniforms` of the seeds whose `seed_streams` are `streams`."""
    bits = _shr(_mix64(streams + output_indices), 12)
    return (bits.double() + 0.5) * 2.0**-52


@dataclass(slots=True)
class SettingsRows:
    """Where the sampling kernel (sampling_kernel.py) reads a step's settings on the device:
    the persistent tables of input_batch.SamplingRows (float32 [capacity, NUM_COLUMNS] in
    `sampling_columns`' layout, and the `seed_streams`, int64 [capacity]), each sampled
    row's index into them and its output index (int64 [n] each)."""

    table: torch.Tensor
    streams: torch.Tensor
    rows: torch.Tensor
    output_indices: torch.Tensor


@dataclass(slots=True)
class SamplingBatch:
    """Per-row sampling settings as tensors on the logits' device, built once per step.

    Penalty tensors are None when no row uses a penalty; `min_p`, `top_k` and `top_p` are None
    when no row uses that filter, so `sample` skips the work.
    """

    all_greedy: bool  # lets the caller skip everything but argmax
    greedy: torch.Tensor | None  # bool [n]; None when no row is greedy, or all are
    temperature: torch.Tensor | None  # float32 [n], 1.0 on greedy rows; None when all greedy
    uniforms: torch.Tensor | None  # float64 [n], see counter_uniforms; None when all greedy
    min_p: torch.Tensor | None  # float32 [n], 0 where off
    top_k: torch.Tensor | None  # int64 [n], vocab_size where off
    top_p: torch.Tensor | None  # float32 [n], inf where off (rounding may make mass reach 1)
    truncated: torch.Tensor | None  # bool [n]: sampled rows with top-k or top-p on; None when all greedy
    repetition_penalty: torch.Tensor | None  # float32 [n]
    frequency_penalty: torch.Tensor | None  # float32 [n]
    presence_penalty: torch.Tensor | None  # float32 [n]
    seen: torch.Tensor | None  # bool [n, vocab]: token occurs in prompt or output
    output_counts: torch.Tensor | None  # float32 [n, vocab]: occurrences in the output
    # The constrained rows (int64 [m]) and their grammars' bitmask (int32 [m, ceil(vocab/32)],
    # structured_output.fill_token_bitmask); None when no row is constrained.
    bitmask_rows: torch.Tensor | None = None
    token_bitmask: torch.Tensor | None = None
    # The rows that want logprobs (int64 [r]) and how many top tokens the most demanding asks
    # for; `sample` leaves their TokenLogprobs, in that order, in `logprobs`.
    logprob_rows: torch.Tensor | None = None
    num_top_logprobs: int = 0
    # What `sample` leaves for the logprob rows, on the logits' device: each row's chosen
    # token's logprob [r], its likeliest tokens [r, num_top_logprobs] and their logprobs.
    logprobs: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    # Whether sampling may read tensors on the host: on the CPU it may (numpy's argmax, the
    # top-p candidates widened only as far as a row needs); on a device it reads nothing
    # (torch's argmax, the candidates sized from the settings alone).
    host_reads: bool = True
    all_truncated: bool = False  # every row has top-k or top-p on, and none is greedy
    num_candidates: int = 0  # the first number of top candidates `kept_candidates` sorts
    # Set when the sampling kernel samples (the CUDA path): it reads the rows' settings
    # itself, and the per-setting tensors above are None but for the penalties.
    settings: SettingsRows | None = None

    @classmethod
    def greedy_only(cls, params: list[SamplingParams], host_reads: bool = True
                    ) -> SamplingBatch | None:
        """The batch of rows that are all greedy without penalties (the common case: `sample`
        then reads nothing but `all_greedy`), or None when some row needs more."""
        if not all(p.greedy and not p.uses_penalties for p in params):
            return None
        return cls(all_greedy=True, greedy=None, temperature=None, uniforms=None, min_p=None,
                   top_k=None, top_p=None, truncated=None, repetition_penalty=None,
                   frequency_penalty=None, presence_penalty=None, seen=None, output_counts=None,
                   host_reads=host_reads)

    @classmethod
    def build(cls, params: list[SamplingParams], seeds: list[int], output_indices: list[int],
              token_histories: list[list[int]] | None, prompt_lens: list[int] | None,
              vocab_size: int, device: torch.device, host_reads: bool = True) -> SamplingBatch:
        """Gather the rows' settings into tensors on `device`; `host_reads` False for logits
        on an accelerator (see the field).

        `seeds` are the requests' `sampling_seed`; `output_indices` the number of tokens each
        has generated so far. `token_histories` (prompt + output ids) and `prompt_lens` are
        needed only when some row uses a penalty.
        """
        if not len(seeds) == len(output_indices) == len(params):
            raise ValueError(f"SamplingBatch.build: {len(params)} params, {len(seeds)} seeds, "
                             f"{len(output_indices)} output indices: expected equal lengths")
        if (greedy_only := cls.greedy_only(params, host_reads)) is not None:
            return greedy_only
        host = sampling_columns(params, vocab_size)
        streams = seed_streams(np.array([as_int64(s) for s in seeds], dtype=np.int64))
        batch = cls.from_columns(
            host, torch.from_numpy(host).to(device), torch.from_numpy(streams).to(device),
            torch.tensor(output_indices, dtype=torch.int64, device=device), vocab_size,
            host_reads)
        if batch.repetition_penalty is not None:
            if token_histories is None or prompt_lens is None:
                raise ValueError("SamplingBatch.build: a request uses penalties, so "
                                 "token_histories and prompt_lens are required")
            batch.count_tokens(token_histories, prompt_lens, vocab_size, device)
        return batch

    @classmethod
    def from_columns(cls, host: np.ndarray, columns: torch.Tensor, streams: torch.Tensor,
                     output_indices: torch.Tensor, vocab_size: int, host_reads: bool
                     ) -> SamplingBatch:
        """The batch of the rows whose settings are `columns` (`sampling_columns`' layout, on
        the logits' device), their seeds' `seed_streams` (int64) and `output_indices` on the
        device too.
        `host` holds the same settings on the host: what it says decides what `sample` runs,
        so nothing is read back. A batch that uses penalties still needs `count_tokens`."""
        greedy, truncated = host[:, _GREEDY] > 0, host[:, _TRUNCATED] > 0
        top_k = host[:, _TOP_K]
        penalised = _penalised(host)
        uses_top_p = bool(np.isfinite(host[:, _TOP_P]).any())
        largest_top_k = int(top_k[top_k < vocab_size].max(initial=0))

        def column(index: int, dtype: torch.dtype | None = None) -> torch.Tensor:
            values = columns[:, index]
            return values if dtype is None else values.to(dtype)

        return cls(
            all_greedy=bool(greedy.all()),
            greedy=column(_GREEDY, torch.bool) if greedy.any() and not greedy.all() else None,
            temperature=column(_TEMPERATURE),
            uniforms=stream_uniforms(streams, output_indices),
            min_p=column(_MIN_P) if (host[:, _MIN_P] > 0).any() else None,
            top_k=column(_TOP_K, torch.int64) if (top_k < vocab_size).any() else None,
            top_p=column(_TOP_P) if uses_top_p else None,
            truncated=column(_TRUNCATED, torch.bool),
            repetition_penalty=column(_REPETITION) if penalised else None,
            frequency_penalty=column(_FREQUENCY) if penalised else None,
            presence_penalty=column(_PRESENCE) if penalised else None,
            seen=None, output_counts=None, host_reads=host_reads,
            all_truncated=bool(truncated.all()),
            num_candidates=(vocab_size if uses_top_p and not host_reads
                            else min(vocab_size, max(_MIN_CANDIDATES, largest_top_k))))

    @classmethod
    def for_kernel(cls, host: np.ndarray, settings: SettingsRows) -> SamplingBatch:
        """The batch the sampling kernel samples: of the rows whose settings are `host`
        (`sampling_columns`' layout, as the tables in `settings` hold them), gathered on the
        device only where penalties need them. A batch that uses penalties still needs
        `count_tokens`."""
        penalties = settings.table[settings.rows] if _penalised(host) else None

        def penalty(index: int) -> torch.Tensor | None:
            return None if penalties is None else penalties[:, index]

        return cls(all_greedy=bool((host[:, _GREEDY] > 0).all()), greedy=None, temperature=None,
                   uniforms=None, min_p=None, top_k=None, top_p=None, truncated=None,
                   repetition_penalty=penalty(_REPETITION), frequency_penalty=penalty(_FREQUENCY),
                   presence_penalty=penalty(_PRESENCE), seen=None, output_counts=None,
                   host_reads=False, settings=settings)

    def count_tokens(self, histories: list[list[int]], prompt_lens: list[int], vocab_size: int,
                     device: torch.device) -> None:
        """Fill `seen` and `output_counts` from the rows' prompt + output ids (penalties)."""
        self.seen, self.output_counts = _token_stats(histories, prompt_lens, vocab_size, device)


# sampling_columns' layout: one float32 column per setting (top_k and the flags are exact).
(_TEMPERATURE, _MIN_P, _TOP_K, _TOP_P, _GREEDY, _TRUNCATED, _REPETITION, _FREQUENCY,
 _PRESENCE) = range(9)
NUM_COLUMNS = 9


def _penalised(host: np.ndarray) -> bool:
    """Whether some row of `host` (`sampling_columns`' layout) uses a penalty."""
    return bool((host[:, _REPETITION] != 1).any() or host[:, _FREQUENCY].any()
                or host[:, _PRESENCE].any())


def sampling_columns(params: list[SamplingParams], vocab_size: int) -> np.ndarray:
    """Each row's settings as `SamplingBatch.from_columns` reads them, float32 [n, NUM_COLUMNS]:
    temperature (1 on greedy rows), min_p (0 where off), top_k (vocab_size where off), top_p
    (inf where off: rounding may make mass reach 1), greedy, truncated (a sampled row with
    top-k or top-p on), and the repetition, frequency and presence penalties."""
    columns = np.empty((len(params), NUM_COLUMNS), dtype=np.float32)
    for row, p in enumerate(params):
        top_k = min(p.top_k or vocab_size, vocab_size)
        columns[row] = (p.temperature or 1.0, p.min_p, top_k,
                        p.top_p if p.top_p < 1 else math.inf, p.greedy,
                        not p.greedy and (top_k < vocab_size or p.top_p < 1),
                        p.repetition_penalty, p.frequency_penalty, p.presence_penalty)
    return columns


def _token_stats(histories: list[list[int]], prompt_lens: list[int], vocab_size: int,
                 device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Seen-mask (prompt + output) and output counts, scattered from all histories at once
    (no mask indexing, which would read a count on the host; the ids go to the device
    without the host waiting for it)."""
    lengths = [len(history) for history in histories]
    rows = np.repeat(np.arange(len(histories), dtype=np.int64), lengths)
    tokens = np.fromiter(itertools.chain.from_iterable(histories), dtype=np.int64, count=len(rows))
    is_output = np.concatenate([np.arange(length) >= prompt_len
                                for length, prompt_len in zip(lengths, prompt_lens)])
    rows_t, tokens_t, is_output_t = (torch.from_numpy(array).to(device, non_blocking=True)
                                     for array in (rows, tokens, is_output.astype(np.float32)))
    seen = torch.zeros(len(histories), vocab_size, dtype=torch.bool, device=device)
    seen[rows_t, tokens_t] = True
    counts = torch.zeros(len(histories), vocab_size, device=device)
    counts.index_put_((rows_t, tokens_t), is_output_t, accumulate=True)
    return seen, counts


def apply_penalties(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Repetition (prompt + output), then frequency and presence (output) penalties, as vLLM."""
    if batch.seen is None:
        return logits
    rep = batch.repetition_penalty[:, None]
    logits = torch.where(batch.seen, torch.where(logits > 0, logits / rep, logits * rep), logits)
    logits = logits - batch.frequency_penalty[:, None] * batch.output_counts
    return logits - batch.presence_penalty[:, None] * (batch.output_counts > 0)


def apply_min_p(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Drop tokens with p < min_p * p_max, i.e. logit < max_logit + log(min_p): no softmax."""
    if batch.min_p is None:
        return logits
    floor = logits.amax(dim=-1, keepdim=True) + torch.log(batch.min_p)[:, None]
    return logits.masked_fill(logits < floor, float("-inf"))


def _log_sum_exp(x: torch.Tensor) -> torch.Tensor:
    """logsumexp over each row, with no term under exp(_EXP_FLOOR)."""
    row_max = x.amax(dim=-1)
    return (x - row_max[:, None]).clamp_(min=_EXP_FLOOR).exp_().sum(dim=-1).log_() + row_max


def apply_top_k_top_p(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Each truncated row's logits with every token outside its top-k, then outside the
    nucleus of their renormalised probs, at -inf (what the draw keeps, as logits)."""
    if batch.top_k is None and batch.top_p is None:
        return logits
    return _drop_all_but(logits, kept_candidates(logits, batch), batch)


def _drop_all_but(logits: torch.Tensor, kept: tuple[torch.Tensor, torch.Tensor],
                  batch: SamplingBatch) -> torch.Tensor:
    """`logits` with every token a truncated row does not keep (`kept_candidates`) at -inf."""
    values, indices = kept
    dropped = torch.ones_like(logits, dtype=torch.bool).scatter_(-1, indices, values.isneginf())
    return logits.masked_fill(dropped & batch.truncated[:, None], float("-inf"))


def kept_candidates(logits: torch.Tensor, batch: SamplingBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's top candidates: their logits, -inf where a truncated row drops them (past
    its top-k, then outside the nucleus of their renormalised probs), and their token ids.
    A truncated row keeps no token outside them. Needs top-k or top-p on in the batch.

    A full sort of a batch's logits over the whole vocabulary costs as much as a decode step
    on the CPU, while the kept set is almost always small. So sort only the top `k`
    candidates (`topk`) and widen `k` (in the end to the whole vocabulary: the plain sort)
    until every truncated row's kept set provably ends inside them: its top-k fits, or the
    candidates' mass reaches its top_p. Without host reads the first `k` holds every row's
    kept set by construction (`num_candidates`: the whole vocabulary where top-p is on).
    """
    vocab = logits.shape[-1]
    k = min(vocab, batch.num_candidates)
    full_log_z = _log_sum_exp(logits) if batch.top_p is not None else None
    while True:
        values, indices = logits.topk(k, dim=-1)
        if batch.top_k is not None:
            outside_top_k = torch.arange(k, device=logits.device) >= batch.top_k[:, None]
            values = values.masked_fill(outside_top_k, float("-inf"))
        if batch.top_p is None:
            return values, indices  # `num_candidates` is at least every row's top-k
        # rows with top-k on have it inside the candidates: renormalise over it, as vLLM does
        log_z = (full_log_z if batch.top_k is None
                 else torch.where(batch.top_k < vocab, values.logsumexp(dim=-1), full_log_z))
        probs = (values - log_z[:, None]).exp()
        mass = probs.cumsum(dim=-1)
        if k == vocab or not batch.host_reads or _kept_sets_inside(batch, k, mass):
            break
        k = k * _GROWTH if k * _GROWTH <= vocab // 4 else vocab
    # The most probable token is always kept: a tiny top_p (1e-300 is 0 in float32) would
    # drop every token, and the draw over no token is NaN.
    outside_top_p = mass - probs >= batch.top_p[:, None]
    outside_top_p[:, 0] = False
    return values.masked_fill(outside_top_p, float("-inf")), indices


def _kept_sets_inside(batch: SamplingBatch, k: int, mass: torch.Tensor) -> bool:
    """Whether every truncated row keeps only tokens among its top `k` candidates, whose
    cumulative probabilities are `mass` (a read on the host): its top-k fits in them, or their
    mass reaches its top_p."""
    covered = ~batch.truncated | (mass[:, -1] >= batch.top_p)
    if batch.top_k is not None:
        covered |= batch.top_k <= k
    return bool(covered.all())


def draw(scaled: torch.Tensor, batch: SamplingBatch,
         kept: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
    """Each row's token drawn from `scaled` (temperature and min-p applied): a truncated
    row's from its kept candidates (`kept`, None when no row truncates) in token-id order,
    the other rows' from the whole vocabulary. Every other token has a zero-width step in a
    truncated row's CDF over the vocabulary, so its draw among the candidates picks the
    token that one would; the whole-vocabulary softmax, mask and sum per row cost more than
    the rest of sampling."""
    if kept is None:
        return _inverse_cdf(scaled, batch.uniforms)
    values, indices = kept
    by_id = indices.argsort(dim=-1)
    ids = indices.gather(1, by_id)
    picked = ids.gather(1, _inverse_cdf(values.gather(1, by_id), batch.uniforms)[:, None]).squeeze(1)
    if batch.all_truncated:
        return picked
    return torch.where(batch.truncated, picked, _inverse_cdf(scaled, batch.uniforms))


def _inverse_cdf(x: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Per row, the index of the first entry whose cumulative weight exp(x) reaches the row's
    uniform times the total: a weight of 0 (-inf) never owns a step. The CDF is summed in
    float32, in place: a float64 copy of [32, 49152] costs more than the rest of sampling
    (fresh pages), and float32 moves < 1e-3 of the probability mass, far below bf16 logits'
    own error."""
    shifted = x - x.amax(dim=-1, keepdim=True)
    cdf = shifted.masked_fill_(shifted < _EXP_FLOOR, float("-inf")).exp_().cumsum_(dim=-1)
    targets = (uniforms * cdf[:, -1]).to(cdf.dtype)
    return torch.searchsorted(cdf, targets[:, None]).squeeze(1)


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor
                        ) -> torch.Tensor:
    """Set to -inf, in place, the logits of `rows` that their bitmask disallows (bit j of word
    w clear: token 32 * w + j is not allowed); returns `logits`. A sampled token is always an
    allowed one, so masking in place leaves nothing the caller reads of it wrong."""
    vocab = logits.shape[-1]
    assert bitmask.shape == (len(rows), (vocab + 31) // 32), (bitmask.shape, len(rows), vocab)
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    allowed = ((bitmask[:, :, None] >> shifts) & 1).flatten(1)[:, :vocab].bool()
    logits[rows] = logits[rows].masked_fill(~allowed, float("-inf"))
    return logits


def token_logprobs(logprobs: torch.Tensor, tokens: torch.Tensor, num_top: int
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each row's chosen token's log-probability [r], its `num_top` likeliest tokens [r, num_top]
    and their log-probabilities, on the device: `logprobs` [r, vocab] (a log-softmax),
    `tokens` int64 [r]. `logprob_entries` makes TokenLogprobs of them on the host."""
    chosen = logprobs.gather(1, tokens[:, None]).squeeze(1)
    top = logprobs.topk(num_top, dim=-1)
    return chosen, top.indices, top.values


def logprob_entries(chosen: np.ndarray, top_ids: np.ndarray, top_logprobs: np.ndarray
                    ) -> list[TokenLogprob]:
    """TokenLogprobs of what `token_logprobs` gave, on the host: [r], [r, k] and [r, k]."""
    return [TokenLogprob(float(lp), ids, values) for lp, ids, values
            in zip(chosen, top_ids.astype(np.int64).tolist(), top_logprobs.tolist())]


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """Each row's argmax as int64: the first maximum, or the first NaN (torch's rule too).

    On the CPU numpy's argmax does it: it is vectorised, torch's CPU argmax is not.
    """
    if logits.device.type == "cpu" and logits.dtype == torch.float32:
        return torch.from_numpy(np.argmax(logits.detach().numpy(), axis=-1))
    return logits.argmax(dim=-1)


def _device_argmax(logits: torch.Tensor) -> torch.Tensor:
    return logits.argmax(dim=-1)


def sample(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Pick one token per row: `[num_seqs, vocab]` logits of any float dtype -> int64 `[num_seqs]`,
    -1 for a row whose logits hold NaN or +inf, or nothing above -inf (no draw over them is
    meaningful: NaN probabilities give an id past the vocabulary).

    The draw is inverse-CDF sampling with the row's counter-based uniform u: the first token
    whose cumulative probability reaches u * total (`draw`). One uniform per row instead of
    one per vocabulary entry keeps the hashing negligible. A token with zero probability
    never owns a step of the CDF, so filtered tokens are never picked. With `batch.settings`
    the sampling kernel does all of it but the penalties and the grammar bitmask, in one
    launch (sampling_kernel.py).
    The constrained rows' logits are masked in place (`apply_token_bitmask`); the logprob
    rows' logprobs (of the logits as given, `token_logprobs`) are left in `batch.logprobs`.
    """
    model_logprobs = (None if batch.logprob_rows is None
                      else logits[batch.logprob_rows].float().log_softmax(dim=-1))
    if batch.settings is not None:
        sampled = _sample_in_kernel(logits, batch)
    else:
        sampled = _flag_unsampleable(logits, _sample_with_torch(logits, batch))
    if model_logprobs is not None:
        chosen = sampled[batch.logprob_rows].clamp(0, logits.shape[-1] - 1)
        batch.logprobs = token_logprobs(model_logprobs, chosen, batch.num_top_logprobs)
    return sampled


def _sample_with_torch(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    logits = apply_penalties(logits.float(), batch)
    if batch.token_bitmask is not None:
        logits = apply_token_bitmask(logits, batch.token_bitmask, batch.bitmask_rows)
    argmax = greedy_tokens if batch.host_reads else _device_argmax
    if batch.all_greedy:
        return argmax(logits)
    scaled = apply_min_p(logits / batch.temperature[:, None], batch)
    kept = (None if batch.top_k is None and batch.top_p is None
            else kept_candidates(scaled, batch))
    sampled = draw(scaled, batch, kept)
    if batch.greedy is not None:
        sampled = torch.where(batch.greedy, argmax(logits), sampled)
    return sampled


def _sample_in_kernel(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    # Imported here: triton is an optional extra (the batch has `settings` only on its path).
    from paged_chat.engine.worker.sampling_kernel import sample_in_kernel

    if batch.seen is not None:
        logits = apply_penalties(logits.float(), batch)
    if batch.token_bitmask is not None:
        logits = apply_token_bitmask(logits, batch.token_bitmask, batch.bitmask_rows)
    return sample_in_kernel(logits, batch.settings)


def _flag_unsampleable(logits: torch.Tensor, sampled: torch.Tensor) -> torch.Tensor:
    """`sampled` with -1 for the rows `sample` cannot sample, found at the cost of one gather:
    argmax picks a NaN or +inf when there is one, and a draw over NaN leaves the vocabulary."""
    vocab_size = logits.shape[-1]
    chosen = logits.gather(1, sampled.clamp(max=vocab_size - 1)[:, None]).squeeze(1)
    return sampled.masked_fill((sampled >= vocab_size) | ~torch.isfinite(chosen), -1)
