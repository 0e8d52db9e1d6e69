"""Top-k, top-p and min-p as per-row floors found on the device, without sorting the vocabulary.

Sorting 64 rows of 151,936 logits to filter them costs more than the decode step's LM head. Each
filter keeps the entries at or above a floor instead, ties included (as transformers' top-k keeps
every entry equal to the k-th largest):

- top-k: the k-th largest logit;
- top-p, on the top-k set: an entry stays while the mass of the entries strictly above it is under
  ``p`` of the set's (a tie stays or goes as a whole, where a sort would cut it anywhere);
- min-p: ``max + T log(min_p)`` (probability at least ``min_p`` times the likeliest's; ``min_p``
  one for all rows, or each row's own).

The top-k and top-p floors are searched over the logits' order-preserving integer keys (a float's
bits with the negatives' flipped): 16-bit keys for bf16 and fp16 logits, 32-bit for fp32. One
program per row first takes the row's max, its sum of ``exp((x - max) / T)`` and each chunk's max,
then narrows a key range with three pivots per pass over the row (each pass counts the entries, or
sums their mass, at or above each pivot): at most 8 passes per filter over a bf16 row, 16 over an
fp32 one. A pass skips the blocks whose chunk maxima are all below its lowest pivot, and the
ranges start high: top-k at the k-th largest chunk maximum, top-p where an entry's mass is too
small to stay. The sampling race (``triton_sampling``) then draws among the entries at or above
both floors, skipping the blocks with none.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from arctic_fca.fca.work import device_sms

BLOCK = 2048  # entries per inner step
# With no more rows than SMs a program has an SM to itself: larger steps keep more bytes in flight;
# with more rows, smaller programs share the SMs better (docs/design/fca.md).
WIDE_BLOCK, WIDE_WARPS = 8192, 16
CHUNK = 128  # entries per chunk maximum (kept by the first pass, so that later passes skip whole blocks)


@triton.jit
def order_keys(x, BITS: tl.constexpr):
    """Integer keys in the order of the floats ``x`` (their raw bits, negatives' magnitude flipped)."""
    if BITS == 16:
        bits = x.to(tl.int16, bitcast=True).to(tl.int32)
        keys = tl.where(bits < 0, bits ^ 0x7FFF, bits)
    else:
        bits = x.to(tl.int32, bitcast=True)
        keys = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    return keys


@triton.jit
def _at_or_above(base, n, chunk_tops, q1, q2, q3, top, scale, MASS: tl.constexpr, SKIP: tl.constexpr,
                 BITS: tl.constexpr, BLOCK: tl.constexpr, CHUNK: tl.constexpr):
    """The counts (MASS: the masses ``exp((x - top) * scale)``) of the ``n`` entries at ``base``
    whose keys are at or above each pivot. SKIP: a block whose chunk maxima (``chunk_tops``) are
    all below the lowest pivot is not read."""
    f1, f2, f3 = 0.0, 0.0, 0.0
    for start in range(0, n, BLOCK):
        if SKIP:
            chunks = start // CHUNK + tl.arange(0, BLOCK // CHUNK)
            tops = tl.load(chunk_tops + chunks, mask=chunks * CHUNK < n, other=float("-inf"))
            read = tl.max(order_keys(tops, BITS), 0) >= q1
        else:
            read = True
        if read:
            cols = start + tl.arange(0, BLOCK)
            ok = cols < n
            x = tl.load(base + cols, mask=ok, other=float("-inf"))
            key = order_keys(x, BITS)
            if MASS:
                weight = tl.where(ok, tl.exp((x.to(tl.float32) - top) * scale), 0.0)
            else:
                weight = ok.to(tl.float32)
            f1 += tl.sum(tl.where(key >= q1, weight, 0.0), 0)
            f2 += tl.sum(tl.where(key >= q2, weight, 0.0), 0)
            f3 += tl.sum(tl.where(key >= q3, weight, 0.0), 0)
    return f1, f2, f3


@triton.jit
def _largest_key_reaching(base, n, chunk_tops, lo, hi, target, top, scale, MASS: tl.constexpr, SKIP: tl.constexpr,
                          BITS: tl.constexpr, BLOCK: tl.constexpr, CHUNK: tl.constexpr):
    """The largest key ``u`` in ``[lo, hi)`` whose entries at or above it reach ``target`` (their
    count, or with MASS their mass), given that ``lo``'s do and ``hi``'s do not."""
    while hi.to(tl.int64) - lo > 1:  # 32-bit keys span more than an int32
        span = hi.to(tl.int64) - lo
        q1 = lo + tl.maximum(span // 4, 1).to(tl.int32)
        q2 = lo + tl.maximum(span // 2, 1).to(tl.int32)
        q3 = lo + tl.maximum(span * 3 // 4, 1).to(tl.int32)
        f1, f2, f3 = _at_or_above(base, n, chunk_tops, q1, q2, q3, top, scale, MASS, SKIP, BITS, BLOCK, CHUNK)
        # The reach only falls as the pivot rises: keep the last pivot that reaches, stop at the first that does not.
        if f3 >= target:
            lo = q3
        elif f2 >= target:
            lo, hi = q2, q3
        elif f1 >= target:
            lo, hi = q1, q2
        else:
            hi = q1
    return lo


@triton.jit
def _row_floors(logits_ptr, stride_row, temperature_ptr, top_k_ptr, top_p_ptr, chunk_tops_ptr, key_floor_ptr,
                value_floor_ptr, vocab, num_chunks, log_min_p, BITS: tl.constexpr, LOWEST: tl.constexpr,
                HIGHEST: tl.constexpr, BLOCK: tl.constexpr, CHUNK: tl.constexpr, ROW_MIN_P: tl.constexpr):
    """One row's floors. ``log_min_p``: log(min_p) (-inf: off), one float for all rows, or with
    ROW_MIN_P a pointer to each row's (fp32 ``[rows]``)."""
    row = tl.program_id(0)
    base = logits_ptr + row.to(tl.int64) * stride_row
    chunk_tops = chunk_tops_ptr + row.to(tl.int64) * num_chunks
    temperature = tl.load(temperature_ptr + row)
    scale = tl.where(temperature == 0, 1.0, 1.0 / temperature)
    # First pass: the row's smallest and largest keys, its max, the mass of the whole row relative to
    # that (online), and each chunk's max.
    bottom_key = tl.full([], HIGHEST, tl.int32)
    top_key = tl.full([], LOWEST, tl.int32)
    top, total = float("-inf"), 0.0
    for start in range(0, vocab, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        ok = cols < vocab
        raw = tl.load(base + cols, mask=ok, other=float("-inf"))
        keys = order_keys(raw, BITS)
        bottom_key = tl.minimum(bottom_key, tl.min(tl.where(ok, keys, HIGHEST), 0))
        top_key = tl.maximum(top_key, tl.max(keys, 0))
        chunks = start // CHUNK + tl.arange(0, BLOCK // CHUNK)
        tl.store(chunk_tops + chunks, tl.max(tl.reshape(raw, [BLOCK // CHUNK, CHUNK]), 1), mask=chunks < num_chunks)
        x = raw.to(tl.float32)
        new_top = tl.maximum(top, tl.max(x, 0))
        total = total * tl.exp((top - new_top) * scale) + tl.sum(tl.exp((x - new_top) * scale), 0)
        top = new_top
    # Every entry is at or above the smallest key: a floor there keeps the row whole.
    floor, mass = bottom_key, total
    top_k = tl.load(top_k_ptr + row)
    top_p = tl.load(top_p_ptr + row)
    sampled = temperature != 0  # greedy rows take the argmax of the raw logits: no filter
    if sampled & (top_k > 0) & (top_k < vocab):
        k = top_k.to(tl.float32)
        if top_k <= num_chunks:  # k chunks whose maxima are at or above the k-th largest maximum: a floor below a_k
            floor = _largest_key_reaching(chunk_tops, num_chunks, chunk_tops, floor, top_key + 1, k, top, scale,
                                          False, False, BITS, BLOCK, CHUNK)
        floor = _largest_key_reaching(base, vocab, chunk_tops, floor, top_key + 1, k, top, scale, False, True, BITS,
                                      BLOCK, CHUNK)
        if top_p < 1.0:  # top-p takes its share of the top-k set's mass: one more pass, only then
            mass, _, _ = _at_or_above(base, vocab, chunk_tops, floor, floor, floor, top, scale, True, True, BITS,
                                      BLOCK, CHUNK)
    if sampled & (top_p < 1.0):
        # An entry whose mass is at most (1 - p) of the set's over its size is out (the entries at or
        # below it hold no more than that): the floor is above it. One nat and two keys of margin for rounding.
        below = top + (tl.log((1.0 - top_p) * mass / vocab) - 1.0) / scale
        below_key = order_keys(below.to(logits_ptr.dtype.element_ty), BITS) - 2
        floor = _largest_key_reaching(base, vocab, chunk_tops, tl.maximum(floor, below_key), top_key + 1,
                                      top_p * mass, top, scale, True, True, BITS, BLOCK, CHUNK)
    if ROW_MIN_P:
        row_log_min_p = tl.load(log_min_p + row)
    else:
        row_log_min_p = log_min_p
    tl.store(key_floor_ptr + row, floor)
    tl.store(value_floor_ptr + row, tl.where(sampled, top * scale + row_log_min_p, float("-inf")))


@dataclass(frozen=True)
class Floors:
    """Each row's floors: ``key`` (int32: entries whose ``order_keys`` are below it are out, by top-k
    and top-p), ``value`` (fp32: entries whose ``logit / T`` is below it are out, by min-p; -inf
    when off), and ``chunk_tops [rows, vocab / chunk]``, each chunk's max (so that the race skips
    blocks with nothing at or above the floors)."""

    key: torch.Tensor
    value: torch.Tensor
    chunk_tops: torch.Tensor
    chunk: int

    def keeps(self, logits: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
        """``[rows, vocab]`` bool: the entries at or above both floors, computed as the kernels do (with torch)."""
        bits = logits.view(torch.int16 if logits.element_size() == 2 else torch.int32).long()
        keys = torch.where(bits < 0, bits ^ ((1 << (logits.element_size() * 8 - 1)) - 1), bits)
        scale = 1 / torch.where(temperature == 0, 1.0, temperature.float())
        return (keys >= self.key[:, None]) & (logits.float() * scale[:, None] >= self.value[:, None])


def row_floors(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
               min_p: float | torch.Tensor) -> Floors:
    """The floors of ``logits [rows, vocab]`` (bf16, fp16 or fp32, last dim contiguous) for
    ``temperature [rows]`` (0: greedy, no filter), ``top_k [rows]`` (0 or >= vocab: off),
    ``top_p [rows]`` (1: off) and ``min_p`` (0: off), one float for all rows or a float tensor
    ``[rows]`` on the logits' device (each row's own)."""
    rows, vocab = logits.shape
    num_chunks = triton.cdiv(vocab, CHUNK)
    floors = Floors(torch.empty(rows, dtype=torch.int32, device=logits.device),
                    torch.empty(rows, dtype=torch.float32, device=logits.device),
                    torch.empty(rows, num_chunks, dtype=logits.dtype, device=logits.device), CHUNK)
    row_min_p = torch.is_tensor(min_p)
    if row_min_p:
        if min_p.shape != (rows,) or min_p.device != logits.device:
            raise ValueError(f"per-row min_p: a tensor [{rows}] on {logits.device}, not "
                             f"{tuple(min_p.shape)} on {min_p.device}")
        # log 0 = -inf: no floor for that row, as a float min_p <= 0. In double, then fp32, as a
        # float min_p's log reaches the kernel: a row's floor is the one that min_p for all rows gives it.
        log_min_p = min_p.double().clamp(min=0).log().float().contiguous()
    else:
        log_min_p = math.log(min_p) if min_p > 0 else float("-inf")
    bits = logits.element_size() * 8
    block, warps = (WIDE_BLOCK, WIDE_WARPS) if rows <= device_sms(logits.device) else (BLOCK, 8)
    _row_floors[(rows,)](logits, logits.stride(0), temperature.float().contiguous(), top_k.to(torch.int32).contiguous(),
                         top_p.float().contiguous(), floors.chunk_tops, floors.key, floors.value, vocab, num_chunks,
                         log_min_p, BITS=bits, LOWEST=-(2 ** (bits - 1)), HIGHEST=2 ** (bits - 1) - 1, BLOCK=block,
                         CHUNK=CHUNK, ROW_MIN_P=row_min_p, num_warps=warps)
    return floors
