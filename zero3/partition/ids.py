"""Parameter ids (``ZeroParam.id``, DeepSpeed's ``ds_id``): unique in a process, and the same on every
rank of a group for the same parameter.

Collectives carry the ids of the parameters they move, and their verification compares them between
ranks (comm/verifier.py), as does every ordering by id (``GatheredParameters``). A process-wide count
gave the same parameter different ids on ranks that had partitioned different numbers of parameters
before (rank 0 alone built an engine over ``new_group([0])``), and the next engine's first reduction
raised ``ZeroDivergenceError`` though every rank ran the same step (probe 29C). So `zero3.Init` and
`zero3.initialize` first move every rank of their group to the highest next id among them
(`skip_to`, runtime/context.py `align_ids`); ids then follow the same build on every rank of the group.
Not across a nested block over a subgroup whose subgroups build different models (review 29Y): the
outer block's later parameters then differ in id, and their first collective raises
``ZeroDivergenceError``; docs/api.md says to build such models outside the outer block."""

from __future__ import annotations

_next = 0


def new_id() -> int:
    global _next
    _next += 1
    return _next - 1


def next_id() -> int:
    return _next


def skip_to(n: int) -> None:
    """Make ``n`` the next id; never back (ids stay unique in the process)."""
    global _next
    _next = max(_next, n)
