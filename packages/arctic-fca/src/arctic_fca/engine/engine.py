"""The embedded sampling engine: continuous batching over a paged KV cache with prefix sharing.

One loop, one step at a time:
- **admit** waiting prompt groups while their worst case fits: a group's KV blocks (its prompt's
  blocks not already cached, plus ``n`` times the blocks for ``max_tokens``) are reserved when it is
  admitted, so a running sequence never waits for memory and nothing is ever preempted;
- **prefill** the admitted groups' prompts in one packed pass: each prompt ONCE, whatever ``n``,
  skipping the full blocks another prompt already holds (the prefix index); its last position's
  logits give the first token of all ``n`` samples;
- otherwise **decode** every running sequence one token, attention through FCA or plain paged
  decode as the cost model prices the step (``arctic_fca.fca.decode``);
- retire finished sequences (stop token or ``max_tokens``), freeing their blocks for the next groups.

The model is any transformers causal LM whose attention goes through the attention registry; the
engine switches it to its paged attention (``arctic_fca.engine.attention``).
"""

from __future__ import annotations

import itertools
import math
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
import torch
from pydantic import Field
from tqdm.auto import tqdm
from transformers import PreTrainedModel

from arctic_core.config import SamplingParams, StrictModel
from arctic_core.errors import ConfigError, RequestError
from arctic_core.hf import check_prompts, copy_weights_, default_stop_tokens, set_attention_implementation
from arctic_fca.engine.attention import ATTENTION_NAME, PrefillSpan, StepMetadata
from arctic_fca.engine.blocks import BlockPool, block_hashes
from arctic_fca.engine.kv_cache import PagedKVCache
from arctic_fca.engine.sampling import RowParams, sample
from arctic_fca.fca.decode import choose_plan, prepare_decode
from arctic_fca.fca.plan import FCAPlan, build_plan
from arctic_fca.fca.work import DecodeWork, build_work, device_sms

CPU_DEFAULT_KV_TOKENS = 1 << 16


class EngineOptions(StrictModel):
    block_size: int = Field(16, description="Tokens per KV block (a power of two >= 16).")
    kv_cache_tokens: int | None = Field(None, gt=0, description="KV cache size; default: 65536 on the CPU, "
                                        "gpu_memory_utilization of the device on CUDA.")
    gpu_memory_utilization: float = Field(0.85, gt=0, le=0.98)
    max_num_seqs: int = Field(256, gt=0, description="Sequences decoded together at most.")
    max_prefill_tokens: int = Field(16384, gt=0, description="Prompt tokens per prefill step (one group may exceed it).")
    fca: Literal["auto", "fca", "plain"] = Field("auto", description="auto: the cost model picks per step.")
    kernel: Literal["auto", "triton", "torch"] = "auto"
    progress: bool | None = Field(None, description="Progress bar; None: only on a terminal.")
    cuda_graphs: bool = Field(True, description="Replay decode steps as CUDA graphs (CUDA only).")
    max_model_len: int | None = Field(None, gt=0, description="Prompt + new tokens at most; default: the model's "
                                      "max_position_embeddings.")


@dataclass
class GenerationOutput:
    prompt_index: int
    tokens: list[int]
    logprobs: list[float]
    policy_version: int


_sequence_ids = itertools.count()


@dataclass
class _Sequence:
    prompt_index: int
    tokens: list[int]
    max_len: int
    blocks: list[int]
    logprobs: list[float] = field(default_factory=list)
    done: bool = False
    seq_id: int = field(default_factory=lambda: next(_sequence_ids))


