"""ZoRRo Train: the prefix forest and the packed forward are exact against the plain computation."""

from __future__ import annotations

import copy
import os
import subprocess
import sys

import pytest
import torch

from arctic_core.batch import RolloutBatch
from arctic_core.demo.tiny_model import TINY_SHAPES, build_tiny_model, build_tokenizer
from arctic_core.errors import ConfigError
from arctic_core.losses.processors import Entropy, LogProbs
from arctic_zorro.forest import build_forest, response_gather_index
from arctic_zorro import forest_attention
from arctic_zorro.forest_attention import FlexKernels, ForestAttentionMeta, forest_block_mask, padded_length
from arctic_zorro.forward import response_outputs
from arctic_zorro.fused_elementwise import compile_elementwise
from arctic_zorro.packed_forward import (ZorroOptions, check_supported, enable_forest_attention,
                                        packed_response_outputs, select_forward)
from forest_batches import forest_batch, padded_batch

FAMILIES = sorted(TINY_SHAPES)


# ----------------------------------------------------------------------------- the forest


def brute_force_visible(forest) -> torch.Tensor:
    """Ancestor-or-self relation computed from the rows' paths, independently of subtree_end."""
    size = forest.num_nodes
    visible = torch.zeros(size, size, dtype=torch.bool)
    for path in forest.row_paths:
        for i, q in enumerate(path.tolist()):
            visible[q, path[: i + 1]] = True
    return visible


@pytest.mark.parametrize("make", [forest_batch, padded_batch])
def test_forest_stores_each_prefix_once_and_encodes_ancestry(make):
    batch = make()
    forest = build_forest(batch)
    sequences = batch.sequences()
    distinct_prefixes = {tuple(s[: i + 1].tolist()) for s in sequences for i in range(len(s))}
    assert forest.num_nodes == len(distinct_prefixes) == batch.packed_tokens()  # the metric fwd_bwd reports
    assert forest.naive_tokens == batch.total_tokens()
    for seq, path in zip(sequences, forest.row_paths, strict=True):
        assert torch.equal(forest.input_ids[path], seq)
        assert torch.equal(forest.position_ids[path], torch.arange(len(seq)))
    assert torch.equal(forest.dense_mask(), brute_force_visible(forest))


def test_forest_counts_for_identical_prompts():
    prompt, n = list(range(10, 30)), 8
    batch = RolloutBatch.from_lists([prompt], [[1, 100 + i] for i in range(n)], [0] * n)
    forest = build_forest(batch)
    assert forest.num_nodes == 20 + 1 + n  # prompt once, the shared first response token once
    assert forest.dedup_ratio == pytest.approx(n * 22 / (20 + 1 + n))


def test_response_gather_points_at_the_predicting_token():
    batch = forest_batch()
    forest = build_forest(batch)
    rows, cols, nodes = response_gather_index(forest, batch)
    for r, c, node in zip(rows.tolist(), cols.tolist(), nodes.tolist(), strict=True):
        prefix = batch.prompt(r) + batch.response(r)[:c]
        assert int(forest.position_ids[node]) == len(prefix) - 1
        assert int(forest.input_ids[node]) == prefix[-1]


def random_forest_batch(seed: int) -> RolloutBatch:
    """Groups of ragged samples over prompts that share a random-length system prefix."""
    gen = torch.Generator().manual_seed(seed)
    system = torch.randint(3, 50, (int(torch.randint(0, 40, (1,), generator=gen)),), generator=gen).tolist()
    prompts, responses, index = [], [], []
    for group in range(int(torch.randint(1, 6, (1,), generator=gen))):
        own = torch.randint(3, 50, (int(torch.randint(1, 30, (1,), generator=gen)),), generator=gen).tolist()
        prompts.append(system + own)
        for _ in range(int(torch.randint(1, 9, (1,), generator=gen))):
            length = int(torch.randint(0, 25, (1,), generator=gen))
            responses.append(torch.randint(3, 50, (length,), generator=gen).tolist())
            index.append(group)
    return RolloutBatch.from_lists(prompts, responses, index)


