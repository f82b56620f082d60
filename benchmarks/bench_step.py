"""Training-step benchmark: zero3 (prefetch on / off) against DDP and FSDP2 on 2 CPU ranks (gloo).

    python benchmarks/bench_step.py            # full run (3 repeats, 20 measured steps): 14 variants x
        # (3 timed + 1 memory) = 56 launches of a rank pair
    python benchmarks/bench_step.py --quick    # smoke run (small model, 1 repeat, 4 steps): 14 variants x 2
        # launches (timed + memory pass) = 28 fresh rank pairs, 4-6 s each lightly loaded, 13-22 s loaded
    python benchmarks/bench_step.py --models small,big --variants zero3,fsdp2,ddp --repeats 2 --steps 10
        # issue 13's comparison: both GPTs (3.7M and 86.7M parameters), default configs, side by side

Every variant trains the same GPT (examples/gpt.py) on the same synthetic batches with AdamW, in its
own fresh pair of rank processes (so the peak RSS is the variant's own), one variant after the
other in one invocation; the order is reversed on every other repeat. Variants: zero3 with its default
config, zero3 with prefetch on and off under tight budgets (in `zero3_config`), DDP, FSDP2 with and
without ``reshard_after_forward`` (True, torch's default for the Blocks, gathers every Block again
for backward; False keeps them gathered from forward to backward; set alike on the root), and extra
rows that each change one knob of the default or lean config (``EXTRA_VARIANTS``, ``LABELS``: without
verification, on gloo's collectives or on the wire instead of shared memory, the optimizer step in
backward for zero3 and FSDP2). Every table names the batch (sequences per rank).

Per step, each rank starts after a barrier and times forward + backward + optimizer step; the step
time is the slower rank's, and the table shows the median over all measured steps of all repeats,
with the per-repeat medians and the median process CPU time per step (all threads, mean over ranks:
less sensitive to a busy host than wall time, blind to time spent waiting on the other rank).
Figures are printed, never asserted: these machines are noisy, so read the ratios of one run.

Timed runs use glibc's default allocator (``MALLOC_MMAP_THRESHOLD_`` removed from their
environment): an mmap per large tensor costs page faults on every step, which no real run pays.
Memory is measured in a pass of its own, one fresh pair of ranks per variant after the timed repeats,
for ``--memory-steps`` steps, with ``MALLOC_MMAP_THRESHOLD_=131072`` (or the value found in the
environment), so every tensor above 128 KiB is mmapped and its pages go back to the OS when it is
freed; RSS then tracks live tensors instead of what glibc's heap keeps. "Peak RSS" is
``ru_maxrss`` inside each rank (max over ranks); "peak - built" subtracts the RSS measured right after
the model, its wrapper and the optimizer were built (before any step), i.e. what training adds on
top of the model state. FSDP2's gathered-parameter peak comes from one extra step of that pass.

All-gather bytes are *received per rank* per step: a collective whose output holds B bytes brings
B x (N-1)/N bytes to each rank. The ideal is 2 x parameter bytes x (N-1)/N (every parameter
gathered once for forward and once for backward). zero3's figure comes from
``engine.last_step_metrics`` (unpadded bytes of the parameters gathered, plus persistent refreshes);
every variant's "wire" figure counts the flat all-gather calls themselves, each call once (padding
included; zero3's ``verify_collectives`` header exchanges counted apart, as "+headers").

Every variant trains the same fp32 model from the same seed on the same batches, so its loss at every
measured step (mean over ranks, every repeat) must match the reference's within ``LOSS_RTOL``
relative (``--loss-rtol``): DDP's first repeat, or the first peer (FSDP2) that ran when DDP is not in
the run, or the first variant when only zero3 ran (a zero3 row is never the reference while a peer ran:
``--zero3-extra`` may change its numbers). A variant outside it trained other numbers: its loss cell
says DIFFERS and it is left out of every ratio ("excluded") and of the goals table, which would
otherwise compare different work. A ``--zero3-extra`` that trains in bf16 or fp16 differs by its
rounding (4.8e-3 relative at --quick in bf16): pass ``--loss-rtol 1e-2`` to compare it at that level.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import platform
import resource
import shutil
import socket
import statistics
import sys
import tempfile
import threading
import time
import traceback
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples"))

VARIANTS = ("zero3", "zero3-prefetch", "zero3-noprefetch", "ddp", "fsdp2", "fsdp2-noreshard")
EXTRA_VARIANTS = ("zero3-noverify", "zero3-collectives", "zero3-prefetch-noverify", "zero3-prefetch-tuned",
                  "zero3-prefetch-wire", "zero3-prefetch-wirereduce", "zero3-prefetch-bwd", "fsdp2-bwd")
LABELS = {
    "zero3": "zero3, default config",
    "zero3-noverify": "zero3, default config, verify_collectives=False",
    "zero3-collectives": "zero3, default config, gloo's all_gather and all_reduce instead of its default transports",
    "zero3-prefetch": "zero3, prefetch on",
    "zero3-noprefetch": "zero3, prefetch off",
    "zero3-prefetch-noverify": "zero3, prefetch on, verify_collectives=False",
    "zero3-prefetch-tuned": "zero3, prefetch on, verify off, reduce_bucket_size = 1 Block",
    "zero3-prefetch-wire": "zero3, prefetch on, gathers and reductions on the wire (allgather_impl=p2p: no shared memory)",
    "zero3-prefetch-wirereduce": "zero3, prefetch on, shared gathers, reductions on the wire (reduce_scatter_impl=p2p)",
    "zero3-prefetch-bwd": "zero3, prefetch on, the optimizer step in backward (sub-groups of one Block)",
    "ddp": "DDP",
    "fsdp2": "FSDP2 (fully_shard per Block + root), reshard_after_forward=True",
    "fsdp2-noreshard": "FSDP2 (fully_shard per Block + root), reshard_after_forward=False",
    "fsdp2-bwd": "FSDP2, reshard_after_forward=True, the optimizer step in backward (one AdamW per parameter, "
                 "stepped in its post-accumulate-grad hook)",
}
MMAP_THRESHOLD = "131072"
"""MALLOC_MMAP_THRESHOLD_ of the memory pass, unless the environment sets another."""
MIB = 1024 * 1024
LOSS_RTOL = 1e-5
"""fp32, same init and batches: the systems differ only in summation order, well inside this."""
QUICK = {"steps": 4, "warmup": 1, "repeats": 1, "memory_steps": 2, "n_layer": 2, "n_embd": 128, "block": 64,
         "vocab": 256}
"""--quick's preset: defaults for these flags, each overridden by the flag when it is given."""
BREAKDOWN = ("forward_seconds", "backward_seconds", "wait_seconds", "reduce_wait_seconds", "header_seconds",
             "optimizer_seconds")
