"""The embedded engine's one-pass sampling kernels on a decode step's logits: device time per call
against reading the logits once (the floor), against the torch path (the same exponential race in
a dozen passes) and with the LM head before it (its bf16 logits read as they are, or copied to fp32
first), and the draws checked where they run: each token's log-prob against
``log_softmax(logits / T)``, greedy rows against ``argmax``, and the frequencies of many draws
from one distribution against its probabilities (a chi-square statistic).

    python3 bench/sampling_kernels.py                           # 64 rows x Qwen3's 151,936 entries, bf16
    python3 bench/sampling_kernels.py --filters 64 512          # top-k / top-p / min-p: floors vs the sort
    TRITON_INTERPRET=1 python3 bench/sampling_kernels.py --smoke  # the same on the CPU, small

``--filters`` times the draw with top-k, top-p and min-p: the kernels (``triton_filters`` finds each
row's floors without sorting, then the one-pass draw) against the torch path (a sort of every row),
on flat logits (random normal, as a random model gives: top-p keeps most of the vocabulary) and
peaked ones (probabilities falling as a power of the rank, as a trained model's do), and checks
that the floors keep exactly the entries the sort keeps and that the tokens' log-probs agree.

The last line printed is a JSON object.
"""

from __future__ import annotations

import argparse
import json

import torch
from torch.profiler import ProfilerActivity, profile

from arctic_fca.engine.sampling import RowParams, filtered_log_probs, sample
from arctic_fca.engine.triton_filters import row_floors
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


FILTERS = {"top_p_0.95": {"top_p": 0.95}, "top_p_0.7": {"top_p": 0.7}, "top_k_20": {"top_k": 20},
           "top_k_20_top_p_0.95": {"top_k": 20, "top_p": 0.95}, "min_p_0.1": {"min_p": 0.1}}


def filter_params(rows: int, device, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0) -> RowParams:
    return RowParams(temperature=torch.ones(rows, device=device), top_k=torch.full((rows,), top_k, device=device),
                     top_p=torch.full((rows,), top_p, device=device), any_top_k=top_k > 0, any_top_p=top_p < 1,
                     min_p=min_p)


def test_logits(rows: int, vocab: int, device, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """bf16 logits: flat (random normal x 3) and peaked (probabilities ~ rank^-2, with noise)."""
    flat = torch.randn(rows, vocab, device=device, generator=gen) * 3
    ranks = torch.rand(rows, vocab, device=device, generator=gen).argsort(-1).float()
    peaked = -2.0 * torch.log1p(ranks) + 0.3 * torch.randn(rows, vocab, device=device, generator=gen)
    return {"flat": flat.bfloat16(), "peaked": peaked.bfloat16()}


def filter_checks(logits: torch.Tensor, params: RowParams, gen: torch.Generator) -> dict:
    """Whether the floors keep exactly what the sort keeps, and the kernels' tokens' log-prob gap."""
    expected = filtered_log_probs(logits, params)
    floors = row_floors(logits, params.temperature, params.top_k, params.top_p, params.min_p)
    kept = floors.keeps(logits, params.temperature)
    tokens, logprobs = sample(logits, params, gen, triton=True)
    return {"same_kept": torch.equal(kept, expected.isfinite()),
            "kept_mean": round(float(kept.sum(-1).float().mean()), 1),
            "logprob_max_abs_diff": max_abs_diff(logprobs, expected.gather(-1, tokens[:, None]).squeeze(-1))}


def smoke() -> dict:
    """The checks on the CPU, small: the draw's, and each filter's on both kinds of logits."""
    gen = torch.Generator().manual_seed(0)
    filters = {f"{kind}/{name}": filter_checks(logits, filter_params(8, "cpu", **setting), gen)
               for kind, logits in test_logits(8, 300, "cpu", gen).items() for name, setting in FILTERS.items()}
    return {**checks(8, 300, draw_rows=200, rounds=2, device="cpu"), "filters": filters}


def filter_timings(rows: int, vocab: int) -> dict:
    """Per logits kind and filter: device microseconds of the kernels and of the torch path, and the checks."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    report = {}
    for kind, logits in test_logits(rows, vocab, "cuda", gen).items():
        for name, setting in FILTERS.items():
            params = filter_params(rows, "cuda", **setting)
            report[f"{kind}/{name}"] = {
                "kernels_us": round(device_us_per_call(lambda: sample(logits, params, gen, triton=True)), 1),
                "sort_us": round(device_us_per_call(lambda: sample(logits, params, gen), calls=10), 1),
                **filter_checks(logits, params, gen)}
        report[f"{kind}/none"] = {"kernels_us": round(device_us_per_call(
            lambda: sample(logits, filter_params(rows, "cuda"), gen, triton=True)), 1)}
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="CPU, under TRITON_INTERPRET=1, small")
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--draw-rows", type=int, default=4096)
    parser.add_argument("--rounds", type=int, default=50)
    parser.add_argument("--filters", nargs="*", type=int, metavar="ROWS",
                        help="time top-k / top-p / min-p at these row counts instead")
    args = parser.parse_args()
    if smoke_or_gpu(args.smoke, smoke, "sampling_kernels.py"):
        return
    if args.filters:
        print(json.dumps({"device": torch.cuda.get_device_name(), "vocab": args.vocab,
                          **{str(rows): filter_timings(rows, args.vocab) for rows in args.filters}}))
        return
    report = {"device": torch.cuda.get_device_name(), "rows": args.rows, "vocab": args.vocab,
              **timings(args.rows, args.vocab), **checks(args.rows, args.vocab, args.draw_rows, args.rounds, "cuda")}
    report["chi_square_0_1_percent"] = CHI_SQUARE_0_1_PERCENT
    print(json.dumps(report))


if __name__ == "__main__":
    main()
