"""FCA work built on the device from block tables alone (``DeviceWorkBuilder``): the forest it
finds equals the host plan's, and the items it writes give exact attention, run by a torch
executor of the kernels' item semantics (the Triton kernels run the same items under the
interpreter in ``triton_interpreted.py``)."""

from __future__ import annotations

import pytest
import torch
from test_fca import attention_args, make_batch, random_forest

from arctic_fca.fca import attention_with_lse, build_plan, choose, merge_partials, paged_decode_attention
from arctic_fca.fca.cost_model import CostConstants
from arctic_fca.fca import device_work
from arctic_fca.fca.device_work import DeviceWorkBuilder

ALWAYS_FCA = CostConstants(per_call_overhead_s=0.0, per_node_overhead_s=0.0, min_speedup=0.0)


def builder_for(batch: dict, rows: int | None = None, costs: CostConstants = ALWAYS_FCA,
                **overrides) -> DeviceWorkBuilder:
    query, key_cache = batch["query"], batch["key_cache"]
    settings = dict(num_q_heads=query.shape[1], num_kv_heads=key_cache.shape[2], head_dim=query.shape[2],
                    kv_dtype=key_cache.dtype, device="cpu", costs=costs, num_sms=2)
    return DeviceWorkBuilder(rows or query.shape[0], batch["block_tables"].shape[1], key_cache.shape[0],
                             key_cache.shape[1], **{**settings, **overrides})


