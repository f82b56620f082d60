"""The wire under zero3 on gloo: collectives against pairwise point-to-point messages, 2 CPU ranks.

    python benchmarks/bench_collectives.py                 # S = 41M fp32 elements per rank (156 MiB), 5 rounds
    python benchmarks/bench_collectives.py --numel 2000000 --rounds 20

For a shard of S elements per rank it times, interleaved round by round after a barrier, each way of
doing zero3's two collectives: the gradient reduction (every rank holds W x S rank-major gradients
and needs the sum of its own chunk) as gloo's all-reduce of W x S (then this rank's slice), gloo's
reduce-scatter, all-to-all plus a local sum, and pairwise isend/irecv plus a local sum; and the
parameter all-gather as gloo's all-gather and as pairwise isend/irecv. Wall time is rank 0's;
CPU time is the process's (every thread, gloo's included). Results are checked equal first.
Figures are printed, never asserted.

Like for like: before each timed call (untimed) every way gets a fresh copy of the W x S gradients,
which it may overwrite as a reduction bucket can be (the all-reduce reduces it in place, the pairwise
way sums into its own chunk); inside the timed call every way allocates its own output, if any.
"""

from __future__ import annotations

import argparse
import datetime
import os
import socket
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _rank(rank: int, world: int, port: int, numel: int, rounds: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=600))
    s = numel
    flat = torch.randn(world * s)
    shard = torch.randn(s)
    peers = [q for q in range(world) if q != rank]

    def all_reduce(work: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(work)
        return work[rank * s:(rank + 1) * s]

    def reduce_scatter(work: torch.Tensor) -> torch.Tensor:
        out = torch.empty(s)
        _reduce_scatter(out, work)
        return out

    def all_to_all(work: torch.Tensor) -> torch.Tensor:
        out = torch.empty(world * s)
        dist.all_to_all_single(out, work)
        return out.view(world, s).sum(0)

    def p2p_reduce(work: torch.Tensor) -> torch.Tensor:
        got = {q: torch.empty(s) for q in peers}
        ops = [op for q in peers for op in (dist.P2POp(dist.isend, work[q * s:(q + 1) * s], q),
                                            dist.P2POp(dist.irecv, got[q], q))]
        for w in dist.batch_isend_irecv(ops):
            w.wait()
        out = work[rank * s:(rank + 1) * s]
        for q in peers:
            out += got[q]
        return out

    def all_gather(work: torch.Tensor) -> torch.Tensor:
        out = torch.empty(world * s)
        _all_gather(out, shard)
        return out

    def p2p_gather(work: torch.Tensor) -> torch.Tensor:
        out = torch.empty(world * s)
        out[rank * s:(rank + 1) * s].copy_(shard)
        ops = [op for q in peers for op in (dist.P2POp(dist.isend, shard, q),
                                            dist.P2POp(dist.irecv, out[q * s:(q + 1) * s], q))]
        for w in dist.batch_isend_irecv(ops):
            w.wait()
        return out

    ways = {"reduction: gloo all-reduce of W x S": all_reduce, "reduction: gloo reduce-scatter": reduce_scatter,
            "reduction: all-to-all + sum": all_to_all, "reduction: pairwise isend/irecv + sum": p2p_reduce,
            "all-gather: gloo all-gather": all_gather, "all-gather: pairwise isend/irecv": p2p_gather}
    want = all_reduce(flat.clone())
    for name in ("reduction: gloo reduce-scatter", "reduction: all-to-all + sum", "reduction: pairwise isend/irecv + sum"):
        torch.testing.assert_close(ways[name](flat.clone()), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(p2p_gather(flat.clone()), all_gather(flat.clone()), rtol=0, atol=0)
    times: dict[str, tuple[list[float], list[float]]] = {k: ([], []) for k in ways}
    work = torch.empty_like(flat)
    for _ in range(rounds):
        for name, fn in ways.items():
            work.copy_(flat)  # untimed: the gradients each way may overwrite
            dist.barrier()
            t0, c0 = time.perf_counter(), time.process_time()
            fn(work)
            times[name][0].append(time.perf_counter() - t0)
            times[name][1].append(time.process_time() - c0)
    if rank == 0:
        print(f"# bench_collectives  {datetime.datetime.now().isoformat(timespec='seconds')}  torch {torch.__version__}  "
              f"{world} gloo ranks x 1 thread  S = {s:,} fp32 elements per rank ({s * 4 / 2**20:.0f} MiB), "
              f"{rounds} rounds\n")
        print("| way | median wall (ms) | median CPU, all threads (ms) |")
        print("|---|---:|---:|")
        for name, (wall, cpu) in times.items():
            print(f"| {name} | {statistics.median(wall) * 1e3:.0f} | {statistics.median(cpu) * 1e3:.0f} |")
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--numel", type=int, default=41_000_000, help="shard elements per rank (S)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--nproc", type=int, default=2)
    args = ap.parse_args()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    mp.spawn(_rank, args=(args.nproc, port, args.numel, args.rounds), nprocs=args.nproc)


if __name__ == "__main__":
    main()
