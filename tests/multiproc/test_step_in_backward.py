"""The optimizer step in backward (``offload_optimizer_step_in_backward``, optim/backward_step.py
[Note: optimizer step in backward]): each sub-group of the drive's optimizer steps inside the
window's last backward as soon as its gradients are reduced, and its gradient shards go at once.
Against the streamed step after backward on 2 ranks: the same shards, masters and moments bit for
bit, with fewer gradient elements ever held; a failure in a sub-group on one rank fails the step on
every rank at ``engine.step()`` with nothing changed (staged); an aborted backward, on every rank
or on one, is undone (staged) or refuses later steps until a checkpoint loads (in place); a second gradient after a sub-group stepped fails the
step instead of being left out."""

from __future__ import annotations

import errno
import re
import os

import pytest
import torch
import torch.distributed as dist
from torch import nn

import zero3
from _used_twice import UsedTwice
from _engine_state import engine_state, same_state
from zero3.errors import ZeroStateError

pytestmark = pytest.mark.multiproc

TIMEOUT = 10.0


def _engine(path: str, in_backward: bool, dtype: str = "fp32", params_on_nvme: bool | str = True,
            staged: bool = True, gas: int = 1, optimizer: str = "nvme") -> zero3.Engine:
    # small reduce buckets: reductions land, and sub-groups step, while the backward still runs
    cfg = {"param_persistence_threshold": 0, "collective_timeout": TIMEOUT, "dtype": dtype, "sub_group_size": 600,
           "gradient_accumulation_steps": gas, "reduce_bucket_size": 256,
           "offload_optimizer": {"device": optimizer, "step_in_backward": in_backward}}
    if optimizer == "nvme":
        cfg["offload_optimizer"].update(nvme_path=path, staged_step=staged)
    if params_on_nvme:
        cfg["offload_param"] = {"device": "nvme", "nvme_path": path, "buffer_size": 2048, "buffer_count": 4,
                                "max_in_cpu": 0}
    torch.manual_seed(0)

    def build() -> nn.Module:
        return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 32),
                             nn.ReLU(), nn.Linear(32, 4))

    if params_on_nvme == "init":
        with zero3.Init(config_dict_or_path=cfg):
            model = build()
    else:
        model = build()
    return zero3.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-6), cfg)


def _loss(engine: zero3.Engine, i: int) -> torch.Tensor:
    torch.manual_seed(100 * i + dist.get_rank())
    x = torch.randn(4, 16).to(engine.params[0]._zero.dtype)
    return engine(x).float().square().mean()


def _window(engine: zero3.Engine, i: int) -> None:
    for _ in range(engine.gradient_accumulation_steps()):
        engine.backward(_loss(engine, i))
        engine.step()


def _watch_gradients(engine: zero3.Engine) -> list[int]:
    """The most gradient-shard elements this rank held at once, updated whenever a gradient lands."""
    reducer, opt = engine.context.reducer, engine.context.optimizer
    peak = [0]
    inner = reducer.on_landed

    def landed(p) -> None:
        peak[0] = max(peak[0], sum(g.numel() for g in opt.grads()))
        if inner is not None:
            inner(p)

    reducer.on_landed = landed
    return peak


def parity(path: str, dtype: str, params_on_nvme: bool | str, staged: bool, gas: int, optimizer: str) -> dict:
    out = {}
    for in_backward in (False, True):
        engine = _engine(os.path.join(path, f"{in_backward}{dist.get_rank()}"), in_backward, dtype, params_on_nvme,
                         staged, gas, optimizer)
        peak = _watch_gradients(engine)
        left = []
        for i in range(3):
            for _ in range(gas):
                engine.backward(_loss(engine, i))
                left.append(len(engine.context.optimizer.grads()))  # gradient shards held after the backward
                engine.step()
        trainable = sum(p._zero.shard_numel for p in engine.params if p.requires_grad)
        stepped = engine.context.optimizer.backward_step.steps_in_backward if in_backward else 0
        subs = len(engine.context.optimizer.streamer.subgroups)
        out[in_backward] = (engine_state(engine), peak[0], trainable, left, stepped, subs)
    return out


