# A record, not maintained (last run at commit 82a42df): what one more near-empty kernel costs in a CUDA graph.
"""What one more kernel costs a decode step: a CUDA graph of N kernels one after another that do
almost nothing (each program reads and writes 512 bytes), per kernel, for grids of 1 program, one
per SM and four per SM (the attention and product kernels' grids), launched plainly and as
programmatic dependent launches (each kernel may start while the one before ends, and waits for it
before touching memory). This is the floor under the per-launch cost of a step of ~300 kernels,
whatever the kernels compute.

GPU only. The last line printed is a JSON object of the results.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from fca_common import graphed, time_us


@triton.jit
def _touch(ptr, WIDTH: tl.constexpr, PDL: tl.constexpr):
    offsets = tl.program_id(0) * WIDTH + tl.arange(0, WIDTH)
    if PDL:  # the next kernel may start now; this one waits for the one before to finish
        gdc_launch_dependents()
        gdc_wait()
    tl.store(ptr + offsets, tl.load(ptr + offsets) + 1.0)


def per_kernel_us(programs: int, kernels: int, pdl: bool = False) -> float:
    """Microseconds per kernel of a graph of ``kernels`` launches of ``programs`` programs each
    (``pdl``: each launched as a programmatic dependent of the one before)."""
    buffer = torch.zeros(programs * 128, device="cuda")
    replay = graphed(lambda: [_touch[(programs,)](buffer, WIDTH=128, PDL=pdl, num_warps=4, launch_pdl=pdl)
                              for _ in range(kernels)])
    return time_us(replay) / kernels


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kernels", type=int, default=300)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("launch_gap.py times GPU launches: no CUDA device here")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    results = {f"{programs} programs{' pdl' if pdl else ''}": round(per_kernel_us(programs, args.kernels, pdl), 2)
               for pdl in (False, True) for programs in (1, sms, 4 * sms)}
    print(json.dumps({"device": torch.cuda.get_device_name(), "kernels": args.kernels, "us_per_kernel": results}))


if __name__ == "__main__":
    main()
