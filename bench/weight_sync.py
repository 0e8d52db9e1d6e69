"""Weight sync time, trainer process -> sampler process, for a Qwen3-1.7B-shaped model (bf16).

Two processes running the actor side of the Ray weight transports (``WeightSyncActor``: what the
trainer's rank 0 and a sampler replica run), without Ray's control plane (a few ms):
- ``cuda-ipc``: both on GPU 0 (colocated); the sender exports one IPC handle per bucket, the
  receiver maps them and copies into its own model's weights;
- ``nccl``: sender on GPU 0, receiver on GPU 1 (two GPUs), bucketed broadcast in a standalone group;
- ``gloo``: both on the CPU (``--smoke`` uses it with a tiny model).
Each sync ends with the receiver's weights checked equal to the sender's. Last line: JSON.

    python3 bench/weight_sync.py --transport cuda-ipc          # one H200
    python3 bench/weight_sync.py --transport nccl              # two GPUs
    uv run python bench/weight_sync.py --smoke                 # CPU, gloo, tiny model
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import time

import torch
import torch.multiprocessing as mp

from arctic_core.hf import copy_weights_
from arctic_core.weights.actor import WeightSyncActor
from arctic_core.weights.broadcast import WeightGroup
from shapes import QWEN3_1_7B

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, vocab_size=1024, tie_word_embeddings=True)


def build(shape: dict, device: str, seed: int) -> torch.nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    with torch.device(device):
        return AutoModelForCausalLM.from_config(AutoConfig.for_model("qwen3", **shape), dtype=torch.bfloat16)


class Endpoint(WeightSyncActor):
    """A trainer rank 0 (sends its model's weights) or a sampler replica (copies into its model)."""

    def __init__(self, model: torch.nn.Module, group: WeightGroup | None) -> None:
        self.model, self._weight_group = model, group

    def weights_to_send(self):
        return [(n, p.detach()) for n, p in self.model.named_parameters()]

    def receive_weights_into(self, weights, version: int) -> None:
        copy_weights_(self.model, weights)


def sender(args: argparse.Namespace, port: int, queue: mp.Queue, done: mp.Queue) -> None:
    device = "cpu" if args.transport == "gloo" else "cuda:0"
    group = None if args.transport == "cuda-ipc" else WeightGroup.join("127.0.0.1", port, 0, 2, args.transport)
    me = Endpoint(build(args.shape, device, seed=1), group)
    for version in range(args.iters):
        if group is None:
            queue.put(me.export_weights_ipc(version, args.bucket_mb << 20))
            done.get()  # the receiver copied: the buffers may go
            me.release_weights_ipc()
        else:
            me.send_weights(version, args.bucket_mb << 20)
    if group is not None:
        group.close()
    queue.put({name: float(t.float().sum()) for name, t in me.weights_to_send()})  # checksums for the check


def receiver(args: argparse.Namespace, port: int, queue: mp.Queue, done: mp.Queue, out: mp.Queue) -> None:
    device = {"gloo": "cpu", "cuda-ipc": "cuda:0", "nccl": "cuda:1"}[args.transport]
    if device != "cpu":
        torch.cuda.set_device(torch.device(device))
    group = None if args.transport == "cuda-ipc" else WeightGroup.join("127.0.0.1", port, 1, 2, args.transport)
    me = Endpoint(build(args.shape, device, seed=2), group)
    times = []
    for _ in range(args.iters):
        payload = queue.get() if group is None else None
        start = time.perf_counter()
        if group is None:
            me.import_weights_ipc(payload)
        else:
            me.receive_weights()
            if device != "cpu":
                torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
        if group is None:
            done.put(True)
    if group is not None:
        group.close()
    sums = queue.get()
    mismatched = [n for n, t in me.weights_to_send() if float(t.float().sum()) != sums[n]]
    out.put({"times": times, "mismatched": mismatched,
             "bytes": sum(p.numel() * p.element_size() for p in me.model.parameters())})


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--transport", choices=["cuda-ipc", "nccl", "gloo"], default="cuda-ipc")
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--bucket-mb", type=int, default=256)
    parser.add_argument("--smoke", action="store_true", help="gloo on the CPU with a tiny model")
    args = parser.parse_args()
    if args.smoke:
        args.transport, args.iters = "gloo", 2
    args.shape = TINY if args.smoke else QWEN3_1_7B
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue, done, out = ctx.Queue(), ctx.Queue(), ctx.Queue()
    procs = [ctx.Process(target=sender, args=(args, port, queue, done)),
             ctx.Process(target=receiver, args=(args, port, queue, done, out))]
    for proc in procs:
        proc.start()
    result = out.get(timeout=1200)
    for proc in procs:
        proc.join()
    steady = result["times"][1:] or result["times"]
    print(json.dumps({"transport": args.transport, "gib": round(result["bytes"] / 2**30, 3),
                      "seconds_median": round(statistics.median(steady), 4),
                      "seconds": [round(t, 4) for t in result["times"]],
                      "bucket_mb": args.bucket_mb, "weights_equal": not result["mismatched"]}))


if __name__ == "__main__":
    main()