@pytest.mark.parametrize("dtype,params_on_nvme,staged,gas,optimizer", [
    ("fp32", True, True, 1, "nvme"), ("fp32", "init", False, 1, "nvme"), ("bf16", False, True, 1, "nvme"),
    ("fp32", False, False, 1, "nvme"), ("fp32", True, True, 2, "nvme"),
    ("fp32", False, True, 1, "none"), ("bf16", False, True, 1, "none"), ("fp32", False, True, 1, "cpu"),
    ("bf16", True, True, 2, "cpu")])
def test_the_step_in_backward_trains_the_same_bit_for_bit_holding_fewer_gradients(pools, tmp_path, dtype,
                                                                                  params_on_nvme, staged, gas,
                                                                                  optimizer):
    for rank, r in enumerate(pools.get(2).run(parity, str(tmp_path), dtype, params_on_nvme, staged, gas, optimizer,
                                              timeout=180)):
        (after, peak_after, trainable, left_after, _, _), (inside, peak_inside, _, left_inside, stepped, subs) = \
            r[False], r[True]
        assert same_state(after, inside), rank
        assert peak_after == trainable, (rank, peak_after, trainable)  # the whole model's gradient shards
        # one micro-batch a window: never the whole model's (with more, they accumulate between micro-batches)
        assert peak_inside < trainable if gas == 1 else peak_inside == trainable, (rank, peak_inside, trainable)
        assert subs > 2 and stepped >= 3 * (subs - 1), (rank, stepped, subs)  # most sub-groups inside backwards
        # after each window's last backward no gradient shard is left; between (gas > 1) they accumulate
        assert left_inside == [0 if (k + 1) % gas == 0 else left_after[k] for k in range(3 * gas)], (rank, left_inside)
        assert all(n > 0 for n in left_after), (rank, left_after)


def _fail_writes_in(engine: zero3.Engine, nth: int) -> None:
    """On rank 1, every ``pwritev`` inside the ``nth`` sub-group stepped in backward fails with ENOSPC
    (as a full drive answers); the caller puts ``backward_step._step_subgroup`` back."""
    bstep = engine.context.optimizer.backward_step
    if dist.get_rank() != 1:
        return
    inner, calls = bstep._step_subgroup, [0]

    def fail(*args):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def faulty(gi, ps) -> None:
        calls[0] += 1
        if calls[0] != nth:
            return inner(gi, ps)
        original, os.pwritev = os.pwritev, fail
        try:
            inner(gi, ps)
            bstep._wait_writes()
        finally:
            os.pwritev = original

    bstep._step_subgroup = faulty


def failures(path: str, params_on_nvme: bool | str) -> dict:
    engine = _engine(os.path.join(path, f"run{dist.get_rank()}"), True, params_on_nvme=params_on_nvme)
    reference = _engine(os.path.join(path, f"ref{dist.get_rank()}"), True, params_on_nvme=params_on_nvme)
    out: dict = {}
    inner = engine.context.optimizer.backward_step._step_subgroup
    for name, nth in (("first step, first sub-group", 1), ("later sub-group", 3)):
        before, steps = engine_state(engine), engine.global_steps
        _fail_writes_in(engine, nth)
        try:
            _window(engine, steps)
            out[name] = ("no error", "", False)
        except Exception as exc:  # noqa: BLE001 - reported to the test
            unchanged = same_state(engine_state(engine), before) and engine.global_steps == steps
            out[name] = (type(exc).__name__, str(exc), unchanged)
        engine.context.optimizer.backward_step._step_subgroup = inner
        if name.startswith("first"):
            _window(engine, 0)
            _window(reference, 0)
    # an exception in the middle of a backward on every rank: what stepped is undone
    before, stepped = engine_state(engine), engine.context.optimizer.backward_step.steps_in_backward
    x_hook = []

    def boom(g):
        raise RuntimeError("boom in backward")

    torch.manual_seed(7)
    x = torch.randn(4, 16, requires_grad=True)
    y = engine(x)
    x_hook.append(x.register_hook(boom))  # runs after the later layers' sub-groups stepped
    try:
        engine.backward(y.square().mean())
        out["abort"] = ("no error", "", False)
    except RuntimeError as exc:
        out["abort"] = (type(exc).__name__, str(exc), same_state(engine_state(engine), before))
    out["stepped before the abort"] = engine.context.optimizer.backward_step.steps_in_backward - stepped
    # a second backward in one window: the second gradient would land on stepped sub-groups
    before = engine_state(engine)
    engine.backward(_loss(engine, 5))
    try:
        engine.backward(_loss(engine, 6))
        engine.step()
        out["twice"] = ("no error", "", False)
    except Exception as exc:  # noqa: BLE001 - reported to the test
        out["twice"] = (type(exc).__name__, str(exc), same_state(engine_state(engine), before))
    for i in (1, 2):
        _window(engine, i)
        _window(reference, i)
    out["continues"] = same_state(engine_state(engine), engine_state(reference))
    return out


