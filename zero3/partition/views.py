"""Raw bytes of tensors, without numpy (torch warns at import without it, and a pickled object
exchange or a safetensors read must not depend on it)."""

from __future__ import annotations

import ctypes

import torch


def byte_view(t: torch.Tensor) -> memoryview:
    """A writable view of the bytes of a contiguous CPU tensor (no copy; keep ``t`` alive)."""
    assert t.device.type == "cpu" and t.is_contiguous(), "byte_view needs a contiguous CPU tensor"
    n = t.numel() * t.element_size()
    if n == 0:
        return memoryview(bytearray(0))
    return memoryview((ctypes.c_ubyte * n).from_address(t.data_ptr())).cast("B")
