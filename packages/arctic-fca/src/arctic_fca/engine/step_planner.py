"""The host side of a decode step: block tables, cache slots, the FCA plan and the work items.

None of it needs the step's sampled tokens, only which sequences run and how long they are, so the
engine plans step t+1 while the GPU runs step t. What changes rarely is kept: the block tables
until a sequence joins, leaves or takes a block, the FCA tree until some sequence fills a block.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from arctic_fca.engine.sequence import Sequence
from arctic_fca.fca.decode import Mode, choose_plan
from arctic_fca.fca.plan import FCAPlan, build_plan
from arctic_fca.fca.tuning import Tuning
from arctic_fca.fca.work import DecodeWork, build_work, device_sms


@dataclass
class DecodeLayout:
    """The running batch's block tables and, lazily, its FCA tree."""

    key: tuple[int, ...]  # StepPlanner.batch_key
    tables: torch.Tensor
    rows: dict[int, tuple[int, int]]  # sequence id -> (its row, its blocks written there)
    plan: FCAPlan | None = None
    plan_full_blocks: np.ndarray | None = None

    @classmethod
    def of(cls, running: list[Sequence], key: tuple[int, ...], before: DecodeLayout | None = None) -> DecodeLayout:
        """Tables of ``key[0]`` rows (past the running sequences: padding on the scratch block 0), as
        wide as the longest sequence's (the CUDA graphs' buffers hold the widest the model allows,
        ~2,560 blocks for 40,960 positions: a copy of 5 MB at 512 rows, at every step a sample left).
        The rows of sequences ``before`` holds are copied from it and only their new blocks written:
        in RL rollouts samples leave at most steps, and writing every row's blocks one by one took a
        large share of the host's time per step (docs/design/fca.md)."""
        width = max(len(s.blocks) for s in running)
        tables = np.zeros((key[0], width), dtype=np.int32)
        rows_before = before.rows if before is not None else {}
        kept, kept_before, grown = [], [], []
        for row, seq in enumerate(running):
            row_before, written = rows_before.get(seq.seq_id, (-1, 0))
            if row_before >= 0:
                kept.append(row)
                kept_before.append(row_before)
            if len(seq.blocks) > written:
                grown.append((row, written, seq.blocks))
        if kept:  # a sequence's blocks only grow while its id lasts (StepPlanner.batch_key)
            copied = min(width, before.tables.shape[1])
            tables[kept, :copied] = before.tables.numpy()[kept_before, :copied]
        for row, written, blocks in grown:
            tables[row, written:len(blocks)] = blocks[written:]
        return cls(key, torch.from_numpy(tables), {s.seq_id: (row, len(s.blocks)) for row, s in enumerate(running)})

    def tree(self, seq_lens: torch.Tensor, block_size: int) -> FCAPlan:
        full = (seq_lens // block_size).numpy()
        if self.plan is None or not np.array_equal(full, self.plan_full_blocks):
            self.plan, self.plan_full_blocks = build_plan(self.tables, seq_lens, block_size), full
        return self.plan


@dataclass
class StepPlan:
    layout: DecodeLayout
    positions: np.ndarray
    slots: np.ndarray
    seq_lens: torch.Tensor
    plan: FCAPlan | None  # None: plain decode
    work: DecodeWork | None  # for the CUDA graphs' kernels; None when running eagerly


class StepPlanner:
    """Plans decode steps for batches padded to ``bucket(n)`` rows (the CUDA graphs' batch sizes;
    without graphs, ``n`` rows)."""

    def __init__(self, block_size: int, mode: Mode, heads: dict, device: torch.device, tuning: Tuning, *,
                 bucket=None, with_work: bool = False) -> None:
        self.block_size, self.mode, self.heads, self.device, self.tuning = block_size, mode, heads, device, tuning
        self.bucket, self.with_work = bucket or (lambda n: n), with_work
        self.layout: DecodeLayout | None = None
        self.prepare_seconds = 0.0

    def reset(self) -> None:
        self.layout = None

    def batch_key(self, running: list[Sequence]) -> tuple[int, ...]:
        """(rows, sequence ids, their block counts): rows is the CUDA-graph bucket the batch is padded
        to; a sequence's blocks only grow until it leaves (a resumed one has a new id)."""
        return (self.bucket(len(running)), *(s.seq_id for s in running), *(len(s.blocks) for s in running))

    def plan(self, running: list[Sequence], ahead: int = 0) -> StepPlan:
        """The step for the running sequences ``ahead`` tokens from now."""
        begin = time.perf_counter()
        bs = self.block_size
        key = self.batch_key(running)
        rows = key[0]
        if self.layout is None or self.layout.key != key:
            self.layout = DecodeLayout.of(running, key, self.layout)
        tables = self.layout.tables
        positions = np.zeros(rows, dtype=np.int64)  # padding rows: position 0 of the scratch block
        positions[: len(running)] = [len(s.tokens) - 1 + ahead for s in running]
        slots = tables.numpy()[np.arange(rows), positions // bs].astype(np.int64) * bs + positions % bs
        seq_lens = torch.from_numpy((positions + 1).astype(np.int32))
        plan = choose_plan(tables, seq_lens, bs, mode=self.mode, **self.heads,
                           plan=self.layout.tree(seq_lens, bs) if self.mode != "plain" else None)
        work = None
        if self.with_work:
            group = self.heads["num_q_heads"] // self.heads["num_kv_heads"]
            work = build_work(plan, seq_lens.numpy(), tables.shape[1], bs, group=group,
                              num_kv_heads=self.heads["num_kv_heads"], num_sms=device_sms(self.device),
                              tuning=self.tuning)
        self.prepare_seconds += time.perf_counter() - begin
        return StepPlan(self.layout, positions, slots, seq_lens, plan, work)
