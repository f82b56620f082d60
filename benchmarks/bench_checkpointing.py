"""Activation memory of a deep model with ``zero3.checkpointing.checkpoint`` against without it.

    python benchmarks/bench_checkpointing.py            # a few minutes on 2 cores
    python benchmarks/bench_checkpointing.py --quick    # smaller model

Every variant trains a model of the same depth and width (the tensor-parallel ones examples/megatron_gpt.py's) for ``--steps`` steps (one warm-up first) in a fresh process
(the two tensor-parallel variants in a fresh pair of gloo ranks) started with
``MALLOC_MMAP_THRESHOLD_=131072``: glibc then mmaps every buffer over 128 KiB and returns its pages
when it is freed, so the resident set follows the live tensors. Per process it reports:

- **saved at end of forward**: the bytes of every tensor autograd keeps for backward when the
  forward has returned, counted by a ``saved_tensors_hooks`` pack hook (exact, no allocator noise);
- **peak RSS above baseline**: ``ru_maxrss`` at the end minus the resident set after the warm-up
  step (model, shards and optimizer state exist then; the warm-up's own peak is that of any step);
- **step**: median seconds per step, for the cost of the recompute (not a benchmark of speed).

Variants on one process (examples/gpt.py, zero3 engine at world size 1): no checkpointing, every
block under ``zero3.checkpointing.checkpoint``, and the same with ``cpu_checkpointing``. On two
gloo ranks (examples/megatron_gpt.py, 2-way tensor parallel, the same depth): checkpointing with
and without ``partition_activations``, per rank. Figures are printed, never asserted.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "examples"))


def _rss() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _measured_steps(step, steps: int) -> dict:
    """Run ``step(counter)`` once to warm up (the optimizer state is made then), read the baseline,
    then ``steps`` times; the measurements of the module docstring."""
    step(None)
    baseline = _rss()
    times, saved = [], []
    for _ in range(steps):
        counter: list[int] = []
        t0 = time.perf_counter()
        step(counter)
        times.append(time.perf_counter() - t0)
        saved.append(sum(counter))
    return {"saved": max(saved), "peak_above": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - baseline,
            "baseline": baseline, "step_s": statistics.median(times)}


def _pack_counter(counter):
    import torch

    def pack(t):
        counter.append(t.numel() * t.element_size())
        return t

    return torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)


def single(variant: str, n_layer: int, n_embd: int, block: int, batch: int, steps: int) -> dict:
    """One process: examples/gpt.py under a zero3 engine, blocks checkpointed as ``variant`` says."""
    import contextlib

    import torch

    import zero3
    from gpt import GPT, GPTConfig, synthetic_batch

    torch.set_num_threads(1)
    if variant == "cpu_checkpointing":
        zero3.checkpointing.configure(None, checkpoint_in_cpu=True)
    cfg = GPTConfig(n_layer=n_layer, n_embd=n_embd, n_head=4, block_size=block, vocab_size=256,
                    checkpoint=None if variant == "none" else "zero3")
    torch.manual_seed(0)
    model = GPT(cfg)
    engine = zero3.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-4),
                              {"param_persistence_threshold": 0})
    x, y = synthetic_batch(0, batch, cfg)

    def step(counter):
        with _pack_counter(counter) if counter is not None else contextlib.nullcontext():
            loss = engine(x, y)
        engine.backward(loss)
        engine.step()

    return _measured_steps(step, steps)


def _tp_rank(rank: int, port: int, partition: bool, dims: dict, out: str) -> None:
    import contextlib

    import torch
    import torch.distributed as dist

    import megatron_gpt as m
    import zero3

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        cfg = m.Config(n_layer=dims["n_layer"], n_embd=dims["n_embd"], n_head=4, block_size=dims["block"],
                       vocab_size=256, checkpoint=True)
        engine, _ = m.build(cfg, m.RunConfig(tp=2, partition_activations=partition))
        x, y = m.synthetic_batch(0, dims["batch"], cfg)

        def step(counter):
            with _pack_counter(counter) if counter is not None else contextlib.nullcontext():
                loss = engine(x, y)
            engine.backward(loss)
            engine.step()

        result = _measured_steps(step, dims["steps"])
        Path(out, f"rank{rank}.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


def tensor_parallel(partition: bool, dims: dict) -> list[dict]:
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as out:
        mp.spawn(_tp_rank, args=(port, partition, dims, out), nprocs=2)
        return [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(2)]


def _worker(spec: dict) -> None:
    if spec["kind"] == "single":
        result = [single(spec["variant"], **spec["dims"])]
    else:
        result = tensor_parallel(spec["variant"] == "partition_activations", spec["dims"])
    sys.stdout.write(json.dumps(result) + "\n")


def run(spec: dict) -> list[dict]:
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072", "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, __file__, "--worker", json.dumps(spec)], env=env, check=True,
                         capture_output=True, text=True, cwd=ROOT)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n-layer", type=int, default=16)
    ap.add_argument("--n-embd", type=int, default=256)
    ap.add_argument("--block", type=int, default=128)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="8 layers, width 128, 2 steps: a smoke run "
                    "(defaults only: --n-layer, --n-embd, --steps given win)")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    if ap.parse_known_args()[0].quick:  # the preset gives defaults; --n-layer etc. given win
        ap.set_defaults(n_layer=8, n_embd=128, steps=2)
    args = ap.parse_args()
    if args.worker is not None:
        _worker(json.loads(args.worker))
        return
    dims = {"n_layer": args.n_layer, "n_embd": args.n_embd, "block": args.block, "batch": args.batch,
            "steps": args.steps}
    mib = 1 << 20
    print(f"GPT {args.n_layer} layers x {args.n_embd} wide, {args.batch} x {args.block} tokens per rank, "
          f"median of {args.steps} steps; MALLOC_MMAP_THRESHOLD_=131072\n")
    print("| variant | ranks | saved at end of forward (MiB) | peak RSS above baseline (MiB) | baseline RSS (MiB) "
          "| step (s) |")
    print("|---|---|---|---|---|---|")
    for kind, variant in (("single", "none"), ("single", "checkpoint"), ("single", "cpu_checkpointing"),
                          ("tp", "checkpoint"), ("tp", "partition_activations")):
        results = run({"kind": kind, "variant": variant, "dims": dims})
        for r, res in enumerate(results):
            ranks = "1" if kind == "single" else f"rank {r} of 2 (tp=2)"
            print(f"| {variant} | {ranks} | {res['saved'] / mib:.2f} | {res['peak_above'] / mib:.1f} | "
                  f"{res['baseline'] / mib:.0f} | {res['step_s']:.2f} |", flush=True)


if __name__ == "__main__":
    main()
