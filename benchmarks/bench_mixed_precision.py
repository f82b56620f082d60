"""Mixed precision benchmark: zero3 fp32 vs zero3 bf16 vs FSDP2 (bf16 params, fp32 reduce), CPU gloo.

    python benchmarks/bench_mixed_precision.py                 # 2 ranks, GPT 4x256, 20 timed steps
    python benchmarks/bench_mixed_precision.py --nproc 4 --n-embd 384 --steps 30

Every configuration runs in fresh ranks (one intra-op thread each) on the same GPT work: AdamW,
clipping to 1.0, ``--batch`` sequences per rank. Printed, as a Markdown table:

- median step time (forward, backward, clip, optimizer step) over the timed steps;
- peak memory per rank: the highest resident set during the timed steps (``VmHWM`` after resetting
  it through ``/proc/self/clear_refs``) minus the resident set before the model was built. The ranks
  run with ``MALLOC_MMAP_THRESHOLD_=131072`` so that freed tensors go back to the OS and the resident
  set follows live memory rather than glibc's cached heap;
- model-state bytes per parameter per rank, counted from live tensors after a backward (parameter
  shards, gradient shards, fp32 masters, optimizer moments), next to the ZeRO formula (2+2+12)/N.
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

MODES = ("zero3 fp32", "zero3 bf16", "FSDP2 bf16")


def _rss_kib(field: str) -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as fh:
        fh.write("5")


def _tensor_bytes(t) -> int:
    import torch

    if t is None:
        return 0
    if hasattr(t, "to_local"):
        t = t.to_local()
    return t.numel() * t.element_size() if isinstance(t, torch.Tensor) and t.dim() > 0 else 0


def _rank(rank: int, world: int, mode: str, args: argparse.Namespace, store: str, out_dir: str) -> None:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from gpt import GPT, GPTConfig, synthetic_batch

    import zero3

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    cfg = GPTConfig(vocab_size=256, block_size=args.block, n_layer=args.n_layer, n_head=args.n_head,
                    n_embd=args.n_embd)
    baseline = _rss_kib("VmRSS")
    torch.manual_seed(0)
    if mode.startswith("zero3"):
        with zero3.Init():
            model = GPT(cfg)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-6, weight_decay=0.1)
        engine = zero3.initialize(model, opt, {"param_persistence_threshold": 0,
                                               "dtype": "bf16" if "bf16" in mode else "fp32"})
        n_params = sum(p.ds_numel for p in engine.params)
        forward, backward = engine, engine.backward

        def clip_and_step() -> None:
            zero3.clip_grad_norm_(engine, 1.0)
            engine.step()

        def state_bytes() -> int:
            m = engine.memory_report()
            return m["param_shard_bytes"] + m["grad_shard_bytes"] + m["optimizer_state_bytes"]
    else:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        model = GPT(cfg)
        n_params = sum(p.numel() for p in model.parameters())
        mesh = init_device_mesh("cpu", (world,))
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for block in model.h:
            fully_shard(block, mesh=mesh, mp_policy=policy)
        fully_shard(model, mesh=mesh, mp_policy=policy)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-6, weight_decay=0.1)
        forward = model

        def backward(loss: torch.Tensor) -> None:
            loss.backward()

        def clip_and_step() -> None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)

        def state_bytes() -> int:
            total = sum(_tensor_bytes(p) + _tensor_bytes(p.grad) for p in model.parameters())
            return total + sum(_tensor_bytes(v) for s in opt.state.values() for v in s.values())

    times, state = [], 0
    for step in range(args.warmup + args.steps):
        if step == args.warmup:
            _reset_peak()
        x, y = synthetic_batch(step, args.batch * world, cfg)
        xs, ys = x[rank * args.batch:(rank + 1) * args.batch], y[rank * args.batch:(rank + 1) * args.batch]
        dist.barrier()
        t0 = time.perf_counter()
        logits = forward(xs)
        loss = F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), ys.reshape(-1))
        backward(loss)
        if step == args.warmup:  # gradients and (after the warm-up steps) moments all exist
            state = state_bytes()
        clip_and_step()
        if step >= args.warmup:
            times.append(time.perf_counter() - t0)
    peak = _rss_kib("VmHWM") - baseline
    with open(os.path.join(out_dir, f"{rank}.json"), "w") as fh:
        json.dump({"median_s": statistics.median(times), "peak_kib": peak, "state_bytes": state,
                   "n_params": n_params, "loss": loss.item()}, fh)
    dist.destroy_process_group()


def run_mode(mode: str, args: argparse.Namespace) -> list[dict]:
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_rank, args=(args.nproc, mode, args, os.path.join(tmp, "store"), tmp), nprocs=args.nproc)
        return [json.load(open(os.path.join(tmp, f"{r}.json"))) for r in range(args.nproc)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--n-layer", type=int, default=4)
    parser.add_argument("--n-head", type=int, default=4)
    parser.add_argument("--n-embd", type=int, default=256)
    parser.add_argument("--block", type=int, default=128)
    parser.add_argument("--batch", type=int, default=4, help="sequences per rank per step")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--modes", default=",".join(MODES))
    args = parser.parse_args()
    os.environ["MALLOC_MMAP_THRESHOLD_"] = "131072"  # inherited by the spawned ranks
    n = args.nproc
    rows = []
    for mode in args.modes.split(","):
        res = run_mode(mode, args)
        n_params = res[0]["n_params"]
        rows.append((mode, max(r["median_s"] for r in res) * 1e3, max(r["peak_kib"] for r in res) / 1024,
                     max(r["state_bytes"] for r in res) / n_params, res[0]["loss"]))
    print(f"GPT {args.n_layer}x{args.n_embd}, block {args.block}, {n_params / 1e6:.2f}M parameters, {n} gloo ranks, "
          f"{args.batch} sequences/rank, {args.steps} timed steps\n")
    print("| configuration | median step (ms) | peak memory / rank (MiB) | model-state bytes / param / rank "
          "| (2+2+12)/N | final loss |")
    print("|---|---:|---:|---:|---:|---:|")
    for mode, ms, mib, per_param, loss in rows:
        print(f"| {mode} | {ms:.1f} | {mib:.1f} | {per_param:.2f} | {16 / n:.2f} | {loss:.4f} |")


if __name__ == "__main__":
    main()