def execute(work, query, key_cache, value_cache, scale: float) -> torch.Tensor:
    """What the Triton kernels compute from the items, in fp32 torch: each item's query rows attend
    to its KV tokens (read page by page through kv_index), then each request merges its rows."""
    num_q_heads, block_size, num_kv_heads = query.shape[1], key_cache.shape[1], key_cache.shape[2]
    group = num_q_heads // num_kv_heads
    partial = torch.zeros(work.partial.shape[0], num_q_heads, query.shape[2])
    lse = torch.full(work.lse.shape, float("-inf"))
    for launch in (work.node, work.single):
        for kv_start, kv_len, q_start, q_count, out_row in launch.items[:, : int(launch.count)].T.tolist():
            tokens = torch.arange(kv_len)
            pages = work.kv_index[kv_start + tokens // block_size].long()
            k, v = (cache[pages, tokens % block_size].permute(1, 0, 2)[None] for cache in (key_cache, value_cache))
            requests = work.q_index[q_start : q_start + q_count].long()
            q = query[requests].reshape(q_count, num_kv_heads, group, -1).permute(1, 0, 2, 3).reshape(
                1, num_kv_heads, q_count * group, -1)
            out, item_lse = attention_with_lse(q, k, v, scale)
            rows = slice(out_row, out_row + q_count)
            partial[rows] = out[0].reshape(num_kv_heads, q_count, group, -1).permute(1, 0, 2, 3).reshape(
                q_count, num_q_heads, -1)
            lse[rows] = item_lse[0].reshape(num_kv_heads, q_count, group).permute(1, 0, 2).reshape(q_count, num_q_heads)
    num_requests = query.shape[0]
    row_request = torch.full((partial.shape[0],), -1)
    for request in range(num_requests):
        first, last = work.merge_indptr[request : request + 2].tolist()
        row_request[work.merge_rows[first:last].long()] = request
    used = row_request >= 0
    out = merge_partials(partial[used], lse[used], row_request[used], num_requests)[0]
    idle = torch.bincount(row_request[used], minlength=num_requests) == 0
    return out.masked_fill(idle[:, None, None], 0.0)  # as the merge kernel: a request with no rows gets zeros


def assert_decodes_exactly(work, query, key_cache, value_cache, tables, lens) -> None:
    """The items' attention (``execute``) equals plain paged decode in fp32."""
    expected = paged_decode_attention(query, key_cache, value_cache, tables, lens, 0.3)
    torch.testing.assert_close(execute(work, query, key_cache, value_cache, 0.3), expected, atol=1e-5, rtol=0)


def same_work(a, b, requests: int) -> bool:
    """Whether two builds wrote the same items and merge for ``requests`` rows."""
    total = int(a.merge_indptr[requests])
    return (all(int(x.count) == int(y.count) and torch.equal(x.items[:, : int(x.count)], y.items[:, : int(y.count)])
                for x, y in ((a.node, b.node), (a.single, b.single)))
            and torch.equal(a.merge_indptr[: requests + 1], b.merge_indptr[: requests + 1])
            and torch.equal(a.merge_rows[:total], b.merge_rows[:total]))


def forest_of_plan(plan) -> set:
    return {(tuple(plan.node_blocks(n)), tuple(plan.node_requests(n))) for n in range(plan.num_nodes)}


def forest_of_builder(builder: DeviceWorkBuilder, tables: torch.Tensor, lens: torch.Tensor) -> set:
    from arctic_fca.fca.device_work import _Forest

    forest = _Forest(tables.long(), lens.long(), builder.block_size, builder.num_blocks)
    nodes = set()
    for n in range(int(forest.num_nodes)):
        row, col, length = int(forest.node_row[n]), int(forest.node_col[n]), int(forest.node_len[n])
        start, size = int(forest.node_q_start[n]), int(forest.node_size[n])
        nodes.add((tuple(tables[row, col : col + length].tolist()),
                   tuple(forest.pair_request[start : start + size].tolist())))
    return nodes


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("seed", range(6))
def test_the_device_forest_is_the_host_plans_forest(seed, block_size):
    segments, requests = random_forest(seed, block_size)
    batch = make_batch(segments, requests, block_size, seed=seed)
    tables, lens = batch["block_tables"], batch["seq_lens"]
    plan = build_plan(tables, lens, block_size)
    assert forest_of_builder(builder_for(batch), tables, lens) == forest_of_plan(plan)


@pytest.mark.parametrize("chunk_range", [(256, 8192), (16, 16), (32, 64)], ids=["whole", "split-1-block", "split"])
@pytest.mark.parametrize("heads", [(4, 2), (4, 4), (8, 1)])
@pytest.mark.parametrize("seed", range(5))
def test_device_work_gives_exact_attention(seed, heads, chunk_range):
    segments, requests = random_forest(seed, 16)
    batch = make_batch(segments, requests, 16, num_q_heads=heads[0], num_kv_heads=heads[1], seed=seed)
    query, key_cache, value_cache, tables, lens = attention_args(batch)
    builder = builder_for(batch, chunk_range=chunk_range)
    work = builder.build(tables, lens)
    assert_decodes_exactly(work, query, key_cache, value_cache, tables, lens)
    has_nodes = build_plan(tables, lens, 16).num_nodes > 0
    assert bool(builder.used_fca) == has_nodes == (int(work.node.count) > 0)


def test_one_builder_serves_successive_steps_and_padded_rows():
    """Buffers are reused: a smaller batch after a larger one, padding rows (length 0) after the
    real ones, and table padding of 0 (vLLM's null block) instead of -1."""
    builder = None
    for seed in (1, 2, 3):
        segments, requests = random_forest(seed, 16)
        batch = make_batch(segments, requests, 16, seed=seed)
        query, key_cache, value_cache, tables, lens = attention_args(batch)
        rows, width = 24, 12
        padded_tables = torch.zeros(rows, width, dtype=torch.int32)
        padded_tables[: len(requests), : tables.shape[1]] = tables.clamp(min=0)
        padded_lens = torch.zeros(rows, dtype=torch.int32)
        padded_lens[: len(requests)] = lens
        big_cache = [torch.cat([c, torch.randn(40, *c.shape[1:])]) for c in (key_cache, value_cache)]
        builder = builder or builder_for({**batch, "block_tables": padded_tables, "key_cache": big_cache[0]}, rows=rows)
        work = builder.build(padded_tables, padded_lens)
        padded_query = torch.cat([query, torch.randn(rows - len(requests), *query.shape[1:])])
        out = execute(work, padded_query, *big_cache, 0.3)[: len(requests)]
        expected = paged_decode_attention(query, key_cache, value_cache, tables.clamp(min=0), lens, 0.3)
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=0)


