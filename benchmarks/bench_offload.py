"""Offload on 2 gloo CPU ranks: resident memory with and without NVMe offload, engine.offload_states,
and a bounded search for the largest GPT that trains with AdamW on this machine.

    python benchmarks/bench_offload.py --nvme-path DIR                 # memory figures (a few minutes)
    python benchmarks/bench_offload.py --nvme-path DIR --quick         # a smaller model (about a minute)
    python benchmarks/bench_offload.py --nvme-path DIR --capacity      # the capacity search (long)

Every variant runs in a fresh pair of rank processes (one torch thread each) started with
``MALLOC_MMAP_THRESHOLD_=131072`` (set here before spawning), so freed tensors go back to the OS
and RSS follows live memory (docs/debugging.md). The model is built under ``zero3.Init`` with the
variant's config (so shards on NVMe are written as they are made) and trained with AdamW on the
same synthetic batches, so every variant must train the same numbers: each rank's loss at every step
is compared with the "no offload" run's (memory figures) or, in the capacity search, with the first
mode's that trained the same size, within 1e-5 relative (``LOSS_RTOL``, fp32 as bench_step.py); a row
outside it says DIFFERS (a capacity row of a size no other mode trained says "no peer").

Memory figures (default): per rank, the highest over both ranks: RSS after the build, RSS between
steps (after the last step), peak RSS (``ru_maxrss``), model state in memory and on NVMe
(``engine.memory_report()``); the step time (slower rank, after a barrier); rank 0's medians of the
time blocked waiting for shards from NVMe and of the bytes read and written per step. The last row runs without
offload and moves everything out with ``offload_states(device="nvme")`` and back.

Capacity (``--capacity``): GPTs with ``n_embd`` 2048 (16 heads, vocab 256, one sequence of 32
tokens per rank; `DefaultInitGPT`: PyTorch's default init) and a growing number of layers, fp32,
AdamW, without offload and with parameters and optimizer state on NVMe (mode ``nvme``: the
default staged step; ``nvme-inplace``: ``staged_step`` false; ``nvme-bwd`` and ``nvme-inplace-bwd``: the same
with ``step_in_backward``, which drops gradient shards as their sub-groups step; ``none-bwd``: no offload
with ``step_in_backward``; ``ds-nvme``: DeepSpeed's). For each mode the search
starts at the size a simple memory/disk model predicts (or at ``--start-layers``), then moves one step (``--capacity-step``
layers) up while attempts succeed, or down while they fail, at most ``--max-attempts`` times. An
attempt succeeds when both ranks finish the optimizer steps asked for (``--capacity-steps``,
default 2: the first step creates AdamW's moments, and only from the second on does a step hold on
the drive and in memory what every later step holds; figures taken with 1 step, before 2026-12-02,
say so). An attempt is stopped (and counted as failed, with the reason) after
``--attempt-timeout`` seconds, when the machine's MemAvailable falls below ``--memory-guard`` GiB
(so this never drives the machine into its OOM killer), or when the drive's free space falls below
``--disk-floor`` GiB. Sizes whose predicted swap files exceed ``--disk-budget`` GiB (default: half
the free space when the search starts) are not attempted. Figures are printed, never asserted.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import resource
import shutil
import socket
import statistics
import sys
import tempfile
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples"))
from gpt import GPT, Block  # noqa: E402  (examples/gpt.py)

GIB, MIB = 1 << 30, 1 << 20


class DefaultInitGPT(GPT):
    """examples/gpt.py's GPT with PyTorch's default initialisation of its layers: the same modules,
    parameters, memory and work per step, without GPT-2's re-initialisation (under zero3.Init that
    gathers and rewrites every weight once more, which only lengthens the build of a large model)."""

    def __init__(self, cfg: Any) -> None:
        torch.nn.Module.__init__(self)
        self.cfg = cfg
        self.wte = torch.nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = torch.nn.Embedding(cfg.block_size, cfg.n_embd)
        self.h = torch.nn.ModuleList([Block(cfg) for _ in range(cfg.n_layer)])
        self.ln_f = torch.nn.LayerNorm(cfg.n_embd)
        self.lm_head = torch.nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # tied, as in GPT


# -- inside a rank ----------------------------------------------------------------------------------
def _rss() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _timed_step(engine: Any, xy: tuple[torch.Tensor, torch.Tensor], rank: int, batch: int, fig: dict[str, Any]) -> None:
    """One training step on this rank's rows of ``xy`` after a barrier; appends the slower rank's
    time and this rank's loss to ``fig`` (zero3's engine and DeepSpeed's take the same calls)."""
    x, y = xy
    dist.barrier()
    t = time.perf_counter()
    loss = engine(x[rank * batch:(rank + 1) * batch], y[rank * batch:(rank + 1) * batch])
    engine.backward(loss)
    engine.step()
    took = torch.tensor([time.perf_counter() - t], dtype=torch.float64)
    dist.all_reduce(took, op=dist.ReduceOp.MAX)
    fig["steps"].append(took.item())
    fig["losses"].append(loss.item())


