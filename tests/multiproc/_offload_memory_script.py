"""Measure resident memory (RSS) of 2 gloo ranks training an 8 x Linear(1024, 1024) model with AdamW,
without offload (then through offload_states / reload_states to NVMe) or with parameters and optimizer
state on NVMe. Run by test_offload_multirank.py with MALLOC_MMAP_THRESHOLD_=131072, so freed tensors
return to the OS and RSS follows live memory, not what glibc keeps.

    python _offload_memory_script.py plain|nvme PORT OUT_PREFIX SWAP_DIR
"""

import json
import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

LAYERS, WIDTH = 8, 1024  # 8.4M parameters: 16 MiB of fp32 shards and 32 MiB of AdamW moments per rank


def rss() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def run(rank: int, world: int, port: int, mode: str, out: str, swap: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    import zero3

    cfg = {"param_persistence_threshold": 0, "max_reuse_distance": 0, "prefetch_bucket_size": WIDTH * WIDTH,
           "max_live_parameters": 3 * WIDTH * WIDTH, "reduce_bucket_size": WIDTH * WIDTH}
    if mode == "nvme":
        cfg["offload_param"] = {"device": "nvme", "nvme_path": swap, "max_in_cpu": 0, "buffer_count": 4,
                                "buffer_size": WIDTH * WIDTH // world}
        cfg["offload_optimizer"] = {"device": "nvme", "nvme_path": swap}
        cfg["sub_group_size"] = 2 * WIDTH * WIDTH // world
    torch.manual_seed(0)
    with zero3.Init(config_dict_or_path=cfg):
        model = nn.Sequential(*[nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(LAYERS)])
    engine = zero3.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-3), cfg)
    g = torch.Generator().manual_seed(rank)
    losses = []
    for _ in range(3):
        x = torch.randn(8, WIDTH, generator=g)
        loss = engine(x).pow(2).mean()
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    figures = {"losses": losses, "rss_between_steps": rss(), "nvme_bytes": engine.memory_report()["nvme_bytes"],
               "pool_bytes": engine.memory_report()["swap_buffer_bytes"]}
    if mode == "plain":
        figures["moved"] = engine.offload_states(device="nvme", nvme_path=swap)
        figures["rss_offloaded"] = rss()
        engine.reload_states()
        figures["rss_reloaded"] = rss()
    with open(f"{out}.{rank}", "w") as fh:
        json.dump(figures, fh)
    dist.destroy_process_group()


if __name__ == "__main__":
    mode, port, out, swap = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
    mp.spawn(run, args=(2, port, mode, out, swap), nprocs=2)