"""zero3's per-step timers (engine.last_step_metrics), printed as the step breakdown."""


# ------------------------------------------------------------------------------------------------
# model and budgets


def label(variant: str) -> str:
    base, _, tree = variant.partition("@")
    return LABELS[base] + (f" [{tree}]" if tree else "")


def gpt_config(args: argparse.Namespace) -> Any:
    from gpt import GPTConfig

    return GPTConfig(vocab_size=args.vocab, block_size=args.block, n_layer=args.n_layer, n_head=args.n_head,
                     n_embd=args.n_embd)


def block_numel(n_embd: int) -> int:
    """Elements of one GPT Block: c_attn 3C^2+3C, attn.c_proj C^2+C, c_fc 4C^2+4C, mlp.c_proj 4C^2+C, 2 LN 4C."""
    c = n_embd
    return 12 * c * c + 13 * c


MODELS = {  # --models presets: the two GPTs of issue 13's table
    "small": {"n_layer": 4, "n_embd": 256, "n_head": 4, "vocab": 2048},  # 3.7M parameters
    "big": {"n_layer": 12, "n_embd": 768, "n_head": 12, "vocab": 2048},  # 86.7M parameters
}


def zero3_config(variant: str, args: argparse.Namespace) -> dict:
    variant = variant.partition("@")[0]
    if variant in ("zero3", "zero3-noverify", "zero3-collectives"):  # ZeroConfig's defaults (verification on)
        cfg = json.loads(args.zero3_extra) if args.zero3_extra else {}
        if variant == "zero3-noverify":  # the same, verification off: what the checks cost
            cfg["verify_collectives"] = False
        if variant == "zero3-collectives":  # the collectives gloo runs used before pairwise messages
            cfg.update(allgather_impl="all_gather", reduce_scatter_impl="all_reduce")
        return cfg
    blk = block_numel(args.n_embd)
    cfg = {
        "param_persistence_threshold": args.persistence,
        "prefetch_bucket_size": blk,
        "max_reuse_distance": 0,
        "max_live_parameters": 3 * blk,
    }
    cfg.update(json.loads(args.zero3_extra) if args.zero3_extra else {})
    if variant == "zero3-noprefetch":
        cfg["prefetch_bucket_size"] = 0
    if variant in ("zero3-prefetch-noverify", "zero3-prefetch-tuned"):
        cfg["verify_collectives"] = False
    if variant == "zero3-prefetch-tuned":
        cfg["reduce_bucket_size"] = blk
    if variant == "zero3-prefetch-wire":  # what shared memory (auto on one host) buys: gathers, and with
        cfg["allgather_impl"] = "p2p"    # them (auto) reductions, on the wire
    if variant == "zero3-prefetch-bwd":  # the optimizer in memory steps each Block's sub-group in backward
        cfg["offload_optimizer"] = {"device": "none", "step_in_backward": True}
        cfg["sub_group_size"] = blk // 2  # a Block's shard at 2 ranks
    if variant == "zero3-prefetch-wirereduce":  # what shared-memory reductions buy beside shared gathers
        cfg["reduce_scatter_impl"] = "p2p"
    return cfg


# ------------------------------------------------------------------------------------------------
# measurement helpers (run inside the ranks)


def rss_bytes() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def maxrss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


class WireCounter:
    """Counts the flat all-gather collectives a rank issues (calls and output bytes), per step.

    A call is counted once however many wrapped functions it passes through: zero3's
    ``_all_gather_flat`` calls ``dist.all_gather_single``, and both are wrapped (an older tree may
    bind the alias at import instead), so only the outermost wrapped call of a thread counts.
    """

    def __init__(self, world: int) -> None:
        self.world = world
        self._inside = threading.local()
        self.reset()

    def reset(self) -> None:
        self.calls = 0
        self.header_calls = 0
        self.header_seconds = 0.0
        self.out_bytes = 0

    def wrap(self, fn: Any) -> Any:
        import torch

        def counted(output: Any, *a: Any, **k: Any) -> Any:
            if getattr(self._inside, "active", False):  # already counted by an outer wrapper
                return fn(output, *a, **k)
            self._inside.active = True
            try:
                if output.dtype == torch.int64 and output.numel() in (3 * self.world, 4 * self.world,
                                                                      8 * self.world):
                    # zero3's verify_collectives header exchange (3, then 4, now 8 int64 per rank
                    # over the versions): a blocking exchange, timed.
                    self.header_calls += 1
                    t0 = time.perf_counter()
                    result = fn(output, *a, **k)
                    self.header_seconds += time.perf_counter() - t0
                    return result
                self.calls += 1
                self.out_bytes += output.numel() * output.element_size()
                return fn(output, *a, **k)
            finally:
                self._inside.active = False

        counted._bench_counted = True  # type: ignore[attr-defined]
        return counted

    def install(self) -> None:
        """Wrap torch's flat all-gathers (FSDP2 looks them up on ``dist`` at call time) and zero3's
        entry to them (an alias bound at import in some trees), each function exactly once."""
        import torch.distributed as dist

        targets: list[tuple[Any, str]] = [(dist, "all_gather_single"), (dist, "all_gather_into_tensor")]
        try:
            import zero3.comm.communicator as zc

            targets.append((zc, "_all_gather_flat"))
        except Exception:  # noqa: BLE001 - zero3 internals may move; its metrics still work
            pass
        originals = {name: getattr(mod, name) for mod, name in targets if hasattr(mod, name)}
        for mod, name in targets:
            fn = originals.get(name)
            if fn is not None and not getattr(fn, "_bench_counted", False):
                setattr(mod, name, self.wrap(fn))