def test_a_build_rests_on_its_inputs_alone_not_on_what_its_buffers_held():
    """vLLM's sleep mode can hand the builder's memory back holding other bytes: every buffer the
    kernels read must be written by each build. Fill them all with garbage first."""
    segments, requests = random_forest(5, 16)
    batch = make_batch(segments, requests, 16, seed=5)
    query, key_cache, value_cache, tables, lens = attention_args(batch)
    builder = builder_for(batch)
    work = builder.work
    for buffer in (work.q_index, work.node.items, work.node.count, work.single.items, work.single.count,
                   work.merge_indptr, work.merge_rows, builder.tables_in, builder.lens_in):
        buffer.fill_(7)
    work.partial.fill_(float("nan"))
    work.lse.fill_(float("nan"))
    assert_decodes_exactly(builder.build(tables, lens), query, key_cache, value_cache, tables, lens)


def unshared_batch(seed: int, rows: int = 0) -> dict:
    """Requests that share no block (singletons of random lengths, some under one block), padded
    with ``rows`` rows of length 0 and vLLM's null block."""
    rng = torch.Generator().manual_seed(seed)
    requests = [((), int(n)) for n in torch.randint(1, 90, (7,), generator=rng)]
    batch = make_batch({}, requests, 16, seed=seed)
    batch["block_tables"] = torch.nn.functional.pad(batch["block_tables"].clamp(min=0), (0, 0, 0, rows))
    batch["seq_lens"] = torch.nn.functional.pad(batch["seq_lens"], (0, rows))
    batch["query"] = torch.cat([batch["query"], torch.randn(rows, *batch["query"].shape[1:])])
    return batch


@pytest.mark.parametrize("chunk_range", [(256, 8192), (16, 16)], ids=["whole", "split-1-block"])
def test_a_build_told_nothing_is_shared_writes_what_the_full_build_writes(chunk_range):
    """``shared=False`` skips the forest search; its work must be the full build's plain choice."""
    batch = unshared_batch(seed=3, rows=2)
    query, key_cache, value_cache, tables, lens = attention_args(batch)
    full = builder_for(batch, chunk_range=chunk_range).build(tables, lens)
    plain_builder = builder_for(batch, chunk_range=chunk_range)
    plain = plain_builder.build(tables, lens, shared=False)
    assert int(plain.node.count) == int(full.node.count) == 0 and not bool(plain_builder.used_fca)
    assert same_work(plain, full, tables.shape[0])
    out = execute(plain, query, key_cache, value_cache, 0.3)
    real = int((lens > 0).sum())
    expected = paged_decode_attention(query[:real], key_cache, value_cache, tables[:real], lens[:real], 0.3)
    torch.testing.assert_close(out[:real], expected, atol=1e-5, rtol=0)
    assert (out[real:] == 0).all()  # padding rows: no items, zeros


def test_shared_and_unshared_builds_take_turns_on_one_builder():
    """An engine's batches alternate between the two builds: neither may rest on what the other
    left in the buffers (a forest's node items, a plain step's row order)."""
    forest = make_batch(*random_forest(2, 16), 16, seed=2)
    alone = unshared_batch(seed=4)
    width = max(forest["block_tables"].shape[1], alone["block_tables"].shape[1])
    for batch in (forest, alone):
        batch["block_tables"] = torch.nn.functional.pad(batch["block_tables"].clamp(min=0),
                                                        (0, width - batch["block_tables"].shape[1]))
    cache = [torch.cat([forest[k], alone[k]]) for k in ("key_cache", "value_cache")]
    alone["block_tables"] = alone["block_tables"] + forest["key_cache"].shape[0]  # its blocks follow the forest's
    rows = max(forest["query"].shape[0], alone["query"].shape[0])
    builder = builder_for({**forest, "key_cache": cache[0]}, rows=rows)
    for batch, shared in ((forest, True), (alone, False), (forest, True), (alone, False)):
        query, _, _, tables, lens = attention_args(batch)
        assert_decodes_exactly(builder.build(tables, lens, shared=shared), query, *cache, tables, lens)
        assert bool(builder.used_fca) == shared


