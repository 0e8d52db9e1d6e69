"""Next-token sampling for a batch of rows, each with its own settings, in transformers' order:
repetition penalty on the raw logits, then temperature, top-k, top-p and min-p.

Each filter keeps the entries at or above a floor, so that a tie stays or goes whole (a sort's
order among equal logits is arbitrary): top-k keeps every entry equal to the k-th largest, as
transformers' ``TopKLogitsWarper`` does; top-p keeps an entry while the mass strictly above it is
under ``top_p`` (where the sort-based rule cuts inside a tie at the boundary, it keeps the tie);
min-p keeps ``logit / T >= max + log(min_p)``. The Triton path (``triton_filters``) finds the same
floors without sorting.

Returns the sampled tokens and their log-probs under the distribution actually sampled from
(after those steps; the raw distribution for greedy rows), which is what an RL trainer needs for
importance ratios against the sampler.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class RowParams:
    """Per-row sampling settings on the logits' device."""

    temperature: torch.Tensor  # [rows] float, 0 = greedy
    top_k: torch.Tensor  # [rows] long, 0 = off
    top_p: torch.Tensor  # [rows] float, 1 = off
    # Whether any row filters, known on the host where the settings come from (no device sync);
    # when False the sort that filtering needs is skipped.
    any_top_k: bool = True
    any_top_p: bool = True
    min_p: float = 0.0  # keep tokens with probability >= min_p x the most likely one's (0: off)
    repetition_penalty: float = 1.0  # divides positive, multiplies negative logits of seen tokens (1: off)
    seen: torch.Tensor | None = None  # [rows, vocab] bool: the tokens of each row's prompt and output so far

    def rows(self, index: torch.Tensor) -> RowParams:
        """The settings of rows ``index`` (a device tensor), in that order."""
        return dataclasses.replace(self, temperature=self.temperature[index], top_k=self.top_k[index],
                                   top_p=self.top_p[index], seen=self.seen[index] if self.seen is not None else None)

    @property
    def filtered(self) -> bool:
        return self.any_top_k or self.any_top_p or self.min_p > 0.0


def filtered_log_probs(logits: torch.Tensor, params: RowParams) -> torch.Tensor:
    """log-softmax of the penalised ``logits / temperature`` restricted to each row's top-k,
    top-p and min-p set."""
    greedy = params.temperature == 0
    logits = logits.float()
    if params.repetition_penalty != 1.0 and params.seen is not None:
        penalised = torch.where(logits < 0, logits * params.repetition_penalty, logits / params.repetition_penalty)
        logits = torch.where(params.seen, penalised, logits)
    scaled = logits / torch.where(greedy, 1.0, params.temperature)[:, None]
    if params.any_top_k or params.any_top_p:
        scaled = _filter(scaled, params, greedy)
    if params.min_p > 0.0:  # probability below min_p x the likeliest's
        below = scaled < scaled.amax(-1, keepdim=True) + math.log(params.min_p)
        scaled = scaled.masked_fill(below & ~greedy[:, None], float("-inf"))
    return scaled.log_softmax(-1)


def seen_tokens(rows: list[list[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """``[len(rows), vocab]`` bool: which tokens each row holds (for the repetition penalty)."""
    width = max(1, max(len(r) for r in rows))
    ids = torch.tensor([r + [r[0]] * (width - len(r)) if r else [0] * width for r in rows], device=device)
    seen = torch.zeros(len(rows), vocab, dtype=torch.bool, device=device)
    return seen.scatter_(1, ids, True) if any(rows) else seen


def _filter(scaled: torch.Tensor, params: RowParams, greedy: torch.Tensor) -> torch.Tensor:
    sorted_logits, order = scaled.sort(dim=-1, descending=True)
    vocab = scaled.shape[-1]
    ranks = torch.arange(vocab, device=scaled.device)
    k = torch.where((params.top_k > 0) & ~greedy, params.top_k.clamp(max=vocab), vocab)
    drop = sorted_logits < sorted_logits.gather(-1, k[:, None] - 1)  # below the k-th largest
    probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(-1)
    # The mass strictly above each entry: the mass before the first entry of its tie.
    tie_starts = torch.ones_like(drop)
    tie_starts[:, 1:] = sorted_logits[:, 1:] != sorted_logits[:, :-1]
    first_of_tie = torch.where(tie_starts, ranks, 0).cummax(-1).values
    above = (probs.cumsum(-1) - probs).gather(-1, first_of_tie)
    top_p = torch.where(greedy, 1.0, params.top_p)
    drop |= (above >= top_p[:, None]) & (top_p < 1)[:, None]  # at 1 rounding must not drop the tail
    return scaled.scatter(-1, order, sorted_logits.masked_fill(drop, float("-inf")))


def sample(logits: torch.Tensor, params: RowParams, generator: torch.Generator, *,
           triton: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens ``[rows]`` and their log-probs ``[rows]`` (fp32); with ``triton``, rows without a
    repetition penalty are drawn by the kernels (one pass over the logits, a few more to find the
    filters' floors without a sort: the same distribution, other random numbers than the torch path's)."""
    if triton and params.repetition_penalty == 1.0:
        from arctic_fca.engine.triton_filters import row_floors
        from arctic_fca.engine.triton_sampling import sample_with_temperature

        floors = row_floors(logits, params.temperature, params.top_k, params.top_p, params.min_p) \
            if params.filtered else None
        return sample_with_temperature(logits, params.temperature, generator, floors)
    log_probs = filtered_log_probs(logits, params)
    # Exponential race: argmax(p / E) with E ~ Exp(1) is a draw from p (one random number per
    # vocabulary entry, no sort and no cumulative sum).
    race = log_probs - torch.empty_like(log_probs).exponential_(generator=generator).log()
    tokens = torch.where(params.temperature == 0, log_probs.argmax(-1), race.argmax(-1))
    return tokens, log_probs.gather(-1, tokens[:, None]).squeeze(-1)