class FSDPLiveTracker:
    """Peak bytes of FSDP2's unsharded parameters (``FSDPParam.all_gather_outputs``), exact at each
    alloc/free of those buffers; only while ``enabled`` (one extra, untimed step)."""

    def __init__(self) -> None:
        self.enabled = False
        self.params: list[Any] = []
        self.peak = 0
        self.ok = False

    def live(self) -> int:
        total = 0
        for fp in self.params:
            for t in getattr(fp, "all_gather_outputs", ()):
                total += t.untyped_storage().nbytes()
        return total

    def _sample(self) -> None:
        self.peak = max(self.peak, self.live())

    def install(self, model: Any) -> None:
        try:
            from torch.distributed.fsdp._fully_shard._fsdp_param import FSDPParam

            for m in model.modules():
                get = getattr(m, "_get_fsdp_state", None)
                if get is None:
                    continue
                group = get()._fsdp_param_group
                if group is not None:
                    self.params.extend(group.fsdp_params)
            tracker = self
            orig_alloc, orig_init, orig_free = (FSDPParam.alloc_all_gather_outputs,
                                                FSDPParam.init_all_gather_outputs, FSDPParam.free_unsharded_param)

            def alloc(fp: Any, *a: Any, **k: Any) -> Any:
                r = orig_alloc(fp, *a, **k)
                if tracker.enabled:
                    tracker._sample()
                return r

            def init(fp: Any, *a: Any, **k: Any) -> Any:
                r = orig_init(fp, *a, **k)
                if tracker.enabled:
                    tracker._sample()
                return r

            def free(fp: Any, *a: Any, **k: Any) -> Any:
                if tracker.enabled:
                    tracker._sample()
                return orig_free(fp, *a, **k)

            FSDPParam.alloc_all_gather_outputs = alloc
            FSDPParam.init_all_gather_outputs = init
            FSDPParam.free_unsharded_param = free
            self.ok = bool(self.params)
        except Exception:  # noqa: BLE001 - FSDP2 internals differ across torch versions
            self.ok = False


# ------------------------------------------------------------------------------------------------
# one variant on one rank


