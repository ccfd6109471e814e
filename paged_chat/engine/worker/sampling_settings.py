"""The layout of a step's sampling settings on the device, shared by the torch sampler
(sampler.py) and the sampling kernel (sampling_kernel.py): one float32 column per setting
in a persistent table (input_batch.SamplingRows), and the floor under which exp() is not
taken."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from paged_chat.engine.core.sampling_params import SamplingParams

# exp() below this is a float32 denormal (or 0), which x86 computes ~100x slower (microcode
# assists): at temperature 0.2 most of a 49,152-token vocabulary lands there, and one exp
# over [8, vocab] took ~6 ms, two thirds of the sampler's time. Such a term is under float32's
# resolution of any row's sum (whose largest term is 1): a sum takes it as exp(EXP_FLOOR), a
# CDF as 0.
EXP_FLOOR = -87.0

# sampling_columns' layout: one float32 column per setting (top_k and the flags are exact).
(TEMPERATURE, MIN_P, TOP_K, TOP_P, GREEDY, TRUNCATED, REPETITION, FREQUENCY,
 PRESENCE) = range(9)
NUM_COLUMNS = 9


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
