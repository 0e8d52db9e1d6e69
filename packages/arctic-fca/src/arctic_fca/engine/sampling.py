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

Random numbers come from the caller's generator, or, with ``RowParams.seeds``, from each row's own
seed: a row's draw then depends on its seed alone, never on the rows beside it, so a request
draws the same numbers alone or inside any batch (the engine gives each sample a key and each of
its tokens the seed ``key + position x SEED_STRIDE``).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch


# A row's seed moves by this much per token (2**64 / golden ratio, odd: as int64 arithmetic wraps,
# the seeds of one sample's tokens are all distinct).
SEED_STRIDE = 0x9E3779B97F4A7C15 - 2**64


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
    # Keep tokens with probability >= min_p x the most likely one's (0: off): one for all rows, or [rows].
    min_p: float | torch.Tensor = 0.0
    # Divides positive, multiplies negative logits of seen tokens (1: off): one for all rows, or [rows].
    repetition_penalty: float | torch.Tensor = 1.0
    seen: torch.Tensor | None = None  # [rows, vocab] bool: the tokens of each row's prompt and output so far
    seeds: torch.Tensor | None = None  # [rows] int64: each row's own seed for this token (None: the caller's generator)
    # Whether any row has min-p or a repetition penalty, when they are given per row (known on the host).
    any_min_p: bool | None = None
    any_penalty: bool | None = None

    def __post_init__(self) -> None:
        if self.any_min_p is None:
            object.__setattr__(self, "any_min_p", torch.is_tensor(self.min_p) or self.min_p > 0.0)
        if self.any_penalty is None:
            penalty = self.repetition_penalty
            object.__setattr__(self, "any_penalty", torch.is_tensor(penalty) or penalty != 1.0)

    def rows(self, index: torch.Tensor) -> RowParams:
        """The settings of rows ``index`` (a device tensor), in that order."""
        return dataclasses.replace(self, temperature=self.temperature[index], top_k=self.top_k[index],
                                   top_p=self.top_p[index], min_p=_rows(self.min_p, index),
                                   repetition_penalty=_rows(self.repetition_penalty, index),
                                   seen=_rows(self.seen, index), seeds=_rows(self.seeds, index))

    def next_token(self) -> RowParams:
        """The settings for each row's next token (its seed moved on)."""
        return self if self.seeds is None else dataclasses.replace(self, seeds=self.seeds + SEED_STRIDE)

    @property
    def filtered(self) -> bool:
        return self.any_top_k or self.any_top_p or bool(self.any_min_p)


def _rows[T](value: T, index: torch.Tensor) -> T:
    return value[index] if torch.is_tensor(value) else value


def _per_row(value: float | torch.Tensor) -> float | torch.Tensor:
    """A per-row setting as a column to broadcast against ``[rows, vocab]``."""
    return value[:, None] if torch.is_tensor(value) else value


def filtered_log_probs(logits: torch.Tensor, params: RowParams) -> torch.Tensor:
    """log-softmax of the penalised ``logits / temperature`` restricted to each row's top-k,
    top-p and min-p set."""
    greedy = params.temperature == 0
    logits = logits.float()
    if params.any_penalty and params.seen is not None:
        penalty = _per_row(params.repetition_penalty)
        penalised = torch.where(logits < 0, logits * penalty, logits / penalty)
        logits = torch.where(params.seen, penalised, logits)
    scaled = logits / torch.where(greedy, 1.0, params.temperature)[:, None]
    if params.any_top_k or params.any_top_p:
        scaled = _filter(scaled, params, greedy)
    if params.any_min_p:  # probability below min_p x the likeliest's (log 0 = -inf: a row without min-p)
        min_p = params.min_p
        log_min_p = min_p.float().log()[:, None] if torch.is_tensor(min_p) else math.log(min_p) if min_p else -math.inf
        below = scaled < scaled.amax(-1, keepdim=True) + log_min_p
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


def sample(logits: torch.Tensor, params: RowParams, generator: torch.Generator | None = None, *,
           triton: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens ``[rows]`` and their log-probs ``[rows]`` (fp32); with ``triton``, rows without a
    repetition penalty are drawn by the kernels (one pass over the logits, a few more to find the
    filters' floors without a sort: the same distribution, other random numbers than the torch path's).
    Random numbers: ``params.seeds`` (each row's own), else ``generator``."""
    if (params.seeds is None) == (generator is None):
        raise ValueError("sample() draws from a generator or from per-row seeds (RowParams.seeds): give one")
    if triton and not params.any_penalty:
        from arctic_fca.engine.triton_filters import row_floors
        from arctic_fca.engine.triton_sampling import sample_with_temperature

        floors = row_floors(logits, params.temperature, params.top_k, params.top_p, params.min_p) \
            if params.filtered else None
        return sample_with_temperature(logits, params.temperature,
                                       generator if params.seeds is None else params.seeds, floors)
    log_probs = filtered_log_probs(logits, params)
    # Exponential race: argmax(p / E) with E ~ Exp(1) is a draw from p (one random number per
    # vocabulary entry, no sort and no cumulative sum).
    noise = _row_exponentials(params.seeds, log_probs) if params.seeds is not None \
        else torch.empty_like(log_probs).exponential_(generator=generator)
    race = log_probs - noise.log()
    tokens = torch.where(params.temperature == 0, log_probs.argmax(-1), race.argmax(-1))
    return tokens, log_probs.gather(-1, tokens[:, None]).squeeze(-1)


def _row_exponentials(seeds: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Exp(1) draws shaped as ``like``, each row from a generator of its own seed (a row's numbers do
    not depend on the rows beside it; a generator per row: the torch path serves the CPU and
    repetition penalties, the kernels draw per-row seeds in one launch)."""
    noise = torch.empty_like(like)
    for row, seed in enumerate(seeds.tolist()):
        noise[row].exponential_(generator=torch.Generator(like.device).manual_seed(seed))
    return noise
