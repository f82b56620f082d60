"""Wall time of building the example GPT under ``zero3.Init`` on 2 gloo ranks, beside another tree.

    python benchmarks/bench_init.py                         # the 86.7M GPT (bench_step.py's big), this tree
    python benchmarks/bench_init.py --baseline DIR          # and DIR's zero3, alternating
    python benchmarks/bench_init.py --preset small --builds 3   # the 3.7M GPT (bench_step.py's small)

The presets are bench_step.py's ``MODELS`` (12x768 and 4x256, vocabulary 2048) with its block size 128.
Before that they were a 12x768 GPT with GPT-2's vocabulary (50,304) and block 256, 123.9M parameters,
and a 4x256 one with vocabulary 1024: the figures docs/performance.md took with them say so.

Each round builds the model once per variant (the order rotated every round), between barriers on
both ranks, and keeps the slower rank's time. Variants: this tree with ``Init()`` (``sync="rng"``,
the default: rank 0's RNG state broadcast, then each rank's values checked against the others',
runtime/rank_values.py), this tree with ``Init(sync="broadcast")`` (rank 0's values for every
parameter, as DeepSpeed's Init), and with ``--baseline`` the other tree's ``Init()``. Prints the median
and every build's seconds; asserts nothing.
"""

from __future__ import annotations

import argparse
import importlib
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench_step
from bench_step import MODELS  # noqa: E402

BLOCK = 128
"""bench_step.py's ``--block`` default."""
PRESETS = {name: dict(n_layer=m["n_layer"], n_embd=m["n_embd"], n_head=m["n_head"], block_size=BLOCK,
                      vocab_size=m["vocab"]) for name, m in MODELS.items()}
"""bench_step.py's GPTs: big 86.7M parameters, small 3.7M."""


def _zero3_of(tree: str):
    """The zero3 package of ``tree`` (imported under its own name, beside this tree's)."""
    saved = {k: v for k, v in sys.modules.items() if k == "zero3" or k.startswith("zero3.")}
    for k in saved:
        del sys.modules[k]
    sys.path.insert(0, tree)
    try:
        return importlib.import_module("zero3")
    finally:
        sys.path.remove(tree)
        theirs = {k: v for k, v in sys.modules.items() if k == "zero3" or k.startswith("zero3.")}
        for k in theirs:
            del sys.modules[k]
        sys.modules.update(saved)


def run(rank: int, world: int, port: int, args: argparse.Namespace, out: "mp.Queue") -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    sys.path.insert(0, os.path.join(ROOT, "examples"))
    sys.path.insert(0, ROOT)
    import zero3
    from gpt import GPT, GPTConfig

    variants = {"Init()": (zero3, "rng"), 'Init(sync="broadcast")': (zero3, "broadcast")}
    if args.baseline:
        variants["Init() [baseline]"] = (_zero3_of(os.path.abspath(args.baseline)), "rng")
    cfg = GPTConfig(**PRESETS[args.preset])
    times: dict[str, list[float]] = {k: [] for k in variants}
    names = list(variants)
    for r in range(args.builds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            lib, sync = variants[name]
            dist.barrier()
            t0 = time.perf_counter()
            torch.manual_seed(0)
            with lib.Init(sync=sync):
                model = GPT(cfg)
            dist.barrier()
            t = torch.tensor([time.perf_counter() - t0])
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            times[name].append(t.item())
            del model
    if rank == 0:
        out.put(times)
    dist.destroy_process_group()


def _meta_gpt(cfg: dict):
    """The preset's GPT on the meta device (no memory): for its parameter count."""
    sys.path.insert(0, os.path.join(ROOT, "examples"))
    from gpt import GPT, GPTConfig

    with torch.device("meta"):
        return GPT(GPTConfig(**cfg))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", choices=sorted(PRESETS), default="big")
    ap.add_argument("--builds", type=int, default=3, help="builds per variant")
    ap.add_argument("--baseline", default=None, help="another tree whose zero3 builds beside this one")
    ap.add_argument("--port", type=int, default=29533)
    args = ap.parse_args()
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    mp.spawn(run, args=(2, args.port, args, out), nprocs=2)
    times = out.get()
    cfg = PRESETS[args.preset]
    n_params = sum(p.numel() for p in _meta_gpt(cfg).parameters())
    print(f"GPT {cfg['n_layer']} x {cfg['n_embd']}, vocabulary {cfg['vocab_size']}, block {cfg['block_size']} "
          f"({n_params / 1e6:.1f}M parameters), built under zero3.Init on 2 gloo ranks, {args.builds} builds per "
          f"variant (wall seconds, the slower rank)\n")
    print("| variant | median (s) | every build (s) |")
    print("|---|---:|---|")
    for name, ts in times.items():
        print(f"| {name} | {statistics.median(ts):.2f} | {' '.join(f'{t:.2f}' for t in ts)} |")


if __name__ == "__main__":
    main()