def _rank(rank: int, world: int, port: int, spec: dict[str, Any], out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=3600))
    import zero3
    from gpt import GPTConfig, synthetic_batch

    fig: dict[str, Any] = {"rank": rank, "steps": [], "losses": []}

    def save() -> None:
        with open(f"{out}.{rank}.tmp", "w") as fh:
            json.dump(fig, fh)
        os.replace(f"{out}.{rank}.tmp", f"{out}.{rank}")

    cfg = GPTConfig(**spec["model"])
    t0 = time.perf_counter()
    torch.manual_seed(0)
    with zero3.Init(config_dict_or_path=spec["zero"]):
        model = (DefaultInitGPT if spec.get("default_init") else GPT)(cfg)
    engine = zero3.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-4), spec["zero"])
    fig.update(build_s=time.perf_counter() - t0, rss_built=_rss(), params=sum(p.ds_numel for p in engine.params))
    save()
    batch = spec["batch"]
    waits, ahead, reads, writes = [], [], [], []
    for step in range(spec["steps"]):
        _timed_step(engine, synthetic_batch(step % 4, batch * world, cfg), rank, batch, fig)
        m = engine.last_step_metrics
        waits.append(m.nvme_wait_seconds)
        ahead.append(m.nvme_reads_ahead)
        reads.append(m.nvme_read_bytes)
        writes.append(m.nvme_write_bytes)
        fig["rss_between_steps"] = _rss()
        save()
    report = engine.memory_report()
    fig.update(report=report, peak_rss=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
               nvme_wait=waits, reads_ahead=ahead, read_bytes=reads, write_bytes=writes)
    if spec.get("extra_step"):  # one more step; with "states", after offload_states and reload_states
        if spec.get("states"):
            fig["moved"] = engine.offload_states(device="nvme", nvme_path=spec["nvme_path"])
            fig["rss_offloaded"] = _rss()
            engine.reload_states()
            fig["rss_reloaded"] = _rss()
        x, y = synthetic_batch(spec["steps"] % 4, batch * world, cfg)
        loss = engine(x[rank * batch:(rank + 1) * batch], y[rank * batch:(rank + 1) * batch])
        engine.backward(loss)
        engine.step()
        fig["extra_loss"] = loss.item()
    fig["done"] = True
    save()
    dist.destroy_process_group()


def _deepspeed_config(n_embd: int, nvme_path: str, batch: int) -> dict:
    """DeepSpeed ZeRO-3 with parameters and optimizer state on NVMe, the same budget knobs as
    `_zero_config` (one Block per prefetch and reduce bucket, three Blocks live, reuse 0), AdamW
    (DeepSpeed's CPU Adam, as its NVMe optimizer offload requires) at the same learning rate."""
    block = 12 * n_embd * n_embd + 13 * n_embd
    return {
        "train_micro_batch_size_per_gpu": batch,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
        "zero_optimization": {
            "stage": 3, "stage3_prefetch_bucket_size": block, "stage3_max_live_parameters": 3 * block,
            "stage3_max_reuse_distance": 0, "reduce_bucket_size": block, "sub_group_size": block // 8,
            "offload_param": {"device": "nvme", "nvme_path": nvme_path, "pin_memory": False,
                              "buffer_count": 5, "buffer_size": 4 * n_embd * n_embd, "max_in_cpu": 0},
            "offload_optimizer": {"device": "nvme", "nvme_path": nvme_path, "pin_memory": False},
        },
        "aio": {"block_size": 1048576, "queue_depth": 8, "single_submit": False, "overlap_events": True},
    }


