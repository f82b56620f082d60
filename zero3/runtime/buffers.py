"""Module buffers across ranks: rank 0's at ``initialize``, and before every forward with gradients
under ``broadcast_buffers``.

Parameters are sharded; buffers (BatchNorm's running statistics, position tables, masks) are not:
every rank holds each one whole. ``initialize`` gives every rank rank 0's buffers, as it gives rank
0's values to parameters made outside ``zero3.Init`` (adopt.py), and as DDP and FSDP's
``sync_module_states`` do: a model built with a different seed per rank would otherwise start with
different buffers. A forward may then change them (running statistics), each rank from its own
batch, so they drift apart: in DeepSpeed and FSDP2, and here by default. With ``broadcast_buffers``
(DDP's option, on by default there) a forward with gradients, and the first forward after one,
first takes rank 0's buffers, as DDP does: the running statistics are rank 0's on every rank, and an
eval forward after training gives the same output everywhere (tests/multiproc/test_buffers.py).
"""

from __future__ import annotations

import torch
from torch import nn

from ..comm.communicator import Communicator
from .adopt import take_from_rank0


class ModuleBuffers:
    """A model's buffers and their broadcast from rank 0 (read from the model at each call: a module may
    register a buffer anew in its forward, as rotary caches do)."""

    def __init__(self, comm: Communicator, model: nn.Module) -> None:
        self.comm = comm
        self.model = model
        self._changed = False  # a forward with gradients ran since the last broadcast: buffers may differ

    def before_forward(self, grad: bool) -> None:
        """A forward of the model begins (on every rank alike): broadcast when it or the one before
        has gradients (a step of two forwards broadcasts before each, as DDP)."""
        if grad or self._changed:
            self.take_from_rank0("forward")
        self._changed = grad

    def take_from_rank0(self, when: str) -> None:
        """Every rank takes rank 0's values, in ``named_buffers`` order (a collective; nothing without
        buffers or at world size 1)."""
        named = [(n, b) for n, b in self.model.named_buffers() if not _broadcast_view(b)]
        if named:
            take_from_rank0(self.comm, named, what=f"module buffers ({when})", log=False)


def _broadcast_view(t: torch.Tensor) -> bool:
    """An expanded tensor (stride 0 along a dimension of size > 1): its elements share memory, so it
    cannot be written, by a forward or by a broadcast; it is left as it is."""
    return any(st == 0 and n > 1 for st, n in zip(t.stride(), t.shape))
