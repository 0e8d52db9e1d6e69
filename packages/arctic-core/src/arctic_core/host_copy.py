"""Copies between host and device that do not make the host wait for the device's queued work."""

from __future__ import annotations

import torch


class HostCopy:
    """``values`` copied to pinned host memory behind the work queued so far (no wait); ``tolist``
    then waits for that copy alone, not for the device work queued after it. On the CPU, the
    values themselves."""

    def __init__(self, values: torch.Tensor) -> None:
        self.copied: torch.cuda.Event | None = None
        self.host = values
        if values.is_cuda:
            self.host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
            self.host.copy_(values, non_blocking=True)
            self.copied = torch.cuda.Event()
            self.copied.record()

    def tolist(self) -> list:
        if self.copied is not None:
            self.copied.synchronize()
        return self.host.tolist()


def to_device(host: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """A host tensor's copy on ``device``, queued behind the work there without waiting for it. On
    CUDA it goes out of pinned memory: a copy from pageable memory, ``non_blocking`` or not, first
    waits for every kernel queued on the stream (the caching host allocator keeps the pinned copy
    until the transfer ran)."""
    device = torch.device(device)
    return (host.pin_memory() if device.type == "cuda" else host).to(device, non_blocking=True)
