"""Every collective of a training run goes through the one communicator, which a test can replace.

A recording `Communicator` subclass is passed to ``zero3.initialize``; a training step, clipping,
``GatheredParameters`` with a modifier, the accessors, consolidation and a checkpoint round trip
must all show up in it with the kind of collective they are. (That no other module can issue a
collective is checked on the source by tests/unit/test_structure.py.)
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import zero3
from zero3.comm.communicator import Communicator, Kind, group_info
from zero3.metrics import StepMetrics

from gpt import GPT, GPTConfig, synthetic_batch

pytestmark = pytest.mark.multiproc

CFG = GPTConfig(block_size=16)


class Recording(Communicator):
    def __init__(self) -> None:
        group, world, rank = group_info(None)
        super().__init__(group, world_size=world, rank=rank, metrics=StepMetrics())
        self.kinds: list[Kind] = []
        self.labels: list[str] = []

    def _note(self, tag):
        self.kinds.append(tag.kind)
        self.labels.append(tag.label)

    def all_gather_params(self, params, tag, count=True, keep_secondary=False, quantize=False):
        self._note(tag)
        return super().all_gather_params(params, tag, count, keep_secondary, quantize)

    def reduce_grads(self, pieces, dtype, device, tag):
        self._note(tag)
        return super().reduce_grads(pieces, dtype, device, tag)

    def all_reduce(self, t, tag, op="sum"):
        self._note(tag)
        return super().all_reduce(t, tag, op)

    def broadcast(self, t, src, tag):
        self._note(tag)
        return super().broadcast(t, src, tag)

    def all_gather_tensor(self, t, tag):
        self._note(tag)
        return super().all_gather_tensor(t, tag)

    def gather_to_rank0(self, t, tag):
        self._note(tag)
        return super().gather_to_rank0(t, tag)

    def exchange_objects(self, obj, tag):
        self._note(tag)
        return super().exchange_objects(obj, tag)


def run_everything(tmp: str) -> dict:
    torch.manual_seed(0)
    model = GPT(CFG)
    comm = Recording()
    engine = zero3.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-3),
                              {"param_persistence_threshold": 0}, communicator=comm)
    adopted = sorted({k.name for k in comm.kinds})  # the model was built without Init: rank 0's values
    comm.kinds.clear()
    rank = dist.get_rank()
    x, y = synthetic_batch(rank, 2, CFG)
    engine.backward(engine(x, y))
    zero3.clip_grad_norm_(engine, 1.0)
    engine.step()
    seen = {"initialize": adopted, "step": sorted({k.name for k in comm.kinds})}
    comm.kinds.clear()
    with zero3.GatheredParameters([model.ln_f.weight], modifier_rank=0):
        if rank == 0:
            model.ln_f.weight.data.fill_(2.0)
    full = zero3.safe_get_full_fp32_param(model.ln_f.weight)
    sd = engine.consolidated_state_dict()
    engine.save_checkpoint(tmp, tag="t")
    engine.load_checkpoint(tmp, tag="t")
    seen["other"] = sorted({k.name for k in comm.kinds})
    seen["ln_f"] = full.tolist()
    seen["consolidated"] = sd["ln_f.weight"].tolist() if rank == 0 else None
    seen["labels"] = sorted(set(comm.labels))
    return seen


def test_every_collective_goes_through_the_communicator_passed_to_initialize(pools, tmp_path):
    results = pools.get(2).run(run_everything, str(tmp_path))
    for r in results:
        assert r["initialize"] == ["ALL_REDUCE", "BROADCAST", "OBJECTS"]  # OBJECTS: the shared-memory arenas'
        # set-up; ALL_REDUCE: the ranks' next parameter id (partition/ids.py)
        assert r["step"] == ["ALL_REDUCE", "GRAD_REDUCE", "PARAM_GATHER"]
        # ALL_REDUCE: the modifier block's exit agrees that no rank raised (gathered.py [Note: a modifier block
        # that raised])
        assert r["other"] == ["ALL_REDUCE", "BROADCAST", "GATHER_TO_ROOT", "OBJECTS", "PARAM_GATHER", "TENSOR_GATHER"]
        assert r["ln_f"] == [2.0] * CFG.n_embd
        assert "GatheredParameters" in r["labels"] and "consolidated_state_dict" in r["labels"]
    assert results[0]["consolidated"] == [2.0] * CFG.n_embd


def exchange_without_numpy() -> list:
    """torch's object collectives call ``Tensor.numpy()``; the communicator's must not need it."""
    real = torch.Tensor.numpy

    def refuse(self, *args, **kwargs):
        raise AssertionError("Tensor.numpy() was called")

    torch.Tensor.numpy = refuse
    try:
        group, world, rank = group_info(None)
        comm = Communicator(group, world_size=world, rank=rank, metrics=StepMetrics())
        return comm.exchange_objects({"rank": rank, "blob": "x" * (10 + 1000 * rank)},
                                     zero3.comm.communicator.Tag(Kind.OBJECTS, "test"))
    finally:
        torch.Tensor.numpy = real


def test_object_exchange_needs_no_numpy(pools):
    for got in pools.get(2).run(exchange_without_numpy):
        assert [g["rank"] for g in got] == [0, 1]
        assert [len(g["blob"]) for g in got] == [10, 1010]



def transports_of_a_group_named_by_device() -> dict:
    """A group of one backend per device (``init_process_group()`` without a backend names its backend
    "undefined", ``new_group(backend="cpu:gloo")`` "cpu:gloo") is the backend its tensors meet."""
    _, world, rank = group_info(None)
    out = {}
    for name, group in (("default", None), ("cpu:gloo", dist.new_group([0, 1], backend="cpu:gloo"))):
        comm = Communicator(group, world_size=world, rank=rank, metrics=StepMetrics())
        out[name] = (dist.get_backend(group), comm.backend, comm.config.allgather_impl, comm.config.reduce_impl)
        comm.release()
    return out


def test_a_group_named_by_device_takes_its_backends_transports(pools):
    for r in pools.get(2).run(transports_of_a_group_named_by_device):
        assert r["default"][0] == "gloo" and r["cpu:gloo"][0] == "cpu:gloo", r  # what torch names them
        assert r["cpu:gloo"][1:] == r["default"][1:], r  # gloo, and gloo's transports (shared memory here)


def engines_one_after_another(n: int) -> dict:
    """Build, train and drop ``n`` engines in one process, as a sweep does; count torch's process
    groups after each (own_groups.py [Note: one own group per set of ranks])."""
    import gc

    from torch.distributed import distributed_c10d as c10d

    rank, world = dist.get_rank(), dist.get_world_size()
    groups, losses = [], []
    for _ in range(n):
        torch.manual_seed(0)
        with zero3.Init():
            model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
        engine = zero3.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), {"collective_timeout": 30})
        g = torch.Generator().manual_seed(1)
        for _ in range(2):
            x = torch.randn(2 * world, 16, generator=g)
            loss = engine(x[2 * rank:2 * rank + 2]).square().mean()
            engine.backward(loss)
            engine.step()
        losses.append(loss.item())
        engine.remove_hooks()
        del engine, model, loss
        gc.collect()
        groups.append(len(c10d._world.pg_map))
    return {"groups": groups, "losses": losses}


def test_engines_built_one_after_another_share_one_process_group(pools):
    """Each engine made a group of its own that stayed until exit: +1 group, 3 threads and 2 sockets per
    engine at world size 2 ("Too many open files" after some hundreds). Every engine's loss is the first's."""
    for r in pools.get(2).run(engines_one_after_another, 5):
        assert len(set(r["groups"])) == 1, r
        assert len(set(r["losses"])) == 1, r


class _Bomb(torch.nn.Module):
    armed = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.armed:
            raise RuntimeError("boom in B's forward")
        return x


def _mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))


def _train_two_steps(engine: zero3.Engine, x: torch.Tensor) -> list[float]:
    """Two SGD steps on this rank's two rows of ``x``; the first weight's first 8 values after."""
    rank = dist.get_rank()
    for _ in range(2):
        engine.backward(engine(x[2 * rank:2 * rank + 2]).square().mean())
        engine.step()
    return [float(v) for v in zero3.safe_get_full_fp32_param(engine.module[0].weight).reshape(-1)[:8]]


def _reference(world: int) -> torch.Tensor:
    """What `_train_two_steps` gives in one process on the whole batch."""
    ref = _mlp()
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    x = torch.randn(2 * world, 16, generator=torch.Generator().manual_seed(3))
    for _ in range(2):
        opt.zero_grad()
        ref(x).square().mean().backward()
        opt.step()
    return ref[0].weight.detach().reshape(-1)[:8]


def engine_over_all_after_one_over_some(init: bool) -> list[float]:
    """Rank 0 alone builds and trains an engine over ``new_group([0])``; then both ranks build one over
    the world. torch names the world engine's own group after how many groups each rank registered,
    which differed, and the second initialize hung in torch's rendezvous (probe 29C)."""
    world = dist.get_world_size()
    alone = dist.new_group([0])
    x = torch.randn(2 * world, 16, generator=torch.Generator().manual_seed(3))
    if dist.get_rank() == 0:
        model = _mlp()
        engine = zero3.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), {"collective_timeout": 30},
                                  group=alone)
        engine.backward(engine(x).square().mean())
        engine.step()
    if init:
        with zero3.Init():
            model = _mlp()
    else:
        model = _mlp()
    engine = zero3.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1),
                              {"collective_timeout": 30, "param_persistence_threshold": 0})
    return _train_two_steps(engine, x)