@pytest.mark.parametrize("breach", ["another column", "another parent"])
def test_tables_that_break_the_prefix_property_decode_plain_and_exact(breach):
    """One physical block must mean one prefix: the same block at two columns, or under two
    different parent blocks, is not a prefix forest, so the batch decodes without nodes."""
    batch = make_batch({"p": 2}, [(("p",), 5), (("p",), 9), ((), 40)], 16, seed=4)
    query, key_cache, value_cache, tables, lens = attention_args(batch)
    tables = tables.clone()
    if breach == "another column":
        tables[2, 1] = tables[0, 0]
    else:
        tables[2, 1] = tables[0, 1]  # same column, but the singleton's block 0 is its own
    builder = builder_for(batch)
    work = builder.build(tables, lens)
    assert not bool(builder.used_fca) and int(work.node.count) == 0
    assert_decodes_exactly(work, query, key_cache, value_cache, tables, lens)


def test_a_node_shared_by_more_requests_than_a_tile_is_served_in_several_tiles():
    batch = make_batch({"sys": 1, "p": 3}, [(("sys", "p"), 1 + i % 20) for i in range(20)] + [(("sys",), 7)] * 3,
                       16, num_q_heads=8, num_kv_heads=1, seed=2)
    query, key_cache, value_cache, tables, lens = attention_args(batch)
    builder = builder_for(batch, chunk_range=(16, 16))
    work = builder.build(tables, lens)
    assert builder.per_tile == 8 and int(work.node.items[3, : int(work.node.count)].max()) == 8
    assert_decodes_exactly(work, query, key_cache, value_cache, tables, lens)


def test_the_device_choice_is_the_host_cost_models():
    """Same prices, same choice, batch by batch (the constants are set so that both choices occur)."""
    costs = CostConstants(per_call_overhead_s=0.0, per_node_overhead_s=0.0, min_speedup=1.5)
    choices = []
    for seed in range(12):
        segments, requests = random_forest(seed, 16)
        batch = make_batch(segments, requests, 16, num_q_heads=8, num_kv_heads=2, head_dim=64, seed=seed)
        builder = builder_for(batch, costs=costs)
        builder.build(batch["block_tables"], batch["seq_lens"])
        plan = build_plan(batch["block_tables"], batch["seq_lens"], 16)
        host = choose(plan, 8, 2, 64, torch.float32, costs)
        assert bool(builder.used_fca) == (host == "fca"), seed
        choices.append(host)
    assert set(choices) == {"fca", "plain"}


def test_the_cost_model_and_the_pair_capacity_can_choose_plain(monkeypatch):
    segments = {"a": 1}
    batch = make_batch(segments, [(("a",), 3), (("a",), 3)], 16, seed=0)
    tables, lens = batch["block_tables"], batch["seq_lens"]
    default_costs = builder_for(batch, costs=CostConstants())
    default_costs.build(tables, lens)
    assert not bool(default_costs.used_fca)  # one block shared by two: the fixed costs outweigh it
    deep = make_batch({"a": 1, "b": 1, "c": 1, "d": 1, "e": 1},
                      [(("a", "b", "c", "d", "e"), 2)] * 2 + [(("a", "b", "c", "d"), 2)]
                      + [(("a", "b", "c"), 2), (("a", "b"), 2), (("a",), 2)], 16, seed=0)
    builder = builder_for(deep)
    builder.build(deep["block_tables"], deep["seq_lens"])
    assert bool(builder.used_fca)
    monkeypatch.setattr(device_work, "PAIRS_PER_REQUEST", 1)  # 6 pair slots, fewer than the forest's 20 pairs
    builder.build(deep["block_tables"], deep["seq_lens"])
    assert not bool(builder.used_fca)


