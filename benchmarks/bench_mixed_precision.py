"""Mixed precision benchmark: zero3 fp32 vs zero3 bf16 vs FSDP2 (bf16 params, fp32 reduce; with and
without resharding after forward), CPU gloo.

    python benchmarks/bench_mixed_precision.py                 # 2 ranks, GPT 4x256, 20 timed steps
    python benchmarks/bench_mixed_precision.py --nproc 4 --n-embd 384 --steps 30
    python benchmarks/bench_mixed_precision.py --warmup 1 --steps 2 --memory-steps 1 --n-layer 2 --n-embd 64
        # smoke run

Every configuration runs in fresh ranks (one intra-op thread each) on the same GPT work: AdamW,
clipping to 1.0, ``--batch`` sequences per rank, the same seed and batches. zero3 runs with
``param_persistence_threshold`` 0 (every parameter gathered and released); FSDP2 is ``fully_shard``
per Block and on the root with ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``, with
``reshard_after_forward`` True (torch's default) and False. Each configuration runs twice, as
bench_step.py does:

- a timed pass under glibc's default allocator (``MALLOC_MMAP_THRESHOLD_`` removed from the ranks'
  environment: an mmap per large tensor costs page faults on every step, which no real run pays).
  Each step starts after a barrier; the step time (forward, backward, clip, optimizer step) is the
  slower rank's, and the table shows the median over the timed steps;
- a memory pass of its own (``--memory-steps`` steps after the warm-up, fresh ranks, with
  ``MALLOC_MMAP_THRESHOLD_=131072`` or the value in the environment, so that freed tensors go back
  to the OS and the resident set follows live memory rather than glibc's cached heap): peak memory
  per rank is the highest resident set during those steps (``VmHWM`` after resetting it through
  ``/proc/self/clear_refs``) minus the resident set before the model was built; model-state bytes
  per parameter per rank are counted from live tensors after a backward (parameter shards, gradient
  shards, fp32 masters, optimizer moments), next to the ZeRO formula (2+2+12)/N.

Loss check: every configuration's loss at every timed step (mean over ranks) is compared with the
``zero3 fp32`` run's (or, without it in ``--modes``, the first configuration's). An fp32 configuration
must match within 1e-5 relative (summation order only, as bench_step.py); a bf16 one within
``--bf16-rtol`` (default 1e-2, the level bench_step.py names for bf16), for the bf16 rounding of
weights and activations, which grows over the steps; the two bf16 recipes also differ from each
other (zero3 keeps bf16 parameter shards and fp32 masters, FSDP2 fp32 shards cast to bf16 at each
gather). A configuration outside its tolerance shows
DIFFERS and is left out of the ratios. The table names the commit it was run at.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples"))

MODES = ("zero3 fp32", "zero3 bf16", "FSDP2 bf16", "FSDP2 bf16 noreshard")
"""``FSDP2 bf16``: reshard_after_forward=True (torch's default); ``noreshard``: False."""
MMAP_THRESHOLD = "131072"
"""MALLOC_MMAP_THRESHOLD_ of the memory pass, unless the environment sets another."""
FP32_RTOL = 1e-5
"""fp32, same init and batches: the systems differ only in summation order (bench_step.py's LOSS_RTOL)."""


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


def _rank(rank: int, world: int, mode: str, args: argparse.Namespace, store: str, out_dir: str,
          memory: bool) -> None:
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
        reshard = not mode.endswith("noreshard")
        for block in model.h:
            fully_shard(block, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard)
        fully_shard(model, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard)
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

    times, losses, state = [], [], 0
    steps = args.memory_steps if memory else args.steps
    for step in range(args.warmup + steps):
        if step == args.warmup and memory:
            _reset_peak()
        x, y = synthetic_batch(step, args.batch * world, cfg)
        xs, ys = x[rank * args.batch:(rank + 1) * args.batch], y[rank * args.batch:(rank + 1) * args.batch]
        dist.barrier()
        t0 = time.perf_counter()
        logits = forward(xs)
        loss = F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), ys.reshape(-1))
        backward(loss)
        if step == args.warmup and memory:  # gradients and (after the warm-up steps) moments all exist
            state = state_bytes()
        clip_and_step()
        if step >= args.warmup:
            times.append(time.perf_counter() - t0)
            losses.append(loss.item())
    peak = _rss_kib("VmHWM") - baseline
    with open(os.path.join(out_dir, f"{rank}.json"), "w") as fh:
        json.dump({"times": times, "peak_kib": peak, "state_bytes": state, "n_params": n_params,
                   "losses": losses}, fh)
    dist.destroy_process_group()


