# A record, not maintained (last run at commit aedc9ac): a decode step as one persistent launch with grid barriers.
"""What would a decode step cost if it were one persistent kernel? A skeleton that moves exactly a
Qwen3-1.7B decode step's bytes, in the step's order and with its dependencies, and computes
nothing, timed three ways on the same buffers:

- "kernels": one streaming-read kernel per phase of each layer (QKV weights, the attention's KV,
  the output product's weights, gate/up's, down's) and a one-program kernel for each small step
  between them (norms, rotary + cache store, the attention's merge), as today's engine launches
  them (28 layers, then the LM head, in one CUDA graph);
- "persistent": one launch whose programs stream every phase in turn, with a grid-wide barrier
  where the step has a dependency (after every phase and small step): what a whole-step
  persistent kernel pays for its synchronisation alone, before any compute;
- "one pass": all the bytes in one streaming read, the floor a step can approach.

"fused/..." runs the first two with the small steps folded into the heavy phases' prologues and
epilogues (five dependencies per layer: QKV, attention, output, gate/up, down), and
"persistent+prefetch" has each program, once it has arrived at a barrier, load the first
``--prefetch`` blocks of its share of the next phase before it waits (weights and cached KV do not
depend on the phase before): what a whole-step kernel whose programs stream the next product's
weights while the last one finishes could reach.

The step's bytes at --shape (groups/samples/prompt, --suffix own tokens per sample): every weight
once and the KV FCA reads (each prompt once, each sample's own tokens). The per-layer phases
follow the fused decoder with the gated gate/up product (no separate SiLU x up).

--smoke (CPU, under TRITON_INTERPRET=1, barriers only in a one-program launch: the interpreter
runs programs one at a time): the kernels' sums against torch's. GPU otherwise; the last line
printed is a JSON object.
"""

from __future__ import annotations

import argparse
import json

import torch
import triton
import triton.language as tl

from decode_gemm import HEAD_DIM, HIDDEN, KV_HEADS, LAYERS, PRODUCTS
from fca_common import graphed, parse_shapes, smoke_or_gpu, time_us

VOCAB, KV_BYTES_PER_TOKEN = 151936, KV_HEADS * HEAD_DIM * 2 * 2  # Qwen3-1.7B: K and V, bf16
BLOCK = 2048  # int32 words per program and iteration (8 KB)


def step_phases(groups: int, samples: int, prompt: int, suffix: int, small_steps: bool = True) -> list[tuple[str, int]]:
    """(name, bytes) of one decode step in order; 0 bytes: a small step (a dependency only), left
    out without ``small_steps`` (folded into the heavy phases)."""
    weight = {name: n * k * 2 for name, (n, k) in PRODUCTS.items()}
    kv = (groups * prompt + groups * samples * suffix) * KV_BYTES_PER_TOKEN
    layer = [("norm", 0), ("qkv", weight["qkv"]), ("rope_store", 0), ("attention", kv), ("merge", 0),
             ("o", weight["o"]), ("norm", 0), ("gate_up", weight["gate_up"]), ("down", weight["down"])]
    phases = layer * LAYERS + [("norm", 0), ("lm_head", VOCAB * HIDDEN * 2), ("sample", 0)]
    return phases if small_steps else [phase for phase in phases if phase[1]]


@triton.jit
def _stream(buf_ptr, lo, hi, acc, BLOCK: tl.constexpr):
    """``acc`` plus the blocks ``lo:hi`` of ``buf`` (whole blocks: Step pads every phase, so no
    mask and vector loads)."""
    for block in range(lo, hi):
        acc += tl.load(buf_ptr + block * BLOCK + tl.arange(0, BLOCK))  # int32 offsets: Step checks
    return acc


@triton.jit
def _share(start, length, pid, programs):
    """This program's slice ``[lo, hi)`` of the blocks ``[start, start + length)``."""
    per = tl.cdiv(length, programs)
    lo = start + pid * per
    return lo, tl.minimum(start + length, lo + per)


@triton.jit
def _read_kernel(buf_ptr, start, length, out_ptr, BLOCK: tl.constexpr):
    """One phase as its own launch: the programs share its blocks; each stores its sum."""
    pid, programs = tl.program_id(0), tl.num_programs(0)
    lo, hi = _share(start, length, pid, programs)
    acc = _stream(buf_ptr, lo, hi, tl.zeros([BLOCK], tl.int32), BLOCK)
    tl.store(out_ptr + pid, tl.sum(acc, 0))