def _rank_deepspeed(rank: int, world: int, port: int, spec: dict[str, Any], out: str) -> None:
    """`_rank` for DeepSpeed (``spec["system"] == "deepspeed"``): the same model, batches and step."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=3600))
    import deepspeed
    from gpt import GPTConfig, synthetic_batch

    fig: dict[str, Any] = {"rank": rank, "steps": [], "losses": [], "system": f"deepspeed {deepspeed.__version__}"}

    def save() -> None:
        with open(f"{out}.{rank}.tmp", "w") as fh:
            json.dump(fig, fh)
        os.replace(f"{out}.{rank}.tmp", f"{out}.{rank}")

    cfg = GPTConfig(**spec["model"])
    ds_config = spec["deepspeed"]
    t0 = time.perf_counter()
    torch.manual_seed(0)
    with deepspeed.zero.Init(config_dict_or_path=ds_config, remote_device="nvme", pin_memory=False):
        model = DefaultInitGPT(cfg)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config)
    fig.update(build_s=time.perf_counter() - t0, rss_built=_rss(), params=sum(p.ds_numel for p in model.parameters()))
    save()
    batch = spec["batch"]
    for step in range(spec["steps"]):
        _timed_step(engine, synthetic_batch(step % 4, batch * world, cfg), rank, batch, fig)
        fig["rss_between_steps"] = _rss()
        save()
    on_drive = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(spec["nvme_path"]) for f in fs)
    fig.update(report={"nvme_bytes": on_drive / world},  # DeepSpeed's swap files, both ranks', per rank
               peak_rss=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
    fig["done"] = True
    save()
    dist.destroy_process_group()


# -- the parent: one variant in fresh processes, with guards ----------------------------------------------
def _mem_available() -> int:
    with open("/proc/meminfo") as fh:
        for line in fh:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


def run_variant(spec: dict[str, Any], timeout: float, guard: dict[str, float]) -> dict[str, Any]:
    """Run ``spec`` on 2 fresh ranks; returns each rank's figures, the outcome and the lowest
    MemAvailable and free disk seen while it ran."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    work = tempfile.mkdtemp(prefix="bench_offload-")
    out = os.path.join(work, "rank")
    ctx = mp.get_context("spawn")
    target = _rank_deepspeed if spec.get("system") == "deepspeed" else _rank
    procs = [ctx.Process(target=target, args=(r, 2, port, spec, out)) for r in range(2)]
    t0 = time.time()
    for p in procs:
        p.start()
    outcome, low_mem, low_disk = "ok", _mem_available(), shutil.disk_usage(spec["nvme_path"]).free
    disk_start = low_disk
    while any(p.is_alive() for p in procs):
        time.sleep(0.1)
        low_mem = min(low_mem, _mem_available())
        low_disk = min(low_disk, shutil.disk_usage(spec["nvme_path"]).free)
        reason = None
        if time.time() - t0 > timeout:
            reason = f"stopped: past the {timeout:.0f} s time limit"
        elif low_mem < guard["memory"]:
            reason = f"stopped: MemAvailable fell below the {guard['memory'] / GIB:.1f} GiB guard"
        elif low_disk < guard["disk"]:
            reason = f"stopped: free disk fell below the {guard['disk'] / GIB:.0f} GiB floor"
        elif any(p.exitcode not in (None, 0) for p in procs):
            reason = "failed: a rank exited with " + ", ".join(str(p.exitcode) for p in procs if p.exitcode)
        if reason is not None:
            outcome = reason
            for p in procs:
                if p.is_alive():
                    p.kill()
            break
    for p in procs:
        p.join(timeout=30)
    ranks = []
    for r in range(2):
        try:
            with open(f"{out}.{r}") as fh:
                ranks.append(json.load(fh))
        except (OSError, ValueError):
            ranks.append({})
    shutil.rmtree(work, ignore_errors=True)
    if outcome == "ok" and not all(f.get("done") for f in ranks):
        outcome = "failed: a rank did not finish (exit codes " + ", ".join(str(p.exitcode) for p in procs) + ")"
    return {"ranks": ranks, "outcome": outcome, "low_mem": low_mem, "low_disk": low_disk,
            "disk_used": disk_start - low_disk, "wall": time.time() - t0}


