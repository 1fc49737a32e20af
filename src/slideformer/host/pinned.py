"""Page-locking host memory once, in place.

cudaHostRegister on an ordinary allocation, not torch's pinned allocator: that one rounds each block
up to a power of two, which would waste up to half of a multi-GB buffer. Pinning is slow (seconds
for a multi-GB buffer), so every caller pins at start (or when a buffer must grow) and never per step.
"""
from __future__ import annotations

import torch


def pin(t: torch.Tensor, what: str, fix: str) -> None:
    """Page-lock ``t``'s memory; on failure raise with what it was for and how to need less."""
    nbytes = t.numel() * t.element_size()
    if nbytes == 0:
        return
    err = torch.cuda.cudart().cudaHostRegister(t.data_ptr(), nbytes, 0)
    if int(err) != 0:
        raise RuntimeError(f"cannot pin {nbytes / 2**30:.1f} GiB of host memory for {what} ({err}); {fix}")


def unpin(t: torch.Tensor) -> None:
    torch.cuda.cudart().cudaHostUnregister(t.data_ptr())
