"""At exit, zero3 lets go of its process groups while the interpreter is still whole.

A gloo worker thread drops its reference to a finished work a moment after the work completes. If
that reference is the last one and the work holds a tensor whose Python object is alive, the thread
needs the GIL to free it; during interpreter finalization it cannot take it, and the process aborts
("terminate called without an active exception") after a run that succeeded. zero3's own process
groups live as long as its communicators, which a script's globals keep until finalization, so the
first communicator registers one `atexit` handler (`release_at_exit`): it collects engines left in
reference cycles, then every live communicator forgets its works and destroys the group it made;
the group's destructor joins its worker threads while they can still take the GIL.
"""

from __future__ import annotations

import atexit
import gc
import weakref
from typing import Protocol


class Releasable(Protocol):
    def release(self) -> None: ...


_live: weakref.WeakSet = weakref.WeakSet()
_registered = False


def track_for_exit(comm: Releasable) -> None:
    """Release ``comm`` at exit (registers the handler the first time)."""
    global _registered
    _live.add(comm)
    if not _registered:
        atexit.register(release_at_exit)
        _registered = True


def release_at_exit() -> None:
    gc.collect()  # engines a script left in reference cycles, and the works they hold
    for comm in list(_live):
        comm.release()
    gc.collect()