@pytest.mark.parametrize("init", [False, True])
def test_an_engine_over_every_rank_after_one_over_some_of_them_builds_and_trains(pools, init):
    want = _reference(2)
    for got in pools.get(2).run(engine_over_all_after_one_over_some, init):
        torch.testing.assert_close(torch.tensor(got), want, rtol=1e-5, atol=1e-7)


def hpz_engine_after_one_over_some(timeout: int) -> list[float]:
    """An engine over every rank, dropped (its own group is kept and taken again), then rank 0 alone
    builds one over ``new_group([0])``, then an hpZ engine over every rank: the hpZ blocks' groups were
    named after counts that differed, and torch's rendezvous timed out or, with ``collective_timeout``
    0 (no own group), hung (review 29Y)."""
    import gc

    x = torch.randn(2 * dist.get_world_size(), 16, generator=torch.Generator().manual_seed(3))
    cfg = {"collective_timeout": timeout, "param_persistence_threshold": 0}
    model = _mlp()
    engine = zero3.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), cfg)
    engine.remove_hooks()
    del engine, model
    gc.collect()
    alone = dist.new_group([0])
    if dist.get_rank() == 0:
        model = _mlp()
        zero3.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), cfg, group=alone).remove_hooks()
        del model
        gc.collect()
    model = _mlp()
    engine = zero3.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), {**cfg, "zero_hpz_partition_size": 2})
    return _train_two_steps(engine, x)