def run_variant(rank: int, world: int, variant: str, args: argparse.Namespace, memory: bool) -> dict:
    """One variant on one rank: timed steps, or (``memory``) the memory pass's steps and FSDP2's
    tracked extra step."""
    import torch
    import torch.distributed as dist

    from gpt import GPT, synthetic_batch

    cfg = gpt_config(args)
    t_begin = time.perf_counter()
    wire = WireCounter(world)
    wire.install()
    out: dict[str, Any] = {"variant": variant, "rank": rank}
    out["rss_start"] = rss_bytes()
    torch.manual_seed(args.seed)

    engine = None
    fsdp_tracker = None
    if variant.startswith("zero3"):
        import zero3

        with zero3.Init():
            model = GPT(cfg)
        opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
        engine = zero3.initialize(model, opt, zero3_config(variant, args))
        out["zero3_config"] = zero3_config(variant, args)
        n_params = sum(p.ds_numel for p in engine.params)
        param_bytes = sum(p.ds_numel * p.element_size() for p in engine.params)
        out["persistent_bytes"] = sum(p.ds_numel * p.element_size() for p in engine.params if p.ds_persist)
        step_model = engine
    elif variant == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        model = GPT(cfg)
        n_params = sum(p.numel() for p in model.parameters())
        param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        step_model = DDP(model)
        opt = torch.optim.AdamW(step_model.parameters(), lr=args.lr)
    elif variant in ("fsdp2", "fsdp2-noreshard", "fsdp2-bwd"):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,))
        model = GPT(cfg)
        n_params = sum(p.numel() for p in model.parameters())
        param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        reshard = variant != "fsdp2-noreshard"
        # Expected traffic: resharded blocks are gathered twice (forward, backward), blocks kept
        # after forward once; the root is never resharded after forward (FSDP2 keeps its parameters
        # through backward), so root params are gathered once.
        root_numel = sum(p.numel() for n, p in model.named_parameters() if not n.startswith("h."))
        out["fsdp2_expected_gather_numel"] = (2 if reshard else 1) * (n_params - root_numel) + root_numel
        for block in model.h:
            fully_shard(block, mesh=mesh, reshard_after_forward=reshard)
        fully_shard(model, mesh=mesh, reshard_after_forward=reshard)
        opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
        if variant == "fsdp2-bwd":  # FSDP2 calls the sharded parameters' post-accumulate-grad hooks
            opt = step_in_backward(model, args.lr)  # after their reduce-scatter (torch's own pattern)
        if memory:
            fsdp_tracker = FSDPLiveTracker()
            fsdp_tracker.install(model)
        step_model = model
    else:
        raise ValueError(f"unknown variant {variant!r}")
    out["n_params"] = n_params
    out["param_bytes"] = param_bytes
    out["build_seconds"] = time.perf_counter() - t_begin
    out["rss_built"] = rss_bytes()
    out["maxrss_built"] = maxrss_bytes()

    warmup, steps = (0, args.memory_steps) if memory else (args.warmup, args.steps)
    total_steps = warmup + steps
    batches = []
    for step in range(total_steps + 1):
        x, y = synthetic_batch(step, args.batch * world, cfg, seed=args.seed)
        batches.append((x[rank * args.batch:(rank + 1) * args.batch].contiguous(),
                        y[rank * args.batch:(rank + 1) * args.batch].contiguous()))

    def one_step(x: Any, y: Any) -> Any:
        if engine is not None:
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
        else:
            loss = step_model(x, y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        return loss.detach()

    times, cpu_times, losses, metrics, wires = [], [], [], [], []
    for step in range(total_steps):
        x, y = batches[step]
        dist.barrier()
        wire.reset()
        t0, c0 = time.perf_counter(), time.process_time()
        loss = one_step(x, y)
        dt, dc = time.perf_counter() - t0, time.process_time() - c0
        w = (wire.calls, wire.header_calls, wire.out_bytes, wire.header_seconds)
        dt_max = torch.tensor([dt], dtype=torch.float64)
        dist.all_reduce(dt_max, op=dist.ReduceOp.MAX)
        sums = torch.tensor([dc, loss.item()], dtype=torch.float64)
        dist.all_reduce(sums)
        cpu_sum, loss_sum = sums[0:1], sums[1:2]
        if step >= warmup:
            times.append(dt_max.item())
            cpu_times.append(cpu_sum.item() / world)
            losses.append(loss_sum.item() / world)
            wires.append(w)
            if engine is not None:
                metrics.append(engine.last_step_metrics.as_dict())
    out["times"] = times
    out["cpu_times"] = cpu_times
    out["all_step_seconds"] = time.perf_counter() - t_begin - out["build_seconds"]
    out["losses"] = losses
    out["header_seconds"] = [w[3] for w in wires]
    out["wire_calls"] = wires[-1][0]
    out["wire_header_calls"] = wires[-1][1]
    out["wire_out_bytes"] = wires[-1][2]
    out["maxrss_steps"] = maxrss_bytes()  # peak over construction + all steps of this run
    if metrics:
        last = metrics[-1]
        out["zero3_last"] = last
        out["wait_seconds"] = [m["wait_seconds"] for m in metrics]
        if "forward_seconds" in last:  # a baseline from before the timers has no breakdown
            out["breakdown"] = {k: [m.get(k, 0.0) for m in metrics] for k in BREAKDOWN}
        out["zero3_peak_live_bytes_max"] = max(m["peak_live_bytes"] for m in metrics)
        out["zero3_allgather_bytes_steps"] = sorted({m["allgather_bytes"] for m in metrics})
    if fsdp_tracker is not None and fsdp_tracker.ok:
        # One extra, untimed step with the unsharded-parameter tracker on.
        fsdp_tracker.enabled = True
        one_step(*batches[total_steps])
        fsdp_tracker.enabled = False
        out["fsdp2_peak_unsharded_bytes"] = fsdp_tracker.peak
    out["rss_end"] = rss_bytes()
    out["maxrss"] = maxrss_bytes()
    if engine is not None:
        # Take the hooks off before destroy_process_group, whatever the garbage collector does. At
        # 940ffa3 an engine was never freed without this (its post-accumulate-grad hooks formed a cycle
        # the collector could not see), and the process group it held was torn down at interpreter
        # exit, which sometimes aborted ("terminate called without an active exception"). At fc91063
        # `del` + gc.collect() frees engine and model without it (world 1 and 2). docs/performance.md.
        engine.remove_hooks()
    return out


class _StepsInBackward:
    """The optimizer of ``fsdp2-bwd``: every parameter stepped in its hook already."""

    def step(self) -> None:
        pass

    def zero_grad(self, set_to_none: bool = True) -> None:
        pass


def step_in_backward(model: Any, lr: float) -> _StepsInBackward:
    """One AdamW per parameter, stepped (and its gradient dropped) as soon as the gradient is final:
    the optimizer-in-backward pattern torch documents for FSDP2 and plain modules alike."""
    import torch

    optimizers = {p: torch.optim.AdamW([p], lr=lr) for p in model.parameters()}

    def _step(param: Any) -> None:
        optimizers[param].step()
        optimizers[param].zero_grad(set_to_none=True)

    for p in model.parameters():
        p.register_post_accumulate_grad_hook(_step)
    return _StepsInBackward()


def _debug(msg: str) -> None:
    if os.environ.get("BENCH_DEBUG"):
        print(f"[{time.time() % 1000:8.2f}] {msg}", file=sys.stderr, flush=True)


def _rank_main(rank: int, world: int, port: int, variant: str, args: argparse.Namespace, outdir: str,
               memory: bool) -> None:
    _debug(f"rank {rank} started")
    if variant.endswith("@baseline"):  # a fresh process: the baseline tree's zero3 shadows the installed one
        sys.path.insert(0, os.path.abspath(args.baseline))
        # and its own examples/gpt.py (today's imports modules the baseline's zero3 may not have;
        # the GPT itself is the same with the options these benchmarks use)
        sys.path.insert(0, os.path.join(os.path.abspath(args.baseline), "examples"))
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    import torch
    import torch.distributed as dist

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=300))
    path = os.path.join(outdir, f"rank{rank}.json")
    _debug(f"rank {rank} process group up")
    try:
        result = run_variant(rank, world, variant, args, memory)
    except BaseException as exc:  # noqa: BLE001 - reported in the table
        with open(path, "w") as fh:
            json.dump({"variant": variant, "rank": rank, "error": f"{type(exc).__name__}: {exc}",
                       "traceback": traceback.format_exc()}, fh)
        raise
    with open(path, "w") as fh:
        json.dump(result, fh)
    _debug(f"rank {rank} done: build {result['build_seconds']:.1f} s, steps {result['all_step_seconds']:.1f} s")
    del result
    gc.collect()
    dist.destroy_process_group()
    _debug(f"rank {rank} process group destroyed")


