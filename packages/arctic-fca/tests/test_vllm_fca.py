"""FCA's vLLM backend additions (``arctic_fca.vllm.fca``) on stand-in vLLM bases, on the CPU: which
batches and layers take the FCA path, and that the path reads vLLM's cache layout and writes
vLLM's output buffer exactly. (The kernels are replaced by the torch executor of their items from
``test_device_work``; the interpreter runs the kernels themselves in ``triton_interpreted.py``.)"""

from __future__ import annotations

import enum
import functools
import types

import numpy as np
import pytest
import torch
from test_device_work import ALWAYS_FCA, execute
from test_fca import attention_args, make_batch, random_forest

from arctic_fca.vllm import fca as vllm_fca
from arctic_fca.vllm import host_tables as vllm_host_tables
from arctic_fca.fca import paged_decode_attention
from arctic_fca.fca.device_work import DeviceWorkBuilder

HEADS, KV_HEADS, HEAD_DIM, SCALE = 4, 2, 16, 0.3


class CGSupport(enum.Enum):  # vLLM's AttentionCGSupport
    ALWAYS, UNIFORM_BATCH, UNIFORM_SINGLE_TOKEN_DECODE, NEVER = 3, 2, 1, 0


class BaseBuilder:
    """Stands in for a vLLM metadata builder: its metadata is a plain object."""

    _cudagraph_support = CGSupport.ALWAYS  # FlashAttention 3's

    @classmethod
    def get_cudagraph_support(cls, vllm_config, kv_cache_spec):
        return cls._cudagraph_support

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device) -> None:
        pass

    def build(self, common_prefix_len, common_attn_metadata, fast_build=False):
        cam = common_attn_metadata
        return types.SimpleNamespace(use_cascade=common_prefix_len > 0, num_actual_tokens=cam.num_actual_tokens,
                                     num_reqs=cam.num_reqs, query_start_loc=cam.query_start_loc,
                                     seq_lens=cam.seq_lens, block_table=cam.block_table_tensor)


class BaseImpl:
    """Stands in for vLLM's FlashAttention impl: the attributes FCA reads, and a forward that
    marks the output so a test can see it ran."""

    def __init__(self, num_heads, head_size, scale, num_kv_heads, alibi_slopes, sliding_window, kv_cache_dtype,
                 logits_soft_cap=None, attn_type="decoder") -> None:
        self.num_heads, self.head_size, self.scale = num_heads, head_size, scale
        self.alibi_slopes, self.kv_cache_dtype, self.attn_type = alibi_slopes, kv_cache_dtype, attn_type
        self.sliding_window = (-1, -1) if sliding_window is None else (sliding_window - 1, 0)
        self.logits_soft_cap, self.sinks, self.dcp_world_size = logits_soft_cap or 0, None, 1

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, output_scale=None,
                output_block_scale=None):
        return output.fill_(-1.0)


