"""ZoRRo Train against the plain computation: exactness (CPU, --smoke) and speed/memory (GPU).

--smoke (CPU, < 2 min): tiny random models of each family, a GRPO-shaped forest batch; prints the
largest log-prob and gradient differences between the packed and the plain forward.

GPU: a full-depth Qwen3-1.7B-shaped model (random bf16 weights), fwd+bwd of one micro-batch (one
prompt of P tokens, N responses of R tokens), for each shape. Baseline in the same process: the
same model without deduplication, padding-free (N packed sequences) with varlen FlashAttention,
LM head on response positions only, chunked like ZoRRo's (a full-vocabulary head over every token
does not fit at the larger shapes). Both use gradient checkpointing. The last line is a JSON object of all results.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import math
import os
import statistics
import sys
import time

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AttentionInterface

from arctic_core.batch import RolloutBatch
from arctic_core.hf import enable_gradient_checkpointing, set_attention_implementation
from arctic_core.losses.processors import Entropy, LogProbs
from arctic_zorro.forest import build_forest
from arctic_zorro.forward import response_outputs, scatter_values
from arctic_zorro.fused_elementwise import compile_elementwise
from arctic_zorro import packed_forward
from arctic_zorro.packed_forward import enable_forest_attention, head_outputs
from shapes import QWEN3_1_7B

SHAPES = [(1024, 512, 8), (4096, 512, 8), (8192, 512, 8), (4096, 1024, 16), (16384, 1024, 8)]


# ----------------------------------------------------------------------------- CPU smoke


def smoke(device: str = "cpu") -> dict[str, object]:
    from arctic_core.demo.tiny_model import TINY_SHAPES, build_tiny_model, build_tokenizer

    tokenizer = build_tokenizer(["count up from 1 2 3 4 5 6 7 8 9 repeat down"] * 4)
    gen = torch.Generator().manual_seed(0)
    vocab = len(tokenizer)
    prompts = [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in (24, 17, 30)]
    prompts.append(prompts[0] + [7, 8, 9])  # a multi-turn branch sharing a partial prefix
    responses, index = [], []
    for p, n in enumerate((4, 3, 1, 2)):
        for _ in range(n):
            responses.append(torch.randint(3, vocab, (int(torch.randint(0, 9, (1,), generator=gen)),),
                                           generator=gen).tolist())
            index.append(p)
    batch = RolloutBatch.from_lists(prompts, responses, index)
    processors = {"logprobs": LogProbs(), "entropy": Entropy()}
    max_lp, max_grad = 0.0, 0.0
    for family in sorted(TINY_SHAPES):
        plain = build_tiny_model(tokenizer, family=family, seed=0).eval().to(device)
        packed = copy.deepcopy(plain)
        enable_forest_attention(packed)
        a, b = response_outputs(plain, batch, processors), packed_response_outputs(packed, batch, processors)
        diff = (a["logprobs"] - b["logprobs"]).detach().abs()
        max_lp = max(max_lp, float(diff.max()) if torch.isfinite(diff).all() else math.inf)  # NaN never reads small
        (a["logprobs"].sum() + a["entropy"].sum()).backward()
        (b["logprobs"].sum() + b["entropy"].sum()).backward()
        for p, q in zip(plain.parameters(), packed.parameters(), strict=True):
            rel = float((q.grad - p.grad).norm() / p.grad.norm().clamp(min=1e-30))
            max_grad = max(max_grad, rel if math.isfinite(rel) else math.inf)
    return {"max_logprob_abs_diff": max_lp, "max_grad_rel_diff": max_grad, "families": sorted(TINY_SHAPES),
            "dedup_ratio": round(build_forest(batch).dedup_ratio, 2)}


# ----------------------------------------------------------------------------- GPU


def varlen_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, sliding_window=None,
                     varlen=None, **kwargs):
    """Baseline attention: causal varlen FlashAttention over packed, independent sequences."""
    from torch.nn.attention.varlen import varlen_attn

    cu, max_len = varlen
    groups = query.shape[1] // key.shape[1]
    q = query[0].transpose(0, 1)
    k = key[0].transpose(0, 1).repeat_interleave(groups, dim=1)
    v = value[0].transpose(0, 1).repeat_interleave(groups, dim=1)
    out = varlen_attn(q, k, v, cu, cu, max_len, max_len, scale=scaling, window_size=(-1, 0))
    return out[None], None


AttentionInterface.register("arctic_varlen", varlen_attention)


def plain_packed_outputs(model, batch: RolloutBatch, processors, full_head: bool = False) -> dict[str, torch.Tensor]:
    """Baseline forward: every row packed back to back (no padding, no dedup), response-only head.

    ``full_head``: the LM head and log-softmax run over every token (what a plain implementation
    that slices log-probs after the head does), still chunked so that it fits in memory.
    """
    device = next(model.parameters()).device
    seqs = [torch.tensor(batch.prompt(i) + batch.response(i)) for i in range(batch.num_responses)]
    lens = torch.tensor([len(s) for s in seqs])
    cu = torch.nn.functional.pad(lens.cumsum(0), (1, 0)).to(device, torch.int32)
    ids = torch.cat(seqs).to(device)[None]
    pos = torch.cat([torch.arange(n) for n in lens.tolist()]).to(device)[None]
    hidden = model.base_model(input_ids=ids, position_ids=pos, varlen=(cu, int(lens.max())),
                              use_cache=False).last_hidden_state[0]
    rows = torch.repeat_interleave(torch.arange(batch.num_responses), batch.response_lens)
    cols = torch.cat([torch.arange(int(n)) for n in batch.response_lens])
    starts = cu[:-1].cpu()
    index = (starts[rows] + batch.prompt_lens[batch.prompt_index][rows] - 1 + cols).to(device)
    if full_head:
        next_ids = torch.roll(ids[0], -1)  # every position's next token (wraps at sequence ends)
        values = head_outputs(model.get_output_embeddings(), hidden, next_ids, processors, HEAD_CHUNK[0])
        return scatter_values({k: v[index] for k, v in values.items()}, batch, rows, cols)
    targets = batch.response_ids[rows, cols].to(device)
    values = head_outputs(model.get_output_embeddings(), hidden[index], targets, processors, HEAD_CHUNK[0])
    return scatter_values(values, batch, rows, cols)


HEAD_CHUNK = [packed_forward.HEAD_CHUNK_TOKENS]  # --head-chunk: both runs chunk their LM head alike


def packed_response_outputs(model, batch, processors):
    return packed_forward.packed_response_outputs(model, batch, processors, head_chunk_tokens=HEAD_CHUNK[0])


def grpo_batch(prompt: int, response: int, n: int, vocab: int) -> RolloutBatch:
    gen = torch.Generator().manual_seed(prompt * 7 + response + n)
    p = torch.randint(0, vocab, (prompt,), generator=gen).tolist()
    rs = [torch.randint(0, vocab, (response,), generator=gen).tolist() for _ in range(n)]
    return RolloutBatch.from_lists([p], rs, [0] * n)


def timed_fwd_bwd(model, forward, batch, iters: int) -> tuple[float, float, float]:
    """Median ms of fwd+bwd, peak GiB, and peak GiB above the memory held before the step."""
    processors = {"logprobs": LogProbs()}
    times, peak, extra = [], 0.0, 0.0
    for i in range(iters + 1):
        model.zero_grad(set_to_none=False)
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        out = forward(model, batch, processors)
        (-(out["logprobs"] * batch.loss_mask.to(out["logprobs"].device)).sum()).backward()
        torch.cuda.synchronize()
        if i:  # the first pass compiles / warms up
            times.append((time.perf_counter() - start) * 1e3)
        peak = torch.cuda.max_memory_allocated() / 2**30
        extra = (torch.cuda.max_memory_allocated() - base) / 2**30
    return (statistics.median(times) if times else float("nan")), peak, extra


def bf16_error(model_bf16, shape) -> dict[str, float]:
    """Mean |log-prob error| of bf16 vs an fp32 copy, without and with deduplication."""
    batch = grpo_batch(*shape, vocab=model_bf16.config.vocab_size)
    ref = copy.deepcopy(model_bf16).float()
    processors = {"logprobs": LogProbs()}
    with torch.no_grad():
        set_attention_implementation(ref, "sdpa")
        exact = response_outputs(ref, batch, processors)["logprobs"]
        del ref
        set_attention_implementation(model_bf16, "arctic_varlen")
        plain = plain_packed_outputs(model_bf16, batch, processors)["logprobs"]
        enable_forest_attention(model_bf16)
        packed = packed_response_outputs(model_bf16, batch, processors)["logprobs"]
    mask = batch.loss_mask.to(exact.device)
    return {
        "plain_bf16_mean_abs_err": float((plain - exact).abs()[mask].mean()),
        "zorro_bf16_mean_abs_err": float((packed - exact).abs()[mask].mean()),
        "plain_bf16_max_abs_err": float((plain - exact).abs()[mask].max()),
        "zorro_bf16_max_abs_err": float((packed - exact).abs()[mask].max()),
    }


def profile(model, batch: RolloutBatch, compiled: bool = False) -> None:
    """Top CUDA kernels of one ZoRRo and one baseline fwd+bwd (where the time goes); ``compiled``:
    also ZoRRo with ``compile_elementwise`` and no checkpointing."""
    variants = [("zorro", packed_response_outputs, None), ("baseline", plain_packed_outputs, "arctic_varlen")]
    for name, forward, attention in variants:
        if attention:
            set_attention_implementation(model, attention)
        else:
            enable_forest_attention(model)
        _print_profile(name, model, forward, batch)
    if compiled:
        with elementwise_compiled(model), without_checkpointing(model):
            enable_forest_attention(model)
            _print_profile("zorro, compiled, no checkpointing", model, packed_response_outputs, batch)


def _print_profile(name: str, model, forward, batch: RolloutBatch) -> None:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    timed_fwd_bwd(model, forward, batch, 1)
    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        timed_fwd_bwd(model, forward, batch, 0)
    print(f"== {name}", file=sys.stderr)
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=18, max_name_column_width=60), file=sys.stderr)


@contextlib.contextmanager
def elementwise_compiled(model):
    """``model`` with ``compile_elementwise`` applied, given back its own forwards after."""
    fused = compile_elementwise(model)
    try:
        yield
    finally:
        for module in fused:
            module.__dict__.pop("forward", None)


@contextlib.contextmanager
def without_checkpointing(model):
    """``model`` with no layer checkpointed, every layer again after."""
    model.gradient_checkpointing_disable()
    try:
        yield
    finally:
        enable_gradient_checkpointing(model)


def compiled_variants(model, batch: RolloutBatch, iters: int) -> dict[str, float]:
    """ZoRRo with the RMSNorms and SiLU x up compiled (``trainer.compile_elementwise``), every
    layer checkpointed and none."""
    enable_forest_attention(model)
    with elementwise_compiled(model):
        ckpt_ms, ckpt_peak, _ = timed_fwd_bwd(model, packed_response_outputs, batch, iters)
        with without_checkpointing(model):
            nockpt_ms, nockpt_peak, _ = timed_fwd_bwd(model, packed_response_outputs, batch, iters)
    return {"zorro_compiled_ms": round(ckpt_ms, 1), "zorro_compiled_peak_gib": round(ckpt_peak, 2),
            "zorro_compiled_no_ckpt_ms": round(nockpt_ms, 1), "zorro_compiled_no_ckpt_peak_gib": round(nockpt_peak, 2)}


def extra_variants(model, batch: RolloutBatch, iters: int) -> dict[str, float]:
    """ZoRRo without gradient checkpointing (its memory allows it) and the full-head baseline."""
    set_attention_implementation(model, "arctic_varlen")
    full_ms, full_peak, _ = timed_fwd_bwd(model, lambda m, b, p: plain_packed_outputs(m, b, p, full_head=True),
                                          batch, iters)
    enable_forest_attention(model)
    with without_checkpointing(model):
        nockpt_ms, nockpt_peak, _ = timed_fwd_bwd(model, packed_response_outputs, batch, iters)
    return {"baseline_full_head_ms": round(full_ms, 1), "baseline_full_head_peak_gib": round(full_peak, 2),
            "zorro_no_ckpt_ms": round(nockpt_ms, 1), "zorro_no_ckpt_peak_gib": round(nockpt_peak, 2)}


def flex_tunings(model, batch: RolloutBatch, iters: int, tunings: list, other: RolloutBatch) -> dict:
    """ZoRRo compiled with no layer checkpointed, its FlexAttention compiled under each of
    ``tunings``: a dict of ``flex_attention`` kernel options (tiles, warps, stages; ``{}``: the
    backend's defaults) or a string naming a variant of the backend's compilation:

    - "max-autotune": Inductor times its own configs for the fixed-shape kernels;
    - "after-other": the backend as training meets it, after a micro-batch of another length
      (``other``: within the same padded length, as is common, it reuses the kernels);
    - "dynamic": padded, compiled for any length (``dynamic=True``);
    - "unpadded": one fixed-shape compile of the exact length (no padding copies);
    - "unpadded-dynamic": the backend before padding: default dynamism, after ``other``;
    - "eager-rotary": the defaults with transformers' eager rotary embedding (not compiled);
    - "head-major-padding": q/k/v padded as ``[1, H, T, D]`` tensors, the output copied back to
      ``[1, T, H, D]`` (how the backend padded before it padded token-major).

    Each starts from a fresh compilation cache, so each pays its compile in the untimed first pass."""
    from arctic_zorro import forest_attention

    timed, default, padded_length = {}, forest_attention.flex_kernels, forest_attention.padded_length
    token_major = forest_attention._padded_flex_attention
    enable_forest_attention(model)
    try:
        for tuning in tunings:
            torch._dynamo.reset()
            name = tuning if isinstance(tuning, str) else ""
            kernels = forest_attention.FlexKernels(
                static_lengths=0 if name.endswith("dynamic") else forest_attention.STATIC_LENGTHS,
                kernel_options=tuning if isinstance(tuning, dict) and tuning else None)
            if name == "max-autotune":
                kernels.fixed_shape = torch.compile(forest_attention._flex_fixed_shape, dynamic=False,
                                                    mode="max-autotune-no-cudagraphs")
            if name == "dynamic":
                kernels.any_shape = torch.compile(forest_attention._flex_any_shape, dynamic=True)
            forest_attention.flex_kernels = lambda kernels=kernels: kernels
            forest_attention.padded_length = (lambda n: n) if name.startswith("unpadded") else padded_length
            forest_attention._padded_flex_attention = (head_major_padding if name == "head-major-padding"
                                                       else token_major)
            with elementwise_compiled(model), without_checkpointing(model):
                if name == "eager-rotary":
                    for module in model.modules():
                        if type(module).__name__.endswith("Attention"):
                            module.__dict__.pop("forward", None)
                if name in ("after-other", "unpadded-dynamic"):
                    timed_fwd_bwd(model, packed_response_outputs, other, 0)
                ms, peak, _ = timed_fwd_bwd(model, packed_response_outputs, batch, iters)
            timed[json.dumps(tuning)] = {"ms": round(ms, 1), "peak_gib": round(peak, 2)}
            print("flex tuning", json.dumps(tuning), timed[json.dumps(tuning)], flush=True)
    finally:
        forest_attention.flex_kernels, forest_attention.padded_length = default, padded_length
        forest_attention._padded_flex_attention = token_major
        torch._dynamo.reset()
    return {"zorro_flex_tunings": timed}


def head_major_padding(query, key, value, forest, mask, window, scaling):
    from arctic_zorro.forest_attention import flex_kernels

    size, extra = query.shape[2], forest.padded_size - query.shape[2]
    query, key, value = (torch.nn.functional.pad(t, (0, 0, 0, extra)) for t in (query, key, value))
    return flex_kernels()(query, key, value, mask, window, scaling)[:, :, :size].transpose(1, 2).contiguous()


def partial_checkpointing(model, batch: RolloutBatch, iters: int, layer_counts: list[int], budget_gib: float,
                          all_layers: tuple[int, float, float]) -> dict:
    """ZoRRo with only its first K decoder layers checkpointed (``checkpoint_layers: K``), for each
    K: the time that deduplication's memory saving buys back. ``iso_memory_layers``: the fastest
    setting whose peak stays within ``budget_gib`` (the baseline's), among these and ``all_layers``
    (the layer count, ms and peak GiB of the run that checkpoints every layer)."""
    enable_forest_attention(model)
    timed = {all_layers[0]: (round(all_layers[1], 1), round(all_layers[2], 2))}
    try:
        for layers in layer_counts:
            enable_gradient_checkpointing(model, layers)
            ms, peak, _ = timed_fwd_bwd(model, packed_response_outputs, batch, iters)
            timed[layers] = (round(ms, 1), round(peak, 2))
    finally:
        enable_gradient_checkpointing(model)
    return {"zorro_partial_ckpt": {str(k): {"ms": ms, "peak_gib": peak} for k, (ms, peak) in timed.items()},
            "iso_memory_layers": min((k for k, (_, peak) in timed.items() if peak <= budget_gib),
                                     key=lambda k: timed[k][0], default=None)}


def gpu(args) -> dict[str, object]:
    config = AutoConfig.for_model("qwen3", **{**QWEN3_1_7B, "num_hidden_layers": args.layers})
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16, attn_implementation="sdpa")
    enable_gradient_checkpointing(model)
    model.train()
    rows = []
    for shape in args.shapes:
        prompt, response, n = shape
        batch = grpo_batch(prompt, response, n, config.vocab_size)
        ratio = n * (prompt + response) / (prompt + n * response)
        enable_forest_attention(model)
        z_ms, z_peak, z_extra = timed_fwd_bwd(model, packed_response_outputs, batch, args.iters)
        set_attention_implementation(model, "arctic_varlen")
        b_ms, b_peak, b_extra = timed_fwd_bwd(model, plain_packed_outputs, batch, args.iters)
        row = {"prompt": prompt, "response": response, "n": n, "token_ratio": round(ratio, 2),
               "baseline_ms": round(b_ms, 1), "zorro_ms": round(z_ms, 1), "speedup": round(b_ms / z_ms, 2),
               "baseline_peak_gib": round(b_peak, 2), "zorro_peak_gib": round(z_peak, 2),
               "baseline_step_gib": round(b_extra, 2), "zorro_step_gib": round(z_extra, 2)}
        if args.extra_variants:
            row.update(extra_variants(model, batch, args.iters))
        if args.compile_elementwise:
            row.update(compiled_variants(model, batch, args.iters))
        if args.flex_kernel_options:
            # "after-other" and "unpadded-dynamic" meet this length first
            other = grpo_batch(prompt - 200, response, n, config.vocab_size)
            row.update(flex_tunings(model, batch, args.iters, args.flex_kernel_options, other))
        if args.checkpoint_layers:
            row.update(partial_checkpointing(model, batch, args.iters, args.checkpoint_layers, b_peak,
                                             (args.layers, z_ms, z_peak)))
            best = row["iso_memory_layers"]
            if best is not None:
                row["iso_memory_speedup"] = round(b_ms / row["zorro_partial_ckpt"][str(best)]["ms"], 2)
        print(json.dumps(row), flush=True)
        rows.append(row)
    result = {"device": torch.cuda.get_device_name(), "layers": args.layers, "torch": torch.__version__, "rows": rows}
    if args.profile:
        profile(model, grpo_batch(*args.shapes[0], config.vocab_size), compiled=args.compile_elementwise)
    if args.bf16_check:
        result["bf16_error_1024_512_8"] = bf16_error(model, (1024, 512, 8))
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="CPU exactness check on tiny models")
    parser.add_argument("--layers", type=int, default=28)
    parser.add_argument("--iters", type=int, default=3)
    parser.add_argument("--shapes", type=lambda s: [tuple(map(int, x.split("/"))) for x in s.split(",")],
                        default=SHAPES, help="P/R/N,P/R/N,...")
    parser.add_argument("--no-bf16-check", dest="bf16_check", action="store_false")
    parser.add_argument("--profile", action="store_true", help="print the top CUDA kernels at the first shape")
    parser.add_argument("--compile-elementwise", action="store_true",
                        help="also time ZoRRo with the RMSNorms and SiLU x up compiled, checkpointed and not")
    parser.add_argument("--extra-variants", action="store_true",
                        help="also time the full-head baseline and ZoRRo without checkpointing")
    parser.add_argument("--checkpoint-layers", type=lambda s: [int(k) for k in s.split(",")], default=[],
                        help="K,K,...: also time ZoRRo with only its first K layers checkpointed")
    parser.add_argument("--flex-kernel-options", type=json.loads, default=None,
                        help='JSON list: also time compiled ZoRRo (no checkpointing) with FlexAttention under each, '
                             'e.g. \'[{}, "max-autotune", '
                             '{"BLOCK_M1": 64, "BLOCK_N1": 64, "BLOCK_M2": 64, "BLOCK_N2": 64}]\'')
    parser.add_argument("--head-chunk", type=int, default=packed_forward.HEAD_CHUNK_TOKENS,
                        help="response tokens per LM-head chunk, in both runs (smaller: lower peak memory)")
    parser.add_argument("--device", default="cpu", help="device of the --smoke models (cuda exercises FlexAttention)")
    args = parser.parse_args()
    HEAD_CHUNK[0] = args.head_chunk
    if args.smoke or not torch.cuda.is_available():
        torch.set_num_threads(min(2, os.cpu_count() or 1))
        result = smoke(args.device)
    else:
        result = gpu(args)
    print(json.dumps(result), file=sys.stdout, flush=True)


if __name__ == "__main__":
    main()
