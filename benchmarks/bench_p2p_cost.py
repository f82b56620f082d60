"""What a MiB costs to move between two ranks on one host: gloo's pairwise messages (isend/irecv,
the way zero3's gathers travel) against a plain copy from a peer's shared-memory tensor (what a
transport over /dev/shm would do). Fixed buffers, so no first-touch page faults are counted.

    torchrun --nproc_per_node 2 benchmarks/bench_p2p_cost.py
    torchrun --nproc_per_node 2 benchmarks/bench_p2p_cost.py --sizes 1,64 --rounds 10

Rank 0 prints the median wall time and the median process CPU time (all threads) of one exchange
per size. Figures are printed, never asserted.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="0.25,1,4,16", help="MiB per message, comma separated")
    ap.add_argument("--rounds", type=int, default=30)
    args = ap.parse_args()

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    if dist.get_world_size() != 2:
        raise SystemExit("run with 2 ranks: torchrun --nproc_per_node 2 ...")
    peer = 1 - rank
    shm = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    tag = os.environ.get("TORCHELASTIC_RUN_ID", str(os.getppid()))
    if rank == 0:
        print("| MiB | shared-memory copy: wall (ms) | CPU (ms) | gloo isend/irecv: wall (ms) | CPU, all threads (ms) |")
        print("|---:|---:|---:|---:|---:|")
    for mib in (float(x) for x in args.sizes.split(",")):
        n = int(mib * 2**20 / 4)
        mine_path = os.path.join(shm, f"zero3-bench-{tag}-{rank}-{n}")
        mine = torch.from_file(mine_path, shared=True, size=n, dtype=torch.float32)
        mine.fill_(rank + 1)
        dist.barrier()
        theirs = torch.from_file(os.path.join(shm, f"zero3-bench-{tag}-{peer}-{n}"), shared=True, size=n,
                                 dtype=torch.float32)
        out = torch.empty(n)
        times: dict[str, list[float]] = {"copy": [], "copy_cpu": [], "p2p": [], "p2p_cpu": []}
        for _ in range(args.rounds):
            dist.barrier()
            t, c = time.perf_counter(), time.process_time()
            out.copy_(theirs)
            times["copy"].append(time.perf_counter() - t)
            times["copy_cpu"].append(time.process_time() - c)
            if out[0].item() != peer + 1:
                raise RuntimeError("the shared-memory copy did not read the peer's tensor")
            dist.barrier()
            t, c = time.perf_counter(), time.process_time()
            ops = [dist.P2POp(dist.isend, mine, peer), dist.P2POp(dist.irecv, out, peer)]
            for work in dist.batch_isend_irecv(ops):
                work.wait()
            times["p2p"].append(time.perf_counter() - t)
            times["p2p_cpu"].append(time.process_time() - c)
        dist.barrier()
        os.unlink(mine_path)
        if rank == 0:
            m = {k: statistics.median(v) * 1e3 for k, v in times.items()}
            print(f"| {mib:g} | {m['copy']:.3f} | {m['copy_cpu']:.3f} | {m['p2p']:.3f} | {m['p2p_cpu']:.3f} |")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
