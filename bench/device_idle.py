"""Where the device waits for the host: from a ``torch.profiler`` trace, the device's busy time per
phase (the ``record_function`` ranges a benchmark marks, e.g. each backend call) and the longest idle
gaps, each with the host operations running while the device waited.

    with torch.profiler.profile(activities=[CPU, CUDA]) as prof:
        with torch.profiler.record_function("phase:fwd_bwd"):
            ...
    print(idle_report(prof))
"""

from __future__ import annotations

import bisect
from collections import defaultdict

from torch.autograd import DeviceType

PHASE_PREFIX = "phase:"


def _merged(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[tuple[float, float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def _busy_within(busy: list[tuple[float, float]], start: float, end: float) -> float:
    first = max(bisect.bisect_right(busy, (start, float("inf"))) - 1, 0)
    total = 0.0
    for b0, b1 in busy[first:]:
        if b0 >= end:
            break
        total += max(0.0, min(b1, end) - max(b0, start))
    return total


def idle_report(prof, top: int = 15, min_gap_us: float = 200.0, top_kernels: int = 0) -> str:
    """The device's busy and idle milliseconds per phase, then the ``top`` longest gaps (at least
    ``min_gap_us``) with their phase and the innermost host operations covering each gap; with
    ``top_kernels``, the kernels that took the most device time, by the phase they started in."""
    events = prof.events()
    # Device work only: not the annotations that mirror host ranges (record_function) on the device's timeline.
    device = [e for e in events if e.device_type == DeviceType.CUDA and e.time_range.end > e.time_range.start
              and not getattr(e, "is_user_annotation", False) and not e.name.startswith(PHASE_PREFIX)]
    host = [e for e in events if e.device_type == DeviceType.CPU]
    phases = [(e.time_range.start, e.time_range.end, e.name[len(PHASE_PREFIX):]) for e in host
              if e.name.startswith(PHASE_PREFIX)]
    busy = _merged([(e.time_range.start, e.time_range.end) for e in device])
    if not busy:
        return "no device activity recorded"

    def phase_at(t: float) -> str:
        inside = [p for p in phases if p[0] <= t < p[1]]
        return min(inside, key=lambda p: p[1] - p[0])[2] if inside else "outside"

    lines = _phase_lines(busy, phases) + _gap_lines(busy, host, phase_at, top, min_gap_us)
    if top_kernels:
        lines += _kernel_table(device, phase_at, top_kernels)
    return "\n".join(lines)


def _phase_lines(busy: list[tuple[float, float]], phases: list[tuple[float, float, str]]) -> list[str]:
    begin = min([busy[0][0]] + [p[0] for p in phases])
    end = max([busy[-1][1]] + [p[1] for p in phases])
    per_phase: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])  # wall, busy (us)
    for start, stop, name in phases:
        per_phase[name][0] += stop - start
        per_phase[name][1] += _busy_within(busy, start, stop)
    covered = sum(stop - start for start, stop in _merged([(p[0], p[1]) for p in phases]))
    total_busy = _busy_within(busy, begin, end)
    per_phase["outside"] = [end - begin - covered, total_busy - sum(used for _, used in per_phase.values())]
    lines = [f"device busy {total_busy / 1e3:.1f} of {(end - begin) / 1e3:.1f} ms"]
    for name, (wall, used) in sorted(per_phase.items(), key=lambda kv: -kv[1][0]):
        lines.append(f"  {name}: wall {wall / 1e3:.1f} ms, device busy {used / 1e3:.1f}, "
                     f"idle {(wall - used) / 1e3:.1f}")
    return lines


def _gap_lines(busy: list[tuple[float, float]], host: list, phase_at, top: int, min_gap_us: float) -> list[str]:
    gaps = [(b1, b0) for (_, b1), (b0, _) in zip(busy, busy[1:], strict=False) if b0 - b1 >= min_gap_us]
    lines = [f"{len(gaps)} gaps >= {min_gap_us / 1e3:.1f} ms, {sum(b - a for a, b in gaps) / 1e3:.1f} ms in all; "
             "the longest:"]
    for start, stop in sorted(gaps, key=lambda g: g[0] - g[1])[:top]:
        middle = (start + stop) / 2
        running = sorted((e for e in host if e.time_range.start <= middle < e.time_range.end
                          and not e.name.startswith(PHASE_PREFIX)),
                         key=lambda e: e.time_range.end - e.time_range.start)
        names = " < ".join(e.name for e in running[:4]) or "(no recorded host op)"
        lines.append(f"  {(stop - start) / 1e3:.2f} ms at +{(start - busy[0][0]) / 1e3:.1f} ms "
                     f"in {phase_at(middle)}: {names}")
    return lines


def _kernel_table(device: list, phase_at, top: int) -> list[str]:
    totals: dict[tuple[str, str], list[float]] = defaultdict(lambda: [0.0, 0])  # us, launches
    for e in device:
        entry = totals[(phase_at(e.time_range.start), e.name)]
        entry[0] += e.time_range.end - e.time_range.start
        entry[1] += 1
    lines = []
    for phase in sorted({p for p, _ in totals}):
        rows = sorted(((us, n, name) for (p, name), (us, n) in totals.items() if p == phase), reverse=True)
        lines.append(f"device time in {phase}: {sum(r[0] for r in rows) / 1e3:.1f} ms; the top kernels:")
        lines += [f"  {us / 1e3:8.1f} ms {n:6d}x  {name[:110]}" for us, n, name in rows[:top]]
    return lines
