"""The FCA kernels' launch and split settings, as one value passed along instead of module globals.

The defaults were tuned on the H200 (``bench/fca_sweep.py``, each layer's KV cold in L2
as in a model). A work build takes a :class:`Tuning` and the work it returns carries it, so the
kernels always launch with the settings the items were cut for.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass(frozen=True)
class LaunchConfig:
    """Triton settings of one launch of the partial-attention kernel."""

    block_n: int = 64  # KV tokens per inner step: a gather of block_n / block_size pages
    num_warps: int = 4
    num_stages: int = 2  # software-pipeline stages (a GPU with less shared memory steps down)
    programs_per_sm: float | None = None  # this launch's own grid (None: Tuning.programs_per_sm)


@dataclass(frozen=True)
class Tuning:
    node: LaunchConfig = LaunchConfig(num_stages=5)  # shared-node items: tall query tiles
    single: LaunchConfig = LaunchConfig(num_stages=2)  # one request's own tokens
    # Persistent programs (x KV heads) per streaming multiprocessor: 4 rather than one program per
    # item let tail items run in the same wave, which small rollouts gain from (docs/design/fca.md).
    programs_per_sm: int = 4
    # The merge: partial rows a program reads at once, and its warps. A request has a few partial
    # rows (2-5 in GRPO rollouts): 4 rows and one warp per program were faster than 16 and two at
    # every GRPO shape measured (docs/design/fca.md).
    merge_rows: int = 4
    merge_warps: int = 1
    overlap_launches: bool = True  # node and single launches on two CUDA streams (they write disjoint rows)
    items_per_sm: int = 2  # split target: work items (x KV heads) per streaming multiprocessor
    node_tile_rows: int = 64  # query rows (requests x heads per KV head) a node item serves at once
    min_chunk_tokens: int = 256  # split lengths: enough items to hide the gathers' latency,
    max_chunk_tokens: int = 8192  # few enough partials to merge
    # A shared prefix longer than the split length is cut into pieces of equal length (whole KV
    # blocks), not into split-length pieces and a short last one: the longest piece sets the
    # launch's time (a 5,440-token prompt: 3 x ~1,820 tokens rather than 2,048 + 2,048 + 1,344).
    even_pieces: bool = True

    def replace(self, **changes: object) -> Tuning:
        return dataclasses.replace(self, **changes)

    def per_tile(self, group: int) -> int:
        """Requests a node item serves at once, with ``group`` query heads per KV head."""
        return max(1, self.node_tile_rows // group)


DEFAULT_TUNING = Tuning()
