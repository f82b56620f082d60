"""Verification is on by default on NCCL too (issue 19 item 8): two NCCL ranks gathering different
parameters of the same size through ``GatheredParameters`` raise `ZeroDivergenceError` on both, with
the default config, and no shard changes. Unverified, each would silently get a mix of the two.

NCCL refuses two ranks on one GPU, so this needs two; skipped otherwise.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import socket
import time

import pytest
import torch
import torch.distributed as dist
from torch import nn

import zero3

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                                 reason="needs two CUDA devices (NCCL refuses two ranks on one)")]

TIMEOUT = 20.0  # collective_timeout, seconds
WAIT = 180  # for both ranks to report, NCCL start-up included


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank: int, port: int, out: "mp.Queue") -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    try:
        torch.cuda.set_device(rank)
        dist.init_process_group("nccl")
        torch.manual_seed(0)
        with torch.device("cuda"):
            model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64))
        engine = zero3.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                  {"collective_timeout": TIMEOUT, "param_persistence_threshold": 0})
        before = [p._zero.shard.detach().clone() for p in engine.params]
        t0 = time.monotonic()
        try:
            with zero3.GatheredParameters([model[rank].weight]):  # same size, a different parameter
                pass
            error = None
        except zero3.ZeroError as exc:
            error = type(exc).__name__
        torch.cuda.synchronize()
        out.put((rank, {"error": error, "seconds": time.monotonic() - t0, "backend": engine.comm.backend,
                        "verify": engine.comm.verify,
                        "unchanged": all(torch.equal(p._zero.shard, b) for p, b in zip(engine.params, before))}))
    except BaseException as exc:  # noqa: BLE001 - reported to the test with the rank
        out.put((rank, {"failed": f"{type(exc).__name__}: {exc}"}))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def test_nccl_ranks_gathering_different_parameters_raise_with_the_default_config():
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_rank, args=(r, port, out), daemon=True) for r in range(2)]
    for p in procs:
        p.start()
    try:
        results = dict(out.get(timeout=WAIT) for _ in procs)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    for rank in range(2):
        r = results[rank]
        assert "failed" not in r, r
        assert (r["backend"], r["verify"]) == ("nccl", True), r
        assert r["error"] == "ZeroDivergenceError", r
        assert r["unchanged"] and r["seconds"] < TIMEOUT, r
