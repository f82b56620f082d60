"""Entering and leaving ``zero3.GatheredParameters`` over many small parameters, world size 1 (no
process group: a gather is a copy from the shard, so what is left is bookkeeping). Before round 37 the
fetch dropped repeated parameters with a scan of the list per entry, quadratic in the count.

    python benchmarks/bench_user_gather.py                          # 1k, 4k, 16k tensors
    python benchmarks/bench_user_gather.py --baseline DIR           # and DIR's zero3, alternating

A model of N ``Linear(4, 4, bias=False)`` built under ``zero3.Init`` (threshold 0, so none is
persistent); one read-only block over all N weights and one with ``modifier_rank=0`` (which publishes
every weight back into its shard at exit). Prints the median seconds of each, and microseconds per tensor
(flat across N when the cost is linear). Figures are printed, never asserted.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_init import _zero3_of  # noqa: E402  (another tree's zero3, beside this one's)


def _time_blocks(zero3, n: int) -> tuple[float, float]:
    with zero3.Init(config={"param_persistence_threshold": 0}):
        model = torch.nn.Sequential(*[torch.nn.Linear(4, 4, bias=False) for _ in range(n)])
    params = list(model.parameters())
    t0 = time.perf_counter()
    with zero3.GatheredParameters(params):
        pass
    t1 = time.perf_counter()
    with zero3.GatheredParameters(params, modifier_rank=0):
        pass
    return t1 - t0, time.perf_counter() - t1


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="1000,4000,16000")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--baseline", help="another checkout whose zero3 runs beside this one")
    args = ap.parse_args()
    torch.set_num_threads(1)
    sys.path.insert(0, ROOT)
    import zero3

    trees = {"zero3": zero3}
    if args.baseline:
        trees["baseline"] = _zero3_of(os.path.abspath(args.baseline))
    print("| tree | tensors | read-only block (s) | us per tensor | modifier block (s) | us per tensor |")
    print("|---|---|---|---|---|---|")
    for n in (int(s) for s in args.sizes.split(",")):
        times: dict[str, list[tuple[float, float]]] = {name: [] for name in trees}
        for _ in range(args.repeats):
            for name, package in trees.items():  # alternating, so a busy host slows both alike
                times[name].append(_time_blocks(package, n))
        for name, rows in times.items():
            read = statistics.median(r for r, _ in rows)
            write = statistics.median(w for _, w in rows)
            print(f"| {name} | {n} | {read:.3f} | {read / n * 1e6:.1f} | {write:.3f} | {write / n * 1e6:.1f} |")


if __name__ == "__main__":
    main()
