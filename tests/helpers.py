"""Helpers shared by the tests: reach into an in-process client's engines, make GRPO batches, and
serve an app on loopback."""

from __future__ import annotations

import json
import socket
import threading
import time

import httpx
import torch
import uvicorn
from safetensors.torch import save as st_save

from arctic_core import wire
from arctic_core.batch import RolloutBatch
from arctic_core.client import ArcticClient

PROMPTS = [[1, 20, 30, 40, 2], [1, 50, 60, 2], [1, 70, 2]]
HOST = "127.0.0.1"


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


class LiveServer:
    """uvicorn serving ``app`` in a background thread on a loopback socket it bound itself."""

    def __init__(self, app) -> None:
        # proto=IPPROTO_TCP, as asyncio's own server sockets: only then does asyncio set TCP_NODELAY
        # on accepted connections (without it every keep-alive answer waits ~40 ms for an ACK).
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((HOST, 0))  # port 0: the OS picks a free one, and we hold it, so no race
        self.url = f"http://{HOST}:{sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "uvicorn did not start"
            time.sleep(0.02)
        assert httpx.get(f"{self.url}/health").status_code == 200

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
