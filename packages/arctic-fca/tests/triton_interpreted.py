"""Run under ``TRITON_INTERPRET=1`` (the CPU test suite starts it as a subprocess): the Triton
decode kernels against the exact torch path on random forests (FCA and plain decode), split-K
forced, GQA and MHA, the engine decoder's fused kernels against their torch reference, the one-pass
sampling kernels, and the embedded engine's greedy output with all these kernels against
transformers ``generate``.
Prints one JSON line."""

from __future__ import annotations

import dataclasses
import json
import os
import sys

assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"
sys.path.insert(0, os.path.dirname(__file__))

import torch  # noqa: E402
from test_fca import attention_args, make_batch, max_abs_diff, random_forest  # noqa: E402

from arctic_fca.fca import build_plan, paged_decode_attention  # noqa: E402
from arctic_fca.fca.triton_decode import triton_decode_attention  # noqa: E402
from arctic_fca.fca.work import plan_work  # noqa: E402
from arctic_fca.fca.tuning import DEFAULT_TUNING  # noqa: E402

# Few persistent programs (8 nominal SMs x 1): each strides over several items, as on a busy GPU;
# requests with more partial rows than 2 merge in several chunks.
TUNING = DEFAULT_TUNING.replace(programs_per_sm=1, merge_rows=2)
# Each launch with a grid of its own: fewer programs for the shared-prefix launch, more for the other.
PER_LAUNCH_TUNING = TUNING.replace(node=dataclasses.replace(TUNING.node, programs_per_sm=0.5),
                                   single=dataclasses.replace(TUNING.single, programs_per_sm=2))


def kernel_cases() -> tuple[float, int]:
    worst, cases = 0.0, 0
    for seed in range(4):
        for block_size, heads, chunk in ((16, (6, 2), 32), (32, (4, 4), None), (16, (8, 1), 16)):
            segments, requests = random_forest(seed, block_size)
            batch = make_batch(segments, requests, block_size, num_q_heads=heads[0], num_kv_heads=heads[1],
                               head_dim=24, seed=seed)
            query, key_cache, value_cache, tables, lens = attention_args(batch)
            expected = paged_decode_attention(query, key_cache, value_cache, tables, lens, 0.3)
            tuning = TUNING if seed < 2 else PER_LAUNCH_TUNING
            for plan in (build_plan(tables, lens, block_size), None):
                work = plan_work(plan, tables, lens, block_size, heads[0], heads[1], 24, chunk=chunk, tuning=tuning)
                out = triton_decode_attention(query, key_cache, value_cache, work, 0.3)
                worst = max(worst, max_abs_diff(out, expected))
                cases += 1
    return worst, cases


def static_work_cases() -> tuple[float, int]:
    """The fixed-capacity buffers a CUDA graph replays: batch padded with scratch rows, tables
    narrower than the buffers' widest, two different steps loaded one after the other into the same
    buffers, the second's tables wider than the first's (its rows cover where the first's nodes were)."""
    import numpy as np
    from arctic_fca.fca.graph_work import StaticDecodeWork
    from arctic_fca.fca.work import build_work

    worst, cases = 0.0, 0
    for with_nodes in (True, False):
        static = None
        for seed in (5, 6):
            segments, requests = random_forest(seed, 16)
            batch = make_batch(segments, requests, 16, num_q_heads=4, num_kv_heads=2, head_dim=16, seed=seed)
            query, key_cache, value_cache, tables, lens = attention_args(batch)
            real = len(requests)
            rows, width = 12, tables.shape[1] + (1 if seed == 5 else 9)
            padded = np.zeros((rows, width), np.int32)
            padded[:real, : tables.shape[1]] = tables.clamp(min=0).numpy()
            lens_padded = np.ones(rows, np.int32)
            lens_padded[:real] = lens.numpy()
            plan = build_plan(torch.from_numpy(padded), torch.from_numpy(lens_padded), 16) if with_nodes else None
            work = build_work(plan, lens_padded, width, 16, group=2, num_kv_heads=2, num_sms=8, chunk=32, tuning=TUNING)
            if static is None:
                static = StaticDecodeWork(rows, 24, key_cache.shape[0], with_nodes=with_nodes, num_q_heads=4,
                                          num_kv_heads=2, head_dim=16, device=torch.device("cpu"), tuning=TUNING)
            assert static.load(work, padded)
            query_padded = torch.cat([query, torch.zeros(rows - real, *query.shape[1:])])
            out = triton_decode_attention(query_padded, key_cache, value_cache, static.work, 0.3)[:real]
            expected = paged_decode_attention(query, key_cache, value_cache, tables.clamp(min=0), lens, 0.3)
            worst = max(worst, max_abs_diff(out, expected))
            cases += 1
    return worst, cases


