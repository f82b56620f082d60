"""Resident memory after each phase of a step (forward, backward, optimizer step): where the peak
RSS of zero3 and FSDP2 comes from, on the 86.7M GPT of bench_step.py, 2 gloo ranks.

    python benchmarks/bench_phases.py                    # zero3 lean and FSDP2, 3 steps each
    python benchmarks/bench_phases.py --batch 1

Each system runs in a fresh pair of rank processes started with ``MALLOC_MMAP_THRESHOLD_=131072``
(so freed tensors leave RSS, as in bench_step.py's memory pass). Rank 0 prints, per phase, its RSS
then and its peak so far (``ru_maxrss``). "zero3 lean" is bench_step.py's: 3 Blocks live at most,
reuse distance 0, prefetch 1 Block, persistence threshold 0; FSDP2 is ``fully_shard`` per Block with
``reshard_after_forward=True`` and on the root with torch's default (the root keeps its parameters). Figures are printed, never asserted.
"""

from __future__ import annotations

import argparse
import datetime
import os
import resource
import socket
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples"))
sys.path.insert(0, ROOT)


def _rss_mib() -> float:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


class _NoStep:
    """Stands for the optimizer when each parameter steps in its post-accumulate-grad hook."""

    def step(self) -> None:
        pass

    def zero_grad(self, set_to_none: bool = True) -> None:
        pass


def _per_param_step_in_backward(model, make_optimizer) -> _NoStep:
    optimizers = {p: make_optimizer([p]) for p in model.parameters()}

    def _step(param) -> None:
        optimizers[param].step()
        optimizers[param].zero_grad(set_to_none=True)

    for p in model.parameters():
        p.register_post_accumulate_grad_hook(_step)
    return _NoStep()


def _rank(rank: int, world: int, port: int, system: str, args: argparse.Namespace) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    import torch
    import torch.distributed as dist

    from gpt import GPT, GPTConfig, synthetic_batch

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=300))
    cfg = GPTConfig(n_layer=12, n_embd=768, n_head=12, vocab_size=2048, block_size=128)
    blk = 12 * 768 * 768 + 13 * 768
    torch.manual_seed(0)
    engine = None
    if system.startswith("zero3"):
        import zero3

        with zero3.Init():
            model = GPT(cfg)
        config = {"param_persistence_threshold": 0, "prefetch_bucket_size": blk,
                  "max_reuse_distance": 0, "max_live_parameters": 3 * blk}
        if system == "zero3-bwd":  # bench_step.py's zero3-prefetch-bwd
            config.update(offload_optimizer={"device": "none", "step_in_backward": True},
                          sub_group_size=blk // world)
        engine = zero3.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-3), config)
    else:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,))
        model = GPT(cfg)
        for block in model.h:
            fully_shard(block, mesh=mesh, reshard_after_forward=True)
        fully_shard(model, mesh=mesh)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        if system == "fsdp2-bwd":  # torch's optimizer-in-backward pattern: one AdamW per parameter
            opt = _per_param_step_in_backward(model, lambda ps: torch.optim.AdamW(ps, lr=1e-3))
    rows = [("built", _rss_mib(), _peak_mib())]
    b = args.batch
    for step in range(args.steps):
        x, y = synthetic_batch(step, b * world, cfg, seed=0)
        x, y = x[rank * b:(rank + 1) * b], y[rank * b:(rank + 1) * b]
        if engine is not None:
            loss = engine(x, y)
            rows.append((f"step {step} forward", _rss_mib(), _peak_mib()))
            engine.backward(loss)
            rows.append((f"step {step} backward", _rss_mib(), _peak_mib()))
            engine.step()
        else:
            loss = model(x, y)
            rows.append((f"step {step} forward", _rss_mib(), _peak_mib()))
            loss.backward()
            rows.append((f"step {step} backward", _rss_mib(), _peak_mib()))
            opt.step()
            opt.zero_grad(set_to_none=True)
        rows.append((f"step {step} optimizer", _rss_mib(), _peak_mib()))
    if rank == 0:
        print(f"\n{system}, batch {b}/rank: | after | RSS (MiB) | peak so far (MiB) |")
        for name, now, peak in rows:
            print(f"| {name} | {now:.0f} | {peak:.0f} |")
    if engine is not None:
        engine.remove_hooks()
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--systems", default="zero3,fsdp2", help="comma list of: zero3, zero3-bwd, fsdp2, fsdp2-bwd")
    ap.add_argument("--batch", type=int, default=4, help="sequences of 128 tokens per rank")
    ap.add_argument("--steps", type=int, default=3)
    args = ap.parse_args()
    import torch.multiprocessing as mp

    os.environ["MALLOC_MMAP_THRESHOLD_"] = "131072"  # read by glibc when the ranks start
    for system in args.systems.split(","):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        mp.start_processes(_rank, args=(2, port, system, args), nprocs=2, start_method="spawn")


if __name__ == "__main__":
    main()
