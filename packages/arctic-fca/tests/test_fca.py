"""FCA decode attention: plan structure, exactness against the plain computation, cost model, errors."""

from __future__ import annotations

import math
import random

import pytest
import torch
import torch.nn.functional as F
from arctic_fca.fca import (
    attention_with_lse,
    fca_attention_with_lse,
    paged_attention_with_lse,
    build_plan,
    choose,
    fca_decode_attention,
    paged_decode_attention,
    prepare_decode,
)

QWEN3_8B_HEADS = dict(num_q_heads=32, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16)


def make_batch(segments: dict[str, int], requests: list[tuple[tuple[str, ...], int]], block_size: int,
               num_q_heads: int = 4, num_kv_heads: int = 2, head_dim: int = 16, dtype=torch.float32, seed: int = 0,
               with_cache: bool = True) -> dict:
    """A paged decode batch laid out as a forest. ``segments`` maps a shared segment's name to its
    number of full blocks; each request is (path of segment names from the root, own suffix tokens).
    Block ids are a random permutation (non-contiguous) with spare blocks; table padding is -1."""
    gen = torch.Generator().manual_seed(seed)
    suffix_blocks = [math.ceil(suffix / block_size) for _, suffix in requests]
    num_blocks = sum(segments.values()) + sum(suffix_blocks) + 3
    free = iter(torch.randperm(num_blocks, generator=gen).tolist())
    segment_ids = {name: [next(free) for _ in range(n)] for name, n in segments.items()}
    rows = [[b for name in path for b in segment_ids[name]] + [next(free) for _ in range(n)]
            for (path, _), n in zip(requests, suffix_blocks, strict=True)]
    width = max(len(row) for row in rows) + 1
    batch = {
        "block_tables": torch.tensor([row + [-1] * (width - len(row)) for row in rows], dtype=torch.int32),
        "seq_lens": torch.tensor([sum(segments[s] for s in path) * block_size + suffix for path, suffix in requests],
                                 dtype=torch.int32),
    }
    if with_cache:
        cache_shape = (num_blocks, block_size, num_kv_heads, head_dim)
        batch["query"] = torch.randn(len(requests), num_q_heads, head_dim, generator=gen).to(dtype)
        batch["key_cache"] = torch.randn(cache_shape, generator=gen).to(dtype)
        batch["value_cache"] = torch.randn(cache_shape, generator=gen).to(dtype)
    return batch


def random_forest(seed: int, block_size: int) -> tuple[dict[str, int], list[tuple[tuple[str, ...], int]]]:
    """Roots (system prompts) -> optional group prompts -> samples, plus singletons; suffixes may be
    empty, prefixes may be one block."""
    rng = random.Random(seed)
    segments: dict[str, int] = {}
    requests: list[tuple[tuple[str, ...], int]] = []
    for root in range(rng.randint(1, 2)):
        segments[f"sys{root}"] = rng.randint(1, 3)
        for group in range(rng.randint(1, 3)):
            path = (f"sys{root}",)
            if rng.random() < 0.7:
                segments[f"prompt{root}.{group}"] = rng.randint(1, 2)
                path += (f"prompt{root}.{group}",)
            requests += [(path, rng.choice([0, 1, rng.randint(1, 2 * block_size)])) for _ in range(rng.randint(1, 4))]
    requests += [((), rng.randint(1, 3 * block_size)) for _ in range(rng.randint(0, 2))]
    rng.shuffle(requests)
    return segments, requests


def attention_args(batch: dict) -> tuple:
    return tuple(batch[k] for k in ("query", "key_cache", "value_cache", "block_tables", "seq_lens"))


def max_abs_diff(out: torch.Tensor, expected: torch.Tensor) -> float:
    """The largest ``|out - expected|``, or inf when either holds a NaN or an inf (a max taken over
    NaNs would otherwise read as a tiny difference)."""
    if not (torch.isfinite(out).all() and torch.isfinite(expected).all()):
        return math.inf
    return (out.float() - expected.float()).abs().max().item()


