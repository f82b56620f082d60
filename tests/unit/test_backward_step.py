"""`BackwardStep` on its own (optim/backward_step.py [Note: optimizer step in backward]), with stand-in
parameters and a recording agreement: for any split into sub-groups and any order in which any subset
of the parameters' gradients land, each sub-group steps exactly once, at the landing of its last
parameter, or at the end of the backward when some of its parameters got a gradient and others
never did; one without any gradient never steps; a stepped sub-group's gradients are gone; a
gradient after its sub-group stepped reaches the agreement as an error; between boundaries nothing
steps; a param group setting changed after a sub-group stepped with it fails the step, one changed
before does not; a gradient accessor refuses a gradient the step used."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, strategies as st

from zero3.errors import ZeroStateError
from zero3.optim.backward_step import BackwardStep, BackwardStepPhase


class _Agreement:
    """Records what `BackwardStep` asks of the agreed step."""

    def __init__(self) -> None:
        self.kept = self.staged = self.rolled_back = 0
        self.concluded: list[BaseException | None] = []

    def keep(self, scaler_state):
        self.kept += 1
        return "kept"

    def stage(self):
        self.staged += 1
        return None

    def conclude(self, kept, error, drop_grads) -> None:
        assert kept == "kept"
        self.concluded.append(error)

    def roll_back(self, kept) -> None:
        self.rolled_back += 1


def _params(n: int) -> list[SimpleNamespace]:
    return [SimpleNamespace(_zero=SimpleNamespace(id=i, name=f"p{i}", train_tensor=torch.zeros(1)))
            for i in range(n)]


def _split(params: list, sizes: list[int]) -> list[tuple[int, list]]:
    out, i = [], 0
    for s in sizes:
        if i < len(params):
            out.append((0, params[i: i + s]))
            i += s
    if i < len(params):
        out.append((0, params[i:]))
    return out


def _make(subgroups, boundary=True, groups=None):
    agreement = _Agreement()
    groups = [{"params": [], "lr": 1e-3, "betas": (0.9, 0.999)}] if groups is None else groups
    steps: list[tuple[int, list[int], set[int]]] = []  # (sub-group index, its ids, ids landed so far)
    landed: set[int] = set()
    index = {id(ps): k for k, (_, ps) in enumerate(subgroups)}

    def step_subgroup(gi, ps) -> None:
        steps.append((index[id(ps)], [p._zero.id for p in ps], set(landed)))

    drops = []
    bstep = BackwardStep(subgroups, agreement, step_subgroup, lambda: None, lambda: drops.append(1),
                         lambda: boundary, lambda: groups)
    return bstep, agreement, steps, landed


def _land(bstep, landed, p) -> None:
    p._zero.train_tensor.grad = torch.ones(1)
    landed.add(p._zero.id)
    bstep.landed(p)


@given(st.integers(1, 16), st.lists(st.integers(1, 5), min_size=1, max_size=16), st.randoms(use_true_random=False),
       st.floats(0.0, 1.0))
def test_each_sub_group_steps_once_when_its_last_gradient_lands_or_at_the_end(n, sizes, rnd, share):
    params = _params(n)
    subgroups = _split(params, sizes)
    arriving = [p for p in params if rnd.random() < share]
    rnd.shuffle(arriving)
    bstep, agreement, steps, landed = _make(subgroups)
    for p in arriving:
        _land(bstep, landed, p)
    during = list(steps)
    bstep.backward_ended()
    arrived = {p._zero.id for p in arriving}
    for k, (_, ps) in enumerate(subgroups):
        ids = {p._zero.id for p in ps}
        mine = [s for s in steps if s[0] == k]
        if not ids & arrived:
            assert not mine  # no gradient at all: never stepped
            continue
        assert len(mine) == 1, (k, steps)
        complete = ids <= arrived
        assert (mine[0] in during) == complete  # inside the landings exactly when all of it landed
        if complete:
            assert ids <= mine[0][2] and mine[0][2] - ids < arrived  # stepped once its last one landed ...
            last = max(arriving.index(p) for p in ps)
            assert mine[0][2] == {p._zero.id for p in arriving[: last + 1]}  # ... and not later
        assert all(p._zero.train_tensor.grad is None for p in ps)  # its gradient shards are gone
    # no gradient landed: nothing opened (engine.step() still agrees, below)
    assert bstep.phase is (BackwardStepPhase.STEPPED if arriving else BackwardStepPhase.IDLE)
    bstep.conclude()
    assert agreement.concluded == [None] and agreement.kept == agreement.staged == 1 and not agreement.rolled_back
    assert bstep.phase is BackwardStepPhase.IDLE


@given(st.integers(2, 12), st.data())
def test_a_gradient_after_its_sub_group_stepped_reaches_the_agreement_as_an_error(n, data):
    params = _params(n)
    subgroups = _split(params, [data.draw(st.integers(1, n))])
    bstep, agreement, steps, landed = _make(subgroups)
    for p in params:
        _land(bstep, landed, p)
    assert len(steps) == len(subgroups)
    again = data.draw(st.sampled_from(params))
    _land(bstep, landed, again)  # a second backward in the window
    bstep.backward_ended()
    assert len(steps) == len(subgroups)  # nothing stepped twice
    bstep.conclude()
    (error,) = agreement.concluded
    assert isinstance(error, ZeroStateError) and f"{again._zero.name} got a gradient after the optimizer stepped it" \
        in str(error)


@given(st.integers(1, 10), st.lists(st.integers(1, 4), min_size=1, max_size=10), st.randoms(use_true_random=False),
       st.lists(st.integers(0, 9), max_size=6))
def test_with_shared_shards_a_use_after_the_gradient_was_sent_fails_the_step_and_one_before_does_not(n, sizes, rnd,
                                                                                                   uses):
    """Shared shards: each parameter's gradient is sent, and later lands, in any interleaving; a
    module fetches (uses) some parameters, released, at any point. The step fails exactly when some
    use of a parameter came after its gradient was sent, whether or not it had stepped by then."""
    from zero3.partition.state import ParamStatus

    params = _params(n)
    for p in params:
        p._zero.status, p._zero.aliased = ParamStatus.NOT_AVAILABLE, False
    subgroups = _split(params, sizes)
    bstep, agreement, steps, landed = _make(subgroups)
    events = [("send", p) for p in params] + [("use", params[u % n]) for u in uses]
    rnd.shuffle(events)
    for p in params:  # a landing comes after its send: insert each at a random later point
        events.insert(rnd.randint(events.index(("send", p)) + 1, len(events)), ("land", p))
    sent: set[int] = set()
    late = False
    for what, p in events:
        if what == "send":
            bstep.sent([p])
            sent.add(p._zero.id)
        elif what == "land":
            _land(bstep, landed, p)
        else:
            late = late or p._zero.id in sent
            bstep.used([p])
    if not late:
        assert len(steps) == len(subgroups)  # every sub-group stepped inside the backward (after a failure: none more)
    bstep.backward_ended()
    bstep.conclude()
    (error,) = agreement.concluded
    assert (error is not None) == late, (events, error)
    if late:
        assert isinstance(error, ZeroStateError) and (
            "after this rank sent its gradient" in str(error) or "was used after the optimizer stepped it" in str(error))


def test_between_boundaries_nothing_steps_and_an_abort_rolls_back_what_did():
    params = _params(4)
    bstep, agreement, steps, landed = _make(_split(params, [2, 2]), boundary=False)
    for p in params:
        _land(bstep, landed, p)
    bstep.backward_ended()
    assert not steps and bstep.phase is BackwardStepPhase.IDLE and agreement.kept == 0
    bstep, agreement, steps, landed = _make(_split(params, [2, 2]))
    for p in params[2:]:
        _land(bstep, landed, p)
    assert len(steps) == 1
    bstep.aborted()
    assert agreement.rolled_back == 1 and bstep.phase is BackwardStepPhase.IDLE and not agreement.concluded
    with pytest.raises(ZeroStateError, match="illegal step-in-backward phase change IDLE -> STEPPED"):
        bstep._enter(BackwardStepPhase.STEPPED)


_SETTINGS = {"lr": 0.5, "betas": (0.8, 0.9), "weight_decay": torch.tensor(0.25), "amsgrad": True, "new_key": 1}


@given(st.integers(1, 12), st.lists(st.integers(1, 4), min_size=1, max_size=12), st.randoms(use_true_random=False),
       st.sampled_from(sorted(_SETTINGS)), st.sampled_from(["before", "during", "after", "never"]))
def test_a_setting_changed_after_a_sub_group_stepped_with_it_fails_the_step(n, sizes, rnd, key, when):
    groups = [{"params": [], "lr": 1e-3, "betas": (0.9, 0.999), "weight_decay": torch.tensor(0.0),
               "amsgrad": False}, {"params": [], "lr": 2e-3}]
    which = rnd.randrange(len(groups))
    params = _params(n)
    bstep, agreement, steps, landed = _make(_split(params, sizes), groups=groups)
    order = list(params)
    rnd.shuffle(order)
    cut = rnd.randrange(len(order) + 1)

    stepped_at_change: list[int] = []

    def change() -> None:
        groups[which][key] = _SETTINGS[key]
        stepped_at_change.append(len(steps))

    if when == "before":  # before the backward: every sub-group steps with the new value
        change()
    for i, p in enumerate(order):
        if when == "during" and i == cut:
            change()
        _land(bstep, landed, p)
    bstep.backward_ended()
    if when == "after":
        change()
    bstep.conclude()
    error = agreement.concluded[-1]
    if stepped_at_change and stepped_at_change[0] > 0:  # some sub-group stepped with the old value
        assert isinstance(error, ZeroStateError), (when, key, steps)
        assert f"param group {which}'s {key!r} changed" in str(error)
    else:
        assert error is None, (when, key, error)
    assert bstep.phase is BackwardStepPhase.IDLE


def test_a_param_group_added_after_the_step_in_backward_fails_the_step():
    params = _params(3)
    groups = [{"params": [], "lr": 1e-3}]
    bstep, agreement, steps, landed = _make(_split(params, [1, 2]), groups=groups)
    for p in params:
        _land(bstep, landed, p)
    bstep.backward_ended()
    groups.append({"params": [], "lr": 1e-3})
    bstep.conclude()
    assert "went from 1 to 2" in str(agreement.concluded[-1])


def test_a_gradient_accessor_refuses_a_gradient_the_step_used_and_only_that_one():
    params = _params(4)
    bstep, agreement, steps, landed = _make(_split(params, [2, 2]))
    for p in params[:2]:
        _land(bstep, landed, p)
    with pytest.raises(ZeroStateError, match=r"safe_get_full_grad\(p0\).*used by the optimizer step"):
        bstep.check_gradient_read(params[0], "safe_get_full_grad")
    bstep.check_gradient_read(params[2], "safe_get_full_grad")  # not stepped: None means no gradient
    bstep.backward_ended()
    bstep.conclude()
    bstep.check_gradient_read(params[0], "safe_get_full_grad")  # after engine.step(): gradients are gone anyway
