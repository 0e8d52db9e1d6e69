"""Several GPUs of one host through Ray: data-parallel ZoRRo training, a sampler replica on a GPU
of its own with NCCL weight sync, and a killed rank's recovery.

- training: ``--gpus`` DeepSpeed ranks, one GPU each (NCCL), against one rank on the same global
  batch, ZeRO-2 and ZeRO-3: losses and weights after their steps (fp32, the Qwen3-1.7B shape cut
  to ``--layers`` layers; the gap in units of the fp32 spacing, as ``ray_one_gpu.py`` reads it);
- speed: the full Qwen3-1.7B shape in bf16 with gradient checkpointing, one GPU against
  ``--gpus`` on the same global batch (``--speed-groups`` prompts x ``--samples``): fwd_bwd + step
  seconds and their ratio, the update's gap against one GPU's (relative to the update), and the
  deduplicated tokens each rank got (prompt groups balanced across ranks);
- grpo: GRPO steps (generate, log_probs, fwd_bwd, step, sync) with the trainer on one GPU and a
  sampler replica (embedded, or vLLM + FCA with ``--sampler vllm``) on another, weights synced by
  ``torch-broadcast`` over NCCL; the sampler's log-probs of its own tokens match the trainer's after
  each sync (and not before it);
- recovery: a rank killed inside ``fwd_bwd`` is named, ``load_checkpoint`` restarts every rank,
  and the next loss is the one the checkpoint gives.

--smoke runs the same on the CPU with a tiny model (Ray ranks on gloo, torch-broadcast on gloo).
The last line printed is a JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

import torch

from arctic_core.ray.trainer import split_by_groups
from ray_one_gpu import colocation, grpo_batch, recovery, train, training, weight_gap
from shapes import QWEN3_1_7B, SMOKE_SHAPE, make_model


def speed(args) -> dict:
    """One GPU against ``args.workers`` on the same global batch, in the model's own dtype."""
    batch = grpo_batch(args.vocab, args.speed_groups, args.speed_prompt, args.speed_response, args.samples, seed=3)
    shards = split_by_groups(batch, args.workers)
    per_rank = [int(batch.select(rows).packed_tokens()) if rows else 0 for rows in shards]
    report = {"global_batch": {"responses": batch.num_responses, "tokens": int(batch.total_tokens()),
                               "packed_tokens": int(batch.packed_tokens())},
              "packed_tokens_per_rank": per_rank}
    for stage in (2, 3):
        one = train(args, stage, 1, batch, big=True)
        ranks = train(args, stage, args.workers, batch, big=True)
        one_s, ranks_s = statistics.median(one["seconds"][1:]), statistics.median(ranks["seconds"][1:])
        gap = weight_gap(one, ranks)
        report[f"zero{stage}"] = {"step_s_one": one_s, "step_s_ranks": ranks_s, "speedup": one_s / ranks_s,
                                  "loss_gap": max(abs(a - b) for a, b in zip(one["losses"], ranks["losses"], strict=True)),
                                  "largest_gap_against_update": gap["largest_gap_against_update"], "tensor": gap["tensor"],
                                  "seconds_one": one["seconds"], "seconds_ranks": ranks["seconds"]}
        print(f"speed ZeRO-{stage}, 1 vs {args.workers} GPUs: {json.dumps(report[f'zero{stage}'])}", flush=True)
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny model")
    parser.add_argument("--gpus", type=int, default=None, help="data-parallel ranks (default: every visible GPU)")
    parser.add_argument("--parts", nargs="+", default=["training", "speed", "grpo", "recovery"])
    parser.add_argument("--layers", type=int, default=4, help="layers of the Qwen3-1.7B shape for the fp32 checks")
    parser.add_argument("--groups", type=int, default=4, help="prompts of the fp32 checks and the GRPO steps")
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=1024)
    parser.add_argument("--response", type=int, default=256)
    parser.add_argument("--speed-groups", type=int, default=16)
    parser.add_argument("--speed-prompt", type=int, default=2048)
    parser.add_argument("--speed-response", type=int, default=512)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--long-call", type=int, default=4, help="the killed call's batch, in training batches")
    parser.add_argument("--micro-batch-tokens", type=int, default=16384)
    parser.add_argument("--kv-cache-tokens", type=int, default=262144)
    parser.add_argument("--sampler", choices=["embedded", "vllm"], default="embedded", help="the replica's engine")
    parser.add_argument("--vllm-memory", type=float, default=0.85, help="vLLM's gpu_memory_utilization")
    args = parser.parse_args()
    args.device, args.colocate = ("cpu" if args.smoke else "cuda"), False
    if args.smoke:
        args.gpus = args.gpus or 2
        args.groups, args.samples, args.prompt, args.response, args.steps, args.long_call = 3, 3, 24, 8, 2, 300
        args.speed_groups, args.speed_prompt, args.speed_response = 4, 32, 8
        args.micro_batch_tokens, args.kv_cache_tokens, args.gpu_share = 4096, 4096, 0.0
    else:
        args.gpus = args.gpus or torch.cuda.device_count()
        if args.gpus < 2:
            raise SystemExit(f"{args.gpus} GPU(s) visible: this needs two or more (bench/ray_one_gpu.py shares one)")
        args.gpu_share = 1.0  # a GPU per rank and per replica: NCCL between them
    args.workers, args.weight_sync = args.gpus, "torch-broadcast"
    shape = SMOKE_SHAPE if args.smoke else QWEN3_1_7B
    args.vocab = shape["vocab_size"] if args.smoke else 1000
    args.big_dtype = "float32" if args.smoke else "bfloat16"
    report = {"gpus": args.gpus}
    with tempfile.TemporaryDirectory() as tmp:
        args.small_model, args.big_model = Path(tmp, "small"), Path(tmp, "big")
        make_model(str(args.small_model), {**shape, "num_hidden_layers": 2 if args.smoke else args.layers},
                   dtype=torch.float32)
        make_model(str(args.big_model), shape, dtype=torch.float32 if args.smoke else torch.bfloat16)
        parts = {"training": lambda: training(args), "speed": lambda: speed(args),
                 "grpo": lambda: colocation(args), "recovery": lambda: recovery(args, Path(tmp))}
        for name in args.parts:
            try:
                report[name] = parts[name]()
            except Exception as exc:  # noqa: BLE001 - one part's failure is reported, the others still run
                report[name] = {"error": f"{type(exc).__name__}: {exc}"[:2000]}
                print(f"{name} failed: {report[name]['error']}", flush=True)
    print(json.dumps(report))


if __name__ == "__main__":
    main()