def decode_steps(seed: int, growth: int) -> tuple[dict, list[torch.Tensor]]:
    """A forest whose requests then decode ``growth`` tokens each: tables hold the final blocks,
    and the sequence lengths of every step from the first on."""
    segments, requests = random_forest(seed, 16)
    batch = make_batch(segments, [(path, suffix + growth) for path, suffix in requests], 16, seed=seed)
    return batch, [batch["seq_lens"] - growth + step for step in range(growth + 1)]


@pytest.mark.parametrize("costs", [ALWAYS_FCA, CostConstants(min_speedup=1e9)], ids=["fca", "plain"])
@pytest.mark.parametrize("seed", range(4))
def test_decode_steps_of_the_same_requests_reuse_their_forest_and_write_the_full_builds_work(seed, costs):
    """With the same ``forest_key`` the builder keeps the first step's forest and writes only the
    single items and the merge: each step's work equals a full build's, bit for bit, and exact."""
    batch, steps = decode_steps(seed, growth=40)  # 40 tokens: suffixes cross two block boundaries
    query, key_cache, value_cache, tables, _ = attention_args(batch)
    reusing, searching = builder_for(batch, costs=costs), builder_for(batch, costs=costs)
    for lens in steps:
        work = reusing.build(tables, lens, forest_key="these requests")
        assert same_work(work, searching.build(tables, lens), tables.shape[0])
        assert_decodes_exactly(work, query, key_cache, value_cache, tables, lens)
    assert reusing.builds == {"forest": 1, "reuse": len(steps) - 1, "plain": 0}
    assert bool(reusing.used_fca) == bool(searching.used_fca)


def test_a_new_key_a_plain_step_or_the_refresh_count_brings_back_the_full_search(monkeypatch):
    monkeypatch.setattr(device_work, "REFRESH_BUILDS", 2)
    batch, steps = decode_steps(1, growth=8)
    tables = batch["block_tables"]
    builder = builder_for(batch)
    kinds = []
    for lens, key, shared in zip(steps, ["a", "a", "b", "b", "b", "b", "b", "b", "b"],
                                 [True, True, True, True, False, True, True, True, True], strict=True):
        before = dict(builder.builds)
        builder.build(tables, lens, shared=shared, forest_key=key)
        kinds += [kind for kind in before if builder.builds[kind] > before[kind]]
    assert kinds == ["forest", "reuse", "forest", "reuse", "plain", "forest", "reuse", "reuse", "forest"]
    # The same key over fewer rows is another batch: searched afresh.
    builder.build(tables[:-1], steps[-1][:-1], forest_key="b")
    assert builder.builds["forest"] == 5


@pytest.mark.parametrize("even", [True, False])
def test_a_long_shared_prefix_is_cut_into_pieces_of_equal_length(even):
    # A 21-block prefix (336 tokens) shared by 4 samples, split length 128: three pieces of 112 tokens
    # (even), or 128 + 128 + 80. The host's and the device's builds cut alike, and both are exact.
    from arctic_fca.fca.tuning import DEFAULT_TUNING
    from arctic_fca.fca.work import plan_work

    tuning = DEFAULT_TUNING.replace(even_pieces=even)
    batch = make_batch({"prompt": 21}, [(("prompt",), n) for n in (3, 17, 9, 30)], 16)
    query, key_cache, value_cache, tables, lens = attention_args(batch)
    expected = [112, 112, 112] if even else [128, 128, 80]
    device = builder_for(batch, chunk_range=(128, 128), tuning=tuning).build(tables, lens)
    host = plan_work(build_plan(tables, lens, 16), tables, lens, 16, query.shape[1], key_cache.shape[2],
                     query.shape[2], chunk=128, tuning=tuning)
    for work in (device, host):
        assert work.node.items[1, : int(work.node.count)].tolist() == expected
        assert_decodes_exactly(work, query, key_cache, value_cache, tables, lens)
