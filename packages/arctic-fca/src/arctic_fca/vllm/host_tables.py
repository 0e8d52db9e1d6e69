"""What the host knows of a decode step's block tables, handed to FCA's metadata builders.

A batch in which no two requests share a KV block cannot gain from FCA, and telling so on the
device costs the work build's whole forest search (docs/design/fca.md, "Inside vLLM"). The host can
tell for the price of a ``np.unique``: prefix caching gives one block id to one token prefix, so
requests that share any block share their first (``fca.shares_a_block``). vLLM's two model
runners keep the first blocks on the host differently:

- V1 (``gpu_model_runner``): the input batch holds a host copy of each group's block table, rows
  in the batch's order, filled before every step;
- V2 (``gpu/model_runner``, the default for common models in vLLM 0.24): block ids are staged to
  the device per request slot and gathered there, so no host copy exists. The first block of each
  slot is recorded as the runner appends ids (``BlockTables.append_block_ids``), and the step's
  slots in batch order are taken as the runner prepares attention (``prepare_attn``).

V2 also names each step's requests (``HostStep.requests``): a slot gets a new id whenever the
runner writes a request's blocks from the start (a new request, or one resumed after preemption).
Between two such writes a request only decodes, and the blocks it fills are its own, so its
place in the shared-prefix forest stands: a step with the same ids as the last reuses its forest
(``DeviceWorkBuilder.build(forest_key=...)``). V1 keeps no such ids (``requests`` is None).

Duck-typed, no vLLM import: the CPU suite runs it on stand-in runners. A runner of neither shape
gets nothing attached (a warning), and FCA then searches every batch on the device, as before.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable
from typing import Any

import numpy as np

from arctic_fca.vllm.fca import HostStep, fca_builders

logger = logging.getLogger(__name__)
HostView = Callable[[], "HostStep | None"]  # this step's requests as the host knows them, or None: unknown


def attach_host_tables(runner: Any) -> int:
    """Set ``host_step`` on each FCA metadata builder of ``runner`` (once its KV cache is set up);
    returns the number of builders that got one."""
    builders = fca_builders(runner)
    if not builders:
        return 0
    if hasattr(runner, "input_batch") and hasattr(runner.input_batch, "block_table"):
        view = _v1_view(runner)
    elif hasattr(runner, "block_tables") and hasattr(runner, "prepare_attn"):
        view = _v2_view(runner)
    else:
        logger.warning("FCA: %s keeps no block tables FCA knows of; every decode batch is searched for "
                       "shared prefixes on the device", type(runner).__name__)
        return 0
    for group_id, builder in builders:
        builder.host_step = view(group_id)
    return len(builders)


def _v1_view(runner: Any) -> Callable[[int], HostView]:
    def for_group(group_id: int) -> HostView:
        def host_step() -> HostStep:
            batch = runner.input_batch
            return HostStep(batch.block_table[group_id].block_table.np[: batch.num_reqs, 0], requests=None)
        return host_step
    return for_group


def _v2_view(runner: Any) -> Callable[[int], HostView]:
    tables = runner.block_tables
    first = np.full((len(tables.block_tables), tables.max_num_reqs), -1, dtype=np.int64)  # per request slot
    request_ids = np.full(tables.max_num_reqs, -1, dtype=np.int64)  # per request slot
    serial = itertools.count()
    step: dict[str, np.ndarray | None] = {"slots": None}  # this step's slots, in batch order
    append, prepare, prepare_dummy = tables.append_block_ids, runner.prepare_attn, runner.prepare_dummy_attn

    def append_block_ids(req_index: int, new_block_ids: tuple[list[int], ...], overwrite: bool) -> None:
        for group_id, ids in enumerate(new_block_ids):
            if ids and (overwrite or tables.num_blocks.np[group_id, req_index] == 0):  # written from the start
                first[group_id, req_index] = ids[0]  # (a kernel-block split keeps first ids distinct)
                request_ids[req_index] = next(serial)
        append(req_index, new_block_ids, overwrite)

    def prepare_attn(input_batch: Any) -> Any:
        step["slots"] = np.asarray(input_batch.idx_mapping_np)
        return prepare(input_batch)

    def prepare_dummy_attn(input_batch: Any) -> Any:
        step["slots"] = None  # a dummy batch: its requests are nobody's
        return prepare_dummy(input_batch)

    tables.append_block_ids, runner.prepare_attn, runner.prepare_dummy_attn = (
        append_block_ids, prepare_attn, prepare_dummy_attn)

    def for_group(group_id: int) -> HostView:
        def host_step() -> HostStep | None:
            slots = step["slots"]
            return None if slots is None else HostStep(first[group_id, slots], request_ids[slots])
        return host_step
    return for_group