def device_work_cases() -> tuple[float, int]:
    """Items built on the device from the block tables (DeviceWorkBuilder), split-K forced."""
    from arctic_fca.fca.cost_model import CostConstants
    from arctic_fca.fca.device_work import DeviceWorkBuilder

    worst, cases = 0.0, 0
    for seed in (7, 8):
        segments, requests = random_forest(seed, 16)
        batch = make_batch(segments, requests, 16, num_q_heads=4, num_kv_heads=2, head_dim=16, seed=seed)
        query, key_cache, value_cache, tables, lens = attention_args(batch)
        builder = DeviceWorkBuilder(len(requests), tables.shape[1], key_cache.shape[0], 16, num_q_heads=4,
                                    num_kv_heads=2, head_dim=16, kv_dtype=key_cache.dtype, device="cpu",
                                    costs=CostConstants(min_speedup=0.0), num_sms=8, chunk_range=(16, 32),
                                    tuning=TUNING)
        # vLLM's layout: [num_blocks, 2, block_size, kv_heads, head_dim], read as strided views, and
        # the output written into a wider buffer's rows (what arctic_fca.vllm.attention does).
        kv_cache = torch.stack([key_cache, value_cache], dim=1)
        output = torch.zeros(len(requests) + 2, 4 * 16)
        out = output[: len(requests)].view(len(requests), 4, 16)
        triton_decode_attention(query, *kv_cache.unbind(1), builder.build(tables, lens), 0.3, out=out)
        expected = paged_decode_attention(query, key_cache, value_cache, tables.clamp(min=0), lens, 0.3)
        worst = max(worst, max_abs_diff(out, expected))
        cases += 1
    return worst, cases


