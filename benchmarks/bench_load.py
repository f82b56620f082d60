"""Peak memory of loading a Hugging Face checkpoint: `zero3.from_pretrained` on 2 ranks against transformers.

    python benchmarks/bench_load.py --size 50M                 # a quick run (~1 min)
    python benchmarks/bench_load.py --size 1B --dir /data/llama-1b   # the issue's ~1B Llama (writes it once)

Phases (``--phases``, in this order):

- ``write``: a Llama-shaped model of ``--size`` parameters, written with ``save_pretrained`` in
  several files (``--shard-size``) in ``--disk-dtype``, in a process of its own; skipped when
  ``--dir`` already holds a ``config.json``.
- ``load``: each measurement in fresh processes with ``MALLOC_MMAP_THRESHOLD_=131072`` (glibc then
  mmaps every buffer over 128 KiB and returns it when freed, so RSS follows live tensors):
  ``zero3.from_pretrained(..., dtype=torch.float32)`` on ``--nproc`` gloo ranks, and transformers'
  single-process ``AutoModelForCausalLM.from_pretrained(..., dtype=torch.float32)``.

Per process: the baseline (resident set after importing torch, transformers and zero3 and joining the
process group), the peak (``VmHWM``, the kernel's high-water mark of the resident set) and the peak
above the baseline. For each zero3 rank: its fp32 shard bytes, the largest tensor's fp32 bytes, and
peak / (shards + largest), raw and above the baseline; the issue's target is at most 1.2. transformers
maps the files, and the pages it reads count in its resident set. Figures are printed, never asserted.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MiB = 1 << 20

# hidden, layers, intermediate, heads, kv heads, vocab: Llama-shaped, untied embeddings
SIZES = {
    "10M": (256, 4, 688, 4, 4, 8000),
    "50M": (512, 8, 1376, 8, 4, 16000),
    "200M": (1024, 12, 2816, 16, 4, 32000),
    "1B": (2048, 22, 5632, 32, 4, 32000),  # TinyLlama-1.1B's shape
}


def _status(field: str) -> int:
    """A ``/proc/self/status`` size field (VmRSS, VmHWM), in bytes."""
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


# -- phase: write ---------------------------------------------------------------------------------
def write_model(out: Path, size: str, disk_dtype: str, shard_size: str) -> None:
    import torch
    import transformers

    hidden, layers, inter, heads, kv, vocab = SIZES[size]
    config = transformers.LlamaConfig(hidden_size=hidden, num_hidden_layers=layers, intermediate_size=inter,
                                      num_attention_heads=heads, num_key_value_heads=kv, vocab_size=vocab,
                                      max_position_embeddings=2048, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=getattr(torch, disk_dtype))
    model.save_pretrained(out, max_shard_size=shard_size)


def phase_write(args: argparse.Namespace) -> list[dict]:
    if (args.dir / "config.json").is_file():
        print(f"write: {args.dir} holds a model already, reused", flush=True)
        return []
    t0 = time.perf_counter()
    subprocess.run([sys.executable, __file__, "_write", str(args.dir), args.size, args.disk_dtype, args.shard_size],
                   check=True, cwd=ROOT)
    files = sorted(p.name for p in args.dir.glob("*.safetensors"))
    print(f"write: {args.size} model in {len(files)} files ({args.disk_dtype}) in {time.perf_counter() - t0:.0f} s",
          flush=True)
    return []


# -- phase: load ----------------------------------------------------------------------------------
def load_worker(kind: str, path: str, rank: int, world: int) -> dict:
    """One measured process: import, join the group (zero3), record the baseline, load, record the peak."""
    import torch
    import transformers

    import zero3

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    torch.set_num_threads(1)
    if kind == "zero3":
        import torch.distributed as dist

        dist.init_process_group("gloo", rank=rank, world_size=world)
    # The model's code imported before the baseline (transformers imports modeling files lazily): the
    # baseline is what any loader pays before it reads a weight.
    config = transformers.AutoConfig.from_pretrained(path)
    transformers.AutoModelForCausalLM._model_mapping[type(config)]
    baseline = _status("VmRSS")
    t0 = time.perf_counter()
    if kind == "zero3":
        model = zero3.from_pretrained(transformers.AutoModelForCausalLM, path, dtype=torch.float32,
                                      zero_config={"param_persistence_threshold": 0})
    else:
        model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    seconds = time.perf_counter() - t0
    peak = _status("VmHWM")
    report = {"kind": kind, "rank": rank, "baseline": baseline, "peak": peak, "seconds": seconds}
    if kind == "zero3":
        shard = 0
        for p in {id(p): p for p in model.parameters()}.values():
            start, end = p._zero.shard_range()
            shard += max(min(end, p._zero.numel) - start, 0) * 4
        report["shards"] = shard
        dist.barrier()
        dist.destroy_process_group()
    return report


def _largest_fp32(path: Path) -> int:
    sys.path.insert(0, str(ROOT))
    from zero3.checkpoint.safetensors import read_safetensors_header

    return max(e.numel * 4 for f in path.glob("*.safetensors") for e in read_safetensors_header(f).entries.values())


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(kind: str, path: Path, world: int) -> list[dict]:
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072", "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()),
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    procs = [subprocess.Popen([sys.executable, __file__, "_load", kind, str(path), str(r), str(world)], env=env,
                              cwd=ROOT, stdout=subprocess.PIPE, text=True) for r in range(world)]
    reports = []
    for p in procs:
        out, _ = p.communicate()
        if p.returncode:
            raise RuntimeError(f"{kind} load process exited with {p.returncode}")
        reports.append(json.loads(out.strip().splitlines()[-1]))
    return reports


def phase_load(args: argparse.Namespace) -> list[dict]:
    largest = _largest_fp32(args.dir)
    rows = []
    for r in _launch("zero3", args.dir, args.nproc):
        r["largest"] = largest
        rows.append(r)
    rows.extend(_launch("transformers", args.dir, 1))
    return rows


PHASES = {"write": phase_write, "load": phase_load}


def _table(rows: list[dict]) -> None:
    print("\n| what | rank | baseline RSS (MiB) | peak RSS (MiB) | peak above baseline (MiB) | fp32 shards (MiB) "
          "| largest tensor fp32 (MiB) | peak / (shards + largest) | above baseline / (shards + largest) | load (s) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        name = "zero3.from_pretrained" if r["kind"] == "zero3" else "transformers from_pretrained (1 process)"
        added = r["peak"] - r["baseline"]
        budget = r.get("shards", 0) + r.get("largest", 0)
        ratio = f"{r['peak'] / budget:.2f}" if budget else "-"
        ratio_added = f"{added / budget:.2f}" if budget else "-"
        print(f"| {name} | {r['rank']} | {r['baseline'] / MiB:,.0f} | {r['peak'] / MiB:,.0f} | {added / MiB:,.0f} "
              f"| {r.get('shards', 0) / MiB:,.0f} | {r.get('largest', 0) / MiB:,.0f} | {ratio} | {ratio_added} "
              f"| {r['seconds']:.1f} |")


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "_write":
        write_model(Path(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5])
        return
    if len(sys.argv) > 1 and sys.argv[1] == "_load":
        kind, path, rank, world = sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
        print(json.dumps(load_worker(kind, path, rank, world)), flush=True)
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="50M")
    parser.add_argument("--dir", type=Path, default=None, help="model directory (written unless it holds one; "
                        "default: a temporary one)")
    parser.add_argument("--disk-dtype", choices=["bfloat16", "float32"], default="bfloat16")
    parser.add_argument("--shard-size", default="200MB", help="save_pretrained's max_shard_size")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--phases", default="write,load", help=f"comma-separated, of {', '.join(PHASES)}")
    args = parser.parse_args()
    args.dir = args.dir or Path(tempfile.mkdtemp(prefix="zero3-bench-load-")) / args.size
    rows: list[dict] = []
    for name in args.phases.split(","):
        rows.extend(PHASES[name](args))
    if rows:
        print(f"\n{args.size} Llama-shaped model in {args.dir} ({args.disk_dtype} on disk), loaded into fp32; "
              "MALLOC_MMAP_THRESHOLD_=131072 in the measured processes")
        _table(rows)


if __name__ == "__main__":
    main()
