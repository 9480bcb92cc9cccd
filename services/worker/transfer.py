"""Small host tensors to the device without stalling the host."""

from __future__ import annotations

import torch


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``tensor`` on ``device``. To CUDA it goes through pinned memory as an asynchronous copy:
    a copy from pageable memory would wait for every kernel queued before it."""
    if device.type != "cuda":
        return tensor
    return tensor.pin_memory().to(device, non_blocking=True)
