"""Device values read on the host later, without making the host wait for work queued after them."""

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
