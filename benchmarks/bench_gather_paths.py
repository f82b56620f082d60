"""How a pairwise gather's messages are cut, side by side in one process: a message per parameter
and peer ("pieces"), one row per peer for every gather ("rows"), or zero3's rule (`wire.DIRECT_MIN_BYTES`:
rows where the parameters average under 1 MiB, "auto"). zero3 lean (bench_step.py's budget) on a GPT
of bench_step.py, 2 gloo ranks, verification on.

    torchrun --nproc_per_node 2 benchmarks/bench_gather_paths.py                 # 3.7M GPT, 36 rounds
    torchrun --nproc_per_node 2 benchmarks/bench_gather_paths.py --model big --rounds 6

The ways alternate every 2 steps, in a rotated order each round, so a busy host slows them alike.
Rank 0 prints the median step (wall) and the median process CPU time per step of each way.
Figures are printed, never asserted.

The ways change only how the messages are cut, so they must gather the same values: after the timed
rounds, each way runs one forward under ``torch.no_grad()`` on the same batch (every parameter gathered
through that way, threshold 0), and its loss (mean over ranks) must equal the "auto" way's (or the first
way's) bit for bit; the table's last column shows the difference, and a way that differs says DIFFERS.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples"))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench_step

WAYS = {"pieces": 0, "rows": 1 << 62, "auto": None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", choices=("small", "big"), default="small")
    ap.add_argument("--rounds", type=int, default=36)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--ways", default="pieces,rows,auto")
    args = ap.parse_args()

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    import zero3
    from zero3.comm import wire
    from bench_step import MODELS, zero3_config
    from gpt import GPT, GPTConfig, synthetic_batch

    m = MODELS[args.model]
    cfg = GPTConfig(vocab_size=m["vocab"], block_size=128, n_layer=m["n_layer"], n_head=m["n_head"],
                    n_embd=m["n_embd"])
    torch.manual_seed(0)
    model = GPT(cfg)
    lean = zero3_config("zero3-prefetch", argparse.Namespace(n_embd=m["n_embd"], persistence=0, zero3_extra=None))
    lean["allgather_impl"] = "p2p"  # the wire's two ways (on one host, auto would read shared memory instead)
    engine = zero3.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-3), lean)
    rank = dist.get_rank()
    auto = wire.DIRECT_MIN_BYTES
    ways = args.ways.split(",")

    def use(way: str) -> None:
        wire.DIRECT_MIN_BYTES = auto if WAYS[way] is None else WAYS[way]

    def step(i: int) -> None:
        x, y = synthetic_batch(i * 2 + rank, args.batch, cfg)
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()

    for way in ways:  # warm-up: the first step records the trace
        use(way)
        step(0)
        step(1)
    wall: dict[str, list[float]] = {w: [] for w in ways}
    cpu: dict[str, list[float]] = {w: [] for w in ways}
    for r in range(args.rounds):
        for way in ways[r % len(ways):] + ways[:r % len(ways)]:
            use(way)
            dist.barrier()
            for k in range(2):
                t, c = time.perf_counter(), time.process_time()
                step(k)
                wall[way].append(time.perf_counter() - t)
                cpu[way].append(time.process_time() - c)
    check: dict[str, float] = {}
    x, y = synthetic_batch(10**6 + rank, args.batch, cfg)  # one batch, the same for every way
    for way in ways:  # the values each way gathers: one forward through it, the loss compared below
        use(way)
        with torch.no_grad():
            loss = engine(x, y).detach().clone()
        dist.all_reduce(loss)
        check[way] = loss.item() / dist.get_world_size()
    use("auto")
    if rank == 0:
        ref = "auto" if "auto" in ways else ways[0]
        print(f"# bench_gather_paths  model {args.model}  batch {args.batch}/rank  {args.rounds} rounds x 2 steps a way")
        print(f"| way | median step (ms) | median CPU/step (ms) | check forward's loss - {ref}'s |")
        print("|---|---:|---:|---|")
        for way in ways:
            diff = check[way] - check[ref]
            print(f"| {way} | {statistics.median(wall[way]) * 1e3:.1f} | {statistics.median(cpu[way]) * 1e3:.1f} | "
                  f"{diff:.1e}{'' if diff == 0 else ' DIFFERS'} |")
        differs = [w for w in ways if check[w] != check[ref]]
        if differs:
            print(f"\nDIFFERS (gathered other values than {ref}: its times are not of the same work): "
                  f"{', '.join(differs)}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
