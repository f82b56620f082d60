"""Which thread holds an engine, and for what.

[Note: one thread]
An engine's gathers, releases, collectives and step state are shared by every call of it, so two
forwards running at once from two threads corrupted each other: wrong outputs, a segfault in a
gather's copy into storage the other thread freed, or a hang in a collective (probe 26D); and a
``save_checkpoint`` from a second thread during training interleaved the two threads' collectives on
one process group: both ranks aborted in gloo, or raised errors that named other causes (probe 38A).
So a call claims the engine for its thread (`ThreadClaim`, the context's: one atomic
``dict.setdefault`` under the GIL) for as long as it runs: a forward of the root until its outermost
call returns (a resident decode forward's too: `root_pre`, `root_post`), and ``engine.backward``,
``engine.step``, the checkpoint and state-dict calls and ``engine.memory_report`` for the call
(`claiming`); entering and leaving ``engine.generation()`` too (generation_mode.py). A call from
another thread meanwhile raises `ConcurrentForwardError` before it changes anything, and the running
one goes on. Torch runs a refused forward's post-forward anyway (always_call), maybe after the claim
has gone: a thread-local mark (`_Local.refused`) tells it to do nothing, or it would take the refusal for
the owner's forward failing and abort its step. Calls one after another from several threads, in any
interleaving of whole forwards, backwards and steps, are fine. Not detected: a submodule called
directly from another thread, a ``loss.backward()`` that ``engine.backward`` does not wrap, and
``GatheredParameters`` (docs/api.md says not to).
"""
from __future__ import annotations

import contextlib
import functools
import sys
import threading
import time
import weakref
from typing import Any, Callable, Iterator, TypeVar

import torch
from torch import nn

from ..errors import ConcurrentForwardError

FORWARD = "a forward of the model"
BACKWARD = "engine.backward()"
T = TypeVar("T")
Token = tuple[int, str, "weakref.ref[_Marker]"]
"""A call's claim: its thread's id, what it runs, a weak reference to its thread's marker."""


class _Marker:
    """One per thread (`_here`), held by the thread's own ``threading.local``: it goes when the thread
    ends, whoever started it. Threads are told apart by it, not by id (review 38R4: an ended thread's id
    is handed to the next one started) nor by their ``threading`` object (review 38R5: a thread not
    started by ``threading`` has a stand-in that says it is alive for ever)."""

    __slots__ = ("__weakref__",)


class _Local(threading.local):
    marker: _Marker | None = None  # this thread's (`_here`)
    refused: Any = None  # the hooks whose root pre-forward refused this thread's running call (`root_pre`)


_LOCAL = _Local()


def _here() -> _Marker:
    """This thread's marker."""
    marker = _LOCAL.marker
    if marker is None:
        marker = _LOCAL.marker = _Marker()
    return marker


class ThreadClaim:
    """The claim on one engine: a `Token` while a call runs, else nothing."""

    def __init__(self) -> None:
        self._held: dict[int, Token] = {}

    @property
    def owner(self) -> int | None:
        """The id of the thread holding the engine now, or None."""
        held = self._held.get(0)
        return None if held is None else held[0]

    def mine(self) -> bool:
        """Whether this thread holds the engine now."""
        held = self._held.get(0)
        return held is not None and held[2]() is _here()

    def take(self, what: str) -> Token | None:
        """Claim the engine for this thread to run ``what``: the token to `release` when this call took
        it, None when this thread held it already (a forward inside ``engine.backward``'s recompute), or
        when ``engine.backward`` holds it and this is autograd's device thread running that backward's
        hooks (CUDA runs them on a thread of its own: review 38R5). Raises `ConcurrentForwardError` when
        another thread holds it; nothing changes then."""
        marker = _here()
        token = (threading.get_ident(), what, weakref.ref(marker))
        held = self._held.setdefault(0, token)
        if held is token:
            return token
        holder = held[2]()
        if holder is not marker:
            if holder is None:  # its thread ended holding it (a BaseException torch's always_call hooks
                self.release(held)  # do not see: review 38R1): nothing runs, so it is free
                return self.take(what)
            if held[1] == BACKWARD and torch._C._current_graph_task_id() >= 0:
                return None  # a hook of the backward the holder runs, on autograd's device thread
            raise concurrent_call_refusal(what, held)
        return None

    def holds(self, token: Token) -> bool:
        """Whether the claim is ``token`` now."""
        return self._held.get(0) is token

    def release(self, token: Token | None) -> None:
        """Give back the claim ``token`` took (nothing for None, or when the claim is no longer it)."""
        if token is not None and self._held.get(0) is token:
            self._held.clear()

    @contextlib.contextmanager
    def held(self, what: str) -> Iterator[None]:
        """The engine claimed for this thread for the block (`take`, then `release`)."""
        token = self.take(what)
        try:
            yield
        finally:
            self.release(token)

    def take_waiting(self, what: str) -> tuple[Token | None, Token | None]:
        """`take`, waiting while another thread holds the engine (a forward: finite; a holder whose thread
        ended is taken over by `take`); returns the token and what held the engine when this call began
        to wait (None: nothing). Not fair: a thread that runs forwards back to back keeps the engine
        until it stops (generation_mode.py; at several ranks that does not keep them alike: docs/api.md)."""
        first = None
        while True:
            try:
                return self.take(what), first
            except ConcurrentForwardError:
                first = first or self._held.get(0)
                time.sleep(0.001)


