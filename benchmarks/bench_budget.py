"""memory_budget alone against a sweep of hand-set knob combinations, on 2 CPU ranks (gloo).

    python benchmarks/bench_budget.py                      # the small GPT (4x256), budget = half the model
    python benchmarks/bench_budget.py --models small,big   # both GPTs of bench_step.py (big: 12x768)
    python benchmarks/bench_budget.py --budget-fraction 0.25 --repeats 3 --steps 10

One pair of rank processes runs every config of a model, one after another, each on a fresh model
(seed 0) with AdamW on the same synthetic batches, after one untimed run that warms the processes
up; the order is reversed on every other repeat. The
budget is ``--budget-fraction`` of the model's fp32 bytes (the full, unpartitioned model's). The
"budget" row sets only ``memory_budget``; the sweep rows set five knobs by hand: persistence
{0, 1e5 elements} x prefetch bucket {0, 1, 2 Blocks} x reuse distance {0, unbounded} x reduce bucket
{1/4, 1 Block} (24 combinations), each with ``max_live_bytes`` = what the budget leaves after that
row's reduce bucket and persistent parameters, as a user fitting the knobs to the same budget would
set it. Each step starts after a barrier; its time is the slower rank's; a row shows the median
over the measured steps of all repeats (and the fastest one).

"Within budget" adds, per run, the runtime's own gauges at their peaks: the gathered and reducer
peak at one moment (``StepMetrics.peak_gathered_and_reduce_bytes``: gathered parameters plus what
the gradient reducer held, the storages of its queued full gradients and of the reduction in flight)
and the persistent parameters, max over steps and ranks. It is zero3 measuring itself (a count of
live storages it drives), not an outside census; for the budget row it also checks the planner
against the runtime that follows its plan. Not in it: activations, gradients autograd holds before
handing them over, the shared-memory outbox arena. Before the reducer had a gauge (round 39) the
column added the reduce bucket as planned, which missed what a reduction holds beside its bucket.

Every config trains the same fp32 model from the same seed on the same batches, so its loss at every
measured step (mean over ranks, every repeat) must match the budget row's first run within 1e-5
relative (``--loss-rtol``, as bench_step.py); a row outside it says DIFFERS and is left out of the
sweep's best and of the confirmation.

The fastest of 24 noisy medians is biased low (the winner's curse), so after the sweep the budget row
and the sweep's winner run again, alternating, ``--confirm`` times each; that head-to-head ratio is
the one to read. Figures are printed, never asserted: on a shared machine read the ratio of one run.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import socket
import statistics
import sys
import tempfile
import time
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples"))
sys.path.insert(0, ROOT)

MODELS = {  # the two GPTs of benchmarks/bench_step.py
    "small": {"n_layer": 4, "n_embd": 256, "n_head": 4, "vocab": 2048},
    "big": {"n_layer": 12, "n_embd": 768, "n_head": 12, "vocab": 2048},
}
MIB = 1024 * 1024
LOSS_RTOL = 1e-5
"""fp32, same init and batches: the configs differ only in summation order (bench_step.py's LOSS_RTOL)."""


def block_numel(n_embd: int) -> int:
    """Elements of one GPT Block (as bench_step.py counts them)."""
    return 12 * n_embd * n_embd + 13 * n_embd


def configs(budget: int, n_embd: int, sizes: list[int]) -> dict[str, dict]:
    """The budget row and the hand-set sweep (see the module docstring); ``sizes``: every
    parameter's elements."""
    blk = block_numel(n_embd)
    out: dict[str, dict] = {"memory_budget": {"memory_budget": budget}}
    for persist in (0, 100_000):
        for prefetch in (0, 1, 2):
            for reuse in (0, None):
                for reduce in (blk // 4, blk):
                    name = (f"persist={persist} prefetch={prefetch}blk reuse={'inf' if reuse is None else 0} "
                            f"reduce={'1/4' if reduce < blk else '1'}blk")
                    persistent = sum(4 * n for n in sizes if n <= persist)
                    live = max(1, budget - 4 * reduce - persistent)
                    out[name] = {"param_persistence_threshold": persist, "max_live_bytes": live,
                                 "prefetch_bucket_bytes": prefetch * blk * 4,
                                 "max_reuse_distance_bytes": 10**15 if reuse is None else 0,
                                 "reduce_bucket_size": reduce}
    return out


def run_config(rank: int, world: int, cfg: dict, args: argparse.Namespace, gpt_cfg: Any) -> dict:
    import torch
    import torch.distributed as dist

    import zero3
    from gpt import GPT, synthetic_batch

    torch.manual_seed(0)
    model = GPT(gpt_cfg)
    engine = zero3.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-3), cfg)
    times, peaks, losses, reduce_peaks, joint = [], [], [], [], []
    for step in range(args.warmup + args.steps):
        x, y = synthetic_batch(step, args.batch * world, gpt_cfg)
        xs, ys = x[rank * args.batch:(rank + 1) * args.batch], y[rank * args.batch:(rank + 1) * args.batch]
        dist.barrier()
        t0 = time.perf_counter()
        loss = engine(xs, ys)
        engine.backward(loss)
        engine.step()
        dt = torch.tensor([time.perf_counter() - t0])
        dist.all_reduce(dt, op=dist.ReduceOp.MAX)
        mean_loss = loss.detach().clone()
        dist.all_reduce(mean_loss)
        if step >= args.warmup:
            times.append(dt.item())
            losses.append(mean_loss.item() / world)
        metrics = engine.last_step_metrics
        persistent = engine.memory_report()["persistent_param_bytes"]
        peaks.append(metrics.peak_live_bytes + persistent)
        reduce_peaks.append(metrics.peak_reduce_held_bytes)
        joint.append(metrics.peak_gathered_and_reduce_bytes + persistent)
    peak = torch.tensor([max(peaks), max(reduce_peaks), max(joint)])
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    budget = engine.coordinator.budget
    out = {"times": times, "peak": int(peak[0].item()), "losses": losses,
           "explain": engine.explain("budget") if budget is not None else [],
           "reduce_held_bytes": int(peak[1].item()), "joint": int(peak[2].item())}
    engine.remove_hooks()
    del engine, model
    gc.collect()
    return out


