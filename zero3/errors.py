"""Exception types. User input errors are ``ValueError``s; lifecycle misuse is ``ZeroStateError``."""

from __future__ import annotations


class ZeroError(Exception):
    """Base class of every error zero3 raises on purpose."""


class ZeroConfigError(ZeroError, ValueError):
    """An invalid configuration value or key."""


class ZeroStateError(ZeroError, RuntimeError):
    """An operation in the wrong lifecycle state (a parameter used outside its gather, ...)."""


class ConcurrentForwardError(ZeroStateError):
    """A call of an engine (a forward of its model, a backward, a step, a checkpoint, ...) began while another
    thread's call of it ran; that call goes on (runtime/thread_claim.py)."""


class ZeroDivergenceError(ZeroError, RuntimeError):
    """Ranks disagreed on something that must be identical on every rank."""


class ZeroCommunicationError(ZeroError, RuntimeError):
    """A collective could not complete: a rank stopped taking part (returned early, raised in its own
    code, died) or its connection closed. Names the silent rank where the others could tell."""


class CheckpointError(ZeroError, ValueError):
    """A checkpoint (or a state dict) cannot be used. The message names the file and the problem."""


class CheckpointNotFoundError(CheckpointError):
    """A checkpoint directory, ``latest`` pointer, metadata or rank file is missing."""


class CheckpointCorruptError(CheckpointError):
    """A file is truncated, fails its checksum, or is not valid JSON or safetensors."""


class CheckpointMismatchError(CheckpointError):
    """The checkpoint belongs to another model or optimizer: names, shapes or groups differ."""


class CheckpointVersionError(CheckpointError):
    """The checkpoint was written in a format version this zero3 cannot read."""
