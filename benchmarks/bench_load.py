"""Peak memory of loading and saving a Hugging Face checkpoint: zero3 on 2 ranks against transformers.

    python benchmarks/bench_load.py --size 50M                 # a quick run (~1 min)
    python benchmarks/bench_load.py --size 1B --dir /data/llama-1b   # the issue's ~1B Llama (writes it once)

Phases (``--phases``, in this order; default all three):

- ``write``: a Llama-shaped model of ``--size`` parameters, built directly in ``--disk-dtype`` and
  written with ``save_pretrained`` in several files (``--shard-size``), in a process of its own
  (its peak RSS is printed); skipped when ``--dir`` already holds a ``config.json``.
- ``load``: each measurement in fresh processes with ``MALLOC_MMAP_THRESHOLD_=131072`` (glibc then
  mmaps every buffer over 128 KiB and returns it when freed, so RSS follows live tensors):
  ``zero3.from_pretrained(..., dtype=torch.float32)`` on ``--nproc`` gloo ranks, and transformers'
  single-process ``AutoModelForCausalLM.from_pretrained(..., dtype=torch.float32)``.
- ``save``: fresh processes again, each loading as above, then measuring only the save:
  ``engine.save_pretrained(dir, max_shard_size=--shard-size)`` on ``--nproc`` ranks, the engine from
  ``zero3.initialize(model, None, config)`` (no optimizer: the fp32 shards are what a fine-tuned
  model's fp32 masters are, and an optimizer's state would be memory that is not the save's), and
  transformers' single-process ``model.save_pretrained`` of its own fp32 model. Then the round trip:
  zero3's files against ``--dir``'s, tensor by tensor with ``safe_open`` (one tensor of each at a
  time), the original cast to the saved dtype (fp32: the model's parameters), ``torch.equal``:
  "round trip bit-exact: True/False" with the number of tensors; and zero3's files against
  transformers'. Written under ``--save-dir`` (kept), else a temporary directory (removed).

Per process: the baseline (load: resident set after importing torch, transformers and zero3 and
joining the process group; save: the resident set just before ``save_pretrained``, when the
high-water mark is reset by writing "5" to ``/proc/self/clear_refs``), the peak (``VmHWM``, the
kernel's high-water mark of the resident set) and the peak above the baseline. For each zero3 rank:
its fp32 shard bytes, the largest tensor's fp32 bytes, and peak / (shards + largest), raw and above
the baseline; the issue's target is at most 1.2. transformers maps the files, and the pages it reads
count in its resident set. Under gloo, rank 0's save holds the tensor being gathered twice (gloo's
``gather`` receives into one flat buffer, then copies it into the outputs). Figures are printed,
never asserted.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
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
def write_model(out: Path, size: str, disk_dtype: str, shard_size: str) -> dict:
    """Build the model directly in ``disk_dtype`` (``from_config(dtype=...)``: one copy, ~2.2 GB at 1B in bf16)
    and save it; returns the resident set after the imports and the peak."""
    import torch
    import transformers

    baseline = _status("VmRSS")
    hidden, layers, inter, heads, kv, vocab = SIZES[size]
    config = transformers.LlamaConfig(hidden_size=hidden, num_hidden_layers=layers, intermediate_size=inter,
                                      num_attention_heads=heads, num_key_value_heads=kv, vocab_size=vocab,
                                      max_position_embeddings=2048, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=getattr(torch, disk_dtype))
    model.save_pretrained(out, max_shard_size=shard_size)
    return {"baseline": baseline, "peak": _status("VmHWM"),
            "model": sum(p.numel() * p.element_size() for p in model.parameters())}


def phase_write(args: argparse.Namespace) -> list[dict]:
    if (args.dir / "config.json").is_file():
        print(f"write: {args.dir} holds a model already, reused", flush=True)
        return []
    t0 = time.perf_counter()
    done = subprocess.run([sys.executable, __file__, "_write", str(args.dir), args.size, args.disk_dtype,
                           args.shard_size], check=True, cwd=ROOT, stdout=subprocess.PIPE, text=True)
    r = json.loads(done.stdout.strip().splitlines()[-1])
    files = sorted(p.name for p in args.dir.glob("*.safetensors"))
    print(f"write: {args.size} model ({r['model'] / MiB:,.0f} MiB) in {len(files)} files ({args.disk_dtype}) in "
          f"{time.perf_counter() - t0:.0f} s, peak RSS {r['peak'] / MiB:,.0f} MiB "
          f"({(r['peak'] - r['baseline']) / MiB:,.0f} above the imports)", flush=True)
    return []


# -- phase: load ----------------------------------------------------------------------------------
ZERO_CONFIG = {"param_persistence_threshold": 0}


def _setup(kind: str, path: str, rank: int, world: int) -> None:
    """Quiet transformers, one torch thread, join the group (zero3), import the model's code."""
    import torch
    import transformers

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


def _load(kind: str, path: str):
    import torch
    import transformers

    import zero3

    if kind == "zero3":
        return zero3.from_pretrained(transformers.AutoModelForCausalLM, path, dtype=torch.float32,
                                     zero_config=ZERO_CONFIG)
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)


