"""The decode step planner's block tables, kept from step to step, against tables built afresh."""

from __future__ import annotations

import random

import torch

from arctic_fca.engine.sequence import Sequence
from arctic_fca.engine.step_planner import DecodeLayout


def test_tables_kept_across_steps_equal_tables_built_afresh():
    """Samples grow by blocks, leave, and join (a resumed one under a new id with new blocks) from
    step to step; each step's tables, built from the last step's, equal those built from nothing."""
    rng = random.Random(0)
    next_block = iter(range(1, 10_000))
    running = [Sequence(0, [1], 100, [next(next_block) for _ in range(rng.randint(1, 4))], None, 0) for _ in range(9)]
    layout = None
    for step in range(40):
        for seq in running:
            if len(seq.blocks) < 12 and rng.random() < 0.3:
                seq.blocks.append(next(next_block))
        if step % 3 == 0:
            running.pop(rng.randrange(len(running)))
        if step % 5 == 0:
            running.insert(rng.randrange(len(running) + 1), Sequence(0, [1], 100, [next(next_block)], None, 0))
        key = (len(running) + rng.randint(0, 3), *(s.seq_id for s in running), *(len(s.blocks) for s in running))
        fresh = DecodeLayout.of(running, key)
        layout = DecodeLayout.of(running, key, layout)
        assert torch.equal(layout.tables, fresh.tables), step
        assert layout.tables[len(running):].eq(0).all()  # padding rows on the scratch block
