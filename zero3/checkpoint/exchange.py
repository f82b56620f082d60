"""The one agreement step of the checkpoint collectives that validate (save, load, pretrained loads,
save_pretrained): all ranks exchange a payload and their errors, so that every rank raises the same
error and none hangs in a later collective."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..comm.communicator import Kind, Tag

if TYPE_CHECKING:
    from ..runtime.context import RuntimeContext


def exchange(ctx: RuntimeContext, payload: Any, error: BaseException | None, what: str) -> list[list[Any]]:
    """All-gather ``payload`` over every rank of the run; every rank raises if any rank had an ``error``
    (see `Communicator.agree_on_errors`).

    Returns one list per model-parallel rank, each holding that rank's data-parallel group's payloads
    in data-parallel rank order (one list without model parallelism). The exchange runs over the
    data-parallel group, then over the model-parallel group carrying those lists, so every rank ends
    with every rank's payload and error and all of them decide alike.
    """
    mp = ctx.model_parallel
    try:
        items = ctx.comm.agree_on_errors(payload, error, Tag(Kind.OBJECTS, what))
    except Exception as exc:  # noqa: BLE001 - the model-parallel peers must learn of it too
        if mp is None:
            raise
        items, error = [], exc
    if mp is None:
        return [items]
    return mp.comm.agree_on_errors(items, error, Tag(Kind.OBJECTS, what + " (model-parallel)"))


__all__ = ["exchange"]