@dataclass
class _DecodeLayout:
    """The running batch's block tables (rebuilt only when sequences join or leave: their blocks
    are fixed at admission) and its FCA tree (rebuilt only when some sequence fills a block)."""

    key: tuple[int, ...]
    tables: torch.Tensor
    plan: FCAPlan | None = None
    plan_full_blocks: np.ndarray | None = None

    @classmethod
    def of(cls, running: list[_Sequence], rows: int, width: int | None) -> _DecodeLayout:
        """Tables of ``rows`` rows (past the running sequences: padding on the scratch block 0)."""
        width = width or max(len(s.blocks) for s in running)
        tables = np.zeros((rows, width), dtype=np.int32)
        for row, seq in enumerate(running):
            tables[row, : len(seq.blocks)] = seq.blocks
        return cls((rows, *(s.seq_id for s in running)), torch.from_numpy(tables))

    def tree(self, seq_lens: torch.Tensor, block_size: int) -> FCAPlan:
        full = (seq_lens // block_size).numpy()
        if self.plan is None or not np.array_equal(full, self.plan_full_blocks):
            self.plan, self.plan_full_blocks = build_plan(self.tables, seq_lens, block_size), full
        return self.plan


@dataclass
class _Group:
    prompt_index: int
    prompt: list[int]
    blocks: list[int] = field(default_factory=list)  # the prompt's blocks, while it is prefilled
    cached: int = 0  # prompt tokens whose K/V another prompt already holds


@dataclass
class _StepPlan:
    key: tuple  # (layout key, position of the first sequence): which step this plan is for
    layout: _DecodeLayout
    positions: np.ndarray
    slots: np.ndarray
    seq_lens: torch.Tensor
    plan: FCAPlan | None
    work: DecodeWork | None


@dataclass
class EngineStats:
    prefill_steps: int = 0
    prefill_tokens: int = 0  # prompt tokens run through the model
    prefix_hit_tokens: int = 0  # prompt tokens found in the cache instead
    decode_steps: int = 0
    fca_steps: int = 0
    generated_tokens: int = 0
    prefill_seconds: float = 0.0  # wall clock (each step ends in a host read of its sampled tokens)
    decode_seconds: float = 0.0
    decode_prepare_seconds: float = 0.0  # host side of decode steps: tables, FCA plan, work items


class EmbeddedEngine:
    def __init__(self, model: PreTrainedModel, options: EngineOptions | None = None, *, seed: int = 0) -> None:
        self.options = options or EngineOptions()
        _check_supported(model)
        set_attention_implementation(model, ATTENTION_NAME)
        self.model = model.eval()
        self.device = next(model.parameters()).device
        self.seed = seed
        self.calls = 0
        self.policy_version = 0
        self.stats = EngineStats()
        self._layout: _DecodeLayout | None = None
        self._next_step: _StepPlan | None = None
        config = model.config
        self.num_q_heads, self.num_kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self._heads = dict(num_q_heads=self.num_q_heads, num_kv_heads=self.num_kv_heads, head_dim=self.head_dim,
                           dtype=model.dtype)
        num_blocks = self._num_blocks()
        self.cache = PagedKVCache(config.num_hidden_layers, num_blocks, self.options.block_size, self.num_kv_heads,
                                  self.head_dim, model.dtype, self.device)
        self.pool = BlockPool(num_blocks)
        self.max_model_len = self.options.max_model_len or getattr(config, "max_position_embeddings", None) or 1 << 16
        self.graphs = None
        if self.device.type == "cuda" and self.options.cuda_graphs and self.options.kernel != "torch":
            from arctic_fca.engine.cuda_graphs import DecodeGraphs  # imports Triton

            self.graphs = DecodeGraphs(model, self.cache, table_width=-(-self.max_model_len // self.options.block_size),
                                       max_num_seqs=self.options.max_num_seqs, num_q_heads=self.num_q_heads,
                                       num_kv_heads=self.num_kv_heads, head_dim=self.head_dim)

    # ---- lifecycle ---------------------------------------------------------------------------

    def update_weights(self, weights, version: int) -> None:
        copy_weights_(self.model, weights)
        self.pool.clear_index()  # cached prefixes hold K/V of the old weights
        self.policy_version = version

    def sleep(self) -> None:
        """Free the KV cache and move the weights to the host (device memory for the trainer)."""
        self.cache.free()
        self.pool.clear_index()
        self._layout, self._next_step = None, None
        if self.graphs is not None:
            self.graphs.clear()  # they point into the freed cache and the moved weights
        self.model.to("cpu")
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def wake(self) -> None:
        self.model.to(self.device)
        self.cache.allocate()

    @property
    def asleep(self) -> bool:
        return not self.cache.allocated

    # ---- generation --------------------------------------------------------------------------

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[GenerationOutput]:
        """``n`` samples per prompt, in prompt-major order (prompt 0's samples first)."""
        if self.asleep:
            raise RequestError("the sampler is asleep; call wake() first")
        self._check_request(prompts, params)
        stops = set(params.stop_token_ids or default_stop_tokens(self.model))
        self._next_step = None  # options may have changed since the last call
        seed = params.seed if params.seed is not None else self.seed + self.calls
        self.calls += 1
        generator = torch.Generator(device=self.device).manual_seed(seed)
        waiting = deque(_Group(i, list(p)) for i, p in enumerate(prompts))
        bar = tqdm(total=len(prompts) * params.n, unit="sample", desc="generate", leave=False,
                   disable=not (self.options.progress if self.options.progress is not None else sys.stderr.isatty()))
        try:
            finished = self._run(waiting, params, generator, stops, bar)
        except BaseException:
            # Nothing survives a failed call: every block goes back (calls are serialised, so all of
            # them were this call's), and the engine serves the next call.
            self.pool = BlockPool(self.pool.num_blocks)
            self._layout, self._next_step = None, None
            raise
        finally:
            bar.close()
        return [GenerationOutput(i, s.tokens[len(p):], s.logprobs, self.policy_version)
                for i, p in enumerate(prompts) for s in sorted(finished[i], key=lambda s: s.seq_id)]

    def _run(self, waiting: deque[_Group], params: SamplingParams, generator: torch.Generator, stops: set[int],
             bar: tqdm) -> dict[int, list[_Sequence]]:
        running: list[_Sequence] = []
        finished: dict[int, list[_Sequence]] = {}
        while waiting or running:
            admitted = self._admit(waiting, len(running), params)
            begin = time.perf_counter()
            if admitted:
                running += self._prefill(admitted, params, generator)
                self.stats.prefill_seconds += time.perf_counter() - begin
            else:
                self._decode(running, params, generator)
                self.stats.decode_seconds += time.perf_counter() - begin
            for seq in running:
                seq.done = seq.done or seq.tokens[-1] in stops or len(seq.tokens) >= seq.max_len
            for seq in [s for s in running if s.done]:
                self.pool.release(seq.blocks)
                finished.setdefault(seq.prompt_index, []).append(seq)
                bar.update(1)
            running = [s for s in running if not s.done]
        return finished

    def _check_request(self, prompts: list[list[int]], params: SamplingParams) -> None:
        if params.n > self.options.max_num_seqs:
            raise RequestError(f"n={params.n} exceeds the engine's max_num_seqs={self.options.max_num_seqs}")
        check_prompts(prompts, self.model.config.vocab_size, params.max_tokens, self.max_model_len)
        for i, prompt in enumerate(prompts):
            needed = self._group_blocks(len(prompt), 0, params)
            if needed > self.pool.capacity:
                raise RequestError(f"prompts[{i}] with n={params.n} and max_tokens={params.max_tokens} needs {needed} KV "
                                   f"blocks; the cache has {self.pool.capacity} (raise kv_cache_tokens)")

    def _own_blocks(self, prompt_len: int, params: SamplingParams) -> int:
        """Blocks one sample writes beyond the prompt's full blocks (the last sampled token is never cached)."""
        bs = self.options.block_size
        return math.ceil((prompt_len + params.max_tokens - 1) / bs) - prompt_len // bs

    def _group_blocks(self, prompt_len: int, cached_blocks: int, params: SamplingParams) -> int:
        bs = self.options.block_size
        prompt_blocks = math.ceil(prompt_len / bs) - cached_blocks
        return prompt_blocks + params.n * self._own_blocks(prompt_len, params)

    # ---- admission and prefill ---------------------------------------------------------------

    def _admit(self, waiting: deque[_Group], num_running: int, params: SamplingParams) -> list[_Group]:
        admitted: list[_Group] = []
        tokens = 0
        bs = self.options.block_size
        while waiting:
            group = waiting[0]
            if num_running + (len(admitted) + 1) * params.n > self.options.max_num_seqs:
                break
            hashes = block_hashes(group.prompt, bs)
            shared = []
            for digest in hashes:
                block = self.pool.cached(digest)
                if block is None:
                    break
                shared.append(block)
            if len(shared) * bs >= len(group.prompt):
                shared.pop()  # keep the last prompt token to compute: its logits start the samples
            if self._group_blocks(len(group.prompt), len(shared), params) > self.pool.num_free:
                break
            new_tokens = len(group.prompt) - len(shared) * bs
            if admitted and tokens + new_tokens > self.options.max_prefill_tokens:
                break
            self.pool.share(shared)
            fresh = self.pool.allocate(math.ceil(len(group.prompt) / bs) - len(shared))
            for digest, block in zip(hashes[len(shared):], fresh, strict=False):
                self.pool.register(block, digest)
            group.blocks, group.cached = shared + fresh, len(shared) * bs
            admitted.append(waiting.popleft())
            tokens += new_tokens
        return admitted

    def _prefill(self, groups: list[_Group], params: SamplingParams, generator: torch.Generator) -> list[_Sequence]:
        bs = self.options.block_size
        ids, positions, slots, spans, start = [], [], [], [], 0
        for g in groups:
            pos = np.arange(g.cached, len(g.prompt))
            all_slots = _slots(g.blocks, np.arange(len(g.prompt)), bs)
            ids.append(g.prompt[g.cached:])
            positions.append(pos)
            slots.append(all_slots[g.cached:])
            context = torch.from_numpy(all_slots).to(self.device) if g.cached else None
            spans.append(PrefillSpan(start, start + pos.size, g.cached, context))
            start += pos.size
            self.stats.prefill_tokens += pos.size
            self.stats.prefix_hit_tokens += g.cached
        meta = StepMetadata(self.cache, torch.from_numpy(np.concatenate(slots)).to(self.device), spans=tuple(spans))
        self.stats.prefill_steps += 1
        last_rows = torch.tensor([s.end - 1 for s in spans], device=self.device)
        logits = self._forward(np.concatenate([np.asarray(i) for i in ids]), np.concatenate(positions), meta, last_rows)
        rows = len(groups) * params.n
        tokens, logprobs = sample(logits.repeat_interleave(params.n, 0), _row_params(params, rows, self.device), generator)
        sequences = []
        for gi, g in enumerate(groups):
            sequences += self._fork(g, params, tokens[gi * params.n:(gi + 1) * params.n].tolist(),
                                    logprobs[gi * params.n:(gi + 1) * params.n].tolist())
        self.stats.generated_tokens += len(sequences)
        return sequences

    def _fork(self, group: _Group, params: SamplingParams, first_tokens: list[int], first_logprobs: list[float]) -> list[_Sequence]:
        """The n samples share the prompt's full blocks; each gets its own copy of a partly filled last block."""
        bs = self.options.block_size
        full = group.blocks[: len(group.prompt) // bs]
        partial = group.blocks[len(full):]
        sequences = []
        for token, logprob in zip(first_tokens, first_logprobs, strict=True):
            own = self.pool.allocate(self._own_blocks(len(group.prompt), params))
            self.pool.share(full)
            if partial and own:
                self.cache.copy_blocks(partial, own[:1])
            sequences.append(_Sequence(group.prompt_index, group.prompt + [token], len(group.prompt) + params.max_tokens,
                                       full + own, [logprob]))
        self.pool.release(group.blocks)
        return sequences

    # ---- decode ------------------------------------------------------------------------------

    def _plan_step(self, running: list[_Sequence], ahead: int = 0) -> _StepPlan:
        """The host side of a decode step (tables, slots, FCA plan, work items) for the running
        sequences ``ahead`` tokens from now; it needs no sampled token, so the next step's is built
        while the GPU runs this one."""
        begin = time.perf_counter()
        bs = self.options.block_size
        key = self._batch_key(running)
        rows = key[0]
        if self._layout is None or self._layout.key != key:
            self._layout = _DecodeLayout.of(running, rows, self.graphs.table_width if self.graphs else None)
        tables = self._layout.tables
        positions = np.zeros(rows, dtype=np.int64)  # padding rows: position 0 of the scratch block
        positions[: len(running)] = [len(s.tokens) - 1 + ahead for s in running]
        slots = tables.numpy()[np.arange(rows), positions // bs].astype(np.int64) * bs + positions % bs
        seq_lens = torch.from_numpy((positions + 1).astype(np.int32))
        plan = choose_plan(tables, seq_lens, bs, mode=self.options.fca, **self._heads,
                           plan=self._layout.tree(seq_lens, bs) if self.options.fca != "plain" else None)
        work = None
        if self.graphs is not None:
            work = build_work(plan, seq_lens.numpy(), tables.shape[1], bs, group=self.num_q_heads // self.num_kv_heads,
                              num_kv_heads=self.num_kv_heads, num_sms=device_sms(self.device))
        self.stats.decode_prepare_seconds += time.perf_counter() - begin
        return _StepPlan((key, positions[0]), self._layout, positions, slots, seq_lens, plan, work)

    def _batch_key(self, running: list[_Sequence]) -> tuple[int, ...]:
        """(rows, sequence ids): rows is the CUDA-graph bucket the batch is padded to."""
        rows = self.graphs.bucket(len(running)) if self.graphs is not None else len(running)
        return (rows, *(s.seq_id for s in running))

    def _decode(self, running: list[_Sequence], params: SamplingParams, generator: torch.Generator) -> None:
        count = len(running)
        step, self._next_step = self._next_step, None
        if step is None or step.key != (self._batch_key(running), len(running[0].tokens) - 1):
            step = self._plan_step(running)
        rows = step.positions.size
        ids = np.zeros(rows, dtype=np.int64)
        ids[:count] = [s.tokens[-1] for s in running]
        logits = None
        if self.graphs is not None:
            logits = self.graphs.run(ids, step.positions, step.slots, step.work, step.layout.tables.numpy(),
                                     step.layout.key)
        if logits is None:  # no graphs, or a step that does not fit them
            decode = prepare_decode(step.layout.tables, step.seq_lens, self.options.block_size, **self._heads,
                                    mode="fca" if step.plan is not None else "plain", kernel=self.options.kernel,
                                    device=self.device, plan=step.plan)
            meta = StepMetadata(self.cache, torch.from_numpy(step.slots).to(self.device), decode=decode)
            logits = self._forward(ids, step.positions, meta, None)
        tokens, logprobs = sample(logits[:count], _row_params(params, count, self.device), generator)
        if all(len(s.tokens) + 1 < s.max_len for s in running):  # else the batch changes anyway
            self._next_step = self._plan_step(running, ahead=1)  # overlaps the GPU's work on this step
        for seq, token, logprob in zip(running, tokens.tolist(), logprobs.tolist(), strict=True):
            seq.tokens.append(token)
            seq.logprobs.append(logprob)
        self.stats.decode_steps += 1
        self.stats.fca_steps += step.plan is not None
        self.stats.generated_tokens += count

    def _forward(self, ids: np.ndarray, positions: np.ndarray, meta: StepMetadata,
                 rows: torch.Tensor | None) -> torch.Tensor:
        """Logits ``[rows, vocab]`` (fp32) of the packed step, at ``rows`` (all rows when None)."""
        input_ids = torch.from_numpy(ids.astype(np.int64)).to(self.device)[None]
        position_ids = torch.from_numpy(positions.astype(np.int64)).to(self.device)[None]
        hidden = self.model.base_model(input_ids=input_ids, position_ids=position_ids, paged=meta,
                                       use_cache=False).last_hidden_state[0]
        if rows is not None:
            hidden = hidden[rows]
        return self.model.get_output_embeddings()(hidden).float()

    def _num_blocks(self) -> int:
        opts = self.options
        per_block = PagedKVCache.bytes_per_block(self.model.config.num_hidden_layers, opts.block_size,
                                                 self.num_kv_heads, self.head_dim, self.model.dtype)
        if opts.kv_cache_tokens is not None:
            return max(1, opts.kv_cache_tokens // opts.block_size)
        if self.device.type != "cuda":
            return CPU_DEFAULT_KV_TOKENS // opts.block_size
        free, total = torch.cuda.mem_get_info(self.device)
        budget = free - (1 - opts.gpu_memory_utilization) * total
        if budget < per_block:
            raise ConfigError(f"no device memory left for the KV cache ({free / 2**30:.1f} GiB free of "
                              f"{total / 2**30:.1f}); lower gpu_memory_utilization's reserve or set kv_cache_tokens")
        return int(budget // per_block)


def _check_supported(model: PreTrainedModel) -> None:
    config = model.config
    layer_types = getattr(config, "layer_types", None) or []
    sliding = any(t != "full_attention" for t in layer_types) or (
        not layer_types and getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True))
    if sliding:
        raise ConfigError(f"the embedded engine cannot run {config.model_type} with sliding-window layers exactly; "
                          "use the hf-generate sampler")
    if model.get_output_embeddings() is None:
        raise ConfigError(f"{type(model).__name__} has no output embedding: not a causal LM")


def _slots(blocks: list[int], positions: np.ndarray, block_size: int) -> np.ndarray:
    return np.asarray(blocks, dtype=np.int64)[positions // block_size] * block_size + positions % block_size


def _row_params(params: SamplingParams, rows: int, device: torch.device) -> RowParams:
    return RowParams(temperature=torch.full((rows,), params.temperature, device=device),
                     top_k=torch.full((rows,), params.top_k, device=device, dtype=torch.long),
                     top_p=torch.full((rows,), params.top_p, device=device),
                     any_top_k=params.top_k > 0 and not params.greedy, any_top_p=params.top_p < 1 and not params.greedy)