@triton.jit
def _wait(counter_ptr, target, MAX_SPINS: tl.constexpr = 1 << 20):
    """Spin until ``target`` programs have arrived (volatile reads, as a grid sync spins). A grid
    whose programs cannot all be resident would wait forever: after MAX_SPINS reads the program
    raises the flag ``counter[2]`` and opens every barrier of the launch (its timing is void)."""
    arrived = tl.load(counter_ptr, volatile=True)
    spins = 0
    while (arrived < target) & (spins < MAX_SPINS):
        arrived = tl.load(counter_ptr, volatile=True)
        spins += 1
    if arrived < target:
        tl.atomic_xchg(counter_ptr + 2, 1)
        tl.atomic_max(counter_ptr, 1 << 30)  # idempotent: several programs may give up at once


@triton.jit
def _phase_share(phase_ptr, phase, pid, programs):
    return _share(tl.load(phase_ptr + 2 * phase), tl.load(phase_ptr + 2 * phase + 1), pid, programs)


@triton.jit
def _prefetch(buf_ptr, lo, hi, PREFETCH: tl.constexpr, BLOCK: tl.constexpr):
    """The blocks ``lo:lo + PREFETCH`` of ``buf`` (zeros past ``hi``) as one [PREFETCH, BLOCK] load."""
    blocks = lo + tl.arange(0, PREFETCH)
    return tl.load(buf_ptr + blocks[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :], mask=(blocks < hi)[:, None],
                   other=0)


@triton.jit
def _persistent_kernel(buf_ptr, phase_ptr, num_phases, counter_ptr, out_ptr, BLOCK: tl.constexpr,
                       BARRIERS: tl.constexpr, PREFETCH: tl.constexpr):
    """Every phase in turn (``phase_ptr``: start and length in blocks per phase, then a (0, 0)
    sentinel), all programs meeting at a grid-wide barrier after each (BARRIERS). With PREFETCH
    (a power of two, or 0), a program loads its first PREFETCH blocks of a phase before waiting
    for the phase before. The programs must all be resident."""
    pid, programs = tl.program_id(0), tl.num_programs(0)
    acc = tl.zeros([BLOCK], tl.int32)
    if PREFETCH:
        ahead = _prefetch(buf_ptr, *_phase_share(phase_ptr, 0, pid, programs), PREFETCH, BLOCK)
    for phase in range(num_phases):
        lo, hi = _phase_share(phase_ptr, phase, pid, programs)
        if PREFETCH:
            acc += tl.sum(ahead, 0)
            lo = tl.minimum(hi, lo + PREFETCH)
        acc = _stream(buf_ptr, lo, hi, acc, BLOCK)
        if BARRIERS:
            tl.atomic_add(counter_ptr, 1)  # arrive (release: this phase's work is done)
        if PREFETCH:  # the next phase's first blocks, in flight while this program waits
            ahead = _prefetch(buf_ptr, *_phase_share(phase_ptr, phase + 1, pid, programs), PREFETCH, BLOCK)
        if BARRIERS:
            _wait(counter_ptr, (phase + 1) * programs)
    tl.store(out_ptr + pid, tl.sum(acc, 0))
    if BARRIERS:  # the last program out resets the barrier for the next launch (graph replays)
        if tl.atomic_add(counter_ptr + 1, 1) == programs - 1:
            tl.atomic_xchg(counter_ptr, 0)
            tl.atomic_xchg(counter_ptr + 1, 0)


