"""One GRPO training step through the real client and server: DeepSpeed with ZoRRo on vs off.

GPU (default): a Qwen3-1.7B-shaped model with --layers layers (random bf16 weights), DeepSpeed
ZeRO-2 in bf16 with gradient checkpointing; one micro-batch of one prompt and N responses.
Reports the fwd_bwd + step time of each mode, the speedup, and how far the two modes' bf16
log-probs and grad norms lie apart. --smoke runs the same on the CPU with a tiny model in fp32.
The last line is a JSON object.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from arctic_core.batch import RolloutBatch
from arctic_core.client import ArcticClient
from shapes import QWEN3_1_7B


def save_model(path: Path, layers: int, smoke: bool) -> None:
    if smoke:
        shape = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                     vocab_size=512)
    else:
        shape = QWEN3_1_7B
    config = AutoConfig.for_model("qwen3", **{**shape, "num_hidden_layers": layers})
    torch.manual_seed(0)
    with torch.device("cuda" if not smoke else "cpu"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32 if smoke else torch.bfloat16)
    model.save_pretrained(path)


def grpo_batch(prompt: int, response: int, n: int, vocab: int) -> RolloutBatch:
    gen = torch.Generator().manual_seed(0)
    p = torch.randint(0, vocab, (prompt,), generator=gen).tolist()
    rs = [torch.randint(0, vocab, (response,), generator=gen).tolist() for _ in range(n)]
    adv = torch.linspace(-1, 1, n)
    return RolloutBatch.from_lists([p], rs, [0] * n, advantages=adv)


def run_mode(path: Path, batch: RolloutBatch, zorro: bool, args) -> dict[str, object]:
    config = {
        "model": {"path": str(path), "dtype": "float32" if args.smoke else "bfloat16"},
        "trainer": {
            "backend": "deepspeed", "micro_batch_tokens": 1 << 20, "gradient_checkpointing": True,
            "optimizer": {"lr": 1e-6}, "options": {"zero_stage": 2, "zorro": {"enable": zorro}},
        },
    }
    client = ArcticClient.in_process(config)
    try:
        logp = client.log_probs(batch).outputs["logprobs"]
        batch = batch.replace(old_logprobs=logp)
        times, norms = [], []
        for i in range(args.iters + 1):
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            start = time.perf_counter()
            client.fwd_bwd(batch, "ppo")
            norms.append(client.step().metrics["grad_norm"])
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            if i:
                times.append((time.perf_counter() - start) * 1e3)
        return {"ms": statistics.median(times), "logprobs": logp, "first_grad_norm": norms[0]}
    finally:
        client.shutdown()
        del client
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--layers", type=int, default=28)
    parser.add_argument("--prompt", type=int, default=2048)
    parser.add_argument("--response", type=int, default=512)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--iters", type=int, default=3)
    args = parser.parse_args()
    if args.smoke:
        args.layers, args.prompt, args.response, args.n, args.iters = 2, 64, 16, 4, 1
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp)
        save_model(path, args.layers, args.smoke)
        batch = grpo_batch(args.prompt, args.response, args.n, AutoConfig.from_pretrained(path).vocab_size)
        on, off = run_mode(path, batch, True, args), run_mode(path, batch, False, args)
    diff = (on["logprobs"] - off["logprobs"]).abs()[batch.loss_mask]
    print(json.dumps({
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "layers": args.layers, "prompt": args.prompt, "response": args.response, "n": args.n,
        "token_ratio": round(args.n * (args.prompt + args.response) / (args.prompt + args.n * args.response), 2),
        "zorro_step_ms": round(on["ms"], 1), "plain_step_ms": round(off["ms"], 1),
        "speedup": round(off["ms"] / on["ms"], 2),
        "logprob_mean_abs_diff": float(diff.mean()), "logprob_max_abs_diff": float(diff.max()),
        "grad_norm_zorro": on["first_grad_norm"], "grad_norm_plain": off["first_grad_norm"],
    }))


if __name__ == "__main__":
    main()