class PagedBaseImpl(BaseImpl):
    """A base that computes causal paged attention from its metadata, query by query (each
    request's queries are the last tokens of its sequence), so a split batch can be checked whole."""

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, output_scale=None,
                output_block_scale=None):
        key_cache, value_cache = kv_cache.unbind(1)
        starts, block_size = attn_metadata.query_start_loc.tolist(), key_cache.shape[1]
        for r in range(attn_metadata.num_reqs):
            length, queries = int(attn_metadata.seq_lens[r]), starts[r + 1] - starts[r]
            blocks = attn_metadata.block_table[r, : -(-length // block_size)].long()
            k, v = (cache[blocks].reshape(-1, KV_HEADS, HEAD_DIM)[:length].repeat_interleave(HEADS // KV_HEADS, 1)
                    .transpose(0, 1) for cache in (key_cache, value_cache))
            q = query[starts[r] : starts[r + 1]].view(queries, HEADS, HEAD_DIM).transpose(0, 1)
            visible = torch.arange(length)[None, :] <= torch.arange(length - queries, length)[:, None]
            out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=visible, scale=self.scale)
            output[starts[r] : starts[r + 1]] = out.transpose(0, 1).reshape(queries, HEADS * HEAD_DIM)
        return output


Builder = type("Builder", (vllm_fca.FCABuilderMixin, BaseBuilder), {})
Impl = type("Impl", (vllm_fca.FCAImplMixin, BaseImpl), {})
PagedImpl = type("PagedImpl", (vllm_fca.FCAImplMixin, PagedBaseImpl), {})


@pytest.fixture
def step(monkeypatch):
    """A padded decode step of a random forest, as vLLM hands it over: a builder, its metadata
    inputs, the FA cache layout [blocks, 2, block, kv_heads, dim] and the query/output buffers."""
    monkeypatch.setattr(vllm_fca, "DeviceWorkBuilder", functools.partial(DeviceWorkBuilder, costs=ALWAYS_FCA,
                                                                         num_sms=2))
    monkeypatch.setattr(vllm_fca, "triton_decode_attention",
                        lambda q, k, v, work, scale, out: out.copy_(execute(work, q, k, v, scale)))
    segments, requests = random_forest(4, 16)
    batch = make_batch(segments, requests, 16, num_q_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM, seed=4)
    query, key_cache, value_cache, tables, lens = attention_args(batch)
    rows = len(requests) + 3  # padded like a CUDA-graph batch: length 0, null blocks
    padded_tables = torch.zeros(rows, tables.shape[1] + 2, dtype=torch.int32)
    padded_tables[: len(requests), : tables.shape[1]] = tables.clamp(min=0)
    padded_lens = torch.zeros(rows, dtype=torch.int32)
    padded_lens[: len(requests)] = lens
    kv_cache = torch.stack([key_cache, value_cache], dim=1)
    layers = {"layers.0.attn": types.SimpleNamespace(
        impl=PagedImpl(HEADS, HEAD_DIM, SCALE, KV_HEADS, None, None, "auto"), kv_cache=kv_cache)}
    config = types.SimpleNamespace(
        scheduler_config=types.SimpleNamespace(max_num_seqs=rows), compilation_config=types.SimpleNamespace(
            max_cudagraph_capture_size=None, static_forward_context=layers),
        cache_config=types.SimpleNamespace(num_gpu_blocks=key_cache.shape[0]),
        model_config=types.SimpleNamespace(get_num_attention_heads=lambda parallel: HEADS), parallel_config=None)
    spec = types.SimpleNamespace(block_size=16, num_kv_heads=KV_HEADS, head_size=HEAD_DIM, dtype=torch.float32)
    cam = decode_metadata(padded_tables, padded_lens)
    expected = paged_decode_attention(query, key_cache, value_cache, tables.clamp(min=0), lens, SCALE)
    return types.SimpleNamespace(builder=Builder(spec, list(layers), config, "cpu"), cam=cam, real=len(requests),
                                 query=torch.cat([query, torch.randn(3, HEADS, HEAD_DIM)]), expected=expected,
                                 kv_cache=kv_cache, layers=layers)


def decode_metadata(tables: torch.Tensor, lens: torch.Tensor, query_lens: list[int] | None = None):
    """Stands in for vLLM's CommonAttentionMetadata (the fields FCA and the stand-in base read)."""
    query_lens = query_lens or [1] * len(lens)
    starts = torch.tensor([0, *np.cumsum(query_lens)], dtype=torch.int32)
    tokens = int(starts[-1])
    return types.SimpleNamespace(
        max_query_len=max(query_lens), num_reqs=len(lens), num_actual_tokens=tokens, causal=True,
        block_table_tensor=tables, seq_lens=lens, query_start_loc=starts, query_start_loc_cpu=starts.clone(),
        slot_mapping=torch.arange(tokens), positions=None, is_prefilling=None, seq_lens_cpu_upper_bound=lens.clone(),
        _seq_lens_cpu=None, _num_computed_tokens_cpu=None, _num_computed_tokens_cache=None)


def assert_exact(step, output: torch.Tensor) -> None:
    torch.testing.assert_close(output[: step.real].view(step.real, HEADS, HEAD_DIM), step.expected, atol=1e-5, rtol=0)


def run(step, meta, impl=None):
    output = torch.full((step.query.shape[0], HEADS * HEAD_DIM), 7.0)
    impl = impl or Impl(HEADS, HEAD_DIM, SCALE, KV_HEADS, None, None, "auto")
    return impl.forward(None, step.query, None, None, step.kv_cache, meta, output)


def test_a_decode_batch_runs_fca_on_vllms_cache_layout_and_output_buffer(step):
    meta = step.builder.build(0, step.cam)
    assert meta.fca is not None and meta.fca_block_size == 16
    output = run(step, meta)
    assert_exact(step, output)
    assert (output[step.real :] == 0).all()  # padding rows: zeros, nothing read out of bounds


@pytest.mark.parametrize("host_sees", ["the forest", "nothing shared", "nothing"])
def test_a_batch_the_host_sees_share_nothing_is_built_without_the_forest_search(step, host_sees):
    """The host's first blocks decide: all different -> plain at once; else (or unknown) the device
    searches for the forest. Exact either way (here the device's tables do hold a forest)."""
    first = step.cam.block_table_tensor[: step.real, 0].numpy()
    step.builder.host_step = {"the forest": lambda: vllm_fca.HostStep(first, None), "nothing": lambda: None,
                              "nothing shared": lambda: vllm_fca.HostStep(np.arange(step.real), None)}[host_sees]
    meta = step.builder.build(0, step.cam)
    assert bool(step.builder.work_builder.used_fca) == (host_sees != "nothing shared")
    output = run(step, meta)
    assert_exact(step, output)


def test_a_host_view_that_fails_is_dropped_and_the_device_searches(step, caplog):
    def moved():
        raise AttributeError("'GPUModelRunner' object has no attribute 'input_batch'")

    step.builder.host_step = moved
    for _ in range(2):  # the second step no longer asks the host
        output = run(step, step.builder.build(0, step.cam))
        assert_exact(step, output)
    assert step.builder.host_step is None and bool(step.builder.work_builder.used_fca)
    assert caplog.text.count("cannot be read") == 1 and "no attribute 'input_batch'" in caplog.text


def v1_runner(builders: list, host_table: np.ndarray, num_reqs: int):
    """Stands in for vLLM's V1 GPU model runner: its input batch's host copy of the block table."""
    block_table = types.SimpleNamespace(block_table=types.SimpleNamespace(np=host_table))
    return runner_holding(builders, input_batch=types.SimpleNamespace(block_table=[block_table], num_reqs=num_reqs))


def runner_holding(builders: list, **parts):
    """A stand-in model runner whose one KV-cache group's attention groups hold ``builders``."""
    return types.SimpleNamespace(attn_groups=[[types.SimpleNamespace(metadata_builders=builders)]], **parts)


class V2BlockTables:
    """Stands in for the V2 runner's ``BlockTables``: ids staged per request slot, counted on the host."""

    def __init__(self, max_num_reqs: int) -> None:
        self.block_tables, self.max_num_reqs = [None], max_num_reqs
        self.num_blocks = types.SimpleNamespace(np=np.zeros((1, max_num_reqs), dtype=np.int32))
        self.staged = []

    def append_block_ids(self, req_index, new_block_ids, overwrite):
        start = 0 if overwrite else self.num_blocks.np[0, req_index]
        self.staged.append((req_index, start, list(new_block_ids[0])))
        self.num_blocks.np[0, req_index] = start + len(new_block_ids[0])


def test_v1_runners_first_blocks_are_its_host_tables_first_column(step):
    host = np.array([[4, 1], [9, 2], [4, 3], [4, 5]], dtype=np.int32)  # the last row: stale padding
    other = BaseBuilder(None, [], None, "cpu")
    assert vllm_host_tables.attach_host_tables(v1_runner([step.builder, other], host, num_reqs=3)) == 1
    assert step.builder.host_step().first_blocks.tolist() == [4, 9, 4]
    assert step.builder.host_step().requests is None  # V1 names no requests: no forest is reused
    assert not hasattr(other, "host_step")


def test_v2_runners_first_blocks_are_recorded_as_it_appends_block_ids(step):
    tables = V2BlockTables(max_num_reqs=8)
    runner = runner_holding([step.builder], block_tables=tables, prepare_attn=lambda batch: "attn",
                            prepare_dummy_attn=lambda batch: "dummy")
    assert vllm_host_tables.attach_host_tables(runner) == 1
    assert step.builder.host_step() is None  # no step prepared yet
    tables.append_block_ids(3, ([7, 8],), overwrite=True)
    tables.append_block_ids(5, ([9],), overwrite=True)
    assert runner.prepare_attn(types.SimpleNamespace(idx_mapping_np=np.array([5, 3]))) == "attn"
    before = step.builder.host_step()
    tables.append_block_ids(3, ([10],), overwrite=False)  # a decode step's new block: not the first
    now = step.builder.host_step()
    assert now.first_blocks.tolist() == [9, 7] and now.requests.tolist() == before.requests.tolist()
    assert tables.staged == [(3, 0, [7, 8]), (5, 0, [9]), (3, 2, [10])]  # vLLM's own bookkeeping runs on
    tables.append_block_ids(3, ([11],), overwrite=True)  # the slot handed to a new request
    after = step.builder.host_step()
    assert after.first_blocks.tolist() == [9, 11] and after.requests[0] == now.requests[0] != after.requests[1]
    tables.append_block_ids(3, ([7],), overwrite=True)  # another request with the old one's first block
    assert step.builder.host_step().requests[1] not in (now.requests[1], after.requests[1])
    assert runner.prepare_dummy_attn(None) == "dummy" and step.builder.host_step() is None


def test_a_runner_of_unknown_shape_gets_nothing_attached(step, caplog):
    runner = runner_holding([step.builder])
    assert vllm_host_tables.attach_host_tables(runner) == 0 and step.builder.host_step is None
    assert "searched for shared prefixes on the device" in caplog.text


def test_the_worker_extension_attaches_the_host_tables(step):
    """What the sampler's ``collective_rpc("arctic_fca_attach_host_tables")`` runs in each worker."""
    from arctic_fca.vllm.worker import ArcticWorkerExtension

    worker = ArcticWorkerExtension.__new__(ArcticWorkerExtension)  # vLLM mixes it into its worker
    worker.model_runner = v1_runner([step.builder], np.zeros((4, 2), dtype=np.int32), num_reqs=2)
    assert worker.arctic_fca_attach_host_tables() == 1 and step.builder.host_step().first_blocks.tolist() == [0, 0]


def test_requests_share_a_block_only_if_they_share_their_first():
    assert vllm_fca.shares_a_block(np.array([5, 9, 5]))
    assert not vllm_fca.shares_a_block(np.array([5, 9, 7]))
    assert not vllm_fca.shares_a_block(np.array([], dtype=np.int32))


@pytest.mark.parametrize("change", ["prefill", "cascade", "one request", "not causal"])
def test_other_batches_go_to_the_base_backend(step, change):
    cam = step.cam
    if change == "prefill":
        cam.max_query_len = 4
    elif change == "one request":
        cam.num_reqs = 1
    elif change == "not causal":
        cam.causal = False
    meta = step.builder.build(16 if change == "cascade" else 0, cam)
    assert meta.fca is None and (run(step, meta) == -1).all()


@pytest.mark.parametrize("layer", [dict(sliding_window=64), dict(alibi_slopes=[0.5] * HEADS),
                                   dict(logits_soft_cap=30.0), dict(kv_cache_dtype="fp8"),
                                   dict(attn_type="encoder_decoder")], ids=lambda d: next(iter(d)))
def test_layers_fca_cannot_run_exactly_go_to_the_base_backend(step, layer):
    settings = dict(num_heads=HEADS, head_size=HEAD_DIM, scale=SCALE, num_kv_heads=KV_HEADS, alibi_slopes=None,
                    sliding_window=None, kv_cache_dtype="auto") | layer
    impl = Impl(**settings)
    assert not impl.fca_exact
    assert (run(step, step.builder.build(0, step.cam), impl) == -1).all()


def test_a_cache_with_another_block_size_goes_to_the_base_backend(step):
    meta = step.builder.build(0, step.cam)
    meta.fca_block_size = 32  # as if vLLM had split its blocks into kernel blocks of another size
    assert (run(step, meta) == -1).all()


def mixed_batch(step):
    """The step's decode rows, then two prefill chunks (the last 5 and 3 tokens of two of its
    sequences, whose KV is in the cache: vLLM writes a step's KV before attention runs)."""
    real = step.real
    tables, lens = step.cam.block_table_tensor[:real], step.cam.seq_lens[:real]
    long_rows = [r for r in range(real) if lens[r] >= 5][:2]
    cam = decode_metadata(torch.cat([tables, tables[long_rows]]), torch.cat([lens, lens[long_rows]]),
                          query_lens=[1] * real + [5, 3])
    query = torch.randn(cam.num_actual_tokens, HEADS, HEAD_DIM)
    query[:real] = step.query[:real]
    return cam, query


def test_a_mixed_batchs_decode_rows_run_fca_and_the_rest_the_base_exactly(step):
    cam, query = mixed_batch(step)
    meta = step.builder.build(0, cam)
    assert meta.fca is not None and meta.fca_split and meta.fca_rows == step.real
    assert meta.num_reqs == 2 and meta.query_start_loc.tolist() == [0, 5, 8]  # the base's part: the prefills
    assert step.builder.steps == {"decode": 0, "mixed": 1, "base": 0} and bool(step.builder.work_builder.used_fca)
    impl = step.layers["layers.0.attn"].impl
    output = impl.forward(None, query, None, None, step.kv_cache, meta, torch.full((len(query), HEADS * HEAD_DIM), 7.0))
    whole = PagedBaseImpl.forward(impl, None, query, None, None, step.kv_cache, BaseBuilder.build(None, 0, cam),
                                  torch.zeros(len(query), HEADS * HEAD_DIM))
    torch.testing.assert_close(output, whole, atol=1e-5, rtol=0)
    assert_exact(step, output)


@pytest.mark.parametrize("layer", ["cannot run FCA", "cache not bound yet"])
def test_a_mixed_batch_stays_whole_unless_every_layer_of_the_builder_runs_fca(step, layer):
    entry = step.layers["layers.0.attn"]
    if layer == "cannot run FCA":
        entry.impl = Impl(HEADS, HEAD_DIM, SCALE, KV_HEADS, None, 64, "auto")  # sliding window
    else:
        entry.kv_cache = torch.tensor([])
    cam, _ = mixed_batch(step)
    meta = step.builder.build(0, cam)
    assert meta.fca is None and not meta.fca_split and meta.num_reqs == cam.num_reqs
    assert step.builder.layers_run_fca is (False if layer == "cannot run FCA" else None)  # unbound: asked again


def test_a_split_batch_at_a_layer_that_cannot_run_fca_is_an_error_not_a_wrong_answer(step):
    cam, query = mixed_batch(step)
    meta = step.builder.build(0, cam)
    impl = Impl(HEADS, HEAD_DIM, SCALE, KV_HEADS, None, 64, "auto")
    with pytest.raises(RuntimeError, match="cannot run FCA"):
        impl.forward(None, query, None, None, step.kv_cache, meta, torch.zeros(len(query), HEADS * HEAD_DIM))


def test_the_same_requests_as_the_last_step_reuse_its_forest(step):
    """The host names the requests (V2: a new id per slot whenever a request enters it)."""
    first = step.cam.block_table_tensor[: step.real, 0].numpy()
    ids = np.arange(step.real) + 100
    step.builder.host_step = lambda: vllm_fca.HostStep(first, ids)
    for _ in range(2):
        assert_exact(step, run(step, step.builder.build(0, step.cam)))
    ids = ids + 1  # other requests in the same slots
    assert_exact(step, run(step, step.builder.build(0, step.cam)))
    assert step.builder.work_builder.builds == {"forest": 2, "reuse": 1, "plain": 0}


def test_the_worker_extension_reports_how_fcas_batches_went(step):
    from arctic_fca.vllm.worker import ArcticWorkerExtension

    worker = ArcticWorkerExtension.__new__(ArcticWorkerExtension)
    worker.model_runner = runner_holding([step.builder, BaseBuilder(None, [], None, "cpu")])
    assert worker.arctic_fca_stats() == {"decode": 0, "mixed": 0, "base": 0}  # no work builder yet
    step.builder.build(0, step.cam)
    step.builder.build(0, mixed_batch(step)[0])
    assert worker.arctic_fca_stats() == {"decode": 1, "mixed": 1, "base": 0, "forest": 2, "reuse": 0, "plain": 0}


@pytest.mark.parametrize("base, ours", [("ALWAYS", "UNIFORM_BATCH"), ("UNIFORM_BATCH", "UNIFORM_BATCH"),
                                        ("UNIFORM_SINGLE_TOKEN_DECODE", "UNIFORM_SINGLE_TOKEN_DECODE"),
                                        ("NEVER", "NEVER")])
def test_mixed_batches_are_never_replayed_from_a_full_cuda_graph(base, ours, monkeypatch):
    """A mixed batch's split is a host decision per step: vLLM must run such batches piecewise."""
    monkeypatch.setattr(BaseBuilder, "_cudagraph_support", CGSupport[base])
    assert Builder.get_cudagraph_support(None, None) is CGSupport[ours]


def test_through_the_v2_view_decode_steps_reuse_the_forest_until_a_slot_takes_a_new_request(step):
    tables = V2BlockTables(max_num_reqs=step.real)
    runner = runner_holding([step.builder], block_tables=tables, prepare_attn=lambda batch: None,
                            prepare_dummy_attn=lambda batch: None)
    vllm_host_tables.attach_host_tables(runner)
    for slot, row in enumerate(step.cam.block_table_tensor[: step.real].tolist()):
        tables.append_block_ids(slot, (row,), overwrite=True)
    runner.prepare_attn(types.SimpleNamespace(idx_mapping_np=np.arange(step.real)))
    for _ in range(2):  # two decode steps of the same requests
        assert_exact(step, run(step, step.builder.build(0, step.cam)))
    tables.append_block_ids(0, (step.cam.block_table_tensor[0].tolist(),), overwrite=True)  # slot 0: a new request
    assert_exact(step, run(step, step.builder.build(0, step.cam)))
    assert step.builder.work_builder.builds == {"forest": 2, "reuse": 1, "plain": 0}
