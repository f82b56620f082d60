"""Exception types. User input errors are ``ValueError``s; lifecycle misuse is ``ZeroStateError``."""

from __future__ import annotations


class ZeroError(Exception):
    """Base class of every error zero3 raises on purpose."""


class ZeroConfigError(ZeroError, ValueError):
    """An invalid configuration value or key."""


class ZeroStateError(ZeroError, RuntimeError):
    """An operation in the wrong lifecycle state (a parameter used outside its gather, ...)."""


class ZeroDivergenceError(ZeroError, RuntimeError):
    """Ranks disagreed on something that must be identical on every rank."""
