"""The one device-to-host copy of a step: what the host needs of the step's results (the
sampled ids, the logprobs asked for) packed in one tensor, copied without blocking into
pinned memory, and waited on through an event, not by syncing the device."""

from __future__ import annotations

import numpy as np
import torch


class DeviceToHost:
    """Brings a step's results to the host; `fetch` is the only place a step reads the device.

    Invariant: the array one `fetch` returns is valid until the next `fetch`.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._pinned = torch.empty(0, dtype=torch.float64, pin_memory=device.type == "cuda")
        self._copied = torch.cuda.Event() if device.type == "cuda" else None

    def fetch(self, values: torch.Tensor) -> np.ndarray:
        """`values` (1-D float64, on the device) on the host, once the device has them."""
        if self._copied is None:
            return values.numpy()
        if self._pinned.numel() < values.numel():
            self._pinned = torch.empty(max(values.numel(), 2 * self._pinned.numel()),
                                       dtype=torch.float64, pin_memory=True)
        host = self._pinned[:values.numel()]
        host.copy_(values, non_blocking=True)
        self._copied.record()
        self._copied.synchronize()
        return host.numpy()