def run_mode(mode: str, args: argparse.Namespace, memory: bool) -> list[dict]:
    """One run of ``mode`` in fresh ranks: timed (glibc's default allocator) or the memory pass."""
    import torch.multiprocessing as mp

    # The children inherit the environment when spawned, and glibc reads it at their start-up.
    if memory:
        os.environ["MALLOC_MMAP_THRESHOLD_"] = args.mmap_threshold
    try:
        with tempfile.TemporaryDirectory() as tmp:
            mp.spawn(_rank, args=(args.nproc, mode, args, os.path.join(tmp, "store"), tmp, memory),
                     nprocs=args.nproc)
            return [json.load(open(os.path.join(tmp, f"{r}.json"))) for r in range(args.nproc)]
    finally:
        os.environ.pop("MALLOC_MMAP_THRESHOLD_", None)


def _commit() -> str:
    try:
        out = subprocess.run(["git", "-C", ROOT, "describe", "--always", "--dirty"], capture_output=True,
                             text=True, timeout=10)
    except OSError:
        return "unknown"
    return out.stdout.strip() or "unknown"


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
    parser.add_argument("--memory-steps", type=int, default=3,
                        help="steps after the warm-up in each configuration's memory pass (its own run)")
    parser.add_argument("--modes", default=",".join(MODES), help=f"comma list from {MODES}")
    parser.add_argument("--bf16-rtol", type=float, default=1e-2,
                        help="relative loss difference from the fp32 reference that a bf16 configuration may "
                             "show at every timed step (default %(default)g)")
    args = parser.parse_args()
    modes = [m for m in args.modes.split(",") if m]
    for m in modes:
        if m not in MODES:
            parser.error(f"unknown mode {m!r}; --modes takes a comma list of {MODES}")
    # Timed ranks run under glibc's defaults; run_mode sets this for the memory pass's ranks only.
    args.mmap_threshold = os.environ.pop("MALLOC_MMAP_THRESHOLD_", MMAP_THRESHOLD)
    n = args.nproc
    timed, mem = {}, {}
    for mode in modes:
        timed[mode] = run_mode(mode, args, memory=False)
    for mode in modes:
        mem[mode] = run_mode(mode, args, memory=True)
    ref_name = "zero3 fp32" if "zero3 fp32" in modes else modes[0]

    def mean_losses(mode: str) -> list[float]:
        return [sum(step) / n for step in zip(*(r["losses"] for r in timed[mode]))]

    ref = mean_losses(ref_name)
    rows = {}
    for mode in modes:
        res = timed[mode]
        steps = [max(ts) for ts in zip(*(r["times"] for r in res))]  # the slower rank's, per step
        losses = mean_losses(mode)
        diffs = [abs(a - b) / max(abs(b), 1e-30) for a, b in zip(losses, ref)]
        rtol = FP32_RTOL if "fp32" in mode else args.bf16_rtol
        same = bool(diffs) and all(d <= rtol for d in diffs)  # NaN compares False: not the same
        n_params = res[0]["n_params"]
        rows[mode] = {"ms": statistics.median(steps) * 1e3, "rtol": rtol, "same": same,
                      "rel": max(diffs) if diffs else float("nan"), "loss": losses[-1],
                      "mib": max(r["peak_kib"] for r in mem[mode]) / 1024,
                      "per_param": max(r["state_bytes"] for r in mem[mode]) / n_params}
    print(f"# bench_mixed_precision at {_commit()}; GPT {args.n_layer}x{args.n_embd}, {args.n_head} heads, block "
          f"{args.block}, vocab 256, {n_params / 1e6:.2f}M parameters; {n} gloo ranks x 1 thread; "
          f"{args.batch} sequences/rank; {args.warmup} warm-up + {args.steps} timed steps (glibc's default "
          f"allocator); memory pass: {args.warmup} warm-up + {args.memory_steps} steps, "
          f"MALLOC_MMAP_THRESHOLD_={args.mmap_threshold}\n")
    base = rows.get("zero3 bf16")
    print(f"| configuration | median step (ms) | vs zero3 bf16 | peak memory / rank (MiB) | model-state bytes / "
          f"param / rank | (2+2+12)/N | final loss | max rel. loss diff vs {ref_name} (tolerance) |")
    print("|---|---:|---:|---:|---:|---:|---:|---|")
    for mode, r in rows.items():
        ok = r["same"] and (base is None or base["same"])
        ratio = f"{r['ms'] / base['ms']:.2f}x" if base is not None and ok else ("n/a" if base is None else "excluded")
        check = f"{r['rel']:.1e} ({r['rtol']:g})" + ("" if r["same"] else " DIFFERS")
        print(f"| {mode} | {r['ms']:.1f} | {ratio} | {r['mib']:.1f} | {r['per_param']:.2f} | {16 / n:.2f} | "
              f"{r['loss']:.4f} | {check} |")
    differs = [m for m, r in rows.items() if not r["same"]]
    if differs:
        print(f"\nDIFFERS (left out of the ratios: loss outside its tolerance of {ref_name}'s): {', '.join(differs)}")


if __name__ == "__main__":
    main()
