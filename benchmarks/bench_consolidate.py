"""Peak memory of ``python -m zero3.consolidate`` against the largest tensor and the model size.

    python benchmarks/bench_consolidate.py                  # ~400 MB fp32 model, largest tensor 64 MB
    python benchmarks/bench_consolidate.py --model-mb 800 --largest-mb 128 --optimizer

The benchmark saves a sharded checkpoint of a synthetic model (one large "embedding" plus many
16 MB matrices) at world size 1 (consolidation reads the same bytes whatever the world size), then
consolidates it several ways, each in a fresh process. Peak memory is the ``ru_maxrss`` of that
process, read with ``getrusage(RUSAGE_CHILDREN)`` in a wrapper process that runs only it.
``MALLOC_MMAP_THRESHOLD_=131072`` makes glibc mmap every buffer over 128 KiB and return its pages
when it is freed, so RSS tracks live tensors rather than what the heap keeps. "baseline" is the
same measurement for a process that only imports ``zero3.checkpoint.consolidate`` (the interpreter plus
torch), and "added" is peak minus baseline: what consolidation itself costs. The issue's target is
added < 2 x largest tensor + a small constant. Figures are printed, never asserted.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

ROOT = Path(__file__).resolve().parent.parent
WRAPPER = ("import resource, subprocess, sys; subprocess.run(sys.argv[1:], check=True); "
           "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)")


class Synthetic(nn.Module):
    """One ``largest_mb`` embedding, then 16 MB (4096 x 1024 fp32) linear layers up to ``model_mb``."""

    def __init__(self, model_mb: int, largest_mb: int) -> None:
        super().__init__()
        width = 1024
        self.embed = nn.Embedding(largest_mb * 256, width)  # 256 rows of 1024 fp32 = 1 MB
        n = max(0, (model_mb - largest_mb) // 16)
        self.layers = nn.ModuleList(nn.Linear(width, 4 * width, bias=False) for _ in range(n))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx)
        return sum(layer(x).sum() for layer in self.layers) + x.sum()


def save(ckpt: Path, model_mb: int, largest_mb: int, optimizer: bool) -> tuple[int, int]:
    """Save the checkpoint (world size 1, in this process); return (model bytes, largest tensor bytes)."""
    import zero3

    torch.manual_seed(0)
    model = Synthetic(model_mb, largest_mb)
    sizes = [p.numel() * 4 for p in model.parameters()]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3) if optimizer else None
    engine = zero3.initialize(model, opt, {"param_persistence_threshold": 0})
    if optimizer:  # one step so the moments exist
        engine.backward(engine(torch.zeros(1, dtype=torch.long)))
        engine.step()
    engine.save_checkpoint(ckpt, tag="bench")
    return sum(sizes), max(sizes)


def measure(argv: list[str]) -> tuple[int, float]:
    """(peak RSS bytes, seconds) of one fresh process running ``argv``."""
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072", "OMP_NUM_THREADS": "1"}
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", WRAPPER, sys.executable, *argv], env=env, check=True, capture_output=True,
                         text=True, cwd=ROOT)
    return int(out.stdout.strip().splitlines()[-1]) * 1024, time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-mb", type=int, default=400)
    parser.add_argument("--largest-mb", type=int, default=64)
    parser.add_argument("--optimizer", action="store_true", help="AdamW moments in the checkpoint (3x the bytes)")
    parser.add_argument("--dir", default=None, help="work directory (default: a temporary one, removed after)")
    args = parser.parse_args()
    work = Path(args.dir or tempfile.mkdtemp(prefix="zero3-bench-consolidate-"))
    try:
        ckpt = work / "ckpt"
        t0 = time.perf_counter()
        model_bytes, largest = save(ckpt, args.model_mb, args.largest_mb, args.optimizer)
        ckpt_bytes = sum(f.stat().st_size for f in (ckpt / "bench").iterdir())
        print(f"model {model_bytes / 2**20:.0f} MiB fp32, largest tensor {largest / 2**20:.0f} MiB, "
              f"checkpoint {ckpt_bytes / 2**20:.0f} MiB (saved in {time.perf_counter() - t0:.1f} s)")
        baseline, _ = measure(["-c", "import zero3.checkpoint.consolidate"])
        print(f"baseline (python + torch + zero3 import): {baseline / 2**20:.0f} MiB")
        print(f"{'variant':<44} {'peak MiB':>9} {'added MiB':>10} {'added/largest':>14} {'added/model':>12} "
              f"{'seconds':>8}")
        cli = ["-m", "zero3.consolidate", str(ckpt)]
        variants = [
            ("safetensors fp32", [*cli, str(work / "out.safetensors")]),
            ("pt fp32", [*cli, str(work / "out.pt")]),
            ("safetensors --dtype bf16", [*cli, str(work / "out16.safetensors"), "--dtype", "bf16"]),
            ("pt fp32 --no-verify", [*cli, str(work / "out2.pt"), "--no-verify"]),
        ]
        if args.optimizer:
            variants.append(("safetensors --include-optimizer", [*cli, str(work / "opt.safetensors"),
                                                                 "--include-optimizer"]))
        for name, argv in variants:
            peak, seconds = measure(argv)
            written = Path(argv[3])
            if not written.is_file() or written.stat().st_size < model_bytes // 2:  # a run that wrote nothing measured nothing
                raise SystemExit(f"{name}: {written} was not written (or is too small): the run measured nothing")
            added = peak - baseline
            print(f"{name:<44} {peak / 2**20:>9.0f} {added / 2**20:>10.0f} {added / largest:>14.2f} "
                  f"{added / model_bytes:>12.2f} {seconds:>8.1f}")
            for f in [*work.glob("out*"), *work.glob("opt*")]:
                f.unlink()
    finally:
        if args.dir is None:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
