"""A reusable pool of gloo ranks for multi-rank tests.

Spawning ranks and importing torch costs seconds, so each world size gets one pool of processes per
test session: the process group is created once and every test sends a picklable, module-level
function to all ranks (``pool.run(fn, *args)``) and gets each rank's return value back. A rank that
raises reports its traceback with its rank; a pool whose ranks failed or timed out is restarted
before the next test, so one broken test cannot poison the others.
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import queue
import tempfile
import traceback
from typing import Any, Callable

RUN_TIMEOUT_S = float(os.environ.get("ZERO3_TEST_TIMEOUT", "300"))


def _worker(rank: int, world_size: int, init_file: str, inq: Any, outq: Any) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=120))
    try:
        while True:
            item = inq.get()
            if item is None:
                break
            fn, args, kwargs = item
            try:
                outq.put((rank, True, fn(*args, **kwargs)))
            except BaseException:  # noqa: BLE001 - reported to the parent with the rank
                outq.put((rank, False, traceback.format_exc()))
    finally:
        dist.destroy_process_group()


class RankPool:
    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self.broken = False
        ctx = mp.get_context("spawn")
        self._dir = tempfile.mkdtemp(prefix=f"zero3-pool{world_size}-")
        init_file = os.path.join(self._dir, "store")
        self._inqs = [ctx.Queue() for _ in range(world_size)]
        self._outq = ctx.Queue()
        self._procs = [ctx.Process(target=_worker, args=(r, world_size, init_file, self._inqs[r], self._outq),
                                   daemon=True) for r in range(world_size)]
        for p in self._procs:
            p.start()

    def run(self, fn: Callable[..., Any], *args: Any, timeout: float = RUN_TIMEOUT_S, **kwargs: Any) -> list[Any]:
        """Run ``fn(*args, **kwargs)`` on every rank; return the results in rank order."""
        for q in self._inqs:
            q.put((fn, args, kwargs))
        results: dict[int, tuple[bool, Any]] = {}
        while len(results) < self.world_size:
            try:
                rank, ok, value = self._outq.get(timeout=timeout)
            except queue.Empty:
                self.broken = True
                missing = sorted(set(range(self.world_size)) - set(results))
                raise TimeoutError(f"ranks {missing} did not finish {fn.__name__} within {timeout:.0f} s") from None
            results[rank] = (ok, value)
        errors = [f"--- rank {r} ---\n{v}" for r, (ok, v) in sorted(results.items()) if not ok]
        if errors:
            self.broken = True
            raise AssertionError(f"{fn.__name__} failed on {len(errors)} rank(s):\n" + "\n".join(errors))
        return [results[r][1] for r in range(self.world_size)]

    def close(self) -> None:
        for q in self._inqs:
            try:
                q.put(None)
            except Exception:  # noqa: BLE001
                pass
        for p in self._procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()


class PoolManager:
    """One live pool per world size; replaces a broken one."""

    def __init__(self) -> None:
        self._pools: dict[int, RankPool] = {}

    def get(self, world_size: int) -> RankPool:
        pool = self._pools.get(world_size)
        if pool is None or pool.broken:
            if pool is not None:
                pool.close()
            pool = self._pools[world_size] = RankPool(world_size)
        return pool

    def close(self) -> None:
        for pool in self._pools.values():
            pool.close()
        self._pools.clear()
