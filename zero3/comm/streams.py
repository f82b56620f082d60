"""The CUDA side stream that parameter gathers run on with ``overlap_comm``.

[Note: streams and buffer lifetime]
On CUDA with ``overlap_comm``, a bucketed gather's (and a world-size-1 gather's) copy-in, all-gather
and copy-out run on one side stream (qwZ and direct pairwise gathers run on the current stream), and an
event recorded there is what the compute stream waits on before the module runs. No
``record_stream``: before the side stream allocates anything it waits for the compute stream
(``side.wait_stream(compute)``), so a block freed by a release on the compute stream is never reused
by the side stream while compute kernels may still read it. Memory is therefore deterministic. On
CPU the collective is issued with ``async_op=True`` and waited in the work's ``wait``, just before use.
"""

from __future__ import annotations

from typing import Any

import torch


class SideStream:
    """One communicator's side stream, made on first use."""

    def __init__(self) -> None:
        self.stream: Any = None

    def enter(self, device: torch.device) -> Any:
        """The side stream, after it waited for the compute stream (run the gather inside
        ``torch.cuda.stream(...)`` of it)."""
        if self.stream is None:
            self.stream = torch.cuda.Stream(device=device)
        self.stream.wait_stream(torch.cuda.current_stream(device))
        return self.stream

    def record(self) -> Any:
        """An event on the side stream marking the end of what was queued on it so far."""
        event = torch.cuda.Event()
        event.record(self.stream)
        return event


def wait_on_compute(event: Any) -> None:
    """Make the compute stream of the event's device wait for it (no host synchronisation); the
    current device's stream when the event was never recorded (it then waits for nothing)."""
    device = getattr(event, "device", None)
    torch.cuda.current_stream(device).wait_event(event)