def release_forward(hooks: Any) -> None:
    """A root forward on this thread ended by an error the root's post-forward did not see (a
    KeyboardInterrupt or SystemExit: torch runs always_call hooks for ``Exception`` only): give back
    the claim it took (review 38R1: every other thread's calls were refused for good)."""
    if hooks._claim.mine():
        hooks._claim.release(hooks._forward_token)
        hooks._forward_token = None


def concurrent_call_refusal(what: str, held: Token) -> ConcurrentForwardError:
    """``what`` began on this thread while thread ``held[0]`` runs ``held[1]`` on the same engine."""
    return ConcurrentForwardError(
        f"{what} began while thread {held[0]} runs {held[1]}: an engine's gathers, releases, collectives and step "
        "state serve one call at a time (as DeepSpeed's and FSDP2's). Call one engine from one thread at a time (a "
        "lock around each call), or give each thread a model and an engine of its own. Nothing changed for this "
        "call, and the other thread's goes on")


def claiming(what: str) -> Callable[[Callable[..., T]], Callable[..., T]]:
    """An engine method that claims its engine for the call (`ThreadClaim.held`)."""
    def wrap(method: Callable[..., T]) -> Callable[..., T]:
        @functools.wraps(method)
        def claimed(engine: Any, *args: Any, **kwargs: Any) -> T:
            with engine.context.claim.held(what):
                return method(engine, *args, **kwargs)
        return claimed
    return wrap


def root_pre(hooks: Any, pre: Callable[..., Any], *args: Any) -> Any:
    """The root's pre-forward: claim the engine for this thread (hooks.py `ModuleHooks`) before anything changes."""
    _LOCAL.refused = None
    try:
        token = hooks._claim.take(FORWARD)
    except ConcurrentForwardError:
        _LOCAL.refused = hooks  # for this call's post-forward, which torch runs anyway (always_call)
        raise
    stale = (bool(hooks.stack) or hooks._resident_calls > 0) and (
        token is not None  # no forward ran (the engine was free), yet calls are open
        or (hooks._forward_token is not None and hooks._claim.holds(hooks._forward_token) and _root_calls(hooks) < 2))
    if stale:  # the last forward ended by a BaseException (Ctrl-C), which torch's always_call hooks skip (review 38R1)
        if hooks._resident_calls:  # a resident decode forward's (review 38R4: the submodule hooks stayed off)
            hooks._resident_calls = 0
            hooks._submodule_hooks.resume()
        else:
            hooks.step.abort(RuntimeError("the model's last forward ended by an exception its hooks did not see"),
                             "forward")
        if token is None:  # this thread's own forward's claim, left by it: taken anew
            hooks._claim.release(hooks._forward_token)
            token = hooks._claim.take(FORWARD)
    if token is not None:
        hooks._forward_token = token
    return pre(*args)


def _root_calls(hooks: Any) -> int:
    """How many calls of the root run on this thread (this one included): a second one means the root
    is called inside itself, not a forward left open by an error."""
    code, root, n = nn.Module._call_impl.__code__, hooks.root, 0
    f = sys._getframe(1)
    while f is not None:
        n += f.f_code is code and f.f_locals.get("self") is root
        f = f.f_back
    return n


def root_post(hooks: Any, post: Callable[..., Any], *args: Any) -> Any:
    """The root's post-forward; the claim goes once the root's outermost call has closed."""
    if _LOCAL.refused is hooks:  # refused by the pre-forward: nothing of it is open, and the claim
        _LOCAL.refused = None       # may have gone since (review 26X: its post-forward aborted the step)
        return None
    if hooks._claim.owner is not None and not hooks._claim.mine():
        return None  # another thread's call runs: this call's pre-forward did not (a hook before it raised)
    try:
        return post(*args)
    finally:
        if not hooks.stack and not hooks._resident_calls:  # the outermost call of the root has closed
            hooks._claim.release(hooks._forward_token)  # (nothing when engine.backward holds it: a recompute)
            hooks._forward_token = None