# -- the memory figures --------------------------------------------------------------------------------------
def _zero_config(n_embd: int, nvme_path: str, param: bool, optimizer: bool, pool_blocks: float = 2.0,
                 sub_groups_per_block: int = 2, staged: bool = True, live_blocks: int = 3,
                 buckets_per_block: int = 1, in_backward: bool = False) -> dict:
    """One Block per prefetch, ``1 / buckets_per_block`` of one per gradient bucket, ``live_blocks`` Blocks live at most (3 unless set); with NVMe offload a
    buffer pool of about ``pool_blocks`` Blocks' shards and optimizer sub-groups of a fraction of one."""
    block = 12 * n_embd * n_embd + 13 * n_embd
    cfg: dict[str, Any] = {"max_reuse_distance": 0, "prefetch_bucket_size": block,
                           "max_live_parameters": live_blocks * block,
                           "reduce_bucket_size": block // buckets_per_block}
    if param:
        largest = 4 * n_embd * n_embd // 2  # c_fc / c_proj weight shard at 2 ranks
        count = max(2, int(pool_blocks * (block // 2) / largest) + 1)
        cfg["offload_param"] = {"device": "nvme", "nvme_path": nvme_path, "max_in_cpu": 0, "buffer_count": count,
                                "buffer_size": largest}
    if optimizer:
        cfg["offload_optimizer"] = {"device": "nvme", "nvme_path": nvme_path, "staged_step": staged,
                                    "step_in_backward": in_backward}
    elif in_backward:
        cfg["offload_optimizer"] = {"device": "none", "step_in_backward": True}
    if optimizer or in_backward:
        cfg["sub_group_size"] = block // sub_groups_per_block
    return cfg


LOSS_RTOL = 1e-5
"""fp32, same init and batches: the variants differ only in summation order (bench_step.py's LOSS_RTOL)."""


def loss_rel(ranks: list[dict], reference: list[dict]) -> float:
    """The worst relative difference of each rank's per-step losses from the same rank's in ``reference``
    (NaN when a rank or a step is missing on either side)."""
    if len(ranks) != len(reference) or not ranks:
        return float("nan")
    diffs = []
    for f, g in zip(sorted(ranks, key=lambda f: f["rank"]), sorted(reference, key=lambda f: f["rank"])):
        a, b = f.get("losses", []), g.get("losses", [])
        if not a or len(a) != len(b):
            return float("nan")
        diffs += [abs(x - y) / max(abs(y), 1e-30) for x, y in zip(a, b)]
    return max(diffs) if all(d == d for d in diffs) else float("nan")


def loss_cell(rel: float) -> str:
    return f"{rel:.1e}" + ("" if rel <= LOSS_RTOL else " DIFFERS")  # NaN compares False: not the same


def memory_figures(args: argparse.Namespace) -> None:
    model = {"n_layer": args.n_layer, "n_embd": args.n_embd, "n_head": args.n_head, "vocab_size": 512,
             "block_size": 64}
    variants = [("no offload", False, False, False), ("parameters on NVMe", True, False, False),
                ("optimizer state on NVMe", False, True, False), ("parameters and optimizer state on NVMe", True, True,
                                                                  False),
                ("no offload; offload_states(nvme) between steps", False, False, True)]
    guard = {"memory": args.memory_guard * GIB, "disk": args.disk_floor * GIB}
    rows = []
    for name, param, optimizer, states in variants:
        spec = {"model": model, "batch": 2, "steps": args.steps, "nvme_path": args.nvme_path, "states": states,
                "extra_step": not (param or optimizer), "zero": _zero_config(args.n_embd, args.nvme_path, param,
                                                                               optimizer)}
        res = run_variant(spec, args.attempt_timeout, guard)
        rows.append((name, res))
        print(f"  {name}: {res['outcome']} ({res['wall']:.0f} s)", file=sys.stderr, flush=True)
    first = rows[0][1]["ranks"][0]
    print(f"# bench_offload  {datetime.datetime.now().isoformat(timespec='seconds')}  torch {torch.__version__}  "
          f"2 gloo ranks x 1 thread, MALLOC_MMAP_THRESHOLD_=131072; GPT n_layer={args.n_layer} n_embd={args.n_embd} "
          f"({first.get('params', 0):,} parameters), fp32, AdamW, 2 sequences of 64 tokens per rank, "
          f"{args.steps} steps; swap files under {args.nvme_path}\n")
    print("Per rank, the higher of the two ranks. Model state in memory = parameter shards + gradient shards + "
          "optimizer state (memory_report, between steps); step = median of the steps after the first.\n")
    print("| variant | RSS after build (MiB) | RSS between steps (MiB) | peak RSS (MiB) | model state in memory "
          "(MiB) | on NVMe (MiB) | buffer pool (MiB) | step (s) | NVMe wait / step (s) | shards read ahead / step | "
          "read / written per step (MiB) | loss after last step | max rel. loss diff vs no offload |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    base_rss = None
    plain = [f for f in rows[0][1]["ranks"] if f.get("done")]
    differs = []
    for name, res in rows:
        ranks = [f for f in res["ranks"] if f.get("done")]
        if len(ranks) < 2:
            print(f"| {name} | {res['outcome']} ||||||||||||")
            continue
        rel = loss_rel(ranks, plain)
        if not rel <= LOSS_RTOL:
            differs.append(name)
        rep = [f["report"] for f in ranks]
        state = max(r["param_shard_bytes"] + r["grad_shard_bytes"] + r["optimizer_state_bytes"] for r in rep)
        rss = max(f["rss_between_steps"] for f in ranks)
        base_rss = rss if base_rss is None else base_rss
        later = ranks[0]["steps"][1:] or ranks[0]["steps"]
        print(f"| {name} | {max(f['rss_built'] for f in ranks) / MIB:.0f} | {rss / MIB:.0f} | "
              f"{max(f['peak_rss'] for f in ranks) / MIB:.0f} | {state / MIB:.1f} | "
              f"{max(r['nvme_bytes'] for r in rep) / MIB:.1f} | {max(r['swap_buffer_bytes'] for r in rep) / MIB:.1f} | "
              f"{statistics.median(later):.2f} | {statistics.median(ranks[0]['nvme_wait'][1:] or [0]):.2f} | "
              f"{statistics.median(ranks[0]['reads_ahead'][1:] or [0]):.0f} | "
              f"{statistics.median(ranks[0]['read_bytes'][1:] or [0]) / MIB:.0f} / "
              f"{statistics.median(ranks[0]['write_bytes'][1:] or [0]) / MIB:.0f} | {ranks[0]['losses'][-1]:.6f} | "
              f"{loss_cell(rel)} |")
    if differs:
        print(f"\nDIFFERS (a rank's loss not within {LOSS_RTOL:g} relative of no offload's at some step: not the same "
              f"work): {'; '.join(differs)}")
    print()
    for name, res in rows:
        ranks = [f for f in res["ranks"] if f.get("done")]
        if len(ranks) < 2 or base_rss is None:
            continue
        if "moved" in ranks[0]:
            plain = [f for f in rows[0][1]["ranks"] if f.get("done")]
            for f in ranks:
                same = len(plain) == 2 and plain[f["rank"]].get("extra_loss") == f["extra_loss"]
                print(f"- {name}, rank {f['rank']}: offload_states moved {f['moved'] / MIB:.1f} MiB; RSS "
                      f"{f['rss_between_steps'] / MIB:.0f} -> {f['rss_offloaded'] / MIB:.0f} MiB after offload_states "
                      f"(-{(f['rss_between_steps'] - f['rss_offloaded']) / MIB:.1f}), {f['rss_reloaded'] / MIB:.0f} MiB "
                      f"after reload_states; the next step's loss {f['extra_loss']:.6f} "
                      f"{'equals' if same else 'DIFFERS FROM'} the uninterrupted run's")
        elif ranks[0]["report"]["nvme_bytes"]:
            for f in ranks:
                saved = base_rss - f["rss_between_steps"]
                nvme = f["report"]["nvme_bytes"]
                print(f"- {name}, rank {f['rank']}: RSS between steps {saved / MIB:.1f} MiB below no offload's "
                      f"(highest rank); on NVMe {nvme / MIB:.1f} MiB, buffer pool "
                      f"{f['report']['swap_buffer_bytes'] / MIB:.1f} MiB")


# -- the capacity search ----------------------------------------------------------------------------------------
CAP_EMBD, CAP_HEAD, CAP_VOCAB, CAP_BLOCK = 2048, 16, 256, 32


def gpt_params(n_layer: int, c: int = CAP_EMBD) -> int:
    """Parameters of examples/gpt.py's GPT (tied embeddings)."""
    return n_layer * (12 * c * c + 13 * c) + (CAP_VOCAB + CAP_BLOCK) * c + 2 * c


LABELS = {"none": "no offload", "none-bwd": "no offload, step_in_backward",
          "nvme": "zero3, params + optimizer on NVMe (staged step)",
          "nvme-inplace": "zero3, params + optimizer on NVMe, staged_step false",
          "nvme-bwd": "zero3, params + optimizer on NVMe (staged step), step_in_backward",
          "nvme-inplace-bwd": "zero3, params + optimizer on NVMe, staged_step false, step_in_backward",
          "ds-nvme": "DeepSpeed, params + optimizer on NVMe"}

DRIVE_BYTES = {"none": 0, "none-bwd": 0, "nvme": 24, "nvme-inplace": 12, "nvme-bwd": 24, "nvme-inplace-bwd": 12,
               "ds-nvme": 20}
"""Bytes per parameter on the drive, both ranks, from the second step on (fp32 AdamW): zero3 holds
the shard and two moments (12), twice when the step is staged (a second region of each, reserved at
the first step); DeepSpeed's measured at 3.48B in the first run (about 20)."""


def _predicted_layers(mode: str, available: int, disk: int) -> int:
    """The largest layer count a simple model says fits: fp32 AdamW holds 16 bytes per parameter
    (parameter, gradient, two moments) over both ranks; without offload all of it is in memory,
    with NVMe offload the gradients (4 bytes) stay in memory (none with ``step_in_backward``, the
    ``-bwd`` modes) and `DRIVE_BYTES` go to the drive. Each
    rank also holds about 1.5 GiB more (torch, gathered blocks, gradient buckets), 2 GiB with offload
    (the buffer pool and the optimizer's sub-groups too)."""
    overhead = 2 * int((1.5 if mode.startswith("none") else 2.0) * GIB)
    n = 1
    while True:
        p = gpt_params(n + 1)
        mem = {"none": 16, "none-bwd": 12}.get(mode, 0 if mode.endswith("-bwd") else 4) * p + overhead
        if mem > available or DRIVE_BYTES[mode] * p > disk:
            return n
        n += 1


def capacity(args: argparse.Namespace) -> None:
    guard = {"memory": args.memory_guard * GIB, "disk": args.disk_floor * GIB}
    free = shutil.disk_usage(args.nvme_path).free
    budget = int(args.disk_budget * GIB) if args.disk_budget else free // 2
    available = _mem_available() - int(guard["memory"]) - int(args.memory_margin * GIB)
    model = {"n_embd": CAP_EMBD, "n_head": CAP_HEAD, "vocab_size": CAP_VOCAB, "block_size": CAP_BLOCK}
    starts = {m: int(n) for m, _, n in (item.partition("=") for item in args.start_layers.split(",") if item)}
    attempts: list[tuple[str, int, dict[str, Any]]] = []
    best: dict[str, tuple[int, dict[str, Any]] | None] = {}
    print(f"# bench_offload --capacity  {datetime.datetime.now().isoformat(timespec='seconds')}  torch "
          f"{torch.__version__}; MemAvailable {(_mem_available()) / GIB:.1f} GiB at the start, free disk under "
          f"{args.nvme_path} {free / GIB:.1f} GiB, disk budget {budget / GIB:.1f} GiB", file=sys.stderr, flush=True)
    for mode in args.modes.split(","):
        n = starts.get(mode) or _predicted_layers(mode, available, budget)
        best[mode] = None
        up: bool | None = None  # the search's direction, set by the first attempt
        for _ in range(args.max_attempts):
            if n < 1:
                break
            if DRIVE_BYTES[mode] * gpt_params(n) > budget:
                attempts.append((mode, n, {"outcome": "not attempted: its swap files would exceed the disk budget",
                                           "ranks": [{}, {}]}))
                if up:
                    break  # a larger one would not fit either
                n -= args.capacity_step
                continue
            spec = {"model": {**model, "n_layer": n}, "batch": 1, "steps": args.capacity_steps, "default_init": True,
                    "nvme_path": args.nvme_path, "zero": _zero_config(CAP_EMBD, args.nvme_path, mode.startswith("nvme"),
                                                                      mode.startswith("nvme"), pool_blocks=1.0,
                                                                      sub_groups_per_block=args.sub_groups,
                                                                      staged=mode in ("nvme", "nvme-bwd"),
                                                                      in_backward=mode.endswith("-bwd"),
                                                                      live_blocks=args.live_blocks,
                                                                      buckets_per_block=args.buckets_per_block)}
            if mode == "ds-nvme":  # DeepSpeed's swap files are named, not unlinked: a folder per attempt, removed after
                ds_path = os.path.join(args.nvme_path, f"deepspeed-{n}")
                os.makedirs(ds_path, exist_ok=True)
                spec.update(system="deepspeed", nvme_path=ds_path, deepspeed=_deepspeed_config(CAP_EMBD, ds_path, 1))
            print(f"  {mode}: n_layer={n} ({gpt_params(n) / 1e9:.2f}B parameters) ...", file=sys.stderr, flush=True)
            try:
                res = run_variant(spec, args.attempt_timeout, guard)
            finally:
                if mode == "ds-nvme":
                    shutil.rmtree(spec["nvme_path"], ignore_errors=True)
            ok = res["outcome"] == "ok"
            print(f"    {res['outcome']} after {res['wall']:.0f} s", file=sys.stderr, flush=True)
            attempts.append((mode, n, res))
            if ok:
                best[mode] = (n, res)
            if up is None:
                up = ok
            elif up != ok:
                break  # the boundary: one size trained, the next one up did not
            n = n + args.capacity_step if ok else n - args.capacity_step
    print(f"# bench_offload --capacity  {datetime.datetime.now().isoformat(timespec='seconds')}  torch "
          f"{torch.__version__}  2 gloo ranks x 1 thread, MALLOC_MMAP_THRESHOLD_=131072; GPT n_embd={CAP_EMBD} "
          f"n_head={CAP_HEAD} vocab={CAP_VOCAB} (DefaultInitGPT), 1 sequence of {CAP_BLOCK} tokens per rank, fp32, "
          f"AdamW, {args.capacity_steps} step(s); guards: "
          f"MemAvailable >= {args.memory_guard} GiB, free disk >= {args.disk_floor} GiB, {args.attempt_timeout:.0f} s per "
          f"attempt; disk budget {budget / GIB:.1f} GiB (free at the start: {free / GIB:.1f} GiB)\n")
    print("| mode | n_layer | parameters | outcome | build (s) | step 1 (s) | step 2 (s) | peak RSS / rank (GiB) | "
          "lowest MemAvailable (GiB) | on NVMe / rank (GiB) | drive used, both ranks (GiB) | "
          "max rel. loss diff vs the first mode that trained this size |")
    print("|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---|")
    first_ok: dict[int, tuple[str, list[dict]]] = {}  # n_layer -> the first mode that trained it, its ranks
    differs, differ_at = [], set()
    for mode, n, res in attempts:
        done = [f for f in res["ranks"] if f and f.get("done")] if res["outcome"] == "ok" else []
        check = "-"
        if done:
            if n not in first_ok:
                first_ok[n] = (mode, done)
                check = "reference" if any(m != mode and m_n == n and r["outcome"] == "ok"
                                           for m, m_n, r in attempts) else "no peer"
            else:
                rel = loss_rel(done, first_ok[n][1])
                check = f"{loss_cell(rel)} (vs {first_ok[n][0]})"
                if not rel <= LOSS_RTOL:
                    differs.append(f"{LABELS[mode]}, n_layer={n}")
                    differ_at.add((mode, n))
        ranks = res["ranks"]
        f = ranks[0] if ranks and ranks[0] else {}
        steps = f.get("steps", [])
        rep = f.get("report", {})
        low = res.get("low_mem")
        print(f"| {LABELS[mode]} | {n} | "
              f"{gpt_params(n) / 1e9:.2f}B | {res['outcome']} | {f.get('build_s', float('nan')):.0f} | "
              + " | ".join(f"{steps[i]:.1f}" if len(steps) > i else "-" for i in range(2)) + " | "
              + (f"{max(r.get('peak_rss', 0) for r in ranks) / GIB:.2f}" if rep else "-") + " | "
              + (f"{low / GIB:.1f}" if low is not None else "-") + " | "
              + (f"{rep.get('nvme_bytes', 0) / GIB:.2f}" if rep else "-") + " | "
              + (f"{res['disk_used'] / GIB:.1f}" if "disk_used" in res else "-") + f" | {check} |")
    if differs:
        print(f"\nDIFFERS (a rank's loss not within {LOSS_RTOL:g} relative of the first mode's at that size): "
              f"{'; '.join(differs)}")
    print()
    for mode, found in best.items():
        label = LABELS[mode]
        if found is None:
            print(f"- {label}: no size trained within the attempts")
            continue
        n, res = found
        steps = res["ranks"][0]["steps"]
        print(f"- {label}: largest that trained: n_layer={n}, {gpt_params(n):,} parameters; step 1 "
              f"{steps[0]:.1f} s" + (f", step 2 {steps[1]:.1f} s" if len(steps) > 1 else "")
              + ("; its loss DIFFERS from the first mode's at that size" if (mode, n) in differ_at else ""))
    for mode in ("none-bwd", "nvme", "nvme-inplace", "nvme-bwd", "nvme-inplace-bwd", "ds-nvme"):
        if best.get("none") and best.get(mode):
            print(f"- ratio, {LABELS[mode]}: {gpt_params(best[mode][0]) / gpt_params(best['none'][0]):.2f}x the "
                  "parameters of no offload")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nvme-path", required=True, help="directory for the swap files (zero3 unlinks its files at once; DeepSpeed's go in a "
                         "folder removed after each attempt)")
    ap.add_argument("--quick", action="store_true", help="a smaller model for the memory figures "
                    "(4x512, 8 heads, 3 steps; defaults only: --n-layer, --n-embd, --n-head, --steps given win)")
    ap.add_argument("--n-layer", type=int, default=6)
    ap.add_argument("--n-embd", type=int, default=768)
    ap.add_argument("--n-head", type=int, default=12)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--capacity", action="store_true", help="run the capacity search instead")
    ap.add_argument("--modes", default="none,nvme,nvme-inplace", help="capacity: which modes, in order: none, "
                    "nvme (zero3, staged step), nvme-inplace (zero3, offload_optimizer.staged_step false), nvme-bwd and nvme-inplace-bwd (the same with offload_optimizer.step_in_backward), none-bwd (no offload, step_in_backward), ds-nvme (DeepSpeed's offload_param and offload_optimizer nvme; run with a Python that has deepspeed)")
    ap.add_argument("--capacity-step", type=int, default=4, help="capacity: layers between attempts")
    ap.add_argument("--capacity-steps", type=int, default=2,
                    help="capacity: optimizer steps per attempt (the first creates AdamW's moments; from the second "
                         "on, every step holds what the rest of training holds)")
    ap.add_argument("--sub-groups", type=int, default=8,
                    help="capacity, zero3 NVMe and -bwd modes: optimizer sub-groups per Block "
                         "(sub_group_size = Block / this)")
    ap.add_argument("--buckets-per-block", type=int, default=1,
                    help="capacity, zero3 modes (no offload included): reduce_bucket_size = Block / this")
    ap.add_argument("--live-blocks", type=int, default=3,
                    help="capacity, zero3 modes: max_live_parameters in Blocks (DeepSpeed's config keeps 3)")
    ap.add_argument("--start-layers", default="", metavar="MODE=N,...",
                    help="capacity: start a mode's search at N layers instead of the predicted size (e.g. nvme=77)")
    ap.add_argument("--max-attempts", type=int, default=4, help="capacity: attempts per mode")
    ap.add_argument("--attempt-timeout", type=float, default=570.0, help="seconds before an attempt is stopped")
    ap.add_argument("--memory-guard", type=float, default=1.5, help="GiB of MemAvailable below which a run is stopped")
    ap.add_argument("--memory-margin", type=float, default=1.0, help="capacity: GiB kept out of the size prediction")
    ap.add_argument("--disk-floor", type=float, default=20.0, help="GiB of free disk below which a run is stopped")
    ap.add_argument("--disk-budget", type=float, default=0.0, help="capacity: GiB of swap files (0: half the free space)")
    if ap.parse_known_args()[0].quick:  # the preset gives defaults; --n-layer etc. given win
        ap.set_defaults(n_layer=4, n_embd=512, n_head=8, steps=3)
    args = ap.parse_args()
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "131072")  # inherited by the spawned ranks
    os.makedirs(args.nvme_path, exist_ok=True)
    if args.capacity:
        capacity(args)
    else:
        memory_figures(args)


if __name__ == "__main__":
    main()