@pytest.mark.parametrize("timeout", [30, 0])
def test_an_hpz_engine_after_engines_over_some_ranks_builds_and_trains(pools, timeout):
    want = _reference(4)
    for got in pools.get(4).run(hpz_engine_after_one_over_some, timeout, timeout=120):
        torch.testing.assert_close(torch.tensor(got), want, rtol=1e-5, atol=1e-7)


def one_engine_fails_beside_another() -> dict:
    """Engines A and B alive together; B's step fails on rank 1 (a module raises there); A goes on,
    then an engine C is built. A and C must train as one process does (own_groups.py: A and B run on
    groups of their own, so B's failure leaves A's intact)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = {"collective_timeout": 3, "param_persistence_threshold": 0}

    def mlp() -> torch.nn.Module:
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))

    xs = [torch.randn(2 * world, 16, generator=torch.Generator().manual_seed(i)) for i in range(4)]
    ref = mlp()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    ref_losses = []
    for x in xs:
        loss = ref(x).square().mean()
        ref_opt.zero_grad()
        loss.backward()
        ref_opt.step()
        ref_losses.append(loss.item())

    def train(engine: zero3.Engine, batches: list) -> list[float]:
        out = []
        for x in batches:
            loss = engine(x[2 * rank:2 * rank + 2]).square().mean()
            engine.backward(loss)
            engine.step()
            total = loss.detach().clone()
            dist.all_reduce(total)
            out.append(total.item() / world)
        return out

    a = mlp()
    ea = zero3.initialize(a, torch.optim.SGD(a.parameters(), lr=0.1), cfg)
    bomb = _Bomb()
    b = torch.nn.Sequential(mlp(), bomb)
    eb = zero3.initialize(b, torch.optim.SGD(b.parameters(), lr=0.1), cfg)
    losses = train(ea, xs[:2])
    bomb.armed = rank == 1
    try:
        train(eb, xs[:1])
        failed = None
    except Exception as exc:  # noqa: BLE001 - rank 1 raises its own error, rank 0 ZeroCommunicationError
        failed = type(exc).__name__
    bomb.armed = False
    dist.barrier()
    losses += train(ea, xs[2:])
    c = mlp()
    ec = zero3.initialize(c, torch.optim.SGD(c.parameters(), lr=0.1), cfg)
    return {"failed": failed, "a": max(abs(x - y) for x, y in zip(losses, ref_losses)),
            "c": max(abs(x - y) for x, y in zip(train(ec, xs), ref_losses))}


def test_a_failed_engine_leaves_another_live_engine_and_the_next_one_intact(pools):
    for rank, r in enumerate(pools.get(2).run(one_engine_fails_beside_another)):
        assert r["failed"] == ("RuntimeError" if rank == 1 else "ZeroCommunicationError"), r
        assert r["a"] < 1e-6 and r["c"] < 1e-6, r


def engine_after_a_destroyed_subgroup() -> dict:
    """The user's subgroup, made before engine A, is destroyed while A lives; then engine B is built.
    torch names a group made with local synchronization after its ranks and the count of registered
    groups, which the destroy lowered: B's own group took the name of A's, and torch raised "The specified
    group name has already been created" (review 30Y)."""
    x = torch.randn(2 * dist.get_world_size(), 16, generator=torch.Generator().manual_seed(3))
    users = dist.new_group([0, 1])
    cfg = {"collective_timeout": 30}
    model_a = _mlp()
    engine_a = zero3.initialize(model_a, torch.optim.SGD(model_a.parameters(), lr=0.1), cfg)
    dist.destroy_process_group(users)
    model_b = _mlp()
    engine_b = zero3.initialize(model_b, torch.optim.SGD(model_b.parameters(), lr=0.1), cfg)
    return {"a": _train_two_steps(engine_a, x), "b": _train_two_steps(engine_b, x)}


