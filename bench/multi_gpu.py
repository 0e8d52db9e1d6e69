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

import torch

from arctic_core.ray.trainer import split_by_groups
from ray_one_gpu import (add_shared_arguments, colocation, grpo_batch, recovery, run_parts, shrink_for_smoke, train,
                         training, weight_gap)


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
                                  "loss_gap": max(abs(a - b)
                                                  for a, b in zip(one["losses"], ranks["losses"], strict=True)),
                                  "largest_gap_against_update": gap["largest_gap_against_update"],
                                  "tensor": gap["tensor"],
                                  "seconds_one": one["seconds"], "seconds_ranks": ranks["seconds"]}
        print(f"speed ZeRO-{stage}, 1 vs {args.workers} GPUs: {json.dumps(report[f'zero{stage}'])}", flush=True)
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_shared_arguments(parser, steps=4, micro_batch_tokens=16384, kv_cache_tokens=262144, vllm_memory=0.85)
    parser.add_argument("--gpus", type=int, default=None, help="data-parallel ranks (default: every visible GPU)")
    parser.add_argument("--parts", nargs="+", default=["training", "speed", "grpo", "recovery"])
    parser.add_argument("--speed-groups", type=int, default=16)
    parser.add_argument("--speed-prompt", type=int, default=2048)
    parser.add_argument("--speed-response", type=int, default=512)
    args = parser.parse_args()
    args.device, args.colocate = ("cpu" if args.smoke else "cuda"), False
    if args.smoke:
        args.gpus = args.gpus or 2
        shrink_for_smoke(args)
        args.speed_groups, args.speed_prompt, args.speed_response = 4, 32, 8
    else:
        args.gpus = args.gpus or torch.cuda.device_count()
        if args.gpus < 2:
            raise SystemExit(f"{args.gpus} GPU(s) visible: this needs two or more (bench/ray_one_gpu.py shares one)")
        args.gpu_share = 1.0  # a GPU per rank and per replica: NCCL between them
    args.workers, args.weight_sync = args.gpus, "torch-broadcast"
    parts = {"training": lambda tmp: training(args), "speed": lambda tmp: speed(args),
             "grpo": lambda tmp: colocation(args), "recovery": lambda tmp: recovery(args, tmp)}
    print(json.dumps(run_parts(args, parts, {"gpus": args.gpus})))


if __name__ == "__main__":
    main()
