"""The model on the device: its paged KV cache sized to the memory it may take, the packed prefill
pass (with one decode row per running sequence in front when prefill and decode are mixed), and the
decode pass (replayed from a CUDA graph where one fits, eager otherwise).

Qwen3, Qwen2, Llama and Mistral models run on the engine's own decoder (``decoder``: fused
kernels, the model's weights); any other transformers causal LM runs its own modules with the
attention registry pointed at the engine's paged attention (``arctic_fca.engine.attention``).
Either way the runner applies the LM head itself, only where tokens are sampled.
"""

from __future__ import annotations

import numpy as np
import torch
from transformers import PreTrainedModel

from arctic_core.batch import to_device
from arctic_core.errors import ConfigError
from arctic_core.hf import copy_weights_, max_positions, set_attention_implementation
from arctic_fca.engine.attention import ATTENTION_NAME, PrefillSpan, StepMetadata
from arctic_fca.engine.decoder import FusedDecoder
from arctic_fca.engine.kv_cache import PagedKVCache
from arctic_fca.engine.sequence import PrefillPiece
from arctic_fca.engine.step_planner import StepPlan
from arctic_fca.fca.decode import PreparedDecode, prepare_decode, resolve_kernel
from arctic_fca.fca.tuning import Tuning

CPU_DEFAULT_KV_TOKENS = 1 << 16


