# A record, not maintained (last run at commit f9e9acc): training attention as dense pieces on cuDNN and flash.
"""GPU timing: one layer's training attention (forward + backward) for one prompt group of a GRPO
micro-batch, as the forest's FlexAttention runs it and as dense attention kernels would.

The forest rule for a group (prompt ``P`` tokens, ``S`` responses of ``R``) splits into dense parts:
the prompt's causal self-attention, every response against the prompt (no mask, the prompt's keys
shared by all responses), every response's causal self-attention. Timing those parts alone on
SDPA's cuDNN and flash backends bounds what a dense-kernel path could reach: the two response
parts also need a log-sum-exp merge, and varying prompt lengths need shapes rounded so that cuDNN
reuses its plans, none of which is timed here. The first line tells whether cuDNN aligns a causal
mask bottom-right when queries are fewer than keys (a difference of 0 would say it does).

    python3 bench/attention_backends.py --shapes '[[5430, 8, 512], [2720, 8, 512]]'
"""
import argparse
import json

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from arctic_core.batch import RolloutBatch
from fca_common import time_us
from arctic_zorro import forest_attention
from arctic_zorro.forest import build_forest
from arctic_zorro.forest_attention import ForestAttentionMeta

HEADS, KV_HEADS, DIM = 16, 8, 128


def leaf(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, device="cuda", dtype=torch.bfloat16).requires_grad_()


def backward_of(out: torch.Tensor) -> None:
    out.backward(torch.ones_like(out))


def flex(prompt: int, samples: int, response: int):
    batch = RolloutBatch.from_lists([list(range(3, 3 + prompt))], [[7 + i] * response for i in range(samples)],
                                    [0] * samples)
    forest = build_forest(batch).to("cuda")
    meta = ForestAttentionMeta(forest, use_flex=True)
    q, k, v = (leaf(1, forest.num_nodes, h, DIM).transpose(1, 2) for h in (HEADS, KV_HEADS, KV_HEADS))
    return lambda: backward_of(forest_attention.forest_attention(None, q, k, v, None, forest=meta)[0])


def split(backend: SDPBackend, prompt: int, samples: int, response: int, expand_kv: bool):
    kv_heads = HEADS if expand_kv else KV_HEADS
    gqa = kv_heads != HEADS
    qp, kp, vp = leaf(1, HEADS, prompt, DIM), leaf(1, kv_heads, prompt, DIM), leaf(1, kv_heads, prompt, DIM)
    qr = leaf(1, HEADS, samples * response, DIM)
    qs, ks, vs = (leaf(samples, HEADS, response, DIM), leaf(samples, kv_heads, response, DIM),
                  leaf(samples, kv_heads, response, DIM))
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def run():
        with sdpa_kernel([backend]):
            a = sdpa(qp, kp, vp, is_causal=True, enable_gqa=gqa)
            b = sdpa(qr, kp, vp, enable_gqa=gqa)
            c = sdpa(qs, ks, vs, is_causal=True, enable_gqa=gqa)
        backward_of(a.sum() + b.sum() + c.sum())
    return run


def cudnn_bottom_right_check() -> dict:
    """Whether cuDNN's causal mask is aligned bottom-right when queries are fewer than keys."""
    q, k, v = (torch.randn(2, 4, n, DIM, device="cuda", dtype=torch.bfloat16) for n in (64, 256, 256))
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.float(), k.float(), v.float(), attn_mask=torch.ones(64, 256, dtype=torch.bool, device="cuda").tril(256 - 64))
    try:
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    except RuntimeError as error:
        return {"cudnn_causal_q<k": f"unsupported: {str(error)[:120]}"}
    return {"cudnn_causal_q<k_max_diff_vs_bottom_right": round(float((out.float() - ref).abs().max()), 4)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shapes", type=json.loads, default=[[5430, 8, 512], [2720, 8, 512]])
    args = parser.parse_args()
    print(json.dumps(cudnn_bottom_right_check()), flush=True)
    for prompt, samples, response in args.shapes:
        pairs = prompt * (prompt + 1) / 2 + samples * (response * prompt + response * (response + 1) / 2)
        flops = 4 * DIM * HEADS * pairs * 3.5  # forward + backward (2.5x)
        variants = {
            "flex": lambda: flex(prompt, samples, response),
            "cudnn_split": lambda: split(SDPBackend.CUDNN_ATTENTION, prompt, samples, response, expand_kv=False),
            "cudnn_split_expanded_kv": lambda: split(SDPBackend.CUDNN_ATTENTION, prompt, samples, response,
                                                     expand_kv=True),
            "flash_split": lambda: split(SDPBackend.FLASH_ATTENTION, prompt, samples, response, expand_kv=False),
        }
        for name, build in variants.items():
            try:
                ms = time_us(build()) / 1e3
                result = {"ms": round(ms, 3), "tflops": round(flops / ms / 1e9, 1)}
            except Exception as error:  # noqa: BLE001 - report the backend that cannot run this shape
                result = {"error": f"{type(error).__name__}: {str(error)[:160]}"}
            print(json.dumps({"shape": [prompt, samples, response], "variant": name, **result}), flush=True)
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