def _shard_bytes(model) -> int:
    """This rank's fp32 shard bytes (padding excluded)."""
    shard = 0
    for p in {id(p): p for p in model.parameters()}.values():
        start, end = p._zero.shard_range()
        shard += max(min(end, p._zero.numel) - start, 0) * 4
    return shard


def _leave(kind: str) -> None:
    if kind == "zero3":
        import torch.distributed as dist

        dist.barrier()
        dist.destroy_process_group()


def load_worker(kind: str, rank: int, world: int, path: str) -> dict:
    """One measured process: import, join the group (zero3), record the baseline, load, record the peak."""
    import zero3  # noqa: F401 - imported before the baseline

    _setup(kind, path, rank, world)
    baseline = _status("VmRSS")
    t0 = time.perf_counter()
    model = _load(kind, path)
    seconds = time.perf_counter() - t0
    peak = _status("VmHWM")
    report = {"phase": "load", "kind": kind, "rank": rank, "baseline": baseline, "peak": peak, "seconds": seconds}
    if kind == "zero3":
        report["shards"] = _shard_bytes(model)
    _leave(kind)
    return report


def _largest_fp32(path: Path) -> int:
    sys.path.insert(0, str(ROOT))
    from zero3.checkpoint.safetensors import read_safetensors_header

    return max(e.numel * 4 for f in path.glob("*.safetensors") for e in read_safetensors_header(f).entries.values())


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(phase: str, kind: str, world: int, *args: str) -> list[dict]:
    """``world`` fresh processes running ``phase``'s worker, each printing its report as a JSON line."""
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072", "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()),
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    procs = [subprocess.Popen([sys.executable, __file__, f"_{phase}", kind, str(r), str(world), *args], env=env,
                              cwd=ROOT, stdout=subprocess.PIPE, text=True) for r in range(world)]
    reports = []
    for p in procs:
        out, _ = p.communicate()
        if p.returncode:
            raise RuntimeError(f"{kind} {phase} process exited with {p.returncode}")
        reports.append(json.loads(out.strip().splitlines()[-1]))
    return reports


def phase_load(args: argparse.Namespace) -> list[dict]:
    largest = _largest_fp32(args.dir)
    rows = []
    for r in _launch("load", "zero3", args.nproc, str(args.dir)):
        r["largest"] = largest
        rows.append(r)
    rows.extend(_launch("load", "transformers", 1, str(args.dir)))
    return rows


# -- phase: save ----------------------------------------------------------------------------------
def _reset_peak() -> None:
    """Reset ``VmHWM`` to the current resident set ("5" in ``/proc/self/clear_refs``, Linux >= 4.0)."""
    with open("/proc/self/clear_refs", "w") as fh:
        fh.write("5")
    if _status("VmHWM") > _status("VmRSS") + 4 * MiB:
        raise RuntimeError("writing 5 to /proc/self/clear_refs did not reset VmHWM")


def save_worker(kind: str, rank: int, world: int, path: str, out: str, shard_size: str) -> dict:
    """One measured process: load (fp32) as in the load phase, then reset the high-water mark and save.

    zero3's engine has no optimizer (``zero3.initialize(model, None, config)``, as for inference): its
    fp32 shards are what ``save_pretrained`` gathers, and optimizer state would be memory that is not
    the save's. A fine-tuned model's fp32 masters are the same bytes, so the save's own cost is this one."""
    import gc

    import zero3

    _setup(kind, path, rank, world)
    model = _load(kind, path)
    saver = model
    if kind == "zero3":
        saver = zero3.initialize(model, None, ZERO_CONFIG)
    gc.collect()
    if kind == "zero3":
        import torch.distributed as dist

        dist.barrier()
    _reset_peak()
    baseline = _status("VmRSS")
    t0 = time.perf_counter()
    saver.save_pretrained(out, max_shard_size=shard_size)
    seconds = time.perf_counter() - t0
    peak = _status("VmHWM")
    report = {"phase": "save", "kind": kind, "rank": rank, "baseline": baseline, "peak": peak, "seconds": seconds}
    if kind == "zero3":
        report["shards"] = _shard_bytes(model)
    _leave(kind)
    return report


def _weights(directory: Path) -> dict[str, Path]:
    """Each tensor's file in a ``save_pretrained`` directory."""
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        return {k: directory / f for k, f in json.loads(index.read_text())["weight_map"].items()}
    return {k: directory / "model.safetensors" for k in _keys(directory / "model.safetensors")}


def _keys(file: Path) -> list[str]:
    from safetensors import safe_open

    with safe_open(file, framework="pt") as fh:
        return list(fh.keys())