class ModelRunner:
    def __init__(self, model: PreTrainedModel, options, tuning: Tuning) -> None:
        check_supported(model)
        set_attention_implementation(model, ATTENTION_NAME)
        self.model, self.options, self.tuning = model.eval(), options, tuning
        self.device = next(model.parameters()).device
        config = model.config
        self.num_q_heads, self.num_kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.heads = dict(num_q_heads=self.num_q_heads, num_kv_heads=self.num_kv_heads, head_dim=self.head_dim,
                          dtype=model.dtype)
        self.cache = PagedKVCache(config.num_hidden_layers, self._num_blocks(), options.block_size, self.num_kv_heads,
                                  self.head_dim, model.dtype, self.device)
        self.triton = resolve_kernel(options.kernel, self.device) == "triton"
        positions = max_positions(model)
        if (options.max_model_len or 0) > positions:
            raise ConfigError(f"sampler.options.max_model_len={options.max_model_len} exceeds the model's "
                              f"max_position_embeddings={positions}")
        self.max_model_len = options.max_model_len or positions
        self.decoder = FusedDecoder.of(model, self.max_model_len) if options.fused_decoder else None
        self.graphs = None
        if self.device.type == "cuda" and options.cuda_graphs and options.kernel != "torch":
            from arctic_fca.engine.cuda_graphs import DecodeGraphs  # imports Triton

            self.graphs = DecodeGraphs(self.logits, self.cache,
                                       table_width=-(-self.max_model_len // options.block_size),
                                       max_num_seqs=options.max_num_seqs, num_q_heads=self.num_q_heads,
                                       num_kv_heads=self.num_kv_heads, head_dim=self.head_dim, tuning=tuning)

    # ---- lifecycle ---------------------------------------------------------------------------

    def load_weights(self, weights) -> None:
        copy_weights_(self.model, weights)

    def sleep(self) -> None:
        """Free the KV cache and move the weights to the host (device memory for the trainer)."""
        self.cache.free()
        if self.graphs is not None:
            self.graphs.clear()  # they point into the freed cache and the moved weights
        if self.decoder is not None:
            self.decoder.release()
        self.model.to("cpu")
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def wake(self) -> None:
        self.model.to(self.device)
        self.cache.allocate()
        if self.decoder is not None:
            self.decoder.bind()

    # ---- forward passes ----------------------------------------------------------------------

    def prefill(self, pieces: list[PrefillPiece], step: StepPlan | None = None,
                ids: np.ndarray | None = None) -> torch.Tensor:
        """The pieces' prompt tokens in one packed pass, after one decode row per sequence of ``step``
        (whose input tokens are ``ids``) when given. The logits ``[decode rows + completed prompts,
        vocab]``: each decoded sequence's, then each completed prompt's last position's (they start
        its ``n`` samples)."""
        bs = self.options.block_size
        decode_rows = step.positions.size if step is not None else 0
        rows, positions, slots, spans, start = [], [], [], [], decode_rows
        for piece in pieces:
            pos = np.arange(piece.start, piece.end)
            all_slots = _slots(piece.group.blocks, np.arange(piece.end), bs)
            rows.append(piece.group.prompt[piece.start : piece.end])
            positions.append(pos)
            slots.append(all_slots[piece.start :])
            context = self.on_device(all_slots) if piece.start else None
            spans.append(PrefillSpan(start, start + pos.size, piece.start, context))
            start += pos.size
        logit_rows = [s.end - 1 for s, p in zip(spans, pieces, strict=True) if p.completes]
        decode = None
        if step is not None:
            rows.insert(0, _padded(ids, decode_rows))
            positions.insert(0, step.positions)
            slots.insert(0, step.slots)
            logit_rows = list(range(ids.size)) + logit_rows
            decode = self._prepare_decode(step)
        meta = StepMetadata(self.cache, self.on_device(np.concatenate(slots)), decode=decode, spans=tuple(spans))
        return self.forward(np.concatenate([np.asarray(r) for r in rows]), np.concatenate(positions), meta,
                            self.on_device(np.array(logit_rows)))

    def decode(self, ids: np.ndarray | torch.Tensor, step: StepPlan) -> torch.Tensor:
        """One token for every running sequence of the step; the logits ``[rows, vocab]`` (rows: the
        step's, padding included). ``ids``: on the host, or on the device (the previous step's samples,
        not yet read by the host)."""
        ids = _padded(ids, step.positions.size)
        if self.graphs is not None:
            logits = self.graphs.run(ids, step.positions, step.slots, step.work, step.layout.tables.numpy(),
                                     step.layout.key)
            if logits is not None:
                return logits
        # No graphs, or a step that does not fit them: eager, with this step's prepared attention.
        meta = StepMetadata(self.cache, self.on_device(step.slots), decode=self._prepare_decode(step))
        return self.forward(ids, step.positions, meta, None)

    def _prepare_decode(self, step: StepPlan) -> PreparedDecode:
        """The step's attention, run eagerly (its work items, when the planner built them for the graphs, reused)."""
        return prepare_decode(step.layout.tables, step.seq_lens, self.options.block_size, **self.heads,
                              mode="fca" if step.plan is not None else "plain", kernel=self.options.kernel,
                              device=self.device, plan=step.plan, tuning=self.tuning, work=step.work)

    def forward(self, ids: np.ndarray | torch.Tensor, positions: np.ndarray, meta: StepMetadata,
                rows: torch.Tensor | None) -> torch.Tensor:
        """Logits ``[rows, vocab]`` of the packed step, at ``rows`` (all rows when None), in the model's
        dtype: the samplers read them in fp32 themselves, so no fp32 copy of the whole vocabulary is made."""

        def as_tensor(a: np.ndarray | torch.Tensor) -> torch.Tensor:
            return a if isinstance(a, torch.Tensor) else self.on_device(a)

        return self.logits(as_tensor(ids), as_tensor(positions), meta, rows)

    def on_device(self, values: np.ndarray) -> torch.Tensor:
        """Host integers as an int64 device tensor, without waiting for the work queued before (a
        prefill pass is queued while the one before still runs, a decode step's smaller batch while
        the step before runs)."""
        return to_device(torch.from_numpy(np.ascontiguousarray(values, dtype=np.int64)), self.device)

    def logits(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: StepMetadata,
               rows: torch.Tensor | None = None) -> torch.Tensor:
        if self.decoder is not None:
            hidden = self.decoder(input_ids, positions, meta)
        else:
            hidden = self.model.base_model(input_ids=input_ids[None], position_ids=positions[None], paged=meta,
                                           use_cache=False).last_hidden_state[0]
        if rows is not None:
            hidden = hidden[rows]
        return self.model.get_output_embeddings()(hidden)

    # ---- sizing ------------------------------------------------------------------------------

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


def check_supported(model: PreTrainedModel) -> None:
    config = model.config
    layer_types = getattr(config, "layer_types", None) or []
    sliding = any(t != "full_attention" for t in layer_types) or (
        not layer_types and getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True))
    if sliding:
        raise ConfigError(f"the embedded engine cannot run {config.model_type} with sliding-window layers exactly; "
                          "use the hf-generate sampler")
    if model.get_output_embeddings() is None:
        raise ConfigError(f"{type(model).__name__} has no output embedding: not a causal LM")


def _padded(ids: np.ndarray | torch.Tensor, rows: int) -> np.ndarray | torch.Tensor:
    """A step's input token ids padded to its ``rows`` (padding rows read token 0)."""
    if isinstance(ids, torch.Tensor):
        return torch.nn.functional.pad(ids, (0, rows - ids.numel()))
    return np.pad(np.asarray(ids, dtype=np.int64), (0, rows - ids.size))


def _slots(blocks: list[int], positions: np.ndarray, block_size: int) -> np.ndarray:
    return np.asarray(blocks, dtype=np.int64)[positions // block_size] * block_size + positions % block_size
