"""Soak: does a rank's resident memory stay flat over a long run? (issue 19, item 10)

    python benchmarks/bench_soak.py                     # 2,000 steps, 2 gloo ranks (~4-6 min on 2 cores)
    python benchmarks/bench_soak.py --steps 300 --every 50   # a quick look

Trains the example GPT (examples/gpt.py, 4 layers x 128, block 64, batch 4 per rank) under
``zero3.Init`` with AdamW and the default config plus ``gradient_clipping`` 1.0 (verification on) and
``param_persistence_threshold`` 0 (``--persistence``), on 2 gloo ranks started here. Every parameter of
this GPT is under the default threshold (1e5 elements; the largest holds 65,536), so with the default
config none is ever gathered or released and the soak would skip the per-module gather/release that a
larger model's run does every step; at 0 every parameter is gathered before its module and released
after it, every step (the table shows the sampled step's all-gather calls and parameters released). ``--persistence
100000`` runs the default config (nothing gathered: the setting of the figures in docs/performance.md
taken before this flag existed). It
samples each rank's resident set size (``VmRSS`` from /proc/self/status) every ``--every`` steps,
with the number of live tensors the garbage collector tracks. It prints one row per sample and the
growth from step ``--from`` (200 by default, after warm-up) to the last step. Figures are printed,
never asserted. RSS is what glibc holds, not live tensors (a freed buffer may stay in the heap), so
read the growth next to the live-tensor count: growth with a flat count is the allocator's, not a
leak of zero3's objects. ``--malloc-mmap`` runs the ranks with ``MALLOC_MMAP_THRESHOLD_=131072``
(every buffer above 128 KiB is mmapped and returned when freed).
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import socket
import sys
import statistics
import tempfile
import time
import warnings

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples"))


def _rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


def _heap_mib() -> tuple[float, float]:
    """glibc's own account, over every arena: (bytes allocated and not freed, bytes freed but kept), MiB.
    The first is what the process's malloc users hold; the second is what the allocator keeps."""
    try:
        fn = ctypes.CDLL("libc.so.6").mallinfo2
    except (OSError, AttributeError):
        return float("nan"), float("nan")
    fn.restype = _MallInfo2
    m = fn()
    return (m.uordblks + m.hblkhd) / 2**20, m.fordblks / 2**20


def _live_tensors() -> int:
    with warnings.catch_warnings():  # isinstance on some torch objects warns of deprecated names
        warnings.simplefilter("ignore")
        return sum(1 for o in gc.get_objects() if isinstance(o, torch.Tensor))


