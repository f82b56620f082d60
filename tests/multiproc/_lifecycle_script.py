"""Two process-group life cycles a test pool cannot run (its processes keep one default group for
good), for tests/multiproc/test_process_lifecycle.py; ``LIFECYCLE`` picks one, the rank writes what
it saw to ``LIFECYCLE_DIR/rank<r>.json``.

- ``reinit``: an engine trains, the default group is destroyed (torch destroys every group with
  it, zero3's kept ones included) while the engine lives, which then refuses a forward naming that,
  and made again; a new engine over the same model (its shards partitioned over the destroyed group)
  trains on, and a second engine over a new model trains: their losses must be one process's on the
  whole batches.
- ``dead_peer``: rank 1 exits in the middle of training; rank 0's next collective must fail saying a
  peer closed its connection, not that a timeout ran out."""

import gc
import json
import os
import sys

import torch
import torch.distributed as dist
from torch import nn

import zero3  # noqa: E402


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


def _batches() -> list:
    g = torch.Generator().manual_seed(3)
    return [(torch.randn(8, 8, generator=g), torch.randn(8, 4, generator=g)) for _ in range(3)]


def _train(model: nn.Module, engine, rank: int, world: int) -> list[float]:
    losses = []
    for x, y in _batches():
        mine = slice(rank * 8 // world, (rank + 1) * 8 // world)
        loss = ((engine(x[mine]) - y[mine]) ** 2).mean()
        engine.backward(loss)
        engine.step()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item() / world)
    return losses


def _reference(passes: int = 1) -> list[float]:
    ref = _mlp()
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    losses = []
    for x, y in _batches() * passes:
        loss = ((ref(x) - y) ** 2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _engine():
    model = _mlp()
    return model, zero3.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                   {"param_persistence_threshold": 0, "collective_timeout": 60})


def reinit(rank: int, world: int) -> dict:
    model, engine = _engine()
    first = _train(model, engine, rank, world)
    dist.destroy_process_group()
    try:
        engine(torch.randn(4, 8))
        refused = None
    except zero3.ZeroStateError as exc:  # probe 30B: torch's bare ValueError from the first gather
        refused = str(exc)
    engine.remove_hooks()
    del engine
    gc.collect()  # an engine left in a reference cycle holds its group, and with it the old store
    # Another port: on the same one a rank that gets here first can rendezvous with the old store,
    # still served by a rank that has not destroyed it yet (torch's own race: 1 in 24 plain runs).
    os.environ["MASTER_PORT"] = os.environ["LIFECYCLE_PORT2"]
    dist.init_process_group("gloo")
    # the same model: its shards name the destroyed group (probe 30B: initialize raised a bare KeyError)
    engine = zero3.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1),
                              {"param_persistence_threshold": 0, "collective_timeout": 60})
    again = _train(model, engine, rank, world)
    model, engine = _engine()
    second = _train(model, engine, rank, world)
    return {"first": first, "second": second, "again": again, "reference": _reference(),
            "continued": _reference(2)[3:], "refused": refused}


def dead_peer(rank: int, world: int) -> dict:
    model, engine = _engine()
    _train(model, engine, rank, world)
    dist.barrier()
    if rank == 1:
        os._exit(0)  # dies without a word: its sockets close
    x = torch.randn(4, 8)
    try:
        engine.backward(engine(x).sum())
        engine.step()
    except zero3.ZeroCommunicationError as exc:
        return {"error": str(exc)}
    return {"error": None}


def main() -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    out = {"reinit": reinit, "dead_peer": dead_peer}[os.environ["LIFECYCLE"]](rank, world)
    with open(os.path.join(os.environ["LIFECYCLE_DIR"], f"rank{rank}.json"), "w") as fh:
        json.dump(out, fh)
    os._exit(0)  # the dead peer's group cannot be destroyed cleanly; the result is written


if __name__ == "__main__":
    sys.exit(main())
