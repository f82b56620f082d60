"""Failures and timeouts: a collective that cannot finish becomes one clear error naming the silent rank.

A rank that stops taking part (returned early, raised in its own code, died) is found by the
timeout of zero3's own process group (``collective_timeout``; with 0, of the user's group zero3 then
runs on, which the failure leaves unusable); the ranks then read, from the process group's store,
what the others reported (`FailureReport`) and name the silent rank ([Note: verified collectives]
in verify.py).
"""

from __future__ import annotations

import builtins
from typing import Any, Callable

from .. import errors
from ..errors import ZeroCommunicationError, ZeroStateError
from .tags import Tag
from .verify import EpochMode, EpochState, FailureReport


class FailureMonitor:
    """Runs every blocking call and wait of one communicator; the first failure closes its group
    (``state.mode`` BROKEN) and raises `ZeroCommunicationError` with what the other ranks reported."""

    def __init__(self, state: EpochState, report: FailureReport | None, world_size: int, rank: int,
                 timeout_s: float, own_group: bool = True) -> None:
        self.state = state
        self.report = report
        self.world_size = world_size
        self.rank = rank
        self.timeout_s = timeout_s
        self.own_group = own_group  # False: zero3 runs on the user's group (collective_timeout 0, Init)
        self._posted = ""  # this rank's last post
        self.global_rank: Callable[[int], int] = lambda r: r  # a group rank's default-group rank (set by Wire)
        self.counted = True  # the verifier counts steps and collectives (off: `state` stays at 0, probe 34A)

    def wait(self, work: Any, tag: Tag | None) -> None:
        self.blocking(work.wait, tag)

    def blocking(self, fn: Callable[[], Any], tag: Tag | None) -> Any:
        try:
            return fn()
        except RuntimeError as exc:  # not NotImplementedError: torch refused the call here (a DTensor's
            if self.world_size > 1 and not isinstance(exc, (ZeroStateError, NotImplementedError)):  # dispatch,
                self.fail(exc, tag)                                                  # probe 38F): no peer failed
            raise

    def post(self, message: str) -> None:
        """Tell the other ranks what happened here (through the store; nothing without one)."""
        self._posted = message
        if self.report is not None:
            self.report.post(message)

    @property
    def last_post(self) -> str:
        """This rank's last post ("step|what happened"; empty before any)."""
        return self._posted

    def fail(self, exc: BaseException, tag: Tag | None) -> None:
        """A collective did not complete (timeout, or a peer closed its connection)."""
        state = self.state
        if state.mode is EpochMode.BROKEN:
            raise ZeroCommunicationError(f"{self._group()} is closed after an earlier failure: {exc}")
        state.mode = EpochMode.BROKEN
        where = (f"collective #{state.seq} of step {state.epoch}" if self.counted else "a collective") + \
            (f" ({tag.describe()})" if tag else "")
        peers: dict[int, str] = {}
        waited = f"{state.epoch}|timed out or lost its peers while waiting in {where}"
        if self.report is not None:
            self.report.post(waited)
            peers = self.report.read(min(2.0, max(0.2, 0.1 * self.timeout_s)))
        lines = []
        name = self.global_rank  # the ranks torch and the launcher name (review of probe 37T: group ranks misled)
        for r in range(self.world_size):
            if r == self.rank:
                continue
            epoch, _, msg = peers.get(r, "").partition("|")
            if msg and epoch.isdigit() and int(epoch) >= state.epoch - 1:
                lines.append(f"rank {name(r)} {msg}")
            else:
                lines.append(f"rank {name(r)} reported nothing: it stopped taking part (returned early, is stuck in its "
                             "own code, or died), or this rank ran a collective the others did not (under "
                             "`if rank == 0:`, a forward, save_checkpoint or a consolidated state dict: run it on "
                             "every rank; a Hugging Face generate() needs synced_gpus=True)")
        limit = f"collective_timeout={self.timeout_s:g} s" if self.timeout_s > 0 else "the process group's timeout"
        text = str(exc)
        closed = any(s in text for s in ("closed by peer", "reset by peer", "Broken pipe", "Connection refused"))
        if closed and len(peers) == self.world_size - 1 and all(post == waited for post in peers.values()):
            # every peer gave up waiting in this very collective: this rank came late, none died (probe 38A F5)
            knob = "collective_timeout in the config" if self.timeout_s > 0 else \
                "the process group's timeout (dist.init_process_group(timeout=...))"
            head = (f"rank {name(self.rank)} reached {where} after the other ranks had given up waiting for it "
                    f"(after {limit}): this rank arrived late (slow data loading, a long forward or other work of "
                    f"its own between collectives), no rank died; raise {knob}")
        else:
            what = "a peer closed its connection (its process exited or died)" if closed \
                else f"not every rank took part within {limit}"
            head = f"rank {name(self.rank)} waited in {where} and {what}"
        raise ZeroCommunicationError(
            f"{head}: " + "; ".join(lines) + f". ({type(exc).__name__}: {str(exc).splitlines()[0][:200]}) "
            + self._aftermath()
        ) from exc

    def _group(self) -> str:
        return "zero3's own process group" if self.own_group else "your process group (the one zero3 runs on)"

    def _aftermath(self) -> str:
        """What the failure left: only zero3's group, or the user's group that zero3 ran on."""
        if self.own_group:
            return ("zero3's own process group is closed now; every further collective of this engine raises. The "
                    "default process group is not affected, but a rank that died is gone: save what you need and "
                    "restart from the last checkpoint.")
        return ("zero3 ran this on your process group (zero3.Init, the agreement of configs, the model-parallel "
                "checks and the gathers of partitioned activations always do; an engine's other collectives do with "
                "collective_timeout 0), and that group is the one that failed: it is unusable now (gloo closed its "
                "connections: further collectives on it, yours and zero3's, raise). Destroy it "
                "(dist.destroy_process_group) and create it again, or restart the job from the last checkpoint.")


def posted_cause(post: str, first: int, last: int) -> str | None:
    """What a rank's ``post`` says happened, when it was posted at a step from ``first`` to ``last``."""
    step, _, what = post.partition("|")
    return what if what and step.isdigit() and first <= int(step) <= last else None


def rebuild_error(rank: int, kind: str, message: str) -> BaseException:
    """Another rank's error, as an exception of the same type where that type is known."""
    known = getattr(errors, kind, None) or getattr(builtins, kind, None)
    if isinstance(known, type) and issubclass(known, Exception):
        return known(f"{message} [raised on rank {rank}]")
    return RuntimeError(f"rank {rank} failed with {kind}: {message}")