def rank_main(rank: int, world: int, port: int, args: argparse.Namespace, outdir: str) -> None:
    global LOSS_RTOL
    LOSS_RTOL = args.loss_rtol  # a spawned rank imports this module afresh; it picks the sweep's best too
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    import torch
    import torch.distributed as dist

    from gpt import GPTConfig

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=600))
    results: dict[str, Any] = {}
    for model in args.models.split(","):
        m = MODELS[model]
        gpt_cfg = GPTConfig(vocab_size=m["vocab"], block_size=args.block, n_layer=m["n_layer"], n_head=m["n_head"],
                            n_embd=m["n_embd"])
        torch.manual_seed(0)
        from gpt import GPT
        sizes = [p.numel() for p in GPT(gpt_cfg).parameters()]
        model_bytes = 4 * sum(sizes)
        budget = int(model_bytes * args.budget_fraction)
        table = configs(budget, m["n_embd"], sizes)
        runs: dict[str, list[dict]] = {name: [] for name in table}
        run_config(rank, world, table[list(table)[1]], args, gpt_cfg)  # untimed: warms the processes up
        for repeat in range(args.repeats):
            names = list(table) if repeat % 2 == 0 else list(reversed(table))
            for name in names:
                runs[name].append(run_config(rank, world, table[name], args, gpt_cfg))
        # Every rank holds the same (all-reduced) times, so every rank picks the same winner.
        best = best_of_sweep(summary_rows(runs, budget), budget)
        confirm: dict[str, list[dict]] = {}
        if best is not None and args.confirm > 0:
            pair = ["memory_budget", best[0]]
            confirm = {name: [] for name in pair}
            for round_ in range(args.confirm):
                for name in (pair if round_ % 2 == 0 else pair[::-1]):
                    confirm[name].append(run_config(rank, world, table[name], args, gpt_cfg))
        results[model] = {"model_bytes": model_bytes, "budget": budget, "runs": runs, "confirm": confirm}
    if rank == 0:
        with open(os.path.join(outdir, "results.json"), "w") as fh:
            json.dump(results, fh)
    dist.destroy_process_group()


def row_bytes(run: dict) -> int:
    """What a run held against the budget: its gathered and reducer peak at one moment, with the
    persistent parameters (the runtime's gauges, max over steps and ranks)."""
    return run["joint"]


def loss_diff(runs: dict[str, list[dict]], reference: list[float]) -> float:
    """The worst relative difference of a config's per-step losses, over its repeats, from ``reference``."""
    diffs = [abs(a - b) / max(abs(b), 1e-30) for r in runs for a, b in zip(r["losses"], reference)]
    return max(diffs) if diffs and all(d == d for d in diffs) else float("nan")


def summary_rows(runs: dict[str, list[dict]], budget: int) -> list[tuple[str, float, int, float, bool]]:
    """(name, median step, bytes held at the peak, fastest step, same loss as the budget row's first run)
    per config, in table order."""
    reference = runs["memory_budget"][0]["losses"]
    rows = []
    for name, rs in runs.items():
        times = [t for r in rs for t in r["times"]]
        rows.append((name, statistics.median(times), max(row_bytes(r) for r in rs), min(times),
                     loss_diff(rs, reference) <= LOSS_RTOL))  # NaN compares False: not the same
    return rows


def best_of_sweep(rows: list[tuple[str, float, int, float, bool]], budget: int) -> tuple | None:
    """The sweep row (every row but the first) with the least median step among those within the
    budget that trained the same numbers."""
    sweep = [r for r in rows[1:] if r[2] <= budget and r[4]]
    return min(sweep, key=lambda r: r[1]) if sweep else None


