"""An independent count of the bytes a rank receives, for checking zero3's byte accounting.

`WireCounter.install()` wraps torch.distributed's point-to-point and collective entry points in this
process (not zero3's communicator): every ``irecv`` handed to ``batch_isend_irecv`` adds its tensor's
bytes to the peer it comes from, and a collective adds, per peer, the bytes that peer contributes
(docs/multinode.md#byte-accounting): an all-gather or all-reduce of n bytes per rank adds n from each
other rank, a broadcast n from the source, a gather n from each rank at the destination, an
all-to-all n / world from each rank, a reduce-scatter the output's n from each rank. Peers are
global ranks. zero3 looks these functions up at each call, so the wrappers see its traffic.
"""

from __future__ import annotations

import copy
import inspect
from collections import Counter
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

import zero3

BASE = {"param_persistence_threshold": 0, "max_reuse_distance": 0, "prefetch_bucket_size": 0}
"""Every parameter gathered on use and released after it (the last layer excepted: its backward
comes right after its forward, within ``max_reuse_distance`` 0), no prefetch."""


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class WireCounter:
    def __init__(self) -> None:
        self.recv: Counter[int] = Counter()  # global rank of the peer -> bytes received from it
        self._saved: dict[str, Callable[..., Any]] = {}

    def snapshot(self) -> Counter[int]:
        return Counter(self.recv)

    def install(self) -> "WireCounter":
        me = dist.get_rank()

        def members(group: Any) -> list[int]:
            return dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)

        def each_peer(group: Any, nbytes: int) -> None:
            for peer in members(group):
                if peer != me:
                    self.recv[peer] += nbytes

        def batch(a: Any) -> None:
            for op in a["p2p_op_list"]:
                if op.op.__name__ == "irecv":
                    self.recv[op.peer] += _nbytes(op.tensor)

        def gather_flat(a: Any) -> None:
            each_peer(a.get("group"), _nbytes(a["input_tensor"]))

        def all_reduce(a: Any) -> None:
            each_peer(a.get("group"), _nbytes(a["tensor"]))

        def broadcast(a: Any) -> None:
            if a["src"] != me:
                self.recv[a["src"]] += _nbytes(a["tensor"])

        def gather(a: Any) -> None:
            if a.get("dst", 0) == me:
                each_peer(a.get("group"), _nbytes(a["tensor"]))

        def all_to_all(a: Any) -> None:
            each_peer(a.get("group"), _nbytes(a["input"]) // len(members(a.get("group"))))

        def reduce_scatter(a: Any) -> None:
            each_peer(a.get("group"), _nbytes(a["output"]))

        counters = {"batch_isend_irecv": batch, "all_gather_single": gather_flat,
                    "all_gather_into_tensor": gather_flat, "all_reduce": all_reduce, "broadcast": broadcast,
                    "gather": gather, "all_to_all_single": all_to_all, "reduce_scatter_single": reduce_scatter,
                    "reduce_scatter_tensor": reduce_scatter}
        for name, count in counters.items():
            original = getattr(dist, name, None)
            if original is None:
                continue
            self._saved[name] = original
            setattr(dist, name, _wrap(original, count))
        return self

    def uninstall(self) -> None:
        for name, original in self._saved.items():
            setattr(dist, name, original)
        self._saved.clear()


def _wrap(original: Callable[..., Any], count: Callable[[Any], None]) -> Callable[..., Any]:
    signature = inspect.signature(original)

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        count(bound.arguments)
        return original(*args, **kwargs)

    return wrapper


class Net(nn.Module):
    """Four linear layers; c.bias (37 elements: shards of 10 on 4 ranks) and d.weight (296: shards of
    74) have shards whose size is not a multiple of 4 (the quantized messages' alignment)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(64, 96)
        self.b = nn.Linear(96, 96)
        self.c = nn.Linear(96, 37)
        self.d = nn.Linear(37, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.d(torch.tanh(self.c(torch.tanh(self.b(torch.tanh(self.a(x)))))))


def numels() -> dict[str, int]:
    return {name: p.numel() for name, p in Net().named_parameters()}


def measure(config: dict, steps: int) -> dict:
    """Train `Net` for ``steps`` steps (SGD, a batch per step and rank) under ``config``; the last
    step is counted by zero3 and by a `WireCounter`, whole and over its backward alone. Returns the
    losses, the full weights before and after (``start_weights``, ``weights``), zero3's counts
    (``recv``, ``p2p``, ``backward_recv``), the independent ones by global
    peer (``independent``, ``backward_independent``), and the hpZ secondary bytes after forward,
    at the step's peak and after it."""
    rank = dist.get_rank()
    counter = WireCounter()
    try:
        torch.manual_seed(0)
        model = Net()
        engine = zero3.initialize(model, torch.optim.SGD(model.parameters(), lr=0.05), config)
        weights = lambda: torch.cat([zero3.safe_get_full_fp32_param(p).reshape(-1)  # noqa: E731
                                     for p in engine.module.parameters()])
        start_weights = weights()
        losses: list[float] = []
        out: dict[str, Any] = {"hpz": engine.comm.hpz, "nodes": engine.comm.nodes}
        for step in range(steps):
            g = torch.Generator().manual_seed(100 * step + rank)
            x, y = torch.randn(16, 64, generator=g), torch.randn(16, 8, generator=g)
            last = step == steps - 1
            if last:
                counter.install()
                start = counter.snapshot()
            loss = nn.functional.mse_loss(engine(x), y)
            if last:
                out["forward_secondary"] = engine.memory_report()["secondary_param_bytes"]
                before = counter.snapshot(), copy.deepcopy(engine.metrics.recv_bytes)
            engine.backward(loss)
            if last:
                after = counter.snapshot(), copy.deepcopy(engine.metrics.recv_bytes)
            engine.step()
            losses.append(loss.item())
        counter.uninstall()
        m = engine.last_step_metrics
        out.update(losses=losses, start_weights=start_weights, weights=weights(), recv=m.recv_bytes, p2p=m.p2p_recv_bytes, peak_secondary=m.peak_secondary_bytes,
                   after_secondary=engine.memory_report()["secondary_param_bytes"],
                   independent=dict(counter.recv - start), backward_independent=dict(after[0] - before[0]),
                   backward_recv=_minus(after[1], before[1]))
        return out
    finally:
        counter.uninstall()


def _minus(after: dict, before: dict) -> dict:
    return {kind: {s: n - before.get(kind, {}).get(s, 0) for s, n in scopes.items()} for kind, scopes in after.items()}
