"""FCA's vLLM backend additions (``arctic_fca.vllm_fca``) on stand-in vLLM bases, on the CPU: which
batches and layers take the FCA path, and that the path reads vLLM's cache layout and writes
vLLM's output buffer exactly. (The kernels are replaced by the torch executor of their items from
``test_device_work``; the interpreter runs the kernels themselves in ``triton_interpreted.py``.)"""

from __future__ import annotations

import functools
import types

import numpy as np
import pytest
import torch
from test_device_work import ALWAYS_FCA, execute
from test_fca import attention_args, make_batch, random_forest

from arctic_fca import vllm_fca, vllm_host_tables
from arctic_fca.fca import paged_decode_attention
from arctic_fca.fca.device_work import DeviceWorkBuilder
from arctic_fca.vllm_plugin import COMPILE_ENV

HEADS, KV_HEADS, HEAD_DIM, SCALE = 4, 2, 16, 0.3


class BaseBuilder:
    """Stands in for a vLLM metadata builder: its metadata is a plain object."""

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device) -> None:
        pass

    def build(self, common_prefix_len, common_attn_metadata, fast_build=False):
        return types.SimpleNamespace(use_cascade=common_prefix_len > 0,
                                     num_actual_tokens=common_attn_metadata.num_actual_tokens)


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


Builder = type("Builder", (vllm_fca.FCABuilderMixin, BaseBuilder), {})
Impl = type("Impl", (vllm_fca.FCAImplMixin, BaseImpl), {})


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
    config = types.SimpleNamespace(
        scheduler_config=types.SimpleNamespace(max_num_seqs=rows), compilation_config=types.SimpleNamespace(
            max_cudagraph_capture_size=None), cache_config=types.SimpleNamespace(num_gpu_blocks=key_cache.shape[0]),
        model_config=types.SimpleNamespace(get_num_attention_heads=lambda parallel: HEADS), parallel_config=None)
    spec = types.SimpleNamespace(block_size=16, num_kv_heads=KV_HEADS, head_size=HEAD_DIM, dtype=torch.float32)
    cam = types.SimpleNamespace(max_query_len=1, num_reqs=rows, num_actual_tokens=rows, causal=True,
                                block_table_tensor=padded_tables, seq_lens=padded_lens)
    expected = paged_decode_attention(query, key_cache, value_cache, tables.clamp(min=0), lens, SCALE)
    return types.SimpleNamespace(builder=Builder(spec, [], config, "cpu"), cam=cam, real=len(requests),
                                 query=torch.cat([query, torch.randn(3, HEADS, HEAD_DIM)]), expected=expected,
                                 kv_cache=torch.stack([key_cache, value_cache], dim=1))


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


def test_the_compile_setting_reaches_the_work_builder(step, monkeypatch):
    """The sampler's ``fca_compile_build`` travels to vLLM's workers as an environment variable;
    the builder then traces its work build (aot_eager here; inductor on the GPU)."""
    monkeypatch.setenv(COMPILE_ENV, "aot_eager")
    meta = step.builder.build(0, step.cam)
    work_builder = step.builder.work_builder
    assert work_builder._run_build != work_builder._build  # the compiled wrapper, not the method
    output = run(step, meta)
    assert_exact(step, output)


@pytest.mark.parametrize("host_sees", ["the forest", "nothing shared", "nothing"])
def test_a_batch_the_host_sees_share_nothing_is_built_without_the_forest_search(step, host_sees):
    """The host's first blocks decide: all different -> plain at once; else (or unknown) the device
    searches for the forest. Exact either way (here the device's tables do hold a forest)."""
    first = step.cam.block_table_tensor[: step.real, 0].numpy()
    step.builder.host_first_blocks = {"the forest": lambda: first, "nothing": lambda: None,
                                      "nothing shared": lambda: np.arange(step.real)}[host_sees]
    meta = step.builder.build(0, step.cam)
    assert bool(step.builder.work_builder.used_fca) == (host_sees != "nothing shared")
    output = run(step, meta)
    assert_exact(step, output)


def test_a_host_view_that_fails_is_dropped_and_the_device_searches(step, caplog):
    def moved():
        raise AttributeError("'GPUModelRunner' object has no attribute 'input_batch'")

    step.builder.host_first_blocks = moved
    for _ in range(2):  # the second step no longer asks the host
        output = run(step, step.builder.build(0, step.cam))
        assert_exact(step, output)
    assert step.builder.host_first_blocks is None and bool(step.builder.work_builder.used_fca)
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
    assert step.builder.host_first_blocks().tolist() == [4, 9, 4]
    assert not hasattr(other, "host_first_blocks")


def test_v2_runners_first_blocks_are_recorded_as_it_appends_block_ids(step):
    tables = V2BlockTables(max_num_reqs=8)
    runner = runner_holding([step.builder], block_tables=tables, prepare_attn=lambda batch: "attn",
                            prepare_dummy_attn=lambda batch: "dummy")
    assert vllm_host_tables.attach_host_tables(runner) == 1
    assert step.builder.host_first_blocks() is None  # no step prepared yet
    tables.append_block_ids(3, ([7, 8],), overwrite=True)
    tables.append_block_ids(5, ([9],), overwrite=True)
    tables.append_block_ids(3, ([10],), overwrite=False)  # a decode step's new block: not the first
    assert runner.prepare_attn(types.SimpleNamespace(idx_mapping_np=np.array([5, 3]))) == "attn"
    assert step.builder.host_first_blocks().tolist() == [9, 7]
    assert tables.staged == [(3, 0, [7, 8]), (5, 0, [9]), (3, 2, [10])]  # vLLM's own bookkeeping runs on
    tables.append_block_ids(3, ([11],), overwrite=True)  # the slot handed to a new request
    assert step.builder.host_first_blocks().tolist() == [9, 11]
    assert runner.prepare_dummy_attn(None) == "dummy" and step.builder.host_first_blocks() is None


def test_a_runner_of_unknown_shape_gets_nothing_attached(step, caplog):
    runner = runner_holding([step.builder])
    assert vllm_host_tables.attach_host_tables(runner) == 0 and step.builder.host_first_blocks is None
    assert "searched for shared prefixes on the device" in caplog.text


def test_the_worker_extension_attaches_the_host_tables(step):
    """What the sampler's ``collective_rpc("arctic_fca_attach_host_tables")`` runs in each worker."""
    from arctic_fca.vllm_worker import ArcticWorkerExtension

    worker = ArcticWorkerExtension.__new__(ArcticWorkerExtension)  # vLLM mixes it into its worker
    worker.model_runner = v1_runner([step.builder], np.zeros((4, 2), dtype=np.int32), num_reqs=2)
    assert worker.arctic_fca_attach_host_tables() == 1 and step.builder.host_first_blocks().tolist() == [0, 0]


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
