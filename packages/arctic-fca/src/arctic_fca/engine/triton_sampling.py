"""Sampling with temperature, and top-k, top-p and min-p as floors found beforehand
(``triton_filters``), in two kernels that read the logits once, instead of a dozen passes over
``[rows, vocab]`` and a sort.

The draw is an exponential race (argmax of ``p_i / E_i`` with ``E_i ~ Exp(1)`` is a draw from
``p``), run in two levels so that only a few entries need a random number: first among the
vocabulary's chunks of ``RACE_CHUNK`` entries, each weighted by its mass (the sum of its entries'
``exp(logit / T)``), then among the entries of the winning chunk. ``P(chunk) P(entry | chunk)`` is
the entry's probability, so the draw is exact, and the pass over the whole vocabulary costs one
exp per entry (the exp-sum of the log-sum-exp, which the sampled token's log-prob needs anyway)
rather than a random number and a log. Greedy rows (temperature 0) take the argmax of the raw
logits (the first of ties, as ``torch.argmax``) and their log-prob under the raw distribution.

The noise comes from Triton's counter-based Philox generator (``tl.rand4x``: a 64-bit key, one
counter per four uniforms). A row spends ``cdiv(vocab, BLOCK) x BLOCK / RACE_CHUNK / 4`` counters
on the first level (chunk ``c``'s uniform is at counter ``c / 4``, whichever slice reads it) and
``RACE_CHUNK / 4`` on the second, either

- keyed by one seed drawn from the caller's ``torch.Generator`` on the device, the rows' counters
  laid end to end (every row's first level, then every row's second level), or
- keyed by each row's own seed (an int64 ``[rows]`` tensor, any value), its counters from 0 (first
  level, then the second): a row's token then depends on its logits, temperature, floors and seed
  alone, never on the rows beside it or its place among them.

Either way there is no host sync and a call with the same generator state or seeds repeats itself.

Masses are summed relative to a block's max: entries more than ~87 below it (a probability under
1e-38 of the top one) flush to 0 there and cannot win.

Stage one: one program per (row, vocabulary slice) keeps the slice's running max, scaled exp-sum
and its best chunk (greedy rows: best entry); stage two: one program per row combines its slices,
then races the winning chunk's entries.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from arctic_fca.engine.triton_filters import Floors, order_keys

SLICE = 16384  # vocabulary entries per stage-one program: rows x slices programs fill the GPU
BLOCK = 2048  # entries per inner step
RACE_CHUNK = 128  # entries per chunk of the first level of the race


@triton.jit
def _slice_race(logits_ptr, stride_row, temperature_ptr, seed_ptr, key_floor_ptr, value_floor_ptr, chunk_tops_ptr,
                max_ptr, sum_ptr, key_ptr, index_ptr, vocab, slices, num_chunks, SLICE: tl.constexpr,
                BLOCK: tl.constexpr, RACE_CHUNK: tl.constexpr, FILTERED: tl.constexpr, BITS: tl.constexpr,
                CHUNK: tl.constexpr, ROW_SEEDS: tl.constexpr):
    row, part = tl.program_id(0), tl.program_id(1)
    temperature = tl.load(temperature_ptr + row)
    greedy = temperature == 0  # greedy rows race on the logits alone
    scale = tl.where(greedy, 1.0, 1.0 / temperature)
    base = logits_ptr + row.to(tl.int64) * stride_row
    end = tl.minimum(vocab, (part + 1) * SLICE)
    # The row's first-level Philox counters: one per four chunks, the last block's chunks past the
    # vocabulary included; from 0 under the row's own seed, else after the rows before it.
    seed, counters = _row_philox(seed_ptr, row, row * tl.cdiv(vocab, BLOCK) * (BLOCK // RACE_CHUNK // 4), ROW_SEEDS)
    key_floor, value_floor = _load_row_floors(key_floor_ptr, value_floor_ptr, row, FILTERED)
    running_max, running_sum = float("-inf"), 0.0
    best_key, best_index = float("-inf"), 0
    for start in range(part * SLICE, end, BLOCK):
        read = True
        if FILTERED:  # a block whose chunk maxima are all below a floor holds no entry of the race: not read
            chunks = start // CHUNK + tl.arange(0, BLOCK // CHUNK)
            tops = tl.load(chunk_tops_ptr + row.to(tl.int64) * num_chunks + chunks, mask=chunks < num_chunks,
                           other=float("-inf"))
            read = ((tl.max(order_keys(tops, BITS), 0) >= key_floor)
                    & (tl.max(tops.to(tl.float32), 0) * scale >= value_floor))
        if read:
            running_max, running_sum, best_key, best_index = _race_block(
                base, start, end, scale, greedy, seed, counters, key_floor, value_floor, running_max, running_sum,
                best_key, best_index, BLOCK, RACE_CHUNK, FILTERED, BITS)
    out = row * slices + part
    tl.store(max_ptr + out, running_max)
    tl.store(sum_ptr + out, running_sum)
    tl.store(key_ptr + out, best_key)
    tl.store(index_ptr + out, best_index)


@triton.jit
def _row_philox(seed_ptr, row, shared_counter, ROW_SEEDS: tl.constexpr):
    """The row's Philox seed (int64) and its first counter: with ROW_SEEDS its own seed
    (``seed_ptr[row]``) and 0, else the call's one seed (``seed_ptr[0]``) and ``shared_counter``."""
    if ROW_SEEDS:
        seed = tl.load(seed_ptr + row)
        counter = shared_counter * 0  # the row's own counter space
    else:
        seed = tl.load(seed_ptr)
        counter = shared_counter
    return seed, counter


