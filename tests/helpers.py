"""Helpers shared by the tests: reach into an in-process client's engines, and make GRPO batches."""

from __future__ import annotations

import json

import torch
from safetensors.torch import save as st_save

from arctic_core import wire
from arctic_core.batch import RolloutBatch
from arctic_core.client import ArcticClient

PROMPTS = [[1, 20, 30, 40, 2], [1, 50, 60, 2], [1, 70, 2]]


def server_of(client: ArcticClient):
    return client.transport.server


def trainer_of(client: ArcticClient):
    return client.transport.server.trainer


def weights(client: ArcticClient) -> dict[str, torch.Tensor]:
    """The trainer's weights as full fp32 CPU copies (any backend, any ZeRO stage)."""
    return {k: v.detach().float().cpu().clone() for k, v in trainer_of(client).named_weights()}


def random_grpo_batch(vocab: int, groups: tuple[int, ...] = (9, 14, 6, 11, 7), samples: int = 3,
                      seed: int = 0) -> RolloutBatch:
    """Prompts of the given lengths, ``samples`` random responses each, random advantages and
    old log-probs near the uniform policy's (so PPO's ratio is neither 1 nor clipped away)."""
    gen = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in groups]
    responses, index = [], []
    for p in range(len(prompts)):
        for _ in range(samples):
            length = int(torch.randint(2, 9, (1,), generator=gen))
            responses.append(torch.randint(3, vocab, (length,), generator=gen).tolist())
            index.append(p)
    batch = RolloutBatch.from_lists(prompts, responses, index)
    old = -torch.log(torch.tensor(float(vocab))) + 0.1 * torch.randn(batch.response_ids.shape, generator=gen)
    return batch.replace(advantages=torch.randn(batch.num_responses, generator=gen),
                         old_logprobs=old * batch.loss_mask)


def wire_body(tensors: dict[str, torch.Tensor], fields: dict, message: str) -> bytes:
    """A wire-format body assembled by hand (to send what the client would never build)."""
    return st_save(tensors, metadata={wire.JSON_KEY: json.dumps(fields), wire.MESSAGE_KEY: message})


def batch_tensors(**changes: torch.Tensor) -> dict[str, torch.Tensor]:
    """A one-response batch's wire tensors (``batch.<field>``), with fields replaced or added."""
    tensors = RolloutBatch.from_lists([[1, 2]], [[3, 4]], [0]).to_tensors() | changes
    return {f"batch.{k}": v for k, v in tensors.items()}