def block_mask_semantics(mask) -> torch.Tensor:
    """What FlexAttention computes from a BlockMask: full blocks attend wholly, partial blocks
    through the mask_mod, other blocks not at all."""
    size = mask.seq_lengths[0]
    q, k = torch.meshgrid(torch.arange(size), torch.arange(size), indexing="ij")
    rule = mask.mask_mod(0, 0, q, k)
    block_q, block_k = mask.BLOCK_SIZE
    blocks = -(-size // block_q)
    kinds = torch.zeros(blocks, -(-size // block_k), dtype=torch.int8)
    for num, index, kind in ((mask.kv_num_blocks, mask.kv_indices, 1),
                             (mask.full_kv_num_blocks, mask.full_kv_indices, 2)):
        for row in range(blocks):
            kinds[row, index[0, 0, row, : num[0, 0, row]].long()] = kind
    per_pair = kinds.repeat_interleave(block_q, 0).repeat_interleave(block_k, 1)[:size, :size]
    return (per_pair == 2) | ((per_pair == 1) & rule)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("block", [4, 16, 128])
def test_forest_block_mask_equals_the_forest_rule(seed, block):
    """The block mask built from the forest's structure (no dense mask, no compilation) makes
    FlexAttention see exactly the dense forest mask, with and without a sliding window."""
    forest = build_forest(random_forest_batch(seed))
    mask = forest_block_mask(forest.subtree_end, forest.position_ids, block=block)
    assert torch.equal(block_mask_semantics(mask), forest.dense_mask())
    if block == 4:
        assert int(mask.full_kv_num_blocks.sum()) > 0  # the shared prefix blocks are read whole
    window = 7
    windowed = forest_block_mask(forest.subtree_end, forest.position_ids, window=window, block=block)
    pos = forest.position_ids
    expected = forest.dense_mask() & ((pos[:, None] - pos[None, :]) < window)
    assert torch.equal(block_mask_semantics(windowed), expected)


def test_padded_lengths_are_whole_blocks_few_per_octave():
    lengths = {padded_length(n) for n in range(1, 1 << 15)}
    assert all(n <= padded_length(n) < n + max(128, n // 8) for n in range(1, 1 << 15))
    assert all(length % 128 == 0 for length in lengths)
    assert sorted(length for length in lengths if 8192 < length <= 16384) == list(range(9216, 16385, 1024))


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("window", [None, 7])
def test_flex_attention_on_padded_blocks_equals_the_dense_forest_mask(monkeypatch, seed, window):
    """The GPU path (q/k/v padded to ``padded_length``, the padded block mask) gives the dense
    path's outputs; FlexAttention runs unfused here (fp32, forward only: it has no CPU backward)."""
    from torch.nn.attention.flex_attention import flex_attention

    kernels, calls = FlexKernels(), []

    def counted(*args, **kwargs):
        calls.append(args)
        return flex_attention(*args, **kwargs)

    kernels.fixed_shape = kernels.any_shape = counted
    monkeypatch.setattr(forest_attention, "flex_kernels", lambda: kernels)
    forest = build_forest(random_forest_batch(seed))
    gen = torch.Generator().manual_seed(seed)
    # q/k/v as the projections give them: [1, T, H, D] in memory, seen as [1, H, T, D].
    q, k, v = (torch.randn(1, forest.num_nodes, heads, 16, generator=gen).transpose(1, 2) for heads in (4, 2, 2))
    outputs = [forest_attention.forest_attention(None, q, k, v, None, scaling=0.25, sliding_window=window,
                                                 forest=ForestAttentionMeta(forest, use_flex=use_flex))[0]
               for use_flex in (True, False)]
    assert padded_length(forest.num_nodes) > forest.num_nodes
    assert outputs[0].shape == outputs[1].shape == (1, forest.num_nodes, 4, 16)
    torch.testing.assert_close(outputs[0], outputs[1], atol=1e-5, rtol=1e-5)
    # Padded token-major, and the result a view of FlexAttention's output: no transposing copies.
    (padded_q, padded_k, padded_v, *_), = calls
    assert all(t.shape[2] == padded_length(forest.num_nodes) and t.transpose(1, 2).is_contiguous()
               for t in (padded_q, padded_k, padded_v))
    assert outputs[0].is_contiguous() and outputs[0]._base is not None


def test_flex_kernels_fix_the_shapes_of_the_first_lengths_then_take_any():
    calls: list[tuple[str, int]] = []
    kernels = FlexKernels(static_lengths=2)
    kernels.fixed_shape = lambda q, *args, **kwargs: calls.append(("fixed", q.shape[2]))
    kernels.any_shape = lambda q, *args, **kwargs: calls.append(("any", q.shape[2]))
    for length in (256, 384, 256, 512, 384):
        q = torch.zeros(1, 2, length, 8)
        kernels(q, q, q, None, None, None)
    with torch.no_grad():  # another grad mode is another compiled graph
        kernels(torch.zeros(1, 2, 256, 8), q, q, None, None, None)
    assert calls == [("fixed", 256), ("fixed", 384), ("fixed", 256), ("any", 512), ("fixed", 384), ("any", 256)]


# ----------------------------------------------------------------------------- exactness per family


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer(["count up from 1 2 3 4 5 6 7 8 9 repeat down"] * 4)


def models(tokenizer, family: str):
    plain = build_tiny_model(tokenizer, family=family, seed=1).eval()
    packed = copy.deepcopy(plain)
    enable_forest_attention(packed)
    return plain, packed


def logprob_loss(outputs: dict[str, torch.Tensor], batch: RolloutBatch) -> torch.Tensor:
    """A loss touching every response token with distinct weights, so gradients are informative."""
    weights = torch.linspace(-1.0, 2.0, batch.response_ids.numel()).reshape(batch.response_ids.shape)
    mask = batch.loss_mask.float()
    return (outputs["logprobs"] * weights * mask).sum() + 0.3 * (outputs["entropy"] * mask).sum()


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("make", [forest_batch, padded_batch])
def test_packed_forward_is_exact(tokenizer, family, make):
    batch = make()
    plain, packed = models(tokenizer, family)
    processors = {"logprobs": LogProbs(0.8), "entropy": Entropy(0.8)}
    expected = response_outputs(plain, batch, processors)
    # A head chunk smaller than the batch's response tokens: several chunks, each recomputed in backward.
    got = select_forward(packed, ZorroOptions(head_chunk_tokens=5))(packed, batch, processors)
    for name in ("logprobs", "entropy"):
        torch.testing.assert_close(got[name], expected[name], atol=1e-5, rtol=0, msg=f"{family} {name}")
    logprob_loss(expected, batch).backward()
    logprob_loss(got, batch).backward()
    for (name, p), q in zip(plain.named_parameters(), packed.parameters(), strict=True):
        assert p.grad is not None and q.grad is not None, name
        assert (q.grad - p.grad).norm() <= 1e-4 * p.grad.norm(), f"{family} {name}"


def test_the_head_keeps_its_logits_for_the_backward_only_where_the_free_memory_holds_them(tokenizer, monkeypatch):
    """Kept or recomputed in the backward, the LM head's chunks give the same outputs and gradients;
    which one runs follows the free memory: every chunk's logits plus one chunk's backward."""
    from arctic_zorro import packed_forward
    from arctic_zorro.memory_budget import HEAD_BYTES_PER_LOGIT

    batch = forest_batch()
    _, packed = models(tokenizer, "qwen3")
    processors = {"logprobs": LogProbs(0.8), "entropy": Entropy(0.8)}
    head = packed.get_output_embeddings()
    tokens, vocab, chunk = int(batch.response_lens.sum()), head.out_features, 5
    fits = tokens * vocab * 4 + chunk * vocab * HEAD_BYTES_PER_LOGIT  # fp32 logits of every token, one chunk's backward
    runs = []
    for budget in (fits, fits - 1):
        monkeypatch.setattr(packed_forward, "activation_budget", lambda device, b=budget: b)
        calls = []
        handle = head.register_forward_hook(lambda module, args, out, calls=calls: calls.append(out.shape[0]))
        packed.zero_grad(set_to_none=True)
        outputs = select_forward(packed, ZorroOptions(head_chunk_tokens=chunk))(packed, batch, processors)
        logprob_loss(outputs, batch).backward()
        handle.remove()
        runs.append((outputs, {n: p.grad.clone() for n, p in packed.named_parameters()}, sum(calls)))
    (kept, kept_grads, kept_rows), (recomputed, recomputed_grads, recomputed_rows) = runs
    assert (kept_rows, recomputed_rows) == (tokens, 2 * tokens)  # the head ran again over every chunk
    monkeypatch.setattr(packed_forward, "activation_budget", lambda device: 1 << 40)
    assert packed_forward.logits_fit(torch.zeros(tokens, 8), vocab, chunk)
    monkeypatch.setattr(packed_forward, "several_ranks", lambda: True)  # ranks must run the same gathers
    assert not packed_forward.logits_fit(torch.zeros(tokens, 8), vocab, chunk)
    for name in ("logprobs", "entropy"):
        torch.testing.assert_close(kept[name], recomputed[name], atol=0, rtol=0)
    for name, grad in kept_grads.items():
        torch.testing.assert_close(grad, recomputed_grads[name], atol=1e-7, rtol=1e-6, msg=name)


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_compiled_norms_activations_and_rotary_are_exact_for_every_family(tokenizer, family):
    """``compile_elementwise`` (RMSNorms, SiLU x up and the rotary embedding compiled) under the
    packed forward gives the plain model's outputs and gradients (fp32)."""
    batch = forest_batch()
    plain, packed = models(tokenizer, family)
    fused = compile_elementwise(packed)
    assert sum(type(m).__name__.endswith("Attention") for m in fused) == packed.config.num_hidden_layers
    processors = {"logprobs": LogProbs(1.0), "entropy": Entropy(1.0)}
    expected = response_outputs(plain, batch, processors)
    got = packed_response_outputs(packed, batch, processors)
    for name in processors:
        torch.testing.assert_close(got[name], expected[name], atol=1e-5, rtol=0, msg=f"{family} {name}")
    logprob_loss(expected, batch).backward()
    logprob_loss(got, batch).backward()
    for (name, p), q in zip(plain.named_parameters(), packed.parameters(), strict=True):
        assert (q.grad - p.grad).norm() <= 1e-4 * p.grad.norm(), f"{family} {name}"


ROTARY_KERNEL_CHECK = """
import torch
from arctic_zorro.fused_elementwise import rotary
from arctic_zorro.rotary_kernel import TritonRotary

gen = torch.Generator().manual_seed(0)
q, k = (torch.randn(2, 37, heads, 16, generator=gen) for heads in (4, 2))  # token-major, as projected
cos, sin = (torch.randn(1, 37, 16, generator=gen) for _ in range(2))      # one set for every row
grads = [torch.randn(2, heads, 37, 16, generator=gen) for heads in (4, 2)]
results = []
for rotate in (TritonRotary.apply, rotary):
    leaves = [q.clone().requires_grad_(), k.clone().requires_grad_()]
    out = rotate(*(t.transpose(1, 2) for t in leaves), cos, sin)
    torch.autograd.backward(out, grads)
    results.append([*out, *(t.grad for t in leaves)])
assert all(torch.equal(a, b) for a, b in zip(*results)), [float((a - b).abs().max()) for a, b in zip(*results)]
assert all(t.transpose(1, 2).is_contiguous() for t in results[0][:2])  # written token-major
"""


@pytest.mark.slow
def test_the_rotary_kernel_is_transformers_rotary_forward_and_backward():
    """The training rotary kernel (Triton; here through Triton's interpreter on the CPU, in fp32)
    gives transformers' expression bit for bit forward and backward, on q/k that arrive as
    ``[B, H, T, D]`` views of token-major tensors, and writes its results token-major."""
    run = subprocess.run([sys.executable, "-c", ROTARY_KERNEL_CHECK], env={**os.environ, "TRITON_INTERPRET": "1"},
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]


def test_sliding_window_is_applied_on_positions(tokenizer):
    """Mistral's window (5) is shorter than the rows: a forest ignoring it would not match."""
    batch = forest_batch()
    plain, packed = models(tokenizer, "mistral")
    unwindowed = copy.deepcopy(packed)
    unwindowed.config.sliding_window = None
    processors = {"logprobs": LogProbs()}
    expected = response_outputs(plain, batch, processors)["logprobs"]
    assert (packed_response_outputs(unwindowed, batch, processors)["logprobs"] - expected).abs().max() > 1e-3
    torch.testing.assert_close(packed_response_outputs(packed, batch, processors)["logprobs"], expected,
                               atol=1e-5, rtol=0)


def test_models_it_cannot_run_exactly_are_refused(tokenizer):
    model = build_tiny_model(tokenizer, "gemma2", attn_implementation="eager", head_dim=32,
                             final_logit_softcapping=30.0)
    with pytest.raises(ConfigError, match="zorro cannot run gemma2 exactly .*soft-capping.*enable: false"):
        check_supported(model)


def test_forest_attention_outside_the_packed_forward_says_so(tokenizer):
    _, packed = models(tokenizer, "qwen3")
    with pytest.raises(RuntimeError, match="needs forest metadata"):
        packed(torch.tensor([[1, 2, 3]]))
