"""FCA's launch settings swept on the GPU (``arctic_fca.fca.tuning``): FCA and plain decode timed
per setting, one knob group at a time, the others at their defaults.

    python3 bench/fca_sweep.py [--quick] [--vllm-shapes] [--shapes G/S/P,...] [--match TEXT,...]

Prints one line per setting, then a JSON object of all results.
"""

from __future__ import annotations

import argparse
import functools
import json
import math

import torch

from arctic_fca.fca.decode import prepare_decode
from arctic_fca.fca.tuning import DEFAULT_TUNING, LaunchConfig, Tuning
from fca_common import (GPU_SUFFIX, QWEN3_1_7B_HEADS, QWEN3_8B_HEADS, VLLM_SHAPES, attention_args, build_batch,
                        layer_copies, parse_shapes, per_layer_us)

SWEEP_SHAPES = [(32, 8, 4096), (8, 16, 16384), (1, 64, 4096), (128, 1, 4096)]


def tuning_of(change: dict) -> Tuning:
    """The default tuning with a sweep setting's changes."""
    fields = {"node": lambda v: LaunchConfig(**v), "single": lambda v: LaunchConfig(**v)}
    names = {"items": "items_per_sm", "programs": "programs_per_sm", "rows": "node_tile_rows"}
    updates = {names.get(k, k): fields.get(k, lambda v: v)(v) for k, v in change.items() if k != "sequential"}
    if change.get("sequential"):
        updates["overlap_launches"] = False
    return DEFAULT_TUNING.replace(**updates)


COMBOS = [  # settings the single-knob sweep liked, together (--sweep --quick)
    ("nodes bn64 s4, singles bn64, 2 items/SM", {"node": {"block_n": 64, "num_warps": 4, "num_stages": 4},
                                                 "single": {"block_n": 64, "num_warps": 4, "num_stages": 2},
                                                 "items": 2}),
    ("nodes bn64 s4, singles bn64 w2 s3, 2 items/SM", {"node": {"block_n": 64, "num_warps": 4, "num_stages": 4},
                                                       "single": {"block_n": 64, "num_warps": 2, "num_stages": 3},
                                                       "items": 2}),
    ("nodes bn64 s4, singles bn64", {"node": {"block_n": 64, "num_warps": 4, "num_stages": 4},
                                     "single": {"block_n": 64, "num_warps": 4, "num_stages": 2}}),
]


def sweep(heads: dict, shapes, quick: bool = False, match: list[str] | None = None) -> dict:
    """Time FCA and plain over launch settings (one knob group at a time, the others at their
    defaults); prints one line per setting. Used to pick ``arctic_fca.fca.tuning``'s defaults."""
    batches = [build_batch(g, s, p, GPU_SUFFIX, dtype=torch.bfloat16, device="cuda", **heads) for g, s, p in shapes]
    scale = 1 / math.sqrt(heads["head_dim"])

    def measure(tuning: Tuning) -> dict:
        times = {}
        for (g, s, p), batch in zip(shapes, batches, strict=True):
            query, key_cache, value_cache, block_tables, seq_lens = attention_args(batch)
            caches = layer_copies(key_cache, value_cache)
            for mode in ("fca", "plain"):
                prepared = prepare_decode(block_tables.cpu(), seq_lens.cpu(), key_cache.shape[1], mode=mode,
                                          num_q_heads=query.shape[1], num_kv_heads=key_cache.shape[2],
                                          head_dim=query.shape[2], dtype=query.dtype, device="cuda", tuning=tuning)
                run = functools.partial(lambda layer, p: p(query, *caches[layer], scale), p=prepared)
                times[f"{g}x{s}@{p} {mode}"] = round(per_layer_us(run), 1)
        return times

    settings = [("default", {}), ("default, sequential launches", {"sequential": True})] + COMBOS
    settings += [] if quick else [(f"node rows {rows}", {"rows": rows}) for rows in (16, 32, 128)]
    # Taller node tiles want more warps (a 128-row tile over 4 warps spills).
    settings += [] if quick else [(f"node rows 128 bn{bn} w8 s{st}",
                                   {"rows": 128, "node": {"block_n": bn, "num_warps": 8, "num_stages": st}})
                                  for bn, st in ((64, 2), (64, 3), (32, 4), (128, 2))]
    settings += [] if quick else [(f"node bn{bn} w{w} s{st}",
                                   {"node": {"block_n": bn, "num_warps": w, "num_stages": st}})
                                  for bn in (32, 64, 128) for w in (4, 8) for st in (2, 3, 4)]
    # Deeper pipelines (more KV bytes in flight per SM; shared memory allows them at one program per SM).
    settings += [] if quick else [(f"node bn{bn} w4 s{st}", {"node": {"block_n": bn, "num_warps": 4, "num_stages": st}})
                                  for bn, st in ((64, 5), (64, 6), (32, 6), (32, 8))]
    settings += [] if quick else [(f"single bn{bn} w{w} s{st}",
                                   {"single": {"block_n": bn, "num_warps": w, "num_stages": st}})
                                  for bn in (64, 128) for w in (2, 4) for st in (2, 3)]
    settings += [] if quick else [(f"items/SM {i} programs/SM {pr}", {"items": i, "programs": pr})
                                  for i in (2, 4, 8, 16) for pr in (16, 32)]
    if match:
        settings = [(name, change) for name, change in settings if name == "default" or any(m in name for m in match)]
    results = {}
    for name, change in settings:
        results[name] = measure(tuning_of(change))
        print(name, json.dumps(results[name]), flush=True)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vllm-shapes", action="store_true",
                        help="Qwen3-1.7B heads at bench/vllm_fca.py's shapes (default: Qwen3-8B's)")
    parser.add_argument("--quick", action="store_true", help="the defaults and COMBOS only")
    parser.add_argument("--shapes", type=parse_shapes,
                        help="G/S/P,...: groups/samples/prefix")
    parser.add_argument("--match", type=lambda s: s.split(","), help="only settings naming one of these")
    args = parser.parse_args()
    heads, shapes = (QWEN3_1_7B_HEADS, VLLM_SHAPES) if args.vllm_shapes else (QWEN3_8B_HEADS, SWEEP_SHAPES)
    print(json.dumps(sweep(heads, args.shapes or shapes, args.quick, args.match)))


if __name__ == "__main__":
    main()