# ------------------------------------------------------------------------------------------------
# driver


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(variant: str, args: argparse.Namespace, memory: bool = False) -> list[dict]:
    """Run one variant in a fresh set of rank processes, timed or (``memory``) the memory pass;
    return each rank's result (or error)."""
    import torch.multiprocessing as mp

    outdir = tempfile.mkdtemp(prefix=f"bench-{variant}-")
    _debug(f"launch {variant}{' (memory)' if memory else ''}")
    # The children inherit the environment when spawned, and glibc reads it at their start-up.
    if memory:
        os.environ["MALLOC_MMAP_THRESHOLD_"] = args.mmap_threshold
    try:
        ctx = mp.start_processes(_rank_main, args=(args.nproc, free_port(), variant, args, outdir, memory),
                                 nprocs=args.nproc, join=False, start_method="spawn")
    finally:
        os.environ.pop("MALLOC_MMAP_THRESHOLD_", None)
    deadline = time.monotonic() + args.timeout
    error = None
    try:
        while not ctx.join(timeout=1.0):
            if time.monotonic() > deadline:
                for p in ctx.processes:
                    if p.is_alive():
                        p.kill()
                error = f"timed out after {args.timeout} s"
                break
    except Exception as exc:  # a rank raised; its JSON has the message
        error = f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1] if str(exc).strip() else ''}"
    _debug(f"joined {variant}")
    results = []
    for r in range(args.nproc):
        path = os.path.join(outdir, f"rank{r}.json")
        if os.path.exists(path):
            with open(path) as fh:
                results.append(json.load(fh))
    shutil.rmtree(outdir, ignore_errors=True)
    if error is not None and not any("error" in r for r in results):
        if len(results) == args.nproc:  # every rank finished and wrote its figures; it died on exit
            for r in results:
                r["exit_error"] = error
        else:
            results.append({"variant": variant, "error": error})
    return results


def fmt_mib(b: float | None) -> str:
    return "n/a" if b is None else f"{b / MIB:.1f}"


