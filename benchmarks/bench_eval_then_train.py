"""The first training step after an evaluation run with grad on (no ``torch.no_grad()``), world size 1.

    python benchmarks/bench_eval_then_train.py                       # N = 25, 100, 400
    python benchmarks/bench_eval_then_train.py --evals 100 --baseline <tree of an older zero3>

Forwards with grad on and no backward join the next step's trace (docs/design.md, following a
trace). For each N, a fresh engine (the example GPT, 4 x 64, threshold 0 and a lean budget, so every
parameter is gathered along the plan) trains a few steps, runs N such forwards, then trains on; the
table gives that step's time and the next two against the median steady step before the loop, and
the time of the loop itself, for plain torch on the same model beside it. Wall clock, one process,
one thread: compare within a run. Figures are printed, never asserted.

Every variant trains the same fp32 model from the same seed on the same batch, so its loss at every
training step (before and after the loop) must match plain torch's for the same N within 1e-5
relative (``--loss-rtol``, as bench_step.py); the last column shows the largest difference, and a
row outside it says DIFFERS: its times are not of the same work.
"""

from __future__ import annotations

import argparse
import datetime
import logging
import os
import statistics
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples"))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import zero3  # noqa: E402
from bench_hooks import load_baseline  # noqa: E402
from gpt import GPT, GPTConfig, synthetic_batch  # noqa: E402

LOSS_RTOL = 1e-5
"""fp32, same init and batch: zero3 at world size 1 differs from torch only in summation order."""
CFG = GPTConfig(block_size=32, vocab_size=256, n_layer=4, n_embd=64, n_head=4)
LEAN = {"param_persistence_threshold": 0, "max_live_parameters": 60_000, "max_reuse_distance": 0,
        "prefetch_bucket_size": 30_000}


def run(lib, evals: int, warmup: int) -> dict:
    torch.manual_seed(0)
    model = GPT(CFG)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    engine = lib.initialize(model, opt, LEAN) if lib is not None else None
    x, y = synthetic_batch(0, 4, CFG)
    losses: list[float] = []

    def step() -> float:
        t = time.perf_counter()
        loss = model(x, y)
        loss.backward()
        if engine is not None:
            engine.step()
        else:
            opt.step()
            opt.zero_grad(set_to_none=True)
        dt = time.perf_counter() - t
        losses.append(loss.item())
        return dt

    steady = statistics.median(step() for _ in range(warmup))
    t = time.perf_counter()
    for _ in range(evals):
        model(x, y)  # grad on, no backward
    loop = time.perf_counter() - t
    first, second, third = step(), step(), step()
    return {"steady": steady, "loop": loop, "first": first, "second": second, "third": third, "losses": losses}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--evals", type=int, nargs="+", default=[25, 100, 400])
    ap.add_argument("--warmup", type=int, default=8)
    ap.add_argument("--baseline", metavar="TREE", help="also time the zero3 package in TREE")
    ap.add_argument("--loss-rtol", type=float, default=LOSS_RTOL,
                    help="relative loss difference from plain torch that still counts as the same result")
    args = ap.parse_args()
    torch.set_num_threads(1)
    logging.disable(logging.WARNING)  # the step that left its trace says so once per run
    libs = [("plain torch", None), ("zero3", zero3)]
    if args.baseline:
        libs.append((f"zero3 [{args.baseline}]", load_baseline(args.baseline)))
    print(f"# bench_eval_then_train  {datetime.datetime.now().isoformat(timespec='seconds')}  torch {torch.__version__}"
          f"  GPT {CFG.n_layer}x{CFG.n_embd}, batch 4x{CFG.block_size}, config {LEAN}\n")
    print("| N forwards | variant | steady step (ms) | the N forwards (ms) | first step after (ms, x steady) "
          "| second | third | max rel. loss diff vs plain torch |")
    print("|---:|---|---:|---:|---:|---:|---:|---|")
    differs = []
    for n in args.evals:
        reference = None
        for name, lib in libs:
            r = run(lib, n, args.warmup)
            reference = reference if reference is not None else r["losses"]  # plain torch runs first
            diffs = [abs(a - b) / max(abs(b), 1e-30) for a, b in zip(r["losses"], reference)]
            rel = max(diffs) if diffs and all(d == d for d in diffs) else float("nan")
            same = rel <= args.loss_rtol  # NaN compares False: not the same
            if not same:
                differs.append(f"N={n} {name}")
            s = r["steady"]
            print(f"| {n} | {name} | {s * 1e3:.1f} | {r['loop'] * 1e3:.0f} | {r['first'] * 1e3:.1f} "
                  f"({r['first'] / s:.1f}x) | {r['second'] * 1e3:.1f} ({r['second'] / s:.1f}x) | "
                  f"{r['third'] * 1e3:.1f} ({r['third'] / s:.1f}x) | {rel:.1e}{'' if same else ' DIFFERS'} |",
                  flush=True)
    if differs:
        print(f"\nDIFFERS (loss not within {args.loss_rtol:g} relative of plain torch's at every step: not the same "
              f"work): {'; '.join(differs)}")


if __name__ == "__main__":
    main()