@pytest.mark.parametrize("params_on_nvme", [True, False])
def test_a_failure_in_the_step_in_backward_is_undone_on_every_rank(pools, tmp_path, params_on_nvme):
    for rank, r in enumerate(pools.get(2).run(failures, str(tmp_path), params_on_nvme, timeout=180)):
        for name in ("first step, first sub-group", "later sub-group"):
            kind, msg, unchanged = r[name]
            assert kind == "OSError" and "rank 1 failed" in msg and "No space left on device" in msg, (rank, name, msg)
            assert "taken on no rank" in msg and unchanged, (rank, name, msg)
        kind, msg, unchanged = r["abort"]
        assert kind == "RuntimeError" and "boom" in msg and unchanged, (rank, r["abort"])
        assert r["stepped before the abort"] > 0, rank  # there was something to undo
        kind, msg, unchanged = r["twice"]
        assert kind == "ZeroStateError" and "got a gradient after the optimizer stepped it" in msg, (rank, msg)
        assert "taken on no rank" in msg and unchanged, (rank, msg)
        assert r["continues"], rank


def abort_on_one_rank(path: str) -> tuple[str, str, bool, int]:
    """An exception in the backward on rank 1 only: rank 0 learns of it at its next collective with
    rank 1 (which closes the engine's group, as for any one-rank failure in a backward), and both
    undo what they stepped."""
    engine = _engine(os.path.join(path, f"r{dist.get_rank()}"), True)
    _window(engine, 0)
    bstep = engine.context.optimizer.backward_step
    before, stepped = engine_state(engine), bstep.steps_in_backward
    torch.manual_seed(7)
    x = torch.randn(4, 16, requires_grad=True)
    y = engine(x)
    if dist.get_rank() == 1:
        x.register_hook(lambda g: (_ for _ in ()).throw(RuntimeError("boom on rank 1")))
    kind, msg = "no error", ""
    try:
        engine.backward(y.square().mean())
        engine.step()
    except Exception as exc:  # noqa: BLE001 - reported to the test
        kind, msg = type(exc).__name__, str(exc)
    return kind, msg, same_state(engine_state(engine), before), bstep.steps_in_backward - stepped


def test_an_exception_in_one_ranks_backward_undoes_the_step_in_backward_on_both(pools, tmp_path):
    results = pools.get(2).run(abort_on_one_rank, str(tmp_path), timeout=120)
    for rank, (kind, msg, unchanged, stepped) in enumerate(results):
        assert kind != "no error" and unchanged, (rank, kind, msg)
        assert stepped > 0, rank  # something had stepped, and was undone
    assert results[1][:2] == ("RuntimeError", "boom on rank 1")


def aborted_in_place(path: str, optimizer: str) -> tuple[str, str, int, bool]:
    engine = _engine(os.path.join(path, f"r{dist.get_rank()}"), True, staged=False, optimizer=optimizer)
    _window(engine, 0)
    engine.save_checkpoint(os.path.join(path, "ckpt"), tag="after0")
    bstep = engine.context.optimizer.backward_step
    stepped = bstep.steps_in_backward
    x = torch.randn(4, 16, requires_grad=True)
    y = engine(x)
    x.register_hook(lambda g: (_ for _ in ()).throw(RuntimeError("boom")))
    try:
        engine.backward(y.square().mean())
    except RuntimeError:
        pass
    stepped = bstep.steps_in_backward - stepped
    kind, msg = "no error", ""
    try:
        _window(engine, 1)
    except ZeroStateError as exc:
        kind, msg = "ZeroStateError", str(exc)
    # the last checkpoint makes it whole again: it then trains as a run that never aborted
    engine.load_checkpoint(os.path.join(path, "ckpt"), tag="after0")
    _window(engine, 1)
    reference = _engine(os.path.join(path, f"ref{dist.get_rank()}"), True, staged=False, optimizer=optimizer)
    _window(reference, 0)
    _window(reference, 1)
    return kind, msg, stepped, same_state(engine_state(engine), engine_state(reference))