def compare_dirs(reference: Path, saved: Path, cast=None) -> tuple[bool, int, set[str]]:
    """Tensor by tensor (one at a time, with ``safe_open``): same keys, and each of ``saved``'s tensors
    equal to ``reference``'s cast to its dtype (``torch.equal``: bit-exact for finite values).
    Returns (all equal, tensors compared, the dtypes ``saved`` holds)."""
    import torch
    from safetensors import safe_open

    ref, got = _weights(reference), _weights(saved)
    equal = set(ref) == set(got)
    if not equal:
        print(f"keys differ: only in {reference}: {sorted(set(ref) - set(got))[:5]}, "
              f"only in {saved}: {sorted(set(got) - set(ref))[:5]}", flush=True)
    dtypes: set[str] = set()
    compared = 0
    for key in sorted(set(ref) & set(got)):
        with safe_open(ref[key], framework="pt") as a, safe_open(got[key], framework="pt") as b:
            want, have = a.get_tensor(key), b.get_tensor(key)
        dtypes.add(str(have.dtype).removeprefix("torch."))
        same = want.shape == have.shape and torch.equal(want.to(have.dtype), have)
        if not same and equal:
            print(f"first difference: {key}", flush=True)
        equal &= same
        compared += 1
    return equal, compared, dtypes


def phase_save(args: argparse.Namespace) -> list[dict]:
    largest = _largest_fp32(args.dir)
    keep = args.save_dir is not None
    base = args.save_dir or Path(tempfile.mkdtemp(prefix="zero3-bench-save-"))
    ours, theirs = base / "zero3", base / "transformers"
    rows = []
    for r in _launch("save", "zero3", args.nproc, str(args.dir), str(ours), args.shard_size):
        r["largest"] = largest
        rows.append(r)
    rows.extend(_launch("save", "transformers", 1, str(args.dir), str(theirs), args.shard_size))
    exact, n, dtypes = compare_dirs(args.dir, ours)
    print(f"save: zero3 wrote {len(list(ours.glob('*.safetensors')))} files ({', '.join(sorted(dtypes))}); "
          f"against {args.dir} ({args.disk_dtype}, cast to the saved dtype): round trip bit-exact: {exact} "
          f"({n} tensors compared)", flush=True)
    same, n, _ = compare_dirs(theirs, ours)
    print(f"save: zero3's files equal transformers' save_pretrained of the same fp32 model: {same} "
          f"({n} tensors compared)", flush=True)
    if not keep:
        shutil.rmtree(base)
    return rows


PHASES = {"write": phase_write, "load": phase_load, "save": phase_save}


NAMES = {("load", "zero3"): "zero3.from_pretrained",
         ("load", "transformers"): "transformers from_pretrained (1 process)",
         ("save", "zero3"): "zero3 engine.save_pretrained",
         ("save", "transformers"): "transformers save_pretrained (1 process)"}


def _table(phase: str, rows: list[dict]) -> None:
    base = "baseline" if phase == "load" else "pre-save"
    print(f"\n| what | rank | {base} RSS (MiB) | peak RSS (MiB) | peak above {base} (MiB) | fp32 shards (MiB) "
          f"| largest tensor fp32 (MiB) | peak / (shards + largest) | above {base} / (shards + largest) "
          f"| {phase} (s) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        name = NAMES[phase, r["kind"]]
        added = r["peak"] - r["baseline"]
        budget = r.get("shards", 0) + r.get("largest", 0)
        ratio = f"{r['peak'] / budget:.2f}" if budget else "-"
        ratio_added = f"{added / budget:.2f}" if budget else "-"
        print(f"| {name} | {r['rank']} | {r['baseline'] / MiB:,.0f} | {r['peak'] / MiB:,.0f} | {added / MiB:,.0f} "
              f"| {r.get('shards', 0) / MiB:,.0f} | {r.get('largest', 0) / MiB:,.0f} | {ratio} | {ratio_added} "
              f"| {r['seconds']:.1f} |")


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "_write":
        print(json.dumps(write_model(Path(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5])), flush=True)
        return
    if len(sys.argv) > 1 and sys.argv[1] in ("_load", "_save"):
        kind, rank, world, rest = sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5:]
        worker = load_worker if sys.argv[1] == "_load" else save_worker
        print(json.dumps(worker(kind, rank, world, *rest)), flush=True)
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="50M")
    parser.add_argument("--dir", type=Path, default=None, help="model directory (written unless it holds one; "
                        "default: a temporary one)")
    parser.add_argument("--disk-dtype", choices=["bfloat16", "float32"], default="bfloat16")
    parser.add_argument("--shard-size", default="200MB", help="save_pretrained's max_shard_size")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--save-dir", type=Path, default=None, help="where the save phase writes (zero3/ and "
                        "transformers/ in it, kept); default: a temporary directory, removed after the comparison")
    parser.add_argument("--phases", default="write,load,save", help=f"comma-separated, of {', '.join(PHASES)}")
    args = parser.parse_args()
    args.dir = args.dir or Path(tempfile.mkdtemp(prefix="zero3-bench-load-")) / args.size
    rows: list[dict] = []
    for name in args.phases.split(","):
        rows.extend(PHASES[name](args))
    if rows:
        print(f"\n{args.size} Llama-shaped model in {args.dir} ({args.disk_dtype} on disk), loaded into fp32; "
              "MALLOC_MMAP_THRESHOLD_=131072 in the measured processes")
    for phase in ("load", "save"):
        if any(r["phase"] == phase for r in rows):
            _table(phase, [r for r in rows if r["phase"] == phase])


if __name__ == "__main__":
    main()