def plain_work_cases() -> tuple[float, int, bool]:
    """The plain build as one Triton program (``plain_work``) against the torch build: the same
    items and merge, bit for bit, over batch sizes, padding rows and split lengths; and decoding
    through it equals plain paged decode."""
    from test_device_work import same_work

    from arctic_fca.fca.device_work import DeviceWorkBuilder

    worst, cases, same = 0.0, 0, True
    for seed, chunk_range in ((9, (16, 32)), (10, (16, 64)), (11, (32, 1024))):
        segments, requests = random_forest(seed, 16)
        batch = make_batch(segments, requests, 16, num_q_heads=4, num_kv_heads=2, head_dim=16, seed=seed)
        query, key_cache, value_cache, tables, lens = attention_args(batch)
        rows = len(requests) + 3  # padding rows of length 0, as a CUDA graph's batch bucket has
        tables = torch.cat([tables, tables.new_zeros(3, tables.shape[1])])
        lens = torch.cat([lens, lens.new_zeros(3)])
        builders = [DeviceWorkBuilder(rows + 2, tables.shape[1], key_cache.shape[0], 16, num_q_heads=4, num_kv_heads=2,
                                      head_dim=16, kv_dtype=key_cache.dtype, device="cpu", num_sms=8,
                                      chunk_range=chunk_range, plain_kernel=kernel, tuning=TUNING)
                    for kernel in (False, True)]
        for builder in builders:  # what an earlier step left must not leak into the plain build
            builder.build(tables, lens)
        torch_work, kernel_work = (b.build(tables, lens, shared=False) for b in builders)
        pairs = builders[0].max_pairs
        same &= same_work(torch_work, kernel_work, rows) and torch.equal(
            torch_work.q_index[pairs : pairs + rows], kernel_work.q_index[pairs : pairs + rows]) and int(
            kernel_work.node.count) == 0 and not bool(builders[1].used_fca)
        padded_query = torch.cat([query, query.new_zeros(3, *query.shape[1:])])
        real_tables, real_lens = tables[: len(requests)].clamp(min=0), lens[: len(requests)]
        expected = torch.cat([paged_decode_attention(query, key_cache, value_cache, real_tables, real_lens, 0.3),
                              padded_query[len(requests):]])
        out = triton_decode_attention(padded_query, key_cache, value_cache, kernel_work, 0.3,
                                      out=torch.full_like(padded_query, float("nan")))
        worst = max(worst, max_abs_diff(out, expected))  # padding rows: no items, the merge writes zeros
        cases += 1
    # Split lengths at their boundaries: 8 items wanted (8 nominal SMs x 2 / 2 KV heads), so 256
    # tokens split in 32s and 257 in 64s.
    for total in (255, 256, 257):
        lens = torch.tensor([total - 3 * (total // 4)] + [total // 4] * 3, dtype=torch.int32)
        tables = torch.arange(4 * 24, dtype=torch.int32).view(4, 24)
        works = [DeviceWorkBuilder(4, 24, 96, 16, num_q_heads=4, num_kv_heads=2, head_dim=16, kv_dtype=torch.float32,
                                   device="cpu", num_sms=8, chunk_range=(16, 1024), plain_kernel=kernel).build(
            tables, lens, shared=False) for kernel in (False, True)]
        chunk = 64 if total > 256 else 32
        same &= same_work(*works, 4) and int(works[1].single.count) == sum(-(-int(n) // chunk) for n in lens)
    return worst, cases, same


def fused_op_cases() -> tuple[float, int]:
    """The engine decoder's fused kernels against their torch reference: residual add + RMSNorm,
    query/key norm + rotary + cache store (with and without the norms, padding slot 0 included),
    SiLU x up."""
    from arctic_fca.engine import fused_ops
    from arctic_fca.engine.kv_cache import PagedKVCache

    gen = torch.Generator().manual_seed(0)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen)

    worst, cases = 0.0, 0
    x, residual, weight = rand(5, 48), rand(5, 48), rand(48)
    for res in (None, residual):
        got = fused_ops.add_rms_norm(x, res, weight, 1e-6, triton=True)
        want = fused_ops.add_rms_norm(x, res, weight, 1e-6, triton=False)
        worst = max(worst, *(max_abs_diff(g, w) for g, w in zip(got, want, strict=True)))
        cases += 1
    heads, tokens, max_len = (4, 2, 16), 6, 40
    cos, sin = rand(max_len, 16), rand(max_len, 16)
    positions, slots = torch.tensor([0, 3, 39, 7, 7, 1]), torch.tensor([17, 2, 30, 9, 0, 25])
    qkv = rand(tokens, (4 + 2 * 2) * 16)
    for norms in (None, (rand(16), rand(16))):
        caches = [PagedKVCache(1, 4, 8, 2, 16, torch.float32, torch.device("cpu")) for _ in range(2)]
        results = [fused_ops.qk_rope_store(qkv, heads, positions, cos, sin, *(norms or (None, None)), 1e-6, cache, 0,
                                           slots, triton=triton)
                   for cache, triton in zip(caches, (True, False), strict=True)]
        worst = max(worst, *(max_abs_diff(g, w) for g, w in zip(*results, strict=True)),
                    max_abs_diff(caches[0].keys[0], caches[1].keys[0]),
                    max_abs_diff(caches[0].values[0], caches[1].values[0]))
        cases += 1
    gate_up = rand(3, 2 * 40)
    worst = max(worst, max_abs_diff(fused_ops.silu_and_mul(gate_up, triton=True),
                                    fused_ops.silu_and_mul(gate_up, triton=False)))
    product_worst, product_cases = fused_linear_cases()
    return max(worst, product_worst), cases + 1 + product_cases


def fused_linear_cases() -> tuple[float, int]:
    """The decoder's products with the small operations folded in, against the unfused torch path:
    plain (with and without a bias), RMSNorm of the input (prepared with torch, and by the product
    that wrote the rows), the residual added, gated SiLU x up; rows, columns and depth off the tiles,
    K unsplit and split in 2 and 3, each launch twice (the split launches' arrival counters reset)."""
    from torch.nn.functional import linear

    from arctic_fca.engine.fused_linear import LinearConfig, Normed, fused_linear
    from arctic_fca.engine.fused_ops import rms_norm, silu_and_mul

    gen = torch.Generator().manual_seed(1)
    worst, cases = 0.0, 0
    for rows, n, k in ((1, 40, 48), (5, 70, 300), (33, 130, 200)):
        x, h, weight, bias, g, g_next, residual = (torch.randn(*shape, generator=gen) for shape in
                                                   ((rows, k), (rows, k), (n, k), (n,), (k,), (n,), (rows, n)))
        weight /= k**0.5  # outputs of order one: the difference is the relative one
        even = weight[: n - n % 2]
        normed = rms_norm(h, g, 1e-6)
        written = residual + linear(x, weight)
        expected = {"plain": linear(x, weight), "bias": linear(x, weight, bias),
                    "norm": linear(normed, weight, bias), "residual": written,
                    "next_norm": rms_norm(written, g_next, 1e-6),
                    "gated": silu_and_mul(linear(normed, even), triton=False), "scaled": Normed.of(h, g).scaled,
                    "next_norm_torch": rms_norm(written, g_next, 1e-6)}
        prepared = Normed.of(h, g, triton=True)
        for split in (1, 2, 3, 3):  # split in 3 twice: the arrival counters were reset
            config = LinearConfig(block_n=32, block_k=32, split_k=split)
            out, written_normed = fused_linear(x, weight, residual=residual, next_norm=g_next, config=config)
            got = {"plain": fused_linear(x, weight, config=config),
                   "bias": fused_linear(x, weight, bias, config=config),
                   "norm": fused_linear(prepared, weight, bias, eps=1e-6, config=config),
                   "residual": out, "next_norm": written_normed.normalized(1e-6, triton=True),
                   "gated": fused_linear(prepared, even, eps=1e-6, gated=True, config=config),
                   "scaled": prepared.scaled, "next_norm_torch": written_normed.normalized(1e-6)}
            worst = max(worst, *(max_abs_diff(got[name], expected[name]) for name in expected))
            cases += len(expected)
    return worst, cases


def sampling_cases() -> dict:
    """The one-pass sampling kernels (vocabulary slices and blocks forced small): each token's
    log-prob against log_softmax(logits / T), greedy rows against argmax (the first of a tie), the
    same seed drawing the same tokens, and the draws' frequencies against the probabilities (a
    chi-square statistic over 12 tokens in 3 chunks of the race's first level; 11 degrees of
    freedom, 31.3 is the 0.1% level), from one generator's seed and from per-row seeds; with per-row
    seeds, each row's token and log-prob the same alone as at any place in batches of other sizes,
    and different seeds drawing different tokens."""
    from arctic_fca.engine import triton_filters, triton_sampling
    from arctic_fca.engine.triton_sampling import sample_with_temperature

    settings = ((triton_sampling, "SLICE", 64), (triton_sampling, "BLOCK", 16), (triton_sampling, "RACE_CHUNK", 4),
                (triton_filters, "BLOCK", 32),
                (triton_filters, "WIDE_BLOCK", 32), (triton_filters, "CHUNK", 8))
    defaults = [getattr(module, name) for module, name, _ in settings]
    for module, name, value in settings:
        setattr(module, name, value)
    try:
        return {**_sampling_checks(sample_with_temperature), **_filter_checks()}
    finally:
        for (module, name, _), value in zip(settings, defaults, strict=True):
            setattr(module, name, value)


def _sampling_checks(sample_with_temperature) -> dict:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 150, generator=gen) * 3
    logits[3, [20, 90]] = logits[3].max() + 1  # a tie across slices: the first index wins
    temperature = torch.tensor([0.0, 1.0, 0.7, 0.0, 1.3, 1.0])
    tokens, logprobs = sample_with_temperature(logits, temperature, torch.Generator().manual_seed(1))
    again, _ = sample_with_temperature(logits, temperature, torch.Generator().manual_seed(1))
    scaled = logits / torch.where(temperature == 0, 1.0, temperature)[:, None]
    expected = scaled.log_softmax(-1).gather(-1, tokens[:, None]).squeeze(-1)
    greedy = temperature == 0
    probs = torch.tensor([0.2, 0.1, 0.05, 0.05, 0.02, 0.03, 0.25, 0.1, 0.04, 0.06, 0.07, 0.03])
    draws = 600
    drawn, _ = sample_with_temperature(probs.log().repeat(draws, 1), torch.ones(draws),
                                       torch.Generator().manual_seed(2))
    counts = torch.bincount(drawn, minlength=12).float()
    # One token e^200 times likelier than the rest, whose race weights flush to 0 (in row 1 after a
    # first block far below it): it must win every draw, with a log-prob of 0.
    dominant = torch.randn(4, 150, generator=gen)
    dominant[:, 120] = 200.0
    dominant[1, :16] = -300.0
    winners, winner_logprobs = sample_with_temperature(dominant, torch.ones(4), torch.Generator().manual_seed(3))
    # Per-row seeds (any int64), 300 consecutive ones: the same distribution.
    row_draws = 300
    drawn, _ = sample_with_temperature(probs.log().repeat(row_draws, 1), torch.ones(row_draws),
                                       torch.arange(row_draws) - 150)
    row_seed_counts = torch.bincount(drawn, minlength=12).float()
    return {"logprob_max_abs_diff": max_abs_diff(logprobs, expected),
            "dominant_token_wins": (bool((winners == 120).all())
                                    and max_abs_diff(winner_logprobs, torch.zeros(4)) < 1e-5),
            "greedy_is_argmax": torch.equal(tokens[greedy], logits[greedy].argmax(-1)) and int(tokens[3]) == 20,
            "same_seed_same_tokens": torch.equal(tokens, again),
            "chi_square": float(((counts - draws * probs) ** 2 / (draws * probs)).sum()),
            "row_seeds_chi_square": float(((row_seed_counts - row_draws * probs) ** 2 / (row_draws * probs)).sum()),
            **_row_seed_checks(sample_with_temperature, gen)}


def _row_seed_checks(sample_with_temperature, gen: torch.Generator) -> dict:
    """Per-row seeds: each row drawn alone, then in batches of other sizes at other places (rows
    repeated, seeds at the int64 extremes and negative): the same token and log-prob; the same
    logits under eight seeds that differ only in their high 32 bits: eight draws, nearly all
    different (flat logits: the noise decides)."""
    logits = torch.randn(5, 150, generator=gen)
    temperature = torch.tensor([1.0, 0.8, 0.0, 1.5, 1.0])
    seeds = torch.tensor([-(2**63), 2**63 - 1, 7, -123456789012345, 0x9E3779B97F4A7C15 - 2**64])
    alone = [sample_with_temperature(logits[r : r + 1], temperature[r : r + 1], seeds[r : r + 1]) for r in range(5)]
    alone_tokens, alone_logprobs = (torch.cat(parts) for parts in zip(*alone, strict=True))
    same = True
    for order in (torch.arange(5), torch.tensor([3, 0, 4, 4, 1, 2, 0, 3])):
        tokens, logprobs = sample_with_temperature(logits[order], temperature[order], seeds[order])
        same &= torch.equal(tokens, alone_tokens[order]) and torch.equal(logprobs, alone_logprobs[order])
    spread, _ = sample_with_temperature(logits[[0] * 8], torch.ones(8), (torch.arange(8) - 4) << 40)
    return {"row_seeds_same_alone_as_in_batches": same, "row_seeds_distinct_tokens": len(set(spread.tolist()))}


def _filter_checks() -> dict:
    """Top-k, top-p and min-p by the kernels' floors against the torch path's sort (fp32 and bf16
    logits, with ties at the boundaries and without; rows of each filter alone, together, greedy;
    min-p one for all rows and each row's own): the same entries kept, each token's log-prob under
    the filtered distribution (drawn from a generator, and from per-row seeds); each row's own
    min-p giving the row the floors that min-p for all rows gives it; and the draws' frequencies
    under top-p against the renormalised probabilities (1 degree of freedom, 10.8 is the 0.1%
    level)."""
    from arctic_fca.engine.sampling import RowParams, filtered_log_probs, sample
    from arctic_fca.engine.triton_filters import row_floors
    from arctic_fca.engine.triton_sampling import sample_with_temperature

    gen = torch.Generator().manual_seed(4)
    kept_equal, worst, row_min_p_equal = True, 0.0, True
    row_min_p = torch.tensor([0.05, 0.3, 0.3, 0.0, 0.05, 0.0])  # row 2 greedy: no filter
    for dtype, ties, min_p in ((torch.float32, False, 0.05), (torch.float32, True, 0.0), (torch.bfloat16, False, 0.0),
                               (torch.bfloat16, True, 0.2)):
        logits = torch.randn(6, 150, generator=gen) * 3
        logits = ((logits * 2).round() / 2 if ties else logits).to(dtype)  # ties: few distinct values
        params = RowParams(temperature=torch.tensor([1.0, 0.7, 0.0, 1.3, 1.0, 2.0]),
                           top_k=torch.tensor([0, 5, 3, 0, 20, 1]), top_p=torch.tensor([0.9, 1.0, 0.5, 0.3, 0.8, 0.95]),
                           min_p=min_p)
        expected = filtered_log_probs(logits, params)
        floors = row_floors(logits, params.temperature, params.top_k, params.top_p, params.min_p)
        kept_equal &= torch.equal(floors.keeps(logits, params.temperature), expected.isfinite())
        tokens, logprobs = sample_with_temperature(logits, params.temperature, torch.Generator().manual_seed(5), floors)
        worst = max(worst, max_abs_diff(logprobs, expected.gather(-1, tokens[:, None]).squeeze(-1)))
        if not ties:  # each row's own min-p: its floors as min-p for all rows gives them, and the sort's support
            params = dataclasses.replace(params, min_p=row_min_p, any_min_p=None)
            expected = filtered_log_probs(logits, params)
            floors = row_floors(logits, params.temperature, params.top_k, params.top_p, params.min_p)
            kept_equal &= torch.equal(floors.keeps(logits, params.temperature), expected.isfinite())
            for value in row_min_p.unique().tolist():
                rows = row_min_p == value
                alike = row_floors(logits, params.temperature, params.top_k, params.top_p, value)
                row_min_p_equal &= all(torch.equal(getattr(floors, name)[rows], getattr(alike, name)[rows])
                                       for name in ("key", "value", "chunk_tops"))
            tokens, logprobs = sample_with_temperature(logits, params.temperature, torch.arange(6) * 31 - 50, floors)
            worst = max(worst, max_abs_diff(logprobs, expected.gather(-1, tokens[:, None]).squeeze(-1)))
    draws = 200
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    top_p = RowParams(temperature=torch.ones(draws), top_k=torch.zeros(draws, dtype=torch.long),
                      top_p=torch.full((draws,), 0.7), any_top_k=False)
    drawn, _ = sample(probs.log().repeat(draws, 1), top_p, torch.Generator().manual_seed(6), triton=True)
    counts = torch.bincount(drawn, minlength=4).float()
    kept_probs = torch.tensor([0.625, 0.375, 0.0, 0.0])
    return {"filters_keep_what_the_sort_keeps": kept_equal, "filtered_logprob_max_abs_diff": worst,
            "row_min_p_floors_as_shared_min_p": row_min_p_equal,
            "filtered_draws_outside": int(counts[2:].sum()),
            "filtered_chi_square": float(((counts[:2] - draws * kept_probs[:2]) ** 2 / (draws * kept_probs[:2])).sum())}


def engine_matches_generate() -> bool:
    """Qwen3 (query/key norms), Qwen2 (QKV biases) and Llama with attention biases (the output
    product's too), each through the fused products of its few-row steps."""
    families = (("qwen3", {}), ("qwen2", {}), ("llama", {"attention_bias": True}))
    return all(_engine_matches_generate(family, overrides) for family, overrides in families)


def _engine_matches_generate(family: str, overrides: dict) -> bool:
    import copy

    from arctic_core.config import SamplingParams
    from arctic_core.demo.task import CountingTask
    from arctic_core.demo.tiny_model import build_tiny_model, build_tokenizer
    from arctic_fca.engine import EmbeddedEngine, EngineOptions

    tokenizer = build_tokenizer(CountingTask().corpus())
    model = build_tiny_model(tokenizer, family=family, seed=3, **overrides)
    reference = copy.deepcopy(model)
    # Prefill chunks of 24 tokens: the longer prompt's last chunks run with its sibling's decode rows.
    options = EngineOptions(kv_cache_tokens=2048, fca="fca", kernel="triton", max_prefill_tokens=24,
                            chunked_prefill=True)
    engine = EmbeddedEngine(model, options, tuning=TUNING)
    engine.planner.with_work = True  # as on a GPU with graphs: eager steps run the planner's work items
    prompts = [[5 + (i * 7 + j) % 200 for j in range(length)] for i, length in enumerate((20, 33))]
    outputs = engine.generate(prompts, SamplingParams(n=2, temperature=0, max_tokens=12, ignore_eos=True))
    for out in outputs:
        prompt = prompts[out.prompt_index]
        expected = reference.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=12, min_new_tokens=12,
                                      pad_token_id=0)[0, len(prompt):].tolist()
        if out.tokens != expected:
            return False
    return (engine.stats.fca_steps == engine.stats.decode_steps > 0 and engine.stats.mixed_steps == 2
            and _filtered_samples_match(engine, reference, prompts))


def _filtered_samples_match(engine, reference, prompts) -> bool:
    """Samples drawn with top-k, top-p and min-p by the kernels: each token's log-prob equals the
    reference model's filtered log-prob of it (teacher forced), within 1e-5."""
    from arctic_core.config import SamplingParams
    from arctic_fca.engine.sampling import RowParams, filtered_log_probs

    params = SamplingParams(n=2, temperature=0.9, top_k=6, top_p=0.8, min_p=0.02, max_tokens=8, ignore_eos=True,
                            seed=1)
    for out in engine.generate(prompts, params):
        prompt = prompts[out.prompt_index]
        logits = reference(torch.tensor([prompt + out.tokens])).logits[0, len(prompt) - 1 : -1]
        rows = logits.shape[0]
        filters = RowParams(temperature=torch.full((rows,), 0.9), top_k=torch.full((rows,), 6),
                            top_p=torch.full((rows,), 0.8), min_p=0.02)
        expected = filtered_log_probs(logits, filters).gather(-1, torch.tensor(out.tokens)[:, None]).squeeze(-1)
        if max_abs_diff(torch.tensor(out.logprobs), expected) > 1e-5:
            return False
    return True


if __name__ == "__main__":
    worst, cases = kernel_cases()
    static_worst, static_cases = static_work_cases()
    device_worst, device_cases = device_work_cases()
    plain_worst, plain_cases, plain_same = plain_work_cases()
    fused_worst, fused_cases = fused_op_cases()
    sampling = sampling_cases()
    print(json.dumps({"sampling": sampling,
                      "max_abs_diff": max(worst, static_worst, device_worst, plain_worst, fused_worst),
                      "cases": cases + static_cases + device_cases + plain_cases + fused_cases,
                      "plain_kernel_equals_torch_build": plain_same,
                      "engine_greedy_matches": engine_matches_generate()}))
