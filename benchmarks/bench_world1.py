"""zero3 at world size 1 on bench_step.py's 3.7M GPT: the plain model, zero3's defaults and zero3
lean (bench_step.py's budget), one process, no communication. Gathers are copies from the shards,
so the lean row's excess over the defaults is what its extra gathers cost in bookkeeping alone;
set beside bench_step.py's 2-rank CPU per step, the rest of the excess is communication.

    python benchmarks/bench_world1.py
    python benchmarks/bench_world1.py --rounds 5

The three alternate every 2 steps, in a rotated order each round. Prints the median process CPU
time per step of each, and the loss after each one's last step: all three train the same model from
the same seed on the same batches, so in fp32 their losses must agree within ``LOSS_RTOL`` of the
plain model's at every step; a way that does not is marked DIFFERS (its time is not the same work).
Figures are printed, never asserted.
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

LOSS_RTOL = 1e-5
"""Relative difference from the plain model's loss, at any step, above which a way is flagged."""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--batch", type=int, default=4)
    args = ap.parse_args()

    import torch

    torch.set_num_threads(1)
    import zero3
    from bench_step import MODELS, zero3_config
    from gpt import GPT, GPTConfig, synthetic_batch

    m = MODELS["small"]
    cfg = GPTConfig(vocab_size=m["vocab"], block_size=128, n_layer=m["n_layer"], n_head=m["n_head"],
                    n_embd=m["n_embd"])
    lean = zero3_config("zero3-prefetch", argparse.Namespace(n_embd=m["n_embd"], persistence=0, zero3_extra=None))
    ways = {"plain": None, "zero3 defaults": {}, "zero3 lean": lean}

    def build(conf: dict | None):
        torch.manual_seed(0)
        model = GPT(cfg)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        if conf is None:
            def plain(i: int) -> float:
                x, y = synthetic_batch(i, args.batch, cfg)
                loss = model(x, y)
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                return loss.item()
            return plain
        engine = zero3.initialize(model, opt, conf)

        def step(i: int) -> float:
            x, y = synthetic_batch(i, args.batch, cfg)
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            return loss.item()
        return step

    steps = {name: build(conf) for name, conf in ways.items()}
    names = list(ways)
    losses: dict[str, list[float]] = {n: [] for n in names}  # per step, in each way's own step order
    for name, step in steps.items():  # warm-up: the first step records the trace
        for i in range(3):
            losses[name].append(step(i))
    cpu: dict[str, list[float]] = {n: [] for n in names}
    for r in range(args.rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            for i in range(2):
                c = time.process_time()
                loss = steps[name](i)
                cpu[name].append(time.process_time() - c)
                losses[name].append(loss)
    print(f"# bench_world1  3.7M GPT  batch {args.batch}  world size 1  {args.rounds} rounds x 2 steps")
    print("| way | median CPU/step (ms) | loss after last step |")
    print("|---|---:|---:|")
    ref = losses["plain"]
    for name in names:
        rel = max(abs(a - b) / max(abs(b), 1e-30) for a, b in zip(losses[name], ref))
        same = rel <= LOSS_RTOL  # NaN compares False: flagged too
        mark = "" if same else f" (DIFFERS from plain by up to {rel:.1e} relative: not the same work)"
        print(f"| {name} | {statistics.median(cpu[name]) * 1e3:.1f} | {losses[name][-1]:.7g}{mark} |")
    print(f"\nEvery way must match the plain model's loss at each of its {len(ref)} steps within {LOSS_RTOL:g} "
          "relative; one marked DIFFERS trained other numbers.")


if __name__ == "__main__":
    main()
