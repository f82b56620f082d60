"""``engine.generation()``'s block: the coordinator's generation mode entered and left between steps, on
one thread at a time (thread_claim.py)."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

from ..errors import ZeroStateError
from .engine_calls import MID_STEP, require_hooks
from .step import StepPhase

logger = logging.getLogger("zero3.engine")


@contextlib.contextmanager
def generation_mode(engine: Any) -> Iterator[Any]:
    """``engine.generation()``'s block (see its docstring). Entering claims the engine for a moment (refused
    while another thread runs a call of it); leaving waits until no forward of another thread runs inside
    the block (a ``generate`` thread feeding a streamer, left early: probe 38A, which ended the mode under
    that forward: an internal error, then divergence, the group closed; forwards back to back keep the
    engine until they stop), then ends the mode, claimed."""
    coordinator = engine.coordinator
    if coordinator.generating:  # nested: the outer block owns the mode
        yield engine
        return
    require_hooks(engine, "engine.generation()")
    if engine.hooks.phase is not StepPhase.IDLE:
        raise ZeroStateError(MID_STEP.format(what="engine.generation()", phase=engine.hooks.phase.name.lower()))
    engine.context.require_states("engine.generation()", ("lp_params",))
    claim = engine.context.claim
    with claim.held("engine.generation()"):
        coordinator.begin_generation()
    try:
        yield engine
    finally:
        token, waited = claim.take_waiting("leaving engine.generation()")
        if waited is not None:
            logger.warning("zero3: engine.generation() was left while thread %d ran %s; it was waited for. Join the "
                           "thread that runs forwards before the block ends: with more than one rank the ranks may "
                           "end the mode after different forwards (a divergence that closes zero3's group), its "
                           "later forwards run outside the mode, and one beside a training call is refused",
                           waited[0], waited[1])
        try:
            engine.hooks.generation_ended()
            coordinator.end_generation()
            engine.hooks.step.guard_grads()  # between steps again (step.py leaves the decode forwards be)
        finally:
            claim.release(token)