def summarise(results: dict) -> str:
    lines = []
    for model, res in results.items():
        budget = res["budget"]
        lines.append(f"\n## {model} GPT: {res['model_bytes'] / MIB:.2f} MiB of fp32 parameters, "
                     f"memory_budget {budget / MIB:.2f} MiB per rank\n")
        bucket = "gathered + reducer at once + persistent"
        lines.append(f"| config | median step (ms) | fastest step (ms) | gathered + persistent peak (MiB) | "
                     f"reducer peak (MiB) | {bucket} (MiB) | within budget | max rel. loss diff vs memory_budget |")
        lines.append("|---|---|---|---|---|---|---|---|")
        rows = summary_rows(res["runs"], budget)
        reference = res["runs"]["memory_budget"][0]["losses"]
        for (name, med, held, fast, same), runs in zip(rows, res["runs"].values()):
            peak, reducer = max(r["peak"] for r in runs), max(r["reduce_held_bytes"] for r in runs)
            lines.append(f"| {name} | {med * 1e3:.1f} | {fast * 1e3:.1f} | {peak / MIB:.2f} | {reducer / MIB:.2f} | "
                         f"{held / MIB:.2f} | "
                         f"{'yes' if held <= budget else 'NO'} | {loss_diff(runs, reference):.1e}"
                         f"{'' if same else ' DIFFERS'} |")
        differs = [r[0] for r in rows if not r[4]]
        if differs:
            lines.append(f"\nDIFFERS (loss not within {LOSS_RTOL:g} relative of memory_budget's first run; left out "
                         f"of the best and the confirmation): {'; '.join(differs)}")
        ours = rows[0]
        best = best_of_sweep(rows, budget)
        sweep = [r for r in rows[1:] if r[2] <= budget and r[4]]
        lines.append("")
        if best is not None:
            lines.append(f"best of the sweep within the budget and the same loss ({len(sweep)} of {len(rows) - 1}): "
                         f"{best[0]}, {best[1] * 1e3:.1f} ms; memory_budget alone: {ours[1] * 1e3:.1f} ms = "
                         f"{ours[1] / best[1]:.3f}x the best; its {bucket} peak: "
                         f"{ours[2] / MIB:.2f} MiB <= budget {budget / MIB:.2f}: {ours[2] <= budget}")
            fastest = min(sweep, key=lambda r: r[3])
            lines.append(f"by fastest step: best of the sweep {fastest[0]}, {fastest[3] * 1e3:.1f} ms; memory_budget "
                         f"{ours[3] * 1e3:.1f} ms = {ours[3] / fastest[3]:.3f}x")
        confirm = res.get("confirm") or {}
        if confirm:
            (a, ra), (b, rb) = confirm.items()
            ta = [t for r in ra for t in r["times"]]
            tb = [t for r in rb for t in r["times"]]
            ma, mb = statistics.median(ta), statistics.median(tb)
            lines.append(f"confirmation ({len(ra)} alternating runs each, after the sweep): {a} {ma * 1e3:.1f} ms "
                         f"(fastest {min(ta) * 1e3:.1f}), {b} {mb * 1e3:.1f} ms (fastest {min(tb) * 1e3:.1f}): "
                         f"**{ma / mb:.3f}x** by median, {min(ta) / min(tb):.3f}x by fastest step")
        explain = res["runs"]["memory_budget"][0]["explain"]
        lines += [f"    {line}" for line in explain]
    return "\n".join(lines)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    global LOSS_RTOL
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="small", help="comma list of: small, big")
    ap.add_argument("--budget-fraction", type=float, default=0.5, help="budget as a share of the model's bytes")
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--steps", type=int, default=6, help="measured steps per config and repeat")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3, help="runs per config; order reversed on odd repeats")
    ap.add_argument("--batch", type=int, default=4, help="sequences per rank")
    ap.add_argument("--block", type=int, default=128)
    ap.add_argument("--confirm", type=int, default=4,
                    help="alternating runs of memory_budget and the sweep's winner after the sweep (0: none)")
    ap.add_argument("--loss-rtol", type=float, default=LOSS_RTOL,
                    help="relative loss difference from the budget row that still counts as the same result")
    ap.add_argument("--json", help="also write the raw results here")
    args = ap.parse_args()
    LOSS_RTOL = args.loss_rtol
    import torch.multiprocessing as mp

    outdir = tempfile.mkdtemp(prefix="bench-budget-")
    mp.start_processes(rank_main, args=(args.nproc, free_port(), args, outdir), nprocs=args.nproc,
                       start_method="spawn")
    with open(os.path.join(outdir, "results.json")) as fh:
        results = json.load(fh)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(results, fh)
    print(summarise(results))


if __name__ == "__main__":
    main()
