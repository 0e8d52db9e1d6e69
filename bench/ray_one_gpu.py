"""Data-parallel ranks and colocated engines on ONE GPU through Ray: what a single GPU can check of
the multi-GPU paths (the speedup of several GPUs needs several GPUs).

- collectives: which torch.distributed backends run the collectives ZeRO uses between two ranks
  that share one GPU (NCCL refuses two ranks on one device; gloo moves CUDA tensors through the host);
- training: ZoRRo with two DeepSpeed ranks sharing the GPU (``gpus_per_worker: 0.5``), ZeRO-2 and
  ZeRO-3, against one rank on the same global batch: losses and weights after its steps (fp32), and
  the time of fwd_bwd + step;
- noise: one rank against itself with half the micro-batch tokens, the floor two ranks are read against;
- recovery: a rank killed inside fwd_bwd is named, ``load_checkpoint`` restarts both ranks, and the
  next loss is the one the checkpoint gives;
- colocation: GRPO steps (generate, log_probs, fwd_bwd, step, sync) with a trainer rank and a
  sampler replica (the embedded engine, or vLLM + FCA with ``--sampler vllm``) as two Ray actors on
  the GPU, weights synced by CUDA IPC; the sampler's log-probs of its own tokens match the trainer's
  after each sync, and not before it. ``--colocate``: the server also puts the engine a call does
  not need to sleep (the sampler's KV cache freed and weights offloaded, the trainer's optimizer
  states offloaded) and wakes it for the next call that does.

--smoke runs the same on the CPU with a tiny model (gloo; the inprocess weight transport instead of
CUDA IPC). The last line printed is a JSON object.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import multiprocessing
import statistics
import tempfile
import threading
import time
from pathlib import Path

import torch

from arctic_core.batch import RolloutBatch
from arctic_core.client import ArcticClient
from arctic_core.errors import WorkerError
from arctic_core.ports import free_port
from shapes import QWEN3_1_7B, SMOKE_SHAPE, make_model

PPO = [{"name": "ppo", "old_logprobs": "current"}, {"name": "entropy", "weight": 0.01}]
# Adam with a large eps moves each weight in proportion to its gradient, so comparing updates
# compares gradients (with the default eps a first step is ~lr * sign(grad), blind to them).
OPTIMIZER = {"lr": 1e-2, "eps": 1.0}
COLLECTIVES = ("all_reduce", "broadcast", "all_gather_into_tensor", "reduce_scatter_tensor", "reduce")


# ---- collectives between two ranks on one device ------------------------------------------------

def _collective_rank(rank: int, backend: str, device: str, port: int, results) -> None:
    torch.distributed.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    x = torch.full((1024,), float(rank + 1), device=device)
    calls = {"all_reduce": lambda: torch.distributed.all_reduce(x.clone()),
             "broadcast": lambda: torch.distributed.broadcast(x.clone(), 0),
             "all_gather_into_tensor": lambda: torch.distributed.all_gather_into_tensor(x.new_empty(2048), x),
             "reduce_scatter_tensor": lambda: torch.distributed.reduce_scatter_tensor(x.new_empty(512), x),
             "reduce": lambda: torch.distributed.reduce(x.clone(), 0)}
    for name in COLLECTIVES:
        try:
            calls[name]()
            if device != "cpu":
                torch.cuda.synchronize()
            results[f"{rank}:{name}"] = "ok"
        except Exception as exc:  # noqa: BLE001 - what fails, and why, is the result
            results[f"{rank}:{name}"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
            break  # a failed collective can leave the group out of step
    torch.distributed.destroy_process_group()


def collectives(device: str) -> dict[str, dict[str, str]]:
    """Per backend, each collective's outcome on two ranks sharing ``device``."""
    context = multiprocessing.get_context("spawn")
    report = {}
    for backend in (("nccl", "gloo") if device != "cpu" else ("gloo",)):
        with context.Manager() as manager:
            results = manager.dict()
            port = free_port()
            ranks = [context.Process(target=_collective_rank, args=(r, backend, device, port, results)) for r in (0, 1)]
            for process in ranks:
                process.start()
            for process in ranks:
                process.join(45)
                if process.is_alive():
                    process.kill()
            outcome = {name: results.get(f"0:{name}", "not reached") for name in COLLECTIVES}
            report[backend] = outcome
        print(f"collectives, two ranks on one {device} device, {backend}: {outcome}", flush=True)
    return report


# ---- training: two ranks sharing the GPU against one ------------------------------------------

