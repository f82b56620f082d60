"""Compiled blocks: zero3 and FSDP2, eager and with ``torch.compile`` per Block, on 2 CPU ranks (gloo).

    python benchmarks/bench_compile.py                       # GPT 4x128, block 64, 8 sequences/rank
    python benchmarks/bench_compile.py --variants zero3,zero3-compiled --steps 10 --backend aot_eager

Variants, built side by side in one pair of rank processes:

- ``zero3``: the example GPT (examples/gpt.py) under ``zero3.Init`` and ``zero3.initialize``, eager;
- ``zero3-leaf``: the same with ``zero3.set_leaf_modules(model, [Block])``: gathers per Block as
  with compiled blocks, eager, to tell what the coarser gathers bring from what compiling brings;
- ``zero3-compiled``: the same with ``zero3.compile_blocks(model, [Block], backend=...)`` before
  ``initialize`` (each Block one zero3 unit, its inner forward compiled, zero3's hooks outside);
- ``fsdp2``: ``fully_shard`` on each Block, then on the root, eager;
- ``fsdp2-compiled``: the same, then ``block.compile(backend=...)`` on each Block, as FSDP2 users do
  (it compiles the Block's ``_call_impl``; dynamo skips FSDP2's hooks, ``skip_fsdp_hooks``).

Every variant does the same work: AdamW, forward + backward + optimizer step on ``--batch``
sequences per rank of the same synthetic batches. The variants' steps are interleaved, one round of
all variants per step index, each variant in a different position of the round in turn, so that a
busy host slows them alike. Each step starts after a barrier; its time is the slower rank's. Step 0
(which compiles) is reported on its own as the compile warm-up, with inductor's and AOTAutograd's
caches disabled so that it is a cold compile; the next ``--warmup`` steps are dropped, and the table
shows the median of the ``--steps`` timed steps. All variants run under glibc's default allocator
(``MALLOC_MMAP_THRESHOLD_`` removed) with one intra-op thread per rank. "CPU / step" is the median
over the timed steps of the process CPU time per step (all threads, mean over ranks): less sensitive
to a busy host than wall time, blind to time spent waiting on the other rank. "graphs" counts the
graphs dynamo compiled during the variant's steps, "recompiled" whether any frame or graph was
compiled after its step 0. The last column is the largest relative difference of the per-step global
loss (every step, step 0 included) from one reference for every row: FSDP2 eager (or, without it in
``--variants``, zero3 eager, else the first variant), so zero3 is checked against FSDP2 too. All
variants train fp32 from the same seed on the same batches: a row more than ``--loss-rtol`` (1e-5, as
bench_step.py; inductor's fusions change only the summation order) from the reference says DIFFERS
and its ratios say "excluded". Figures are printed, never asserted: a shared machine is noisy, so read
the ratios of one run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples"))
sys.path.insert(0, ROOT)

VARIANTS = ("zero3", "zero3-leaf", "zero3-compiled", "fsdp2", "fsdp2-compiled")
LABELS = {
    "zero3": "zero3, eager",
    "zero3-leaf": "zero3, eager, Block a leaf module",
    "zero3-compiled": "zero3, compile_blocks (Block)",
    "fsdp2": "FSDP2 (fully_shard per Block + root), eager",
    "fsdp2-compiled": "FSDP2 (fully_shard per Block + root), block.compile()",
}


def _build(variant: str, args: argparse.Namespace, cfg, world: int):
    """The model and one training step ``step(x, y) -> loss`` of ``variant``."""
    import torch

    import zero3
    from gpt import GPT, Block

    torch.manual_seed(0)
    if variant.startswith("zero3"):
        with zero3.Init():
            model = GPT(cfg)
        if variant.endswith("compiled"):
            zero3.compile_blocks(model, [Block], backend=args.backend)
        elif variant.endswith("leaf"):
            zero3.set_leaf_modules(model, [Block])
        engine = zero3.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-6, weight_decay=0.1),
                                  {"param_persistence_threshold": 0})

        def zero3_step(x, y):
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            return loss

        return zero3_step
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = GPT(cfg)
    mesh = init_device_mesh("cpu", (world,))
    for block in model.h:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    if variant.endswith("compiled"):
        for block in model.h:
            block.compile(backend=args.backend)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-6, weight_decay=0.1)

    def fsdp2_step(x, y):
        loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    return fsdp2_step


def _counts() -> tuple[int, int, int]:
    from torch._dynamo.utils import counters

    return (counters["frames"]["total"], counters["stats"]["unique_graphs"], sum(counters["graph_break"].values()))


def _rank(rank: int, world: int, variants: list[str], args: argparse.Namespace, store: str, out_dir: str) -> None:
    import torch
    import torch._inductor.config
    import torch.distributed as dist

    from gpt import GPTConfig, synthetic_batch

    torch.set_num_threads(1)
    torch._inductor.config.force_disable_caches = True  # every compiled variant compiles cold
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    cfg = GPTConfig(vocab_size=256, block_size=args.block, n_layer=args.n_layer, n_head=args.n_head,
                    n_embd=args.n_embd)
    steps = {v: _build(v, args, cfg, world) for v in variants}
    times = {v: [] for v in variants}
    cpu = {v: [] for v in variants}
    losses = {v: [] for v in variants}
    compiles = {v: [] for v in variants}  # (frames, graphs, graph breaks) added by each step
    for step in range(1 + args.warmup + args.steps):
        x, y = synthetic_batch(step, args.batch * world, cfg)
        xs, ys = x[rank * args.batch:(rank + 1) * args.batch], y[rank * args.batch:(rank + 1) * args.batch]
        shift = step % len(variants)  # each variant in every position of the round in turn
        for v in variants[shift:] + variants[:shift]:
            before = _counts()
            dist.barrier()
            t0, c0 = time.perf_counter(), time.process_time()
            loss = steps[v](xs, ys)
            times[v].append(time.perf_counter() - t0)
            cpu[v].append(time.process_time() - c0)
            compiles[v].append([b - a for a, b in zip(before, _counts())])
            loss = loss.detach().clone()
            dist.all_reduce(loss)
            losses[v].append(loss.item() / world)
    with open(os.path.join(out_dir, f"{rank}.json"), "w") as fh:
        json.dump({"times": times, "cpu": cpu, "losses": losses, "compiles": compiles}, fh)
    dist.destroy_process_group()


def run(variants: list[str], args: argparse.Namespace) -> dict[str, dict]:
    """All variants in one pair of ranks, their steps interleaved, so a busy host slows them alike."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_rank, args=(args.nproc, variants, args, os.path.join(tmp, "store"), tmp), nprocs=args.nproc)
        ranks = [json.load(open(os.path.join(tmp, f"{r}.json"))) for r in range(args.nproc)]
    out = {}
    for v in variants:
        step_s = [max(r["times"][v][i] for r in ranks) for i in range(len(ranks[0]["times"][v]))]
        timed = step_s[1 + args.warmup:]
        added = [[max(r["compiles"][v][i][k] for r in ranks) for k in range(3)] for i in range(len(step_s))]
        cpu_s = [statistics.mean(r["cpu"][v][i] for r in ranks) for i in range(1 + args.warmup, len(step_s))]
        out[v] = {"first_s": step_s[0], "median_s": statistics.median(timed), "min_s": min(timed),
                  "cpu_s": statistics.median(cpu_s),
                  "losses": ranks[0]["losses"][v], "graphs": sum(a[1] for a in added),
                  "recompiled": any(a[0] or a[1] for a in added[1:]), "graph_breaks": sum(a[2] for a in added)}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--n-layer", type=int, default=4)
    parser.add_argument("--n-head", type=int, default=4)
    parser.add_argument("--n-embd", type=int, default=128)
    parser.add_argument("--block", type=int, default=64)
    parser.add_argument("--batch", type=int, default=8, help="sequences per rank per step")
    parser.add_argument("--warmup", type=int, default=3, help="steps dropped after the compiling step 0")
    parser.add_argument("--steps", type=int, default=20, help="timed steps")
    parser.add_argument("--backend", default="inductor", help="torch.compile backend of the compiled variants")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--loss-rtol", type=float, default=1e-5,
                        help="relative loss difference from the reference row that still counts as the same "
                             "result (default %(default)g, fp32)")
    args = parser.parse_args()
    os.environ.pop("MALLOC_MMAP_THRESHOLD_", None)  # glibc's default allocator for every variant
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")  # no compile worker pool on a shared host
    variants = args.variants.split(",")
    unknown = sorted(set(variants) - set(VARIANTS))
    if unknown:
        parser.error(f"unknown variants {unknown}; choose from {', '.join(VARIANTS)}")
    results = run(variants, args)
    ref = "fsdp2" if "fsdp2" in results else ("zero3" if "zero3" in results else variants[0])
    for r in results.values():
        diffs = [abs(a - b) / max(abs(b), 1e-30) for a, b in zip(r["losses"], results[ref]["losses"])]
        r["rel"] = max(diffs) if diffs and all(d == d for d in diffs) else float("nan")
        r["same"] = bool(diffs) and all(d <= args.loss_rtol for d in diffs)  # NaN compares False
    print(f"GPT {args.n_layer}x{args.n_embd} ({args.n_head} heads), block {args.block}, {args.nproc} gloo ranks, "
          f"batch {args.batch} sequences/rank, backend {args.backend}; median of {args.steps} steps after "
          f"{1 + args.warmup} warm-up steps; step = the slower rank's forward + backward + AdamW step\n")
    print("| variant | median step (ms) | fastest (ms) | vs zero3 eager | vs FSDP2 eager | CPU / step (ms) "
          "| CPU vs zero3 eager | step 0, with compile (s) | graphs (recompiled after step 0) | graph breaks "
          f"| max rel. loss diff vs {LABELS[ref]} |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for v, r in results.items():

        def vs(base: str, key: str) -> str:
            if base not in results:
                return "-"
            if not (r["same"] and results[base]["same"]):
                return "excluded"
            return f"{r[key] / results[base][key]:.2f}x"

        ratio = {base: vs(base, "median_s") for base in ("zero3", "fsdp2")}
        cpu_ratio = vs("zero3", "cpu_s")
        diff = f"{r['rel']:.1e}" + ("" if r["same"] else " DIFFERS")
        print(f"| {LABELS[v]} | {r['median_s'] * 1e3:.1f} | {r['min_s'] * 1e3:.1f} | {ratio['zero3']} | "
              f"{ratio['fsdp2']} | {r['cpu_s'] * 1e3:.1f} | {cpu_ratio} | {r['first_s']:.1f} | {r['graphs']} ({'yes' if r['recompiled'] else 'no'}) | "
              f"{r['graph_breaks']} | {diff} |")
    differs = [LABELS[v] for v, r in results.items() if not r["same"]]
    if differs:
        print(f"\nDIFFERS (loss not within {args.loss_rtol:g} relative of {LABELS[ref]}'s at every step; left "
              f"out of the ratios): {'; '.join(differs)}")


if __name__ == "__main__":
    main()