def test_an_engine_after_a_destroyed_subgroup_builds_beside_a_live_one_and_both_train(pools):
    want = _reference(2)
    for got in pools.get(2).run(engine_after_a_destroyed_subgroup):
        torch.testing.assert_close(torch.tensor(got["a"]), want, rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(torch.tensor(got["b"]), want, rtol=1e-5, atol=1e-7)


USER_TAGS = (1, 2, 3)


class _Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l1, self.l2, self.l3 = torch.nn.Linear(6, 16), torch.nn.Linear(16, 16), torch.nn.Linear(16, 3)

    def forward(self, x, y):
        return torch.nn.functional.mse_loss(self.l3(torch.tanh(self.l2(torch.tanh(self.l1(x))))), y)


def _net_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(8, 6, generator=g), torch.randn(8, 3, generator=g)


def user_messages_beside_pairwise_transfers() -> dict:
    """With ``collective_timeout: 0`` zero3 runs on the user's group; rank 0 sends the user's own
    messages (tags 1, 2, 3) before each step and rank 1 receives them after it, while zero3's pairwise
    all-gathers and reduce-scatters run on that group. zero3 numbered its tags 1, 2, 3, ... and took the
    user's messages: a timeout or a hang (probe 32N)."""
    import datetime
    group = dist.new_group([0, 1], timeout=datetime.timedelta(seconds=5))  # "before" fails in seconds
    rank = dist.get_rank()
    torch.manual_seed(0)
    with zero3.Init(data_parallel_group=group):
        model = _Net()
    cfg = {"param_persistence_threshold": 0, "max_reuse_distance": 0, "max_live_parameters": 300,
           "prefetch_bucket_size": 200, "collective_timeout": 0, "allgather_impl": "p2p",
           "reduce_scatter_impl": "p2p"}
    engine = zero3.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-6), cfg, group=group)
    losses, received = [], []
    for step in range(3):
        x, y = _net_batch(step)
        sends = [dist.isend(torch.full((52,), 1000.0 * tag + step), dst=1, tag=tag, group=group)
                 for tag in USER_TAGS] if rank == 0 else []
        loss = engine(x[4 * rank:4 * rank + 4], y[4 * rank:4 * rank + 4])
        engine.backward(loss)
        engine.step()
        if rank == 1:
            for tag in reversed(USER_TAGS):
                buf = torch.zeros(52)
                dist.recv(buf, src=0, tag=tag, group=group)
                received.append((tag, buf.unique().tolist()))
        for w in sends:
            w.wait()
        total = loss.detach().clone()
        dist.all_reduce(total, group=group)
        losses.append(total.item() / 2)
    weight = [float(v) for v in zero3.safe_get_full_fp32_param(model.l2.weight).reshape(-1)]
    return {"losses": losses, "received": received, "weight": weight}


def test_a_users_own_small_tag_messages_on_its_group_pass_beside_zero3s_pairwise_transfers(pools):
    torch.manual_seed(0)
    ref = _Net()
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, eps=1e-6)
    want = []
    for step in range(3):
        loss = ref(*_net_batch(step))
        loss.backward()
        opt.step()
        opt.zero_grad()
        want.append(loss.item())
    for rank, got in enumerate(pools.get(2).run(user_messages_beside_pairwise_transfers, timeout=60)):
        torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(want), rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(torch.tensor(got["weight"]), ref.l2.weight.detach().reshape(-1), rtol=1e-5,
                                   atol=1e-6)
        if rank == 1:
            assert got["received"] == [(tag, [1000.0 * tag + step]) for step in range(3)
                                       for tag in reversed(USER_TAGS)], got["received"]
