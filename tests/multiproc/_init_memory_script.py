"""Measure peak RSS growth while building a model on 2 gloo ranks, plain or under zero3.Init.

Run as a script (by test_init_memory.py) with MALLOC_MMAP_THRESHOLD_=131072 so freed tensors go back
to the OS and ru_maxrss measures live memory, not what glibc keeps.
"""

import os
import resource
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

LAYERS, WIDTH = 8, 2048  # 8 x 16 MiB fp32 weights: 128 MiB in all


def build(rank: int, world: int, port: int, mode: str, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    import zero3

    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    ctx = zero3.Init() if mode == "zero3" else zero3.Init(enabled=False)
    with ctx:
        model = nn.Sequential(*[nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(LAYERS)])
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with open(f"{out}.{rank}", "w") as fh:
        fh.write(str((peak - base) * 1024))
    del model
    dist.destroy_process_group()


if __name__ == "__main__":
    mode, port, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    mp.spawn(build, args=(2, port, mode, out), nprocs=2)