def grpo_batch(vocab: int, groups: int, prompt: int, response: int, samples: int, seed: int = 0) -> RolloutBatch:
    gen = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, vocab, (prompt,), generator=gen).tolist() for _ in range(groups)]
    responses = [torch.randint(3, vocab, (response - (i % 5) * response // 8,), generator=gen).tolist()
                 for i in range(groups * samples)]
    batch = RolloutBatch.from_lists(prompts, responses, [i // samples for i in range(groups * samples)])
    return batch.replace(advantages=torch.randn(batch.num_responses, generator=gen))


def trainer_config(args, stage: int, workers: int, micro_batch_tokens: int | None = None, big: bool = False) -> dict:
    """One DeepSpeed rank in this process, or ``workers`` Ray ranks with ``args.gpu_share`` of a GPU
    each; the fp32 model of the checks, or (``big``) the full shape in its dtype with checkpointing."""
    deepspeed = {"zero_stage": stage}
    if workers == 1:
        trainer = {"backend": "deepspeed", "options": deepspeed}
    else:
        trainer = {"backend": "ray", "options": {"workers": workers, "gpus_per_worker": args.gpu_share,
                                                 "backend": "deepspeed", "options": deepspeed}}
    model = {"path": str(args.big_model), "dtype": args.big_dtype} if big else {"path": str(args.small_model),
                                                                                "dtype": "float32"}
    return {"model": {**model, "device": args.device}, "seed": 0,
            "sampler": {"backend": "embedded", "options": {"kv_cache_tokens": 4096}},
            "trainer": {**trainer, "optimizer": OPTIMIZER, "gradient_checkpointing": big,
                        "micro_batch_tokens": micro_batch_tokens or args.micro_batch_tokens}}


def train(args, stage: int, workers: int, batch: RolloutBatch, micro_batch_tokens: int | None = None,
          big: bool = False) -> dict:
    with ArcticClient.in_process(trainer_config(args, stage, workers, micro_batch_tokens, big)) as client:
        start_weights = {name: w.float().cpu().clone() for name, w in client.transport.server.trainer.named_weights()}
        losses, seconds = [], []
        for _ in range(args.steps):
            start = time.perf_counter()
            losses.append(client.fwd_bwd(batch, PPO).metrics["loss"])
            client.step()
            seconds.append(time.perf_counter() - start)
        weights = {name: w.float().cpu() for name, w in client.transport.server.trainer.named_weights()}
    free_device_memory()
    return {"losses": losses, "seconds": seconds, "weights": weights, "start": start_weights}


def free_device_memory() -> None:
    """What a closed client left in this process's allocator goes back to the device (the ranks
    and replicas of the next part share it)."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def weight_gap(one: dict, other: dict) -> dict[str, object]:
    """How far two runs' weights lie apart after their steps, per element against the fp32 spacing at
    the weight (its rounding) plus 1e-4 of the tensor's largest update (the gradient tolerance):
    1 or less means equal within those. Against the largest update alone small updates of weights
    near 1, only a few spacings long, would read as large gaps."""
    ratios, relative = {}, {}
    for name, weight in one["weights"].items():
        gap = (other["weights"][name] - weight).abs()
        update = (weight - one["start"][name]).abs().max()
        spacing = torch.nextafter(weight.abs(), torch.tensor(float("inf"))) - weight.abs()
        ratios[name] = float((gap / (spacing + 1e-4 * update)).max())
        relative[name] = float(gap.max() / update.clamp_min(1e-30))
    worst = max(ratios, key=ratios.get)
    return {"within_tolerance": ratios[worst], "tensor": worst, "largest_gap_against_update": max(relative.values())}


def training(args) -> dict:
    """``args.workers`` ranks against one on the same batch, ZeRO-2 and ZeRO-3 (fp32)."""
    batch = grpo_batch(args.vocab, args.groups, args.prompt, args.response, args.samples)
    report = {}
    for stage in (2, 3):
        one, ranks = train(args, stage, 1, batch), train(args, stage, args.workers, batch)
        report[f"zero{stage}"] = {
            "workers": args.workers, "losses_one": one["losses"], "losses_ranks": ranks["losses"],
            "loss_gap": max(abs(a - b) for a, b in zip(one["losses"], ranks["losses"], strict=True)),
            "weights": weight_gap(one, ranks),
            "step_s_one": statistics.median(one["seconds"][1:]),
            "step_s_ranks": statistics.median(ranks["seconds"][1:])}
        print(f"training ZeRO-{stage}: {json.dumps(report[f'zero{stage}'])}", flush=True)
    return report


def noise_floor(args) -> dict:
    """One rank against itself with half the micro-batch tokens: how far the same engine's updates
    move when only the batch's packing changes (the floor any two-rank gap is read against)."""
    batch = grpo_batch(args.vocab, args.groups, args.prompt, args.response, args.samples)
    one, halves = train(args, 2, 1, batch), train(args, 2, 1, batch, args.micro_batch_tokens // 2)
    report = weight_gap(one, halves)
    print(f"one rank, half the micro-batch tokens: {json.dumps(report)}", flush=True)
    return report


# ---- recovery: a rank killed inside fwd_bwd -----------------------------------------------------

def recovery(args, folder: Path) -> dict:
    import ray

    batch = grpo_batch(args.vocab, args.groups, args.prompt, args.response, args.samples)
    long_call = grpo_batch(args.vocab, args.groups * args.long_call, args.prompt, args.response, args.samples, seed=1)
    with ArcticClient.in_process(trainer_config(args, 2, args.workers)) as client:
        trainer = client.transport.server.trainer
        client.fwd_bwd(batch, PPO)
        client.step()
        client.save_checkpoint(str(folder / "ckpt"))
        expected = client.fwd_bwd(batch, PPO).metrics["loss"]
        client.step()
        start = time.perf_counter()
        client.fwd_bwd(long_call, PPO)
        long_s = time.perf_counter() - start  # to kill the next one a third of the way in
        client.step()
        killer = threading.Timer(long_s / 3, ray.kill, [trainer.workers[-1]])
        killer.start()
        try:
            client.fwd_bwd(long_call, PPO)
            error = "no error: the call ended before the kill"
        except WorkerError as exc:
            error = str(exc)
        killer.join()
        still_up = client.status().step
        start = time.perf_counter()
        client.load_checkpoint(str(folder / "ckpt"))
        restore_s = time.perf_counter() - start
        loss = client.fwd_bwd(batch, PPO).metrics["loss"]
        grad_norm = client.step().metrics["grad_norm"]
    free_device_memory()
    report = {"long_call_s": long_s, "error": error, "step_while_degraded": still_up, "restore_s": restore_s,
              "loss_after_restore": loss, "expected_loss": expected, "grad_norm_after": grad_norm}
    print(f"recovery: {json.dumps(report)}", flush=True)
    return report


# ---- colocation: a GRPO step with the trainer and a sampler replica on one GPU ------------------

def colocated_config(args) -> dict:
    return {"model": {"path": str(args.big_model), "dtype": args.big_dtype, "device": args.device}, "seed": 0,
            "trainer": {"backend": "ray", "optimizer": {"lr": 1e-4}, "micro_batch_tokens": args.micro_batch_tokens,
                        "gradient_checkpointing": True,
                        "options": {"workers": 1, "gpus_per_worker": args.gpu_share, "backend": "deepspeed",
                                    "options": {"zero_stage": 2}}},
            "sampler": {"backend": "ray", "options": {"replicas": 1, "gpus_per_replica": args.gpu_share,
                                                      "backend": args.sampler, "options": sampler_options(args)}},
            "weight_sync": {"transport": args.weight_sync},
            "colocate": args.colocate}


def sampler_options(args) -> dict:
    """The replica's own options: the embedded engine's KV cache, or vLLM's share of the GPU (vLLM
    refuses to start unless that much memory is free beside the trainer)."""
    if args.sampler == "vllm":
        return {"gpu_memory_utilization": args.vllm_memory, "max_model_len": args.prompt + args.response + 64}
    return {"kv_cache_tokens": args.kv_cache_tokens}


def logprob_gap(batch: RolloutBatch, trainer_logprobs: torch.Tensor) -> float:
    """Mean |sampler - trainer| log-prob over the response tokens."""
    mask = batch.loss_mask.bool()
    return float((batch.sampling_logprobs - trainer_logprobs).abs()[mask].mean())


@contextlib.contextmanager
def timed(times: dict[str, float], name: str):
    """``times[name]``: the seconds the block took."""
    start = time.perf_counter()
    yield
    times[name] = time.perf_counter() - start


def colocation(args) -> dict:
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, args.vocab, (args.prompt,), generator=gen).tolist() for _ in range(args.groups)]
    params = {"n": args.samples, "max_tokens": args.response, "temperature": 1.0}
    steps = []
    with ArcticClient.in_process(colocated_config(args)) as client:
        for _ in range(args.steps):
            times = {}
            with timed(times, "generate"):
                batch = client.generate(prompts, **params).batch
            with timed(times, "log_probs"):
                current = client.log_probs(batch).outputs["logprobs"]
            synced_gap = logprob_gap(batch, current)
            advantages = torch.randn(batch.num_responses, generator=gen)
            with timed(times, "fwd_bwd"):
                client.fwd_bwd(batch.replace(old_logprobs=current, advantages=advantages), PPO)
            with timed(times, "step"):
                client.step()
            stale_gap = logprob_gap(batch, client.log_probs(batch).outputs["logprobs"])  # stepped, not synced
            with timed(times, "sync"):
                sync = client.sync_weights()
            times["total"] = sum(times.values())  # the calls of a GRPO step (not the stale-weights check)
            steps.append({"seconds": times, "version": int(batch.policy_version.max()),
                          "response_tokens": int(batch.response_lens.sum()), "gap_synced": synced_gap,
                          "gap_after_step_before_sync": stale_gap, "sync_bytes": sync.metrics.get("bytes")})
            print(f"colocated GRPO step: {json.dumps(steps[-1])}", flush=True)
    free_device_memory()
    return {"steps": steps}


def add_shared_arguments(parser: argparse.ArgumentParser, **defaults: object) -> None:
    """The arguments this script and ``multi_gpu.py`` share (``defaults`` by destination name)."""
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny model")
    parser.add_argument("--layers", type=int, default=4, help="layers of the Qwen3-1.7B shape for the fp32 checks")
    parser.add_argument("--groups", type=int, default=4)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=1024)
    parser.add_argument("--response", type=int, default=256)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--long-call", type=int, default=4, help="the killed call's batch, in training batches")
    parser.add_argument("--micro-batch-tokens", type=int, default=8192)
    parser.add_argument("--kv-cache-tokens", type=int, default=65536)
    parser.add_argument("--sampler", choices=["embedded", "vllm"], default="embedded", help="the replica's engine")
    parser.add_argument("--vllm-memory", type=float, default=0.3, help="vLLM's gpu_memory_utilization")
    parser.set_defaults(**defaults)


def shrink_for_smoke(args) -> None:
    """A CPU run's sizes: a tiny model and batch, Ray ranks on gloo (no GPU share)."""
    args.groups, args.samples, args.prompt, args.response, args.steps, args.long_call = 3, 3, 24, 8, 2, 300
    args.micro_batch_tokens, args.kv_cache_tokens, args.gpu_share = 4096, 4096, 0.0


def run_parts(args, parts: dict, report: dict) -> dict:
    """Build the fp32 check model and the full-shape model, then run ``args.parts`` of ``parts``
    (name -> function of the temporary folder); one part's failure is reported, the others run."""
    shape = SMOKE_SHAPE if args.smoke else QWEN3_1_7B
    args.vocab = shape["vocab_size"] if args.smoke else 1000
    args.big_dtype = "float32" if args.smoke else "bfloat16"
    with tempfile.TemporaryDirectory() as tmp:
        args.small_model, args.big_model = Path(tmp, "small"), Path(tmp, "big")
        make_model(str(args.small_model), {**shape, "num_hidden_layers": 2 if args.smoke else args.layers},
                   dtype=torch.float32)
        make_model(str(args.big_model), shape, dtype=torch.float32 if args.smoke else torch.bfloat16)
        for name in args.parts:
            try:
                report[name] = parts[name](Path(tmp))
            except Exception as exc:  # noqa: BLE001 - one part's failure is reported, the others still run
                report[name] = {"error": f"{type(exc).__name__}: {exc}"[:2000]}
                print(f"{name} failed: {report[name]['error']}", flush=True)
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_shared_arguments(parser)
    parser.add_argument("--parts", nargs="+", default=["collectives", "training", "noise", "recovery", "colocation"])
    parser.add_argument("--gpu-share", type=float, default=0.5)
    parser.add_argument("--colocate", action="store_true", help="the server puts engines a call does not need to sleep")
    args = parser.parse_args()
    args.device = "cpu" if args.smoke else "cuda"
    args.workers, args.weight_sync = 2, "inprocess" if args.smoke else "cuda-ipc"
    if args.smoke:
        shrink_for_smoke(args)
    elif not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run with --smoke on the CPU")
    parts = {"collectives": lambda tmp: collectives(args.device), "training": lambda tmp: training(args),
             "noise": lambda tmp: noise_floor(args), "recovery": lambda tmp: recovery(args, tmp),
             "colocation": lambda tmp: colocation(args)}
    print(json.dumps(run_parts(args, parts, {})))


if __name__ == "__main__":
    main()