def test_max_abs_diff_never_reads_nan_as_small():
    ones = torch.ones(3)
    assert max_abs_diff(ones, ones + 1e-6) < 1e-5
    assert max_abs_diff(torch.full((3,), math.nan), ones) == math.inf
    assert max_abs_diff(ones, torch.tensor([1.0, math.inf, 1.0])) == math.inf
    assert max(0.0, max_abs_diff(torch.full((3,), math.nan), torch.full((3,), math.nan))) == math.inf


def sdpa_oracle(batch: dict, scale: float) -> torch.Tensor:
    """Per request, gather the KV token by token and run torch SDPA: independent of the paged code."""
    outs = []
    block_size, num_q_heads = batch["key_cache"].shape[1], batch["query"].shape[1]
    for r, seq_len in enumerate(batch["seq_lens"].tolist()):
        slots = [(int(batch["block_tables"][r, t // block_size]), t % block_size) for t in range(seq_len)]
        k, v = (torch.stack([cache[b, s] for b, s in slots]).float().transpose(0, 1)
                for cache in (batch["key_cache"], batch["value_cache"]))
        group = num_q_heads // k.shape[0]
        k, v = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)
        q = batch["query"][r].float()[:, None, :]
        outs.append(F.scaled_dot_product_attention(q, k, v, scale=scale)[:, 0])
    return torch.stack(outs)


# ----------------------------------------------------------------------------- the plan


def test_plan_depth_three_forest():
    batch = make_batch({"sys": 2, "a": 1, "b": 2},
                       [(("sys", "a"), 5), (("sys", "a"), 16), (("sys", "a"), 1), (("sys", "b"), 3),
                        (("sys", "b"), 20)],
                       block_size=16, with_cache=False)
    plan = build_plan(batch["block_tables"], batch["seq_lens"], 16)
    tables = batch["block_tables"]
    assert plan.num_nodes == 3
    assert plan.node_parent.tolist() == [-1, 0, 0]
    assert plan.node_requests(0) == [0, 1, 2, 3, 4] and plan.node_blocks(0) == tables[0, :2].tolist()
    assert plan.node_requests(1) == [0, 1, 2] and plan.node_blocks(1) == tables[0, 2:3].tolist()
    assert plan.node_requests(2) == [3, 4] and plan.node_blocks(2) == tables[3, 2:4].tolist()
    assert plan.suffix_block_start.tolist() == [3, 3, 3, 4, 4]
    assert plan.suffix_lens.tolist() == [5, 16, 1, 3, 20]
    assert plan.fca_kv_tokens() == 5 * 16 + 45 and plan.plain_kv_tokens() == int(batch["seq_lens"].sum())


def test_plan_singletons_have_only_a_suffix():
    batch = make_batch({}, [((), 40), ((), 1), ((), 16)], block_size=16, with_cache=False)
    plan = build_plan(batch["block_tables"], batch["seq_lens"], 16)
    assert plan.num_nodes == 0 and plan.num_node_rows == 0
    assert plan.suffix_block_start.tolist() == [0, 0, 0] and plan.suffix_lens.tolist() == [40, 1, 16]


def test_plan_only_full_blocks_are_shared():
    # Both point at blocks [10, 11, ...]; block 11 is partially filled for request 1, so only 10 is shared.
    tables = torch.tensor([[10, 11, 12], [10, 11, -1]], dtype=torch.int32)
    plan = build_plan(tables, torch.tensor([40, 20], dtype=torch.int32), 16)
    assert plan.num_nodes == 1 and plan.node_blocks(0) == [10] and plan.node_requests(0) == [0, 1]
    assert plan.suffix_block_start.tolist() == [1, 1] and plan.suffix_lens.tolist() == [24, 4]


def test_plan_empty_suffix_and_a_request_ending_inside_the_tree():
    # Request 0's whole sequence is the shared blocks [1, 2]; 1 and 2 share [1, 2, 3] and go on.
    tables = torch.tensor([[1, 2, -1, -1], [1, 2, 3, 4], [1, 2, 3, 5]], dtype=torch.int32)
    plan = build_plan(tables, torch.tensor([32, 50, 49], dtype=torch.int32), 16)
    assert [plan.node_blocks(n) for n in range(plan.num_nodes)] == [[1, 2], [3]]
    assert [plan.node_requests(n) for n in range(plan.num_nodes)] == [[0, 1, 2], [1, 2]]
    assert plan.suffix_block_start.tolist() == [2, 3, 3] and plan.suffix_lens.tolist() == [0, 2, 1]


def common_full_blocks(tables: torch.Tensor, full: list[int], a: int, b: int) -> int:
    """Leading full blocks requests ``a`` and ``b`` share."""
    shared = 0
    while shared < min(full[a], full[b]) and tables[a, shared] == tables[b, shared]:
        shared += 1
    return shared


@pytest.mark.parametrize("seed", range(30))
def test_plan_is_the_radix_tree_of_the_full_blocks(seed):
    """The tree's defining properties, whatever builds it: each node's requests are exactly those
    whose full blocks begin with the node's path, and they are >= 2; a request's nodes end where
    another request stops sharing with it, its suffix where the last one does; nodes come depth
    first, parents before children, siblings (and roots) by their first request."""
    rng = random.Random(seed)
    rows, width = rng.randint(1, 24), rng.randint(1, 8)
    # Two ids per column: prefixes shared at every depth, and equal ids after different prefixes
    # (the same id at the same position is not a shared prefix).
    tables = torch.tensor([[rng.choice([1, 1, 2]) * 100 + column for column in range(width)] for _ in range(rows)],
                          dtype=torch.int32)
    lens = torch.tensor([rng.randint(1, width * 16) for _ in range(rows)], dtype=torch.int32)
    plan = build_plan(tables, lens, 16)
    full = (lens // 16).tolist()
    common = [[common_full_blocks(tables, full, a, b) for b in range(rows)] for a in range(rows)]
    paths: list[list[int]] = []
    for node in range(plan.num_nodes):
        parent = int(plan.node_parent[node])
        assert parent < node
        paths.append((paths[parent] if parent >= 0 else []) + plan.node_blocks(node))
        end = len(paths[node])
        members = [r for r in range(rows) if full[r] >= end and tables[r, :end].tolist() == paths[node]]
        assert plan.node_requests(node) == members and len(members) >= 2
    for r in range(rows):
        ends = sorted(len(paths[n]) for n in range(plan.num_nodes) if r in plan.node_requests(n))
        assert ends == sorted({common[r][o] for o in range(rows) if o != r and common[r][o] > 0})
        assert int(plan.suffix_block_start[r]) == max([0] + [common[r][o] for o in range(rows) if o != r])
    children: dict[int, list[int]] = {}
    for node in range(plan.num_nodes):
        children.setdefault(int(plan.node_parent[node]), []).append(node)
    depth_first, stack = [], [-1]
    while stack:
        node = stack.pop()
        depth_first += [node] if node >= 0 else []
        stack += sorted(children.get(node, []), key=lambda n: plan.node_requests(n)[0], reverse=True)
    assert depth_first == list(range(plan.num_nodes))


def test_plan_tensors_are_flat_int32():
    segments, requests = random_forest(3, 16)
    batch = make_batch(segments, requests, 16, with_cache=False)
    plan = build_plan(batch["block_tables"], batch["seq_lens"], 16)
    for name in ("node_kv_indptr", "node_kv_indices", "node_q_indptr", "node_q_indices", "node_parent",
                 "suffix_block_start", "suffix_lens"):
        tensor = getattr(plan, name)
        assert tensor.dtype == torch.int32 and tensor.dim() == 1, name
    # Every request's KV is covered exactly once: its nodes' tokens plus its suffix.
    assert plan.plain_kv_tokens() == int(batch["seq_lens"].sum())


# ----------------------------------------------------------------------------- exactness


def test_attention_of_an_empty_part_is_zero_with_lse_minus_inf():
    q, k = torch.randn(2, 1, 3, 8), torch.randn(2, 1, 5, 8)
    out, lse = attention_with_lse(q, k, k, 0.3, kv_lens=torch.tensor([0, 5]))
    assert torch.equal(out[0], torch.zeros_like(out[0])) and torch.isneginf(lse[0]).all()
    assert torch.isfinite(out).all() and torch.isfinite(lse[1]).all()


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("heads", [(8, 2), (4, 4)], ids=["gqa", "mha"])
def test_fca_equals_plain_on_random_forests(block_size, heads):
    num_q_heads, num_kv_heads = heads
    for seed in range(6):
        segments, requests = random_forest(seed, block_size)
        batch = make_batch(segments, requests, block_size, num_q_heads, num_kv_heads, seed=seed)
        scale = 1 / math.sqrt(16)
        plain = paged_decode_attention(*attention_args(batch), scale)
        torch.testing.assert_close(plain, sdpa_oracle(batch, scale), atol=1e-5, rtol=0)
        torch.testing.assert_close(fca_decode_attention(*attention_args(batch), scale), plain, atol=1e-5, rtol=0)
        query, key_cache, value_cache, tables, lens = attention_args(batch)
        step = prepare_decode(tables, lens, block_size, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads,
                              head_dim=16, dtype=query.dtype)  # the cost model's pick, FCA or plain
        torch.testing.assert_close(step(query, key_cache, value_cache, scale), plain, atol=1e-5, rtol=0)


def test_fca_combined_lse_equals_the_whole_sequences_lse():
    """The merge returns each request's log-sum-exp over all its keys, not only its output: an
    engine that merges FCA with more attention (cascades of cascades) relies on it."""
    shared = 0
    for seed in range(6):
        segments, requests = random_forest(seed, 16)
        batch = make_batch(segments, requests, 16, num_q_heads=8, num_kv_heads=2, seed=seed)
        query, key_cache, value_cache, tables, lens = attention_args(batch)
        plan = build_plan(tables, lens, 16)
        shared += plan.num_nodes
        out, lse = fca_attention_with_lse(query, key_cache, value_cache, tables, 0.25, plan)
        starts = torch.zeros_like(lens)
        whole_out, whole_lse = paged_attention_with_lse(query, key_cache, value_cache, tables, starts, lens, 0.25)
        assert max_abs_diff(lse, whole_lse) < 1e-5 and max_abs_diff(out, whole_out) < 1e-5
    assert shared > 0  # the forests did share prefixes


def test_fca_with_a_reused_plan_and_only_shared_sequences():
    # Every sequence lies entirely in shared blocks: all suffixes are empty.
    batch = make_batch({"sys": 1, "p": 2}, [(("sys",), 0), (("sys", "p"), 0), (("sys", "p"), 0)], 16, 8, 2)
    plan = build_plan(batch["block_tables"], batch["seq_lens"], 16)
    assert plan.suffix_lens.tolist() == [0, 0, 0]
    out = fca_decode_attention(*attention_args(batch), 0.25, plan=plan)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, paged_decode_attention(*attention_args(batch), 0.25), atol=1e-5, rtol=0)


@pytest.mark.parametrize("dtype, tolerance", [(torch.bfloat16, 2e-2), (torch.float16, 2e-3)])
def test_low_precision_against_the_fp32_oracle(dtype, tolerance):
    segments, requests = random_forest(7, 16)
    batch = make_batch(segments, requests, 16, 8, 2, dtype=dtype, seed=7)
    as_fp32 = {k: (v.float() if v.is_floating_point() else v) for k, v in batch.items()}
    out = fca_decode_attention(*attention_args(batch), 0.25)
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), paged_decode_attention(*attention_args(as_fp32), 0.25),
                               atol=tolerance, rtol=tolerance)


# ----------------------------------------------------------------------------- cost model


def test_cost_model_plain_when_nothing_is_shared():
    batch = make_batch({}, [((), 4096)] * 8, 16, with_cache=False)
    assert choose(build_plan(batch["block_tables"], batch["seq_lens"], 16), **QWEN3_8B_HEADS) == "plain"


def test_cost_model_fca_for_a_large_prefix_shared_by_eight():
    batch = make_batch({"prompt": 256}, [(("prompt",), 256)] * 8, 16, with_cache=False)
    assert choose(build_plan(batch["block_tables"], batch["seq_lens"], 16), **QWEN3_8B_HEADS) == "fca"


def test_cost_model_plain_for_a_tiny_prefix_shared_by_two():
    batch = make_batch({"prompt": 1}, [(("prompt",), 256)] * 2, 16, with_cache=False)
    assert choose(build_plan(batch["block_tables"], batch["seq_lens"], 16), **QWEN3_8B_HEADS) == "plain"


# ----------------------------------------------------------------------------- errors


def _good_batch() -> dict:
    return make_batch({"p": 1}, [(("p",), 5), (("p",), 7)], 16, 8, 2)


def _bad(**changes) -> tuple:
    batch = _good_batch()
    batch.update(changes)
    return attention_args(batch)


@pytest.mark.parametrize("make_args, error, message", [
    (lambda b: _bad(query=b["query"][0]), ValueError, r"query must be \[num_requests, num_q_heads, head_dim\]"),
    (lambda b: _bad(query=b["query"].double()), TypeError, "query dtype must be one of"),
    (lambda b: _bad(key_cache=b["key_cache"].half()), TypeError, "key_cache dtype .* differs from query"),
    (lambda b: _bad(value_cache=b["value_cache"][:, :, :1]), ValueError, "value_cache shape"),
    (lambda b: _bad(query=b["query"][:, :5]), ValueError,
     r"num_q_heads \(5\) must be a multiple of num_kv_heads \(2\)"),
    (lambda b: _bad(query=b["query"][..., :8]), ValueError, "query head_dim 8 != key_cache head_dim 16"),
    (lambda b: _bad(block_tables=b["block_tables"].long()), TypeError, "block_tables must be int32"),
    (lambda b: _bad(seq_lens=b["seq_lens"][:1]), ValueError, "seq_lens has 1 requests but block_tables has 2"),
    (lambda b: _bad(seq_lens=torch.tensor([0, 7], dtype=torch.int32)), ValueError, "seq_lens must be >= 1"),
    (lambda b: _bad(seq_lens=torch.tensor([5, 100], dtype=torch.int32)), ValueError,
     r"seq_lens\[1\] = 100 exceeds the 3 blocks"),
    (lambda b: _bad(block_tables=b["block_tables"] + 1000), ValueError, "block ids outside"),
    (lambda b: _bad(key_cache=b["key_cache"][:, :8], value_cache=b["value_cache"][:, :8]), ValueError,
     "block_size must be a power of two >= 16, got 8"),
])
def test_clear_errors(make_args, error, message):
    args = make_args(_good_batch())
    for op in (paged_decode_attention, fca_decode_attention):
        with pytest.raises(error, match=message):
            op(*args, 0.25)


def test_a_plan_for_another_batch_is_refused():
    batch = _good_batch()
    other = make_batch({}, [((), 3)] * 3, 16, with_cache=False)
    with pytest.raises(ValueError, match="plan was built for 3 requests"):
        fca_decode_attention(*attention_args(batch), 0.25,
                             plan=build_plan(other["block_tables"], other["seq_lens"], 16))


def test_a_gpu_with_less_shared_memory_gets_fewer_pipeline_stages(monkeypatch):
    """The node launch asks for 5 pipeline stages (the H200's 227 KiB of shared memory per block
    hold them); where Triton cannot fit them it raises OutOfResources when compiling, and the
    launch steps down to what fits, remembered for the next call."""
    from triton.runtime.errors import OutOfResources

    from arctic_fca.fca import triton_decode
    from arctic_fca.fca.work import plan_work

    tried = []

    class SmallGpuKernel:  # stands in for the Triton kernel: compiles with at most 3 stages
        def __getitem__(self, grid):
            def launch(*args, num_stages, **kwargs):
                tried.append(num_stages)
                if num_stages > 3:
                    raise OutOfResources(num_stages * 32768, 3 * 32768, "shared memory")
            return launch

    monkeypatch.setattr(triton_decode, "_partial_attention", SmallGpuKernel())
    monkeypatch.setattr(triton_decode, "_fitted_stages", {})
    batch = make_batch({"p": 2}, [(("p",), 3)] * 4, 16)
    query, key_cache, value_cache, tables, lens = attention_args(batch)
    work = plan_work(build_plan(tables, lens, 16), tables, lens, 16, 4, 2, 16)
    for _ in range(2):
        triton_decode._launch(work.node, work, query, key_cache, value_cache, work.partial, work.lse, 0.25)
    assert work.tuning.node.num_stages == 5 and tried == [5, 4, 3, 3]  # the setting itself stays

