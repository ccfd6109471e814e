"""Verifying drafted tokens against the model's own distribution at each drafted position.

A request with k drafts gets k + 1 rows of logits: row i is the model's distribution for
the token after draft i - 1 (row 0: after the request's last token). Drafts are kept
while the model agrees with them, and the first disagreement (or, when all agree, the
last row) yields the model's own token, so a step yields 1 to k + 1 tokens.

- Greedy (`verify_greedy`): a draft is kept while it is the row's argmax: the tokens are
  exactly those of decoding one at a time.
- Sampled (`rejection_sample`): the standard rule for a deterministic draft (the draft
  distribution q is all on draft x): keep x with probability p(x), else draw from p with x
  removed and renormalised (the residual max(p - q, 0)); after k kept drafts, draw from
  the last row. Each emitted token is then distributed exactly as p.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch

from paged_chat.engine.worker.sampler import as_int64, counter_uniforms, greedy_tokens


def verify_greedy(logits: torch.Tensor, drafts: Sequence[Sequence[int]],
                  to_host: Callable[[torch.Tensor], np.ndarray]) -> list[list[int] | None]:
    """Per request, its accepted drafts and the model's next token, from `logits` holding
    each request's 1 + len(drafts) rows in order; None for a request whose kept rows hold a
    NaN or inf logit (its tokens would be meaningless). `to_host` brings a tensor to the
    host (the runner's one copy)."""
    vocab_size = logits.shape[-1]
    targets = greedy_tokens(logits)
    chosen = logits.gather(1, targets.clamp(max=vocab_size - 1)[:, None]).squeeze(1)
    targets = targets.masked_fill(~torch.isfinite(chosen), -1)
    host = to_host(targets.double()).astype(np.int64)
    counts = np.array([len(d) for d in drafts], dtype=np.int64)
    width = int(counts.max())
    padded = np.full((len(drafts), width + 1), -2, dtype=np.int64)   # -2: no draft there
    flat = np.fromiter((t for d in drafts for t in d), dtype=np.int64, count=int(counts.sum()))
    filled = np.arange(width)[None, :] < counts[:, None]
    padded[:, :width][filled] = flat
    starts = np.concatenate(([0], np.cumsum(counts + 1)[:-1]))
    rows = starts[:, None] + np.minimum(np.arange(width + 1)[None, :], counts[:, None])
    model = host[rows]
    num_accepted = np.cumprod(model == padded, axis=1).sum(axis=1)
    verified: list[list[int] | None] = []
    for row, accepted in zip(model.tolist(), num_accepted.tolist()):
        tokens = row[:accepted + 1]
        verified.append(None if min(tokens) < 0 else tokens)
    return verified


def verify_sampled(logits: torch.Tensor, drafts: Sequence[int], temperature: float,
                   seed: int, output_index: int) -> list[int] | None:
    """One request's accepted drafts and drawn token (`rejection_sample`) from its
    1 + len(drafts) rows of `logits`, at `temperature` (no other filter); its uniforms are
    counter-based on (seed, position), as the sampler's, two per position from
    `output_index` (the index of the row-0 token in its output) on. None when a row holds a
    NaN or inf logit."""
    if not bool(torch.isfinite(logits).all()):
        return None
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    indices = 2 * (output_index + torch.arange(len(drafts) + 1, device=logits.device))
    seeds = torch.full_like(indices, as_int64(seed))
    uniforms = torch.stack([counter_uniforms(seeds, indices),
                            counter_uniforms(seeds, indices + 1)], dim=1)
    draft = torch.tensor(list(drafts), dtype=torch.int64, device=logits.device)
    return rejection_sample(probs, draft, uniforms)


def rejection_sample(probs: torch.Tensor, draft: torch.Tensor, uniforms: torch.Tensor
                     ) -> list[int]:
    """One request's tokens under the rule for a deterministic draft: `probs` [k + 1, vocab]
    (rows sum to 1), `draft` [k] int64, `uniforms` [k + 1, 2] in (0, 1): column 0 decides
    whether row i's draft is kept, column 1 draws row i's own token where one is drawn."""
    num_drafts = draft.shape[0]
    rows = torch.arange(num_drafts, device=probs.device)
    kept = uniforms[:num_drafts, 0] < probs[rows, draft].double()
    num_kept = int(torch.cumprod(kept.long(), 0).sum())
    row = probs[num_kept].double()
    if num_kept < num_drafts:       # the residual of a rejected deterministic draft
        residual = row.clone()
        residual[draft[num_kept]] = 0.0
        if bool(residual.sum() > 0):   # else p is all on the draft, but for rounding
            row = residual
    cdf = torch.cumsum(row, 0)
    drawn = int(torch.searchsorted(cdf, uniforms[num_kept, 1] * cdf[-1]))
    return [*draft[:num_kept].tolist(), min(drawn, row.shape[0] - 1)]
