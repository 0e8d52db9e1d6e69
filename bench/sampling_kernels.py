"""The embedded engine's one-pass sampling kernels on a decode step's logits: device time per call
against reading the logits once (the floor), against the torch path (the same exponential race in
a dozen passes) and with the LM head before it (its bf16 logits read as they are, or copied to fp32
first), and the draws checked where they run: each token's log-prob against
``log_softmax(logits / T)``, greedy rows against ``argmax``, and the frequencies of many draws
from one distribution against its probabilities (a chi-square statistic).

    python3 bench/sampling_kernels.py                           # 64 rows x Qwen3's 151,936 entries, bf16
    TRITON_INTERPRET=1 python3 bench/sampling_kernels.py --smoke  # the same on the CPU, small

The last line printed is a JSON object.
"""

from __future__ import annotations

import argparse
import json

import torch
from torch.profiler import ProfilerActivity, profile

from arctic_fca.engine.sampling import RowParams, sample
from arctic_fca.engine.triton_sampling import sample_with_temperature
from fca_common import max_abs_diff, smoke_or_gpu

BINS = 15  # the most likely tokens get a bin each; the rest share one
CHI_SQUARE_0_1_PERCENT = 37.70  # the 0.1% level of chi-square with BINS degrees of freedom


def device_us_per_call(fn, calls: int = 50) -> float:
    """Microseconds of device time (every kernel ``fn`` launches) per call, from the profiler: the
    host's launch time, which a CUDA graph or queued steps hide, is not counted."""
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    return sum(event.device_time_total for event in prof.key_averages()) / calls


def torch_race(logits: torch.Tensor, temperature: torch.Tensor, generator: torch.Generator):
    """The torch path of the same draw (``sampling.sample`` without the kernels)."""
    rows = logits.shape[0]
    params = RowParams(temperature=temperature, top_k=torch.zeros(rows, dtype=torch.long, device=logits.device),
                       top_p=torch.ones(rows, device=logits.device), any_top_k=False, any_top_p=False)
    return sample(logits, params, generator, triton=False)


def timings(rows: int, vocab: int, hidden: int = 2048) -> dict:
    """Device microseconds per call: the draw, a greedy draw, the torch path, one read of the logits,
    and the LM head with the draw, its bf16 logits read as they are or first copied to fp32."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    head = torch.randn(vocab, hidden, device="cuda", dtype=torch.bfloat16) * 0.02
    states = torch.randn(rows, hidden, device="cuda", dtype=torch.bfloat16)
    logits = states @ head.T
    ones = torch.ones(rows, device="cuda")
    calls = {"draw": lambda: sample_with_temperature(logits, ones, gen),
             "greedy_draw": lambda: sample_with_temperature(logits, torch.zeros_like(ones), gen),
             "torch_path": lambda: torch_race(logits, ones, gen),
             "read_logits_once": lambda: logits.amax(-1),
             "head_and_draw": lambda: sample_with_temperature(states @ head.T, ones, gen),
             "head_fp32_copy_and_draw": lambda: sample_with_temperature((states @ head.T).float(), ones, gen)}
    return {f"{name}_us": round(device_us_per_call(call, calls=10 if name == "torch_path" else 50), 1)
            for name, call in calls.items()}


def checks(rows: int, vocab: int, draw_rows: int, rounds: int, device: str) -> dict:
    gen = torch.Generator(device=device).manual_seed(1)
    logits = (torch.randn(rows, vocab, device=device, generator=gen) * 3).bfloat16()
    temperature = torch.tensor([0.0, 1.0, 0.7, 1.3], device=device).repeat(rows // 4 + 1)[:rows]
    tokens, logprobs = sample_with_temperature(logits, temperature, gen)
    scaled = logits.float() / torch.where(temperature == 0, 1.0, temperature)[:, None]
    expected = scaled.log_softmax(-1).gather(-1, tokens[:, None]).squeeze(-1)
    greedy = temperature == 0
    return {"logprob_max_abs_diff": max_abs_diff(logprobs, expected),
            "greedy_is_argmax": torch.equal(tokens[greedy], logits[greedy].float().argmax(-1)),
            **frequencies(logits[1], draw_rows, rounds, gen)}


def frequencies(row: torch.Tensor, draw_rows: int, rounds: int, gen: torch.Generator) -> dict:
    """Draws from one row at temperature 1 (``draw_rows`` copies, ``rounds`` calls): the counts of the
    BINS most likely tokens and of the rest against their probabilities."""
    probs = row.float().softmax(-1)
    top = probs.topk(BINS).indices
    bin_of = torch.full_like(probs, BINS, dtype=torch.long)
    bin_of[top] = torch.arange(BINS, device=probs.device)
    expected = torch.cat((probs[top], (1 - probs[top].sum()).clamp_min(0)[None]))
    counts = torch.zeros(BINS + 1, device=probs.device)
    copies, ones = row[None].expand(draw_rows, -1), torch.ones(draw_rows, device=row.device)
    for _ in range(rounds):
        drawn, _ = sample_with_temperature(copies, ones, gen)
        counts += torch.bincount(bin_of[drawn], minlength=BINS + 1).float()
    draws = draw_rows * rounds
    keep = expected * draws >= 5  # chi-square needs enough expected draws per bin
    chi = ((counts - draws * expected) ** 2 / (draws * expected))[keep].sum()
    return {"draws": draws, "chi_square": round(float(chi), 2), "bins": int(keep.sum()),
            "top_token_share": [round(float(counts[0]) / draws, 4), round(float(expected[0]), 4)]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="CPU, under TRITON_INTERPRET=1, small")
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--draw-rows", type=int, default=4096)
    parser.add_argument("--rounds", type=int, default=50)
    args = parser.parse_args()
    if smoke_or_gpu(args.smoke, lambda: checks(8, 300, draw_rows=200, rounds=2, device="cpu"), "sampling_kernels.py"):
        return
    report = {"device": torch.cuda.get_device_name(), "rows": args.rows, "vocab": args.vocab,
              **timings(args.rows, args.vocab), **checks(args.rows, args.vocab, args.draw_rows, args.rounds, "cuda")}
    report["chi_square_0_1_percent"] = CHI_SQUARE_0_1_PERCENT
    print(json.dumps(report))


if __name__ == "__main__":
    main()