@triton.jit
def _load_row_floors(key_floor_ptr, value_floor_ptr, row, FILTERED: tl.constexpr):
    """The row's floors (triton_filters): entries below either one are out of the race."""
    key_floor, value_floor = 0, 0.0
    if FILTERED:
        key_floor = tl.load(key_floor_ptr + row)
        value_floor = tl.load(value_floor_ptr + row)
    return key_floor, value_floor


@triton.jit
def _scaled(base, cols, ok, scale, key_floor, value_floor, FILTERED: tl.constexpr, BITS: tl.constexpr):
    """The entries ``cols`` times ``scale``, -inf where masked off or below a floor."""
    raw = tl.load(base + cols, mask=ok, other=float("-inf"))
    x = raw.to(tl.float32) * scale
    if FILTERED:
        x = tl.where((order_keys(raw, BITS) >= key_floor) & (x >= value_floor), x, float("-inf"))
    return x


@triton.jit
def _race_block(base, start, end, scale, greedy, seed, counters, key_floor, value_floor, running_max, running_sum,
                best_key, best_index, BLOCK: tl.constexpr, RACE_CHUNK: tl.constexpr, FILTERED: tl.constexpr,
                BITS: tl.constexpr):
    """Entries ``start : start + BLOCK`` into the slice's running max, exp-sum and best race key (a
    chunk's, or for greedy rows an entry's: the key is the logit itself)."""
    cols = start + tl.arange(0, BLOCK)
    x = _scaled(base, cols, cols < end, scale, key_floor, value_floor, FILTERED, BITS)
    new_max = tl.maximum(running_max, tl.max(x, 0))
    if FILTERED:  # a block filtered out whole leaves the max at -inf: exp(-inf - -inf) would be NaN
        new_max_or_0 = tl.where(new_max == float("-inf"), 0.0, new_max)
    else:
        new_max_or_0 = new_max
    weight = tl.exp(x - new_max_or_0)
    running_sum = running_sum * tl.exp(running_max - new_max_or_0) + tl.sum(weight, 0)
    if greedy:
        block_key, block_best = tl.max(x, 0, return_indices=True)  # the first of a tie, as torch.argmax
        block_best += start
    else:
        # Each chunk's mass over an exponential: E = -log(u) > 0 (u in [0, 1); u = 0 never wins).
        masses = tl.sum(tl.reshape(weight, [BLOCK // RACE_CHUNK, RACE_CHUNK]), 1)
        first = start // RACE_CHUNK
        key = masses / -tl.log(_uniforms(seed, counters + first // 4, BLOCK // RACE_CHUNK))
        block_key, block_best = tl.max(key, 0, return_indices=True)
        block_key = tl.log(block_key) + new_max  # back to the log domain, to compare across blocks
        block_best += first
    if block_key > best_key:  # strictly: the earlier block keeps a tie, as torch.argmax keeps the first
        best_key, best_index = block_key, block_best
    return new_max, running_sum, best_key, best_index


@triton.jit
def _uniforms(seed, first_counter, COUNT: tl.constexpr):
    """``COUNT`` uniforms in [0, 1) from ``COUNT / 4`` Philox calls (counters from ``first_counter``)."""
    u0, u1, u2, u3 = tl.rand4x(seed, first_counter + tl.arange(0, COUNT // 4))
    return tl.reshape(tl.join(tl.join(u0, u1), tl.join(u2, u3)), [COUNT])


@triton.jit
def _combine_slices(logits_ptr, stride_row, temperature_ptr, seed_ptr, key_floor_ptr, value_floor_ptr, max_ptr,
                    sum_ptr, key_ptr, index_ptr, token_ptr, logprob_ptr, vocab, slices, first_counter,
                    SLICES_P2: tl.constexpr, RACE_CHUNK: tl.constexpr, FILTERED: tl.constexpr, BITS: tl.constexpr,
                    ROW_SEEDS: tl.constexpr):
    """A row's slices into its log-sum-exp and winner (a chunk, or for greedy rows the token), then
    the token: the race among the winning chunk's entries, on Philox counters of its own (from
    ``first_counter``, past the first level's: every row's, or with ROW_SEEDS the row's own)."""
    row = tl.program_id(0)
    parts = tl.arange(0, SLICES_P2)
    ok = parts < slices
    maxes = tl.load(max_ptr + row * slices + parts, mask=ok, other=float("-inf"))
    sums = tl.load(sum_ptr + row * slices + parts, mask=ok, other=0.0)
    keys = tl.load(key_ptr + row * slices + parts, mask=ok, other=float("-inf"))
    top = tl.max(maxes, 0)
    log_total = top + tl.log(tl.sum(sums * tl.exp(maxes - top), 0))
    winner = tl.load(index_ptr + row * slices + tl.argmax(keys, 0))  # the first slice of a tie
    temperature = tl.load(temperature_ptr + row)
    greedy = temperature == 0
    scale = tl.where(greedy, 1.0, 1.0 / temperature)
    base = logits_ptr + row.to(tl.int64) * stride_row
    token = winner
    if not greedy:
        key_floor, value_floor = _load_row_floors(key_floor_ptr, value_floor_ptr, row, FILTERED)
        cols = winner * RACE_CHUNK + tl.arange(0, RACE_CHUNK)
        x = _scaled(base, cols, cols < vocab, scale, key_floor, value_floor, FILTERED, BITS)
        weight = tl.exp(x - tl.max(x, 0))
        seed, counters = _row_philox(seed_ptr, row, row * (RACE_CHUNK // 4), ROW_SEEDS)
        counters += first_counter
        token = winner * RACE_CHUNK + tl.argmax(weight / -tl.log(_uniforms(seed, counters, RACE_CHUNK)), 0)
    x = tl.load(base + token).to(tl.float32) * scale
    tl.store(token_ptr + row, token.to(tl.int64))
    tl.store(logprob_ptr + row, x - log_total)


def sample_with_temperature(logits: torch.Tensor, temperature: torch.Tensor,
                            generator_or_seeds: torch.Generator | torch.Tensor,
                            floors: Floors | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens ``[rows]`` (int64) and their log-probs ``[rows]`` (fp32) of ``logits [rows, vocab]``
    (last dim contiguous), ``temperature [rows]`` (0: greedy); with ``floors``
    (``triton_filters.row_floors``) among the entries top-k, top-p and min-p keep, the log-probs
    under that filtered distribution.

    ``generator_or_seeds``: a ``torch.Generator`` on the logits' device (one seed drawn from it
    for the whole call), or an integer tensor ``[rows]`` there, each row's own seed (any int64): row
    ``r``'s token then depends on row ``r``'s logits, temperature, floors and seed alone, the same
    alone or at any place in any batch."""
    rows, vocab = logits.shape
    device = logits.device
    row_seeds = torch.is_tensor(generator_or_seeds)
    if row_seeds:
        seeds = generator_or_seeds
        if seeds.shape != (rows,) or seeds.device != device or seeds.is_floating_point() or seeds.is_complex():
            raise ValueError(f"per-row seeds: an integer tensor [{rows}] on {device}, not "
                             f"{seeds.dtype} {tuple(seeds.shape)} on {seeds.device}")
        seed = seeds.to(torch.int64).contiguous()
    else:
        seed = torch.randint(0, 2**31 - 1, (1,), device=device, generator=generator_or_seeds, dtype=torch.int64)
    slices = triton.cdiv(vocab, SLICE)
    partial = torch.empty(3, rows, slices, dtype=torch.float32, device=device)
    index = torch.empty(rows, slices, dtype=torch.int32, device=device)
    tokens = torch.empty(rows, dtype=torch.int64, device=device)
    logprobs = torch.empty(rows, dtype=torch.float32, device=device)
    temperature = temperature.float().contiguous()
    filtered = floors is not None
    floors = floors or Floors(index, partial, logits, chunk=BLOCK)  # without floors: pointers the kernel does not read
    assert BLOCK % floors.chunk == 0, "a race block must hold whole chunks"
    assert BLOCK // RACE_CHUNK >= 4 and RACE_CHUNK >= 4, "the race draws its uniforms four at a time"
    bits = logits.element_size() * 8
    _slice_race[(rows, slices)](logits, logits.stride(0), temperature, seed, floors.key, floors.value,
                                floors.chunk_tops, partial[0], partial[1], partial[2], index, vocab, slices,
                                floors.chunk_tops.shape[1], SLICE=SLICE, BLOCK=BLOCK, RACE_CHUNK=RACE_CHUNK,
                                FILTERED=filtered, BITS=bits, CHUNK=floors.chunk, ROW_SEEDS=row_seeds, num_warps=8)
    # The second level's counters follow the first level's: every row's (one seed), or the row's own.
    first_counter = (1 if row_seeds else rows) * triton.cdiv(vocab, BLOCK) * (BLOCK // RACE_CHUNK // 4)
    _combine_slices[(rows,)](logits, logits.stride(0), temperature, seed, floors.key, floors.value, partial[0],
                             partial[1], partial[2], index, tokens, logprobs, vocab, slices, first_counter,
                             SLICES_P2=max(2, triton.next_power_of_2(slices)), RACE_CHUNK=RACE_CHUNK,
                             FILTERED=filtered, BITS=bits, ROW_SEEDS=row_seeds, num_warps=4)
    return tokens, logprobs
