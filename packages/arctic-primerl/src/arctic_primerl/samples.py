"""From PRIME-RL's packed micro-batches back to prompt groups Arctic can pack once.

PRIME-RL packs flat samples (one rollout branch each) along a row, without a prompt/completion
split: ``loss_mask`` marks the model-sampled tokens. A sample's prompt is what precedes its first
trainable token, its response runs to its last trainable token (anything after it cannot change a
trained log-prob), and samples whose prompts are the same tokens form one group, so ZoRRo packs
each prompt once however the orchestrator spread the samples over micro-batches.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import torch

from arctic_core.batch import RolloutBatch
from arctic_primerl.wire import MicroBatch, WireError


@dataclass
class Sample:
    prompt: list[int]
    response: list[int]
    trainable: list[bool]
    inference_logprobs: list[float]
    advantages: list[float]
    temperature: float
    env_name: str
    origin: tuple[int, int]
    """Where the response starts: (micro-batch, token offset in its row)."""


def unpack(batches: list[MicroBatch]) -> list[Sample]:
    """Every sample with at least one trainable token, in order (padding and dummies carry none)."""
    samples = []
    for i, batch in enumerate(batches):
        _refuse_unserved_streams(batch, f"micro-batch {i}")
        start = 0
        for length in _segments(batch):
            sample = _sample(batch, start, start + length, i)
            if sample is not None:
                samples.append(sample)
            start += length
    return samples


def _segments(batch: MicroBatch) -> list[int]:
    """Sample lengths: ``sequence_lengths``, with the padding PRIME-RL appends to the last sample
    split off where its positions restart at 0."""
    lengths = list(batch.sequence_lengths)
    start = len(batch.input_ids) - lengths[-1]
    restarts = [t for t in range(start + 1, len(batch.input_ids)) if batch.position_ids[t] == 0]
    if restarts:
        lengths[-1:] = [restarts[0] - start, len(batch.input_ids) - restarts[0]]
    return lengths


def _sample(batch: MicroBatch, start: int, end: int, index: int) -> Sample | None:
    where = f"micro-batch {index}"
    mask = _trainable(batch, start, end, where)
    if not any(mask):
        return None
    first = mask.index(True)
    last = len(mask) - 1 - mask[::-1].index(True)
    if first == 0:
        raise WireError(f"{where}: a sample's first token is trainable; nothing precedes it to predict it from")
    temperatures = {batch.temperatures[t] for t in range(start + first - 1, start + last)}
    if len(temperatures) != 1:
        raise WireError(f"{where}: one sample sampled at several temperatures {sorted(temperatures)}")
    span = slice(start + first, start + last + 1)
    return Sample(
        prompt=batch.input_ids[start : start + first],
        response=batch.input_ids[span],
        trainable=mask[first : last + 1],
        inference_logprobs=batch.inference_logprobs[span],
        advantages=batch.advantages[span],
        temperature=temperatures.pop(),
        env_name=batch.env_names[start],
        origin=(index, start + first),
    )


def _trainable(batch: MicroBatch, start: int, end: int, where: str) -> list[bool]:
    """The rl component's tokens: the loss mask, less tokens whose rl weight is 0 (PRIME-RL gives
    zero-advantage tokens weight 0 with ``filter_zero_advantages``)."""
    mask = batch.loss_mask[start:end]
    if batch.rl_weights is None:
        return list(mask)
    weights = batch.rl_weights[start:end]
    if any(w not in (0.0, 1.0) for w, m in zip(weights, mask, strict=True) if m):
        raise WireError(f"{where}: rl_weights other than 0 and 1 are not supported by arctic-primerl")
    return [m and w != 0.0 for m, w in zip(mask, weights, strict=True)]


def _refuse_unserved_streams(batch: MicroBatch, where: str) -> None:
    for name, algorithm in (("ce_weights", "cross-entropy (sft, echo)"),
                            ("ref_kl_weights", "reference KL (opd, opsd)")):
        stream = getattr(batch, name)
        if stream is not None and any(stream):
            raise WireError(f"{where}: the {algorithm} loss component ({name}) is not served by arctic-primerl; "
                            "use an algorithm whose samples train the rl component only (grpo, max_rl, ...)")
    if batch.mm_kwargs or batch.routed_experts is not None:
        raise WireError(f"{where}: multimodal inputs and routed-expert replay are not served by arctic-primerl")


def by_temperature(samples: list[Sample]) -> dict[float, RolloutBatch]:
    """One Arctic batch per sampling temperature (log-probs are taken at it), prompts grouped by tokens."""
    groups: dict[float, list[Sample]] = defaultdict(list)
    for sample in samples:
        groups[sample.temperature].append(sample)
    return {temperature: to_batch(group) for temperature, group in groups.items()}


def to_batch(samples: list[Sample]) -> RolloutBatch:
    """Samples as a RolloutBatch: identical prompts stored once; the sampler's log-probs serve as
    the old log-probs (PRIME-RL's importance ratio is against the sampling policy)."""
    prompts: dict[tuple[int, ...], int] = {}
    index = [prompts.setdefault(tuple(s.prompt), len(prompts)) for s in samples]
    width = max(len(s.response) for s in samples)
    logprobs = torch.tensor([_pad(s.inference_logprobs, width) for s in samples], dtype=torch.float32)
    return RolloutBatch.from_lists(
        [list(p) for p in prompts], [s.response for s in samples], index,
        loss_mask=torch.tensor([_pad(s.trainable, width, False) for s in samples]),
        old_logprobs=logprobs, sampling_logprobs=logprobs,
        advantages=torch.tensor([_pad(s.advantages, width) for s in samples], dtype=torch.float32),
    )


def _pad(values: list, width: int, fill: object = 0.0) -> list:
    return list(values) + [fill] * (width - len(values))


def count_trainable(samples: list[Sample]) -> int:
    return sum(sum(s.trainable) for s in samples)