@pytest.mark.parametrize("optimizer", ["nvme", "none"])
def test_an_aborted_backward_that_stepped_in_place_refuses_later_steps_until_a_checkpoint_loads(pools, tmp_path,
                                                                                                optimizer):
    for rank, (kind, msg, stepped, same) in enumerate(pools.get(2).run(aborted_in_place, str(tmp_path), optimizer,
                                                                       timeout=120)):
        assert stepped > 0, rank
        assert kind == "ZeroStateError" and "load the last checkpoint" in msg and "part-way" in msg, (rank, kind, msg)
        assert same, rank


def with_comm_features(path: str, extra: dict) -> tuple[bool, int]:
    states, stepped = [], 0
    for in_backward in (False, True):
        base = {} if "memory_budget" in extra else {"param_persistence_threshold": 0, "reduce_bucket_size": 256}
        cfg = {**base, "collective_timeout": TIMEOUT, "sub_group_size": 600, **extra,
               "offload_optimizer": {"device": "none", "step_in_backward": in_backward}}
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))
        engine = zero3.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-6), cfg)
        for i in range(3):
            _window(engine, i)
        states.append(engine_state(engine))
        if in_backward:
            stepped = engine.context.optimizer.backward_step.steps_in_backward
    return same_state(*states), stepped


@pytest.mark.parametrize("extra", [{"zero_quantized_gradients": True}, {"zero_quantized_weights": True},
                                   {"memory_budget": 20000}, {"overlap_comm": False}])
def test_the_step_in_backward_trains_the_same_beside_zeropp_memory_budget_and_blocking_reductions(pools, tmp_path,
                                                                                                  extra):
    """qgZ reduces through its own path, qwZ gathers quantized weights, memory_budget picks the knobs
    after the first step, and without overlap every reduction lands at once: the gradients still land
    through the reducer, once each."""
    for rank, (same, stepped) in enumerate(pools.get(2).run(with_comm_features, str(tmp_path), extra, timeout=120)):
        assert same and stepped >= 6, (rank, same, stepped)  # the same model; sub-groups stepped in each backward


def read_after_send(impl: str) -> dict:
    out = {}
    for in_backward in (False, True):
        torch.manual_seed(0)
        cfg = {"param_persistence_threshold": 0, "max_reuse_distance": 0, "collective_timeout": TIMEOUT,
               "allgather_impl": impl, "reduce_bucket_size": 8,  # m's gradient goes to a reduction at once
               "sub_group_size": 36,  # m's shard (weight and bias at 2 ranks): one sub-group
               "offload_optimizer": {"device": "none", "step_in_backward": in_backward}}
        model = UsedTwice()
        engine = zero3.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-6), cfg)
        shared = engine.context.comm.shared is not None
        try:
            for i in range(2):
                torch.manual_seed(10 * i + dist.get_rank())
                engine.backward(engine(torch.randn(4, 8, requires_grad=True)))
                engine.step()
            out[in_backward] = (engine_state(engine), shared)
        except ZeroStateError as exc:
            out[in_backward] = (str(exc), shared)
    return out


def test_with_shared_shards_a_weight_read_after_its_gradient_was_sent_fails_the_step_in_backward(pools, tmp_path):
    """With shared-memory gathers a peer may step ``m`` and write its shard once this rank sent m's
    gradient; the recompute then reads that shard, so the step fails on every rank. Pairwise, the
    recompute gets each rank's shard as that rank holds it then (before its step): the same as the
    step after backward."""
    for impl in ("shm", "p2p"):
        for rank, r in enumerate(pools.get(2).run(read_after_send, impl, timeout=120)):
            (after, _), (inside, shared) = r[False], r[True]
            assert shared == (impl == "shm"), (rank, impl)
            if impl == "shm":
                assert isinstance(inside, str) and re.search(
                    r"m\.weight was gathered from the peers' shared memory and used after this rank sent its "
                    r"gradient", inside), (rank, inside)
                assert not isinstance(after, str), (rank, after)
            else:
                assert same_state(after, inside), rank