def _rank(rank: int, world: int, port: int, args: argparse.Namespace, out: str) -> None:
    import zero3
    from gpt import GPT, GPTConfig, synthetic_batch

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    cfg = GPTConfig(n_layer=4, n_head=4, n_embd=128, block_size=64, vocab_size=256)
    torch.manual_seed(0)
    with zero3.Init():
        model = GPT(cfg)
    engine = zero3.initialize(model, torch.optim.AdamW(model.parameters(), lr=3e-3, eps=1e-6),
                              {"gradient_clipping": 1.0, "param_persistence_threshold": args.persistence})
    samples = []
    times: list[float] = []
    for step in range(1, args.steps + 1):
        t0 = time.perf_counter()
        x, y = synthetic_batch(step * world + rank, args.batch, cfg)
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        if args.trim_every and step % args.trim_every == 0:
            ctypes.CDLL("libc.so.6").malloc_trim(0)
        times.append(time.perf_counter() - t0)
        if step % args.every == 0 or step == args.steps:
            in_use, kept = _heap_mib()
            samples.append({"step": step, "rss_mib": _rss_mib(), "live_tensors": _live_tensors(),
                            "heap_in_use_mib": in_use, "heap_free_kept_mib": kept,
                            "loss": float(loss.detach()),
                            "gathers": engine.last_step_metrics.allgather_calls,
                            "releases": engine.last_step_metrics.releases,
                            "median_step_s": statistics.median(times[-args.every:])})
    del engine, model, loss
    gc.collect()
    dist.destroy_process_group()
    with open(out, "w") as f:
        json.dump(samples, f)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--every", type=int, default=100, help="sample every N steps")
    ap.add_argument("--from", dest="start", type=int, default=200, help="growth is measured from this step")
    ap.add_argument("--batch", type=int, default=4, help="sequences per rank")
    ap.add_argument("--persistence", type=int, default=0,
                    help="zero3 param_persistence_threshold (elements; default 0: every parameter gathered and "
                         "released every step; 100000, zero3's default, gathers none of this GPT's)")
    ap.add_argument("--malloc-mmap", action="store_true", help="ranks run with MALLOC_MMAP_THRESHOLD_=131072")
    ap.add_argument("--trim-every", type=int, default=0,
                    help="call glibc's malloc_trim(0) in each rank every N steps (0: never): is the growth "
                         "memory glibc holds after it was freed?")
    ap.add_argument("--fr-buffer", type=int, default=None,
                    help="run the ranks with TORCH_FR_BUFFER_SIZE=N (torch's flight recorder ring; zero3 makes 0 "
                         "the default on CPU builds): 2000 reproduces the RSS creep of issue 19 item 10")
    args = ap.parse_args()
    if args.fr_buffer is not None:
        os.environ["TORCH_FR_BUFFER_SIZE"] = str(args.fr_buffer)  # inherited by the spawned ranks
    if args.malloc_mmap:
        os.environ["MALLOC_MMAP_THRESHOLD_"] = "131072"  # inherited by the spawned ranks
    world = 2
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    tmp = tempfile.mkdtemp(prefix="zero3-soak-")
    outs = [os.path.join(tmp, f"rank{r}.json") for r in range(world)]
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_rank, args=(r, world, port, args, outs[r])) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    if any(p.exitcode for p in procs):
        raise SystemExit(f"a rank failed: exit codes {[p.exitcode for p in procs]}")
    per_rank = [json.load(open(o)) for o in outs]
    print(f"# soak: example GPT 4x128, batch {args.batch}/rank, {world} gloo ranks, {args.steps} steps, "
          f"verification on, param_persistence_threshold {args.persistence}, allocator: {'MALLOC_MMAP_THRESHOLD_=131072' if args.malloc_mmap else 'default'}"
          + (f", malloc_trim every {args.trim_every} steps" if args.trim_every else "")
          + f", TORCH_FR_BUFFER_SIZE={os.environ.get('TORCH_FR_BUFFER_SIZE', 'unset, so zero3 makes it 0 in a CPU build')}")
    print("| step | " + " | ".join(f"rank {r} RSS (MiB) | rank {r} heap in use / freed-kept (MiB) | rank {r} live tensors"
                                  for r in range(world)) + " | all-gather calls / parameters released in the step, rank 0 | "
          "median step, rank 0 (s) | loss |")
    print("|---:|" + "---:|---:|---:|" * world + "---:|---:|---:|")
    for i, row in enumerate(per_rank[0]):
        cells = " | ".join(f"{per_rank[r][i]['rss_mib']:.1f} | {per_rank[r][i]['heap_in_use_mib']:.1f} / "
                           f"{per_rank[r][i]['heap_free_kept_mib']:.1f} | {per_rank[r][i]['live_tensors']}"
                           for r in range(world))
        print(f"| {row['step']} | {cells} | {row['gathers']} / {row['releases']} | {row['median_step_s']:.4f} | "
              f"{row['loss']:.4f} |")
    for r in range(world):
        base = next((s for s in per_rank[r] if s["step"] >= args.start), per_rank[r][0])
        last = per_rank[r][-1]
        print(f"rank {r}: RSS {base['rss_mib']:.1f} MiB at step {base['step']} -> {last['rss_mib']:.1f} MiB at step "
              f"{last['step']} ({last['rss_mib'] - base['rss_mib']:+.1f} MiB); heap in use "
              f"{last['heap_in_use_mib'] - base['heap_in_use_mib']:+.1f} MiB, freed-kept "
              f"{last['heap_free_kept_mib'] - base['heap_free_kept_mib']:+.1f} MiB; live tensors "
              f"{base['live_tensors']} -> {last['live_tensors']}")


if __name__ == "__main__":
    main()