def summarise(runs: dict[str, list[list[dict]]], mem: dict[str, list[dict]],
              args: argparse.Namespace) -> tuple[str, dict]:
    """The tables of one model: ``runs`` holds each variant's timed repeats (each a list of rank
    results), ``mem`` its memory pass's rank results."""
    lines = []
    rows = {}
    for variant, reps in runs.items():
        errors = [r["error"] for rep in reps for r in rep if "error" in r]
        if errors:
            rows[variant] = {"error": errors[0], "traceback": next((r.get("traceback") for rep in reps for r in rep
                                                                      if r.get("traceback")), None)}
            continue
        mem_ranks = mem.get(variant, [])
        mem_error = next((r["error"] for r in mem_ranks if "error" in r), None if mem_ranks else "not run")
        mem_ok = mem_ranks if mem_error is None else []
        times = [t for rep in reps for t in rep[0]["times"]]
        rep_medians = [statistics.median(rep[0]["times"]) for rep in reps]
        q = statistics.quantiles(times, n=10) if len(times) >= 2 else [times[0]] * 9
        rows[variant] = {
            "median": statistics.median(times),
            "rep_medians": rep_medians,
            "best": min(rep_medians),
            "p10": q[0],
            "p90": q[-1],
            "cpu": statistics.median(t for rep in reps for t in rep[0]["cpu_times"]),
            "header_ms": statistics.median(t for rep in reps for r in rep for t in r["header_seconds"]) * 1e3,
            "wait_ms": (statistics.median(t for rep in reps for r in rep for t in r["wait_seconds"]) * 1e3
                        if "wait_seconds" in reps[0][0] else None),
            "maxrss": max((r["maxrss_steps"] for r in mem_ok), default=None),
            "growth": max((r["maxrss_steps"] - r["rss_built"] for r in mem_ok), default=None),
            "built": max((r["rss_built"] for r in mem_ok), default=None),
            "m0": mem_ok[0] if mem_ok else None,
            "memory_error": mem_error,
            "batch": args.batch,
            "loss": reps[0][0]["losses"][-1],
            "losses_agree_across_repeats": len({round(rep[0]["losses"][-1], 6) for rep in reps}) == 1,
            "r0": reps[0][0],
        }
    ref_name = check_losses(runs, rows)
    ddp_row = rows.get("ddp", {}) if rows.get("ddp", {}).get("same") else {}  # DDP is the reference when it ran
    ddp = ddp_row.get("median")
    ddp_best = ddp_row.get("best")
    ddp_cpu = ddp_row.get("cpu")
    ddp_loss = rows.get("ddp", {}).get("loss")
    any_ok = next((r["r0"] for r in rows.values() if "r0" in r), None)
    world = args.nproc
    frac = (world - 1) / world
    if any_ok is not None:
        pbytes = any_ok["param_bytes"]
        ideal = 2 * pbytes * frac
    else:
        pbytes = ideal = None

    batch = args.batch
    timing = ["| variant | batch/rank | median step per repeat (s) | p10 – p90 over all steps (s) | CPU s/step/rank "
              "| CPU vs DDP | zero3 gather wait / header checks (ms/step) |",
              "|---|---:|---:|---:|---:|---:|---:|"]
    head = ("| variant | batch/rank | median step (s) | vs DDP (median; best repeat) | peak RSS/rank (MiB) | "
            "peak - built (MiB) | gathered param peak (MiB) | all-gather recv/rank/step (MiB) | vs ideal | "
            "wire calls/step (+headers) | prefetch hit rate | loss after last step |")
    lines.append(head)
    lines.append("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for variant in runs:
        row = rows[variant]
        name = label(variant)
        if "error" in row:
            lines.append(f"| {name} | {batch} | FAILED: {row['error']} | | | | | | | | | |")
            continue
        r0 = row["r0"]
        med = row["median"]
        ratio = f"{med / ddp:.2f}x (best {row['best'] / ddp_best:.2f}x)" if ddp else "n/a"
        if not row["same"]:
            ratio = "excluded (loss differs)"
        reps = "/".join(f"{m:.3f}" for m in row["rep_medians"])
        zero3_ms = "n/a"
        if row["wait_ms"] is not None:
            zero3_ms = f"{row['wait_ms']:.0f} / {row['header_ms']:.0f}"
        timing.append(f"| {name} | {batch} | {reps} | {row['p10']:.3f} – {row['p90']:.3f} | {row['cpu']:.3f} | "
                      + ("excluded" if not row["same"] else f"{row['cpu'] / ddp_cpu:.2f}x" if ddp_cpu else "n/a")
                      + f" | {zero3_ms} |")
        gathered = "n/a"
        recv = "n/a"
        vs_ideal = "n/a"
        hit = "n/a"
        wire_recv = r0["wire_out_bytes"] * frac
        calls = f"{r0['wire_calls']}"
        if r0["wire_header_calls"]:
            calls += f" (+{r0['wire_header_calls']})"
        if variant.startswith("zero3"):
            m = r0["zero3_last"]
            gathered = fmt_mib(r0["zero3_peak_live_bytes_max"])
            if r0.get("persistent_bytes"):
                gathered += f" (+{fmt_mib(r0['persistent_bytes'])} persistent)"
            elem = r0["param_bytes"] / r0["n_params"]
            gb = (m["allgather_bytes"] + m["persistent_refresh_numel"] * elem) * frac
            recv = f"{gb / MIB:.2f} (wire {wire_recv / MIB:.2f})"
            vs_ideal = f"{gb / ideal:.2f}x"
            denom = m["prefetch_hits"] + m["demand_fetches"]
            if m["prefetched"] or variant != "zero3-noprefetch":
                hit = f"{m['prefetch_hits'] / denom:.0%} ({m['prefetch_hits']}/{denom})" if denom else "n/a"
            else:
                hit = f"0% (0/{denom}, off)"
        elif variant.startswith("fsdp2"):
            peak = (row["m0"] or {}).get("fsdp2_peak_unsharded_bytes")
            gathered = fmt_mib(peak) if peak is not None else "n/a"
            recv = f"{wire_recv / MIB:.2f} (expected {r0['fsdp2_expected_gather_numel'] * r0['param_bytes'] / r0['n_params'] * frac / MIB:.2f})"
            vs_ideal = f"{wire_recv / ideal:.2f}x"
        elif variant == "ddp":
            gathered = f"{fmt_mib(r0['param_bytes'])} (full model, always)"
            recv = "0 (all-reduces grads)"
            calls = "0"
        loss = f"{row['loss']:.6f}"
        if ddp_loss is not None and variant != "ddp":
            loss += f" (Δ {row['loss'] - ddp_loss:+.1e})"
        if not row["same"]:
            loss += f" DIFFERS from {label(ref_name)}: up to {row['loss_rel']:.1e} relative"
        lines.append(f"| {name} | {batch} | {med:.3f} | {ratio} | {fmt_mib(row['maxrss'])} | "
                     f"{fmt_mib(row['growth'])} | {gathered} | {recv} | {vs_ideal} | {calls} | {hit} | {loss} |")
    notes = []
    if ref_name is not None:
        notes.append(f"Same result: every variant's loss at each measured step, every repeat, within {LOSS_RTOL:g} "
                     f"relative of {label(ref_name)}'s; "
                     + (", ".join(label(v) for v, r in rows.items() if "r0" in r and not r["same"])
                        + " DIFFER and are left out of the ratios" if any("r0" in r and not r["same"]
                                                                          for r in rows.values())
                        else "all agree"))
    if any_ok is not None:
        notes.append(f"Model: {any_ok['n_params']:,} parameters = {fmt_mib(any_ok['param_bytes'])} MiB fp32; "
                     f"ideal all-gather per rank per step 2 x {fmt_mib(pbytes)} x {world - 1}/{world} = "
                     f"{fmt_mib(ideal)} MiB.")
    for variant, row in rows.items():
        if "r0" in row:
            r0 = row["r0"]
            if row["m0"] is not None:
                notes.append(f"{label(variant)}: memory pass: RSS at rank start {fmt_mib(row['m0']['rss_start'])} "
                             f"MiB, after building model+wrapper+optimizer {fmt_mib(row['built'])} MiB (max over ranks)"
                             + ("" if row["losses_agree_across_repeats"] else "; last loss differs across repeats"))
            else:
                notes.append(f"{label(variant)}: memory pass FAILED: {row['memory_error']}")
            if variant.startswith("zero3"):
                m = r0["zero3_last"]
                notes.append(f"  zero3 last step: {m['allgather_calls']} all-gathers, {m['allgather_bytes']:,} B "
                             f"gathered, demand {m['demand_fetches']}, prefetched {m['prefetched']}, hits "
                             f"{m['prefetch_hits']}, wasted {m['wasted_prefetches']}, peak live "
                             f"{m['peak_live_numel']:,} el, wait {m['wait_seconds'] * 1e3:.1f} ms, reduce calls "
                             f"{m['reduce_calls']}, divergences {m['divergences']}; config {r0['zero3_config']}")
        else:
            notes.append(f"{label(variant)} FAILED: {row['error']}")
            if row.get("traceback"):
                notes.append("  " + row["traceback"].strip().replace("\n", "\n  "))
    lines += ["", "Timing detail (step = slower rank's wall time; CPU = process CPU time, all threads, mean of "
              "ranks; zero3 gather wait = metrics.wait_seconds, header checks = time blocked in the "
              "verify_collectives exchanges, medians per rank-step):", ""] + timing
    breakdown = ["| variant | batch/rank | step | forward | backward | of which: gather wait | reduction wait "
                 "| header exchanges | optimizer | rest |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for variant in runs:
        row = rows[variant]
        if "r0" not in row or "breakdown" not in row["r0"]:
            continue
        med = {k: statistics.median(t for rep in runs[variant] for r in rep for t in r["breakdown"][k]) * 1e3
               for k in BREAKDOWN}
        step_ms = row["median"] * 1e3
        rest = step_ms - med["forward_seconds"] - med["backward_seconds"] - med["optimizer_seconds"]
        breakdown.append(f"| {label(variant)} | {batch} | {step_ms:.0f} | {med['forward_seconds']:.0f} | "
                         f"{med['backward_seconds']:.0f} | {med['wait_seconds']:.0f} | {med['reduce_wait_seconds']:.0f} "
                         f"| {med['header_seconds']:.0f} | {med['optimizer_seconds']:.0f} | {rest:.0f} |")
    if len(breakdown) > 2:
        lines += ["", "zero3 step breakdown (ms, medians over ranks and steps, from engine.last_step_metrics; the "
                  "waits are inside forward/backward; rest = step - forward - backward - optimizer: reduction "
                  "landing, persistent refresh, Python between phases):", ""] + breakdown
    text = "\n".join(lines) + "\n\n" + "\n".join(f"- {n}" if not n.startswith("  ") else n for n in notes)
    return text, rows


def check_losses(runs: dict[str, list[list[dict]]], rows: dict[str, dict]) -> str | None:
    """Set ``same`` and ``loss_rel`` on every row that ran: its worst relative loss difference, over
    measured steps and repeats, from the reference (DDP's first repeat, else the first peer that ran,
    else the first variant), whose name it returns (None when no variant ran)."""
    ran = [v for v, r in rows.items() if "r0" in r]
    if not ran:
        return None
    peers = [v for v in ran if not v.startswith("zero3")]  # fp32 always; a zero3 row may carry --zero3-extra
    ref_name = "ddp" if "ddp" in ran else (peers[0] if peers else ran[0])
    ref = rows[ref_name]["r0"]["losses"]
    for v in ran:
        diffs = [abs(a - b) / max(abs(b), 1e-30) for rep in runs[v] for a, b in zip(rep[0]["losses"], ref)]
        ok = bool(diffs) and all(d <= LOSS_RTOL for d in diffs)  # NaN compares False: not the same
        rows[v]["same"] = ok
        rows[v]["loss_rel"] = max(diffs) if diffs and all(d == d for d in diffs) else float("nan")
    return ref_name


def goals(results: dict[str, dict[str, dict]]) -> str:
    """Issue 13's goals, read off this run: every zero3 variant's median step against FSDP2's and DDP's."""
    lines = ["| model | batch/rank | variant | median step (s) | vs FSDP2 | vs FSDP2 without reshard | vs DDP | "
             "peak RSS/rank vs FSDP2 | vs FSDP2 without reshard |",
             "|---|---:|---|---:|---:|---:|---:|---:|---:|"]
    excluded: list[str] = []
    for model, rows in results.items():
        fsdp, keep, ddp = rows.get("fsdp2", {}), rows.get("fsdp2-noreshard", {}), rows.get("ddp", {})
        for variant, row in rows.items():
            if not variant.startswith("zero3") or "median" not in row:
                continue
            if not row["same"]:
                excluded.append(f"{model}: {label(variant)}")
                continue

            def vs(other: dict, key: str = "median") -> str:
                if other and not other.get("same", True):
                    return "excluded (its loss differs)"
                mine, theirs = row.get(key), other.get(key)
                return f"{mine / theirs:.2f}x" if mine is not None and theirs is not None else "n/a"

            lines.append(f"| {model} | {row['batch']} | {label(variant)} | {row['median']:.3f} | {vs(fsdp)} | "
                         f"{vs(keep)} | {vs(ddp)} | {vs(fsdp, 'maxrss')} | {vs(keep, 'maxrss')} |")
    for model, rows in results.items():  # issue 9's goal: the checks cost at most 3% of the step
        on, off = rows.get("zero3", {}), rows.get("zero3-noverify", {})
        if "median" in on and "median" in off and on["same"] and off["same"]:
            lines.append(f"\n{model}: verification on / off (default config) = {on['median'] / off['median']:.3f}x "
                         f"({on['median']:.3f} s / {off['median']:.3f} s)")
    if excluded:
        lines.append(f"\nLeft out (loss not within {LOSS_RTOL:g} relative of the reference's): " + "; ".join(excluded))
    return "\n".join(lines)


def main() -> None:
    global LOSS_RTOL
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="smoke run: small model, 1 repeat, few steps (defaults only: "
                    "--steps, --n-layer, ... given on the command line win)")
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--steps", type=int, default=20, help="measured steps per run")
    ap.add_argument("--memory-steps", type=int, default=3,
                    help="steps of each variant's memory pass (its own run, MALLOC_MMAP_THRESHOLD_ set)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=3, help="runs per variant; order reversed on odd repeats")
    ap.add_argument("--batch", default="4", metavar="N|MODEL=N,...",
                    help="sequences per rank: one number, or per --models preset (e.g. small=4,big=1: issue "
                         "21's table), 4 for a preset not named")
    ap.add_argument("--block", type=int, default=128)
    ap.add_argument("--n-layer", type=int, default=4)
    ap.add_argument("--n-head", type=int, default=4)
    ap.add_argument("--n-embd", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--persistence", type=int, default=0, help="zero3 param_persistence_threshold (elements)")
    ap.add_argument("--zero3-extra", default="", metavar="JSON",
                    help='extra zero3 config merged into every zero3 variant, e.g. \'{"reduce_bucket_size": 1000000}\'')
    ap.add_argument("--loss-rtol", type=float, default=LOSS_RTOL,
                    help="relative loss difference from the reference that still counts as the same result "
                         "(default %(default)g, fp32; about 1e-2 for a --zero3-extra in bf16)")
    ap.add_argument("--models", default="", metavar="LIST",
                    help=f"comma list of presets from {sorted(MODELS)} (overriding --n-layer/--n-embd/--n-head/"
                         "--vocab), each measured in turn, then a side-by-side table of the goals")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--variants", default=",".join(VARIANTS + EXTRA_VARIANTS),
                    help=f"comma list from {VARIANTS + EXTRA_VARIANTS}")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds per variant run before it is killed")
    ap.add_argument("--json", help="also write the raw per-rank results here")
    ap.add_argument("--baseline", metavar="DIR",
                    help="a source tree holding another zero3/ (e.g. a git worktree of an older commit): every "
                         "zero3 variant also runs with it, labelled [baseline], interleaved in the same run")
    # --quick's preset gives defaults; a flag given on the command line wins over it.
    if ap.parse_known_args()[0].quick:
        ap.set_defaults(**QUICK)
    args = ap.parse_args()
    LOSS_RTOL = args.loss_rtol
    try:
        batches = _batches(args.batch)
    except ValueError as exc:
        ap.error(str(exc))
    args.batch = batches.get("", 4)
    variants = [v for v in args.variants.split(",") if v]
    for v in variants:
        if v not in LABELS:
            ap.error(f"unknown variant {v!r}")
    if args.baseline:
        if not os.path.isfile(os.path.join(args.baseline, "zero3", "__init__.py")):
            ap.error(f"--baseline {args.baseline!r} holds no zero3/__init__.py")
        variants = [w for v in variants for w in ((v, v + "@baseline") if v.startswith("zero3") else (v,))]
    # Timed ranks run under glibc's defaults; `launch` sets this for the memory pass's ranks only.
    args.mmap_threshold = os.environ.pop("MALLOC_MMAP_THRESHOLD_", MMAP_THRESHOLD)
    models = [m for m in args.models.split(",") if m] if args.models else []
    for m in models:
        if m not in MODELS:
            ap.error(f"unknown model {m!r}; --models takes a comma list of {sorted(MODELS)}")
    for m in batches:
        if m and m not in models:
            ap.error(f"--batch names {m!r}, which is not in --models {args.models!r}")
    results = {}
    for model in models or [None]:
        margs = argparse.Namespace(**{**vars(args), **MODELS.get(model, {})})
        margs.batch = batches.get(model or "", args.batch)
        if model:
            print(f"\n## model {model}", flush=True)
        text, rows = measure(variants, margs)
        print(text, flush=True)
        results[model or f"{margs.n_layer}x{margs.n_embd}"] = rows
    print("\n## Side by side (issue 13's goals: zero3 <= 0.9x FSDP2 on both models, <= 1.3x DDP on the big one; "
          "peak memory no worse)\n", flush=True)
    print(goals(results), flush=True)


def _batches(text: str) -> dict[str, int]:
    """``--batch``: "4" -> {"": 4}; "small=4,big=1" -> {"small": 4, "big": 1}."""
    out: dict[str, int] = {}
    for part in (p.strip() for p in text.split(",") if p.strip()):
        name, _, value = part.rpartition("=")
        if not value.isdigit() or int(value) < 1:
            raise ValueError(f"--batch {text!r}: {part!r} is not N or MODEL=N with N a positive integer")
        out[name] = int(value)
    return out


def measure(variants: list[str], args: argparse.Namespace) -> tuple[str, dict]:
    """Run every variant ``args.repeats`` times (order reversed on odd repeats); the summary and its rows."""
    import torch

    t_start = time.monotonic()
    print(f"# bench_step  {datetime.datetime.now().isoformat(timespec='seconds')}  torch {torch.__version__}  "
          f"python {platform.python_version()}  {os.cpu_count()} CPUs  {args.nproc} gloo ranks x "
          f"{max(1, (os.cpu_count() or 1) // args.nproc)} threads  timed: glibc's default allocator; memory "
          f"pass: MALLOC_MMAP_THRESHOLD_={args.mmap_threshold}, {args.memory_steps} steps", flush=True)
    print(f"# GPT n_layer={args.n_layer} n_embd={args.n_embd} n_head={args.n_head} block={args.block} "
          f"vocab={args.vocab}; batch {args.batch}/rank; AdamW lr {args.lr}; {args.warmup} warm-up + "
          f"{args.steps} measured steps; {args.repeats} repeat(s)", flush=True)
    runs: dict[str, list[list[dict]]] = {v: [] for v in variants}
    for rep in range(args.repeats):
        order = variants if rep % 2 == 0 else list(reversed(variants))
        for v in order:
            t0 = time.monotonic()
            res = launch(v, args)
            err = next((r["error"] for r in res if "error" in r), None)
            exit_err = next((r["exit_error"] for r in res if "exit_error" in r), None)
            if exit_err:
                print(f"  repeat {rep} {v}: figures complete, but a rank died at exit: {exit_err}", flush=True)
            med = statistics.median(res[0]["times"]) if err is None and res else float("nan")
            print(f"  repeat {rep} {v:<24} {'FAILED ' + err if err else f'median {med:.3f} s'}  "
                  f"({time.monotonic() - t0:.0f} s wall)", flush=True)
            runs[v].append(res)
    mem: dict[str, list[dict]] = {}
    for v in variants:
        t0 = time.monotonic()
        mem[v] = launch(v, args, memory=True)
        err = next((r["error"] for r in mem[v] if "error" in r), None)
        peak = max((r["maxrss_steps"] for r in mem[v] if "maxrss_steps" in r), default=None)
        print(f"  memory {v:<25} {'FAILED ' + err if err else f'peak RSS {fmt_mib(peak)} MiB'}  "
              f"({time.monotonic() - t0:.0f} s wall)", flush=True)
    print(f"# total {time.monotonic() - t_start:.0f} s\n", flush=True)
    if args.json:
        path = args.json if not args.models else f"{os.path.splitext(args.json)[0]}-{args.n_layer}x{args.n_embd}.json"
        with open(path, "w") as fh:
            json.dump({"args": vars(args), "runs": runs, "memory": mem}, fh, indent=1)
    return summarise(runs, mem, args)


if __name__ == "__main__":
    main()