class Step:
    """The step's phases laid out one after another in one buffer of int32 words, each padded to
    whole blocks of BLOCK words; ``spans``: (first block, blocks) per phase. ``buffer``: another
    Step's, when these phases lay out the same bytes (the same step without its 0-byte phases)."""

    def __init__(self, phases: list[tuple[str, int]], device: str, buffer: torch.Tensor | None = None) -> None:
        blocks = [triton.cdiv(size, 4 * BLOCK) for _, size in phases]
        starts = torch.tensor([0, *blocks[:-1]]).cumsum(0)
        self.spans = list(zip(starts.tolist(), blocks, strict=True))
        if sum(blocks) * BLOCK >= 2**31:
            raise ValueError("the step's bytes exceed the kernels' int32 offsets (8 GiB): a smaller --shape")
        words = sum(blocks) * BLOCK
        if buffer is not None and buffer.numel() != words:
            raise ValueError(f"a shared buffer must hold these phases' {words} words, not {buffer.numel()}")
        self.buffer = buffer if buffer is not None else torch.randint(-8, 8, (words,), dtype=torch.int32,
                                                                      device=device)
        self.table = torch.tensor([x for span in [*self.spans, (0, 0)] for x in span], dtype=torch.int64,
                                  device=device)
        self.counter = torch.zeros(3, dtype=torch.int32, device=device)  # arrivals, departures, stuck
        self.bytes = 4 * self.buffer.numel()

    def stuck(self) -> bool:
        """Whether a persistent launch since the last call found its programs not all resident."""
        stuck = bool(self.counter[2])
        self.counter[2] = 0
        return stuck

    def _sums(self, programs: int) -> torch.Tensor:
        return torch.zeros(programs, dtype=torch.int32, device=self.buffer.device)

    def kernels(self, programs: int) -> torch.Tensor:
        out = self._sums(programs)
        for start, length in self.spans:
            grid = programs if length else 1
            _read_kernel[(grid,)](self.buffer, start, length, out, BLOCK=BLOCK, num_warps=8)
        return out

    def persistent(self, programs: int, barriers: bool = True, prefetch: int = 0) -> torch.Tensor:
        out = self._sums(programs)
        _persistent_kernel[(programs,)](self.buffer, self.table, len(self.spans), self.counter, out, BLOCK=BLOCK,
                                        BARRIERS=barriers, PREFETCH=prefetch, num_warps=8)
        return out

    def one_pass(self, programs: int) -> torch.Tensor:
        out = self._sums(programs)
        _read_kernel[(programs,)](self.buffer, 0, self.buffer.numel() // BLOCK, out, BLOCK=BLOCK, num_warps=8)
        return out


def smoke() -> dict:
    """Each way's total against torch's sum on a small step (barriers with one program only: see
    the module doc)."""
    step = Step([("a", 4 * 5000), ("small", 0), ("b", 4 * 70001), ("c", 4 * 3)], "cpu")  # padded to blocks
    expected = int(step.buffer.sum())
    got = {"kernels": step.kernels(3), "persistent": step.persistent(3, barriers=False), "one_pass": step.one_pass(4),
           "persistent+prefetch": step.persistent(3, barriers=False, prefetch=4),
           "one program, barriers": step.persistent(1, prefetch=2)}
    # "kernels" stores each phase's sums over the last ones: its total is the last phase's; check it alone
    last_start, last_blocks = step.spans[-1]
    last = step.buffer[last_start * BLOCK:(last_start + last_blocks) * BLOCK]
    checks = {"persistent": int(got["persistent"].sum()) == expected,
              "persistent+prefetch": int(got["persistent+prefetch"].sum()) == expected,
              "one program, barriers": int(got["one program, barriers"].sum()) == expected and not step.stuck(),
              "one_pass": int(got["one_pass"].sum()) == expected,
              "kernels_last_phase": int(got["kernels"].sum()) == int(last.sum())}
    return {"all_equal": all(checks.values()), **checks}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="CPU check (run with TRITON_INTERPRET=1)")
    parser.add_argument("--shape", default="8/8/2048", help="groups/samples/prompt")
    parser.add_argument("--suffix", type=int, default=256, help="own tokens per sample (its mean over a rollout)")
    parser.add_argument("--programs-per-sm", type=json.loads, default=[1, 2, 4])
    parser.add_argument("--prefetch", type=json.loads, default=[1, 2, 4],
                        help="blocks of 8 KB each program loads of the next phase before it waits (powers of two)")
    args = parser.parse_args()
    if smoke_or_gpu(args.smoke, smoke, "persistent_step.py"):
        return
    groups, samples, prompt = parse_shapes(args.shape)[0]
    step = Step(step_phases(groups, samples, prompt, args.suffix), "cuda")
    fused = Step(step_phases(groups, samples, prompt, args.suffix, small_steps=False), "cuda", buffer=step.buffer)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    results = {"device": torch.cuda.get_device_name(), "shape": args.shape, "suffix": args.suffix,
               "step_gb": round(step.bytes / 1e9, 3), "launches_per_step": len(step.spans),
               "fused_launches_per_step": len(fused.spans), "ms": {}}
    for per_sm in args.programs_per_sm:
        programs = per_sm * sms
        ways = {"kernels": (step, "kernels", {}), "persistent": (step, "persistent", {}),
                "one_pass": (step, "one_pass", {}), "fused/kernels": (fused, "kernels", {}),
                "fused/persistent": (fused, "persistent", {}),
                **{f"fused/persistent+prefetch {n}": (fused, "persistent", {"prefetch": n}) for n in args.prefetch}}
        for name, (which, way, options) in ways.items():
            key = f"{name}/{per_sm} per SM"
            sums = getattr(which, way)(programs, **options)
            if which.stuck():
                results["ms"][key] = "programs not all resident"
            else:
                if way != "kernels" and int(sums.sum()) != int(which.buffer.sum()):
                    raise AssertionError(f"{key}: its sums differ from torch's")
                replay = graphed(lambda w=which, f=way, p=programs, o=options: getattr(w, f)(p, **o))
                results["ms"][key] = round(time_us(replay) / 1e3, 3)
            print(key, results["ms"][key], flush=True)
    best_pass = min(v for k, v in results["ms"].items() if k.startswith("one_pass"))
    results["one_pass_tb_s"] = round(step.bytes / (best_pass * 1e-3) / 1e12, 2)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
