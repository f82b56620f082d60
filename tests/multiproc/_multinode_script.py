"""A rank of tests/multiproc/test_multinode.py: started by one of two torchrun agents (2 nodes x 2 ranks
on one machine), it trains tests/_wire.py's `Net` under each option and writes what it measured.

    torchrun --nnodes 2 --nproc-per-node 2 --rdzv-backend c10d --rdzv-endpoint 127.0.0.1:PORT \\
        tests/multiproc/_multinode_script.py OUT_DIR

Writes OUT_DIR/rank{RANK}.json: torchrun's environment as this rank saw it, every rank's GROUP_RANK
(to map peers to nodes independently of zero3), and `measure`'s results per option.
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from _wire import BASE, measure  # noqa: E402

OPTIONS = {
    "exact": {},
    "hpz": {"zero_hpz_partition_size": -1},
    "qwz": {"zero_quantized_weights": True},
    "qgz": {"zero_quantized_gradients": True},
    "all": {"zero_hpz_partition_size": -1, "zero_quantized_weights": True, "zero_quantized_gradients": True},
}


def main() -> None:
    out_dir = sys.argv[1]
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    try:
        env = {k: os.environ[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK")}
        group_ranks = [None] * dist.get_world_size()
        dist.all_gather_object(group_ranks, int(env["GROUP_RANK"]))
        results = {"env": env, "group_ranks": group_ranks}
        for name, extra in OPTIONS.items():
            run = measure({**BASE, **extra}, 3)
            results[name] = {k: v.tolist() if hasattr(v, "tolist") else v for k, v in run.items()}  # JSON
        with open(os.path.join(out_dir, f"rank{env['RANK']}.json"), "w") as fh:
            json.dump(results, fh)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
