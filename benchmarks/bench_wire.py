"""ZeRO++ on the wire: loss curves of the example GPT and step time of an 86.7M GPT with hpZ, qwZ, qgZ.

    python benchmarks/bench_wire.py curves                     # 5 options x 200 steps, ~11 min: split it
    python benchmarks/bench_wire.py curves --variants exact,hpz,qwz        # ~6.5 min
    python benchmarks/bench_wire.py curves --variants qgz,all              # ~4.5 min
    python benchmarks/bench_wire.py step-time                  # 86.7M GPT, 2 ranks: exact, qwZ, qgZ, both
    python benchmarks/bench_wire.py step-time --nodes 2 --variants exact,hpz,all   # 2 nodes x 2 ranks
    python benchmarks/bench_wire.py plot                       # redraw the figure from the saved curves

Every run starts its ranks with torchrun, one agent per node, all agents on this machine meeting at a
c10d rendezvous on 127.0.0.1 (two agents stand for two nodes: zero3 tells them apart by torchrun's
GROUP_RANK). Each variant gets a fresh launch.

``curves``: examples/train_gpt.py (its default 0.83M-parameter GPT, AdamW, clipping) for ``--steps``
steps on 2 nodes x 2 ranks, once per option: exact (fp32 on the wire), hpZ (``--hpz -1``), qwZ,
qgZ (int8), and all three. The losses (mean over ranks, every step) are merged into
docs/multinode_loss.json, drawn into docs/multinode_loss.png (loss curves, and each option's loss
relative to exact's, 10-step means) and tabled with the last step's received bytes by kind and node.
The example trains on this repository's text, so saved curves of another corpus (the repository
changed between the parts of a run) are dropped, not mixed.

``step-time``: the 86.7M GPT (12 layers x 768, vocab 2048, block 128: 86,727,168 parameters) for
``--warmup`` + ``--steps`` steps per option (its steps take seconds on 2 cores: keep them few), on
``--nodes`` x ``--nproc-per-node`` ranks; budgets as bench_step.py's (prefetch one Block, at most
three Blocks live, nothing kept for reuse). A step is timed on every rank after a barrier; the
table shows the slowest rank's median, zero3's breakdown and the bytes received per rank. hpZ needs
two nodes of at least two ranks each (one node has nothing to keep apart), so it has its own run.

Figures are printed, never asserted. On one machine every "inter-node" byte goes over loopback like
the others, so fewer bytes show up as less copying, not as a faster network.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples"))

CURVES_JSON = os.path.join(ROOT, "docs", "multinode_loss.json")
CURVES_PNG = os.path.join(ROOT, "docs", "multinode_loss.png")
OPTIONS = {  # name: (example flags, config keys)
    "exact": ([], {}),
    "hpz": (["--hpz", "-1"], {"zero_hpz_partition_size": -1}),
    "qwz": (["--qwz"], {"zero_quantized_weights": True}),
    "qgz": (["--qgz"], {"zero_quantized_gradients": True}),
    "qwz+qgz": (["--qwz", "--qgz"], {"zero_quantized_weights": True, "zero_quantized_gradients": True}),
    "all": (["--hpz", "-1", "--qwz", "--qgz"], {"zero_hpz_partition_size": -1, "zero_quantized_weights": True,
                                                "zero_quantized_gradients": True}),
}
LABELS = {"exact": "exact", "hpz": "hpZ", "qwz": "qwZ", "qgz": "qgZ", "qwz+qgz": "qwZ+qgZ", "all": "hpZ+qwZ+qgZ"}
COLORS = {"exact": "black", "hpz": "tab:red", "qwz": "tab:blue", "qgz": "tab:green", "qwz+qgz": "tab:purple",
          "all": "tab:orange"}
KINDS = ("all-gather", "secondary all-gather", "gradient reduction")


# ------------------------------------------------------------------------------------------------
# launching


def torchrun(nodes: int, nproc: int, args: list[str], log_dir: str, timeout: float) -> None:
    """Run ``args`` (a script and its arguments) under ``nodes`` torchrun agents of ``nproc`` ranks."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    procs, logs = [], []
    for node in range(nodes):
        path = os.path.join(log_dir, f"agent{node}.log")
        logs.append(open(path, "w"))
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(nodes), "--nproc-per-node", str(nproc),
             "--node-rank", str(node), "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", *args],
            cwd=ROOT, env=env, stdout=logs[-1], stderr=subprocess.STDOUT, start_new_session=True))
    try:
        for p in procs:
            p.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        for p in procs:
            os.killpg(p.pid, signal.SIGKILL)
        raise
    finally:
        for log in logs:
            log.close()
    for node, p in enumerate(procs):
        if p.returncode != 0:
            with open(os.path.join(log_dir, f"agent{node}.log")) as fh:
                raise RuntimeError(f"torchrun agent {node} exited with {p.returncode}:\n{fh.read()[-4000:]}")


# ------------------------------------------------------------------------------------------------
# curves


def run_curves(args: argparse.Namespace) -> None:
    _pyplot()  # the runs end in a figure: know before minutes of training that it can be drawn
    saved = _load_curves()
    for name in args.variants:
        with tempfile.TemporaryDirectory(prefix="zero3-wire-") as tmp:
            out = os.path.join(tmp, "run.json")
            t0 = time.perf_counter()
            torchrun(2, 2, [os.path.join(ROOT, "examples", "train_gpt.py"), "--steps", str(args.steps),
                            "--log-json", out, *OPTIONS[name][0]], tmp, timeout=args.timeout)
            with open(out) as fh:
                run = json.load(fh)
        run["launch_seconds"] = time.perf_counter() - t0
        stale = [n for n, r in saved.items() if r.get("corpus") != run["corpus"]]
        if stale:  # trained on other text (the repository changed since): not comparable
            print(f"dropping saved curves {stale}: they were trained on another version of the corpus", flush=True)
            for n in stale:
                del saved[n]
        saved[name] = run
        print(f"{LABELS[name]}: {args.steps} steps in {run['seconds']:.0f} s (launch {run['launch_seconds']:.0f} s), "
              f"last loss {run['losses'][-1]:.4f}", flush=True)
        with open(CURVES_JSON, "w") as fh:
            json.dump(saved, fh)
    plot(saved)


def _load_curves() -> dict[str, Any]:
    if os.path.exists(CURVES_JSON):
        with open(CURVES_JSON) as fh:
            return json.load(fh)
    return {}


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)


def _pyplot() -> Any:
    """matplotlib's pyplot on the file-only Agg backend; a clear exit when matplotlib is missing."""
    try:
        import matplotlib
    except ImportError:
        raise SystemExit("drawing docs/multinode_loss.png needs matplotlib: pip install -e '.[plot]' "
                         "(or pip install matplotlib)") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot(saved: dict[str, Any]) -> None:
    """Draw docs/multinode_loss.png and print the table of the saved curves."""
    plt = _pyplot()
    names = [n for n in OPTIONS if n in saved]
    if not names:
        raise SystemExit(f"no curves in {CURVES_JSON}: run `bench_wire.py curves` first")
    steps = len(saved[names[0]]["losses"])
    lo = min(min(saved[n]["losses"]) for n in names)
    hi = max(max(saved[n]["losses"]) for n in names)
    fig, (curves, rel) = plt.subplots(1, 2, figsize=(11, 4), layout="constrained")
    relative = {}
    for n in names:
        losses = saved[n]["losses"]
        curves.plot(range(steps), losses, color=COLORS[n], linewidth=0.8, label=LABELS[n])
        if n != "exact" and "exact" in saved:
            exact = saved["exact"]["losses"]
            relative[n] = [100 * (_mean(losses[i - 9: i + 1]) / _mean(exact[i - 9: i + 1]) - 1) for i in range(9, steps)]
    # The y range covers the last three quarters of the run; early loss spikes are clipped (left panel).
    bound = max([1.0] + [math.ceil(abs(y)) for ys in relative.values() for y in ys[steps // 4:]])
    for n, ys in relative.items():
        rel.plot(range(9, steps), ys, color=COLORS[n], linewidth=0.8, label=LABELS[n])
    curves.set(title="loss (mean over 4 ranks), example GPT, 2 nodes x 2 ranks", xlabel="step", ylabel="loss",
               xlim=(0, steps - 1), ylim=(float(int(lo)), float(int(hi) + 1)))
    rel.set(title=f"loss / exact loss - 1, 10-step means, clipped at ±{bound:g}%", xlabel="step",
            ylabel="%", xlim=(0, steps - 1), ylim=(-bound, bound))
    for ax in (curves, rel):
        ax.grid(color="0.9")
        ax.legend(frameon=False)
        ax.title.set_fontsize(10)
    fig.savefig(CURVES_PNG, dpi=100)
    plt.close(fig)
    print(f"\nwrote {os.path.relpath(CURVES_PNG, ROOT)}\n")
    print("| option | last loss | mean of last 10 | vs exact (last / last 10) | all-gather intra / inter | "
          "secondary all-gather intra / inter | gradient reduction intra / inter | peak secondary | train s |")
    print("|---|---|---|---|---|---|---|---|---|")
    exact = saved.get("exact")
    for n in names:
        r = saved[n]
        last, last10 = r["losses"][-1], _mean(r["losses"][-10:])
        vs = "" if exact is None or n == "exact" else \
            f"{100 * (last / exact['losses'][-1] - 1):+.2f}% / {100 * (last10 / _mean(exact['losses'][-10:]) - 1):+.2f}%"
        cells = [" / ".join(f"{r['recv_bytes'].get(k, {}).get(s, 0):,}" for s in ("intra", "inter")) for k in KINDS]
        print(f"| {LABELS[n]} | {last:.4f} | {last10:.4f} | {vs} | {' | '.join(cells)} | "
              f"{r['peak_secondary_bytes']:,} | {r['seconds']:.0f} |")
    print("\nbytes: received by rank 0 in the last step (its forward, backward and optimizer step)")


# ------------------------------------------------------------------------------------------------
# step time (the ranks run `worker`)


def run_step_time(args: argparse.Namespace) -> None:
    results = {}
    for name in args.variants:
        with tempfile.TemporaryDirectory(prefix="zero3-wire-") as tmp:
            out = os.path.join(tmp, "steps.json")
            t0 = time.perf_counter()
            torchrun(args.nodes, args.nproc_per_node,
                     [os.path.abspath(__file__), "worker", "--variant", name, "--json", out, "--steps", str(args.steps),
                      "--warmup", str(args.warmup), "--n-layer", str(args.n_layer), "--n-embd", str(args.n_embd),
                      "--vocab", str(args.vocab), "--block", str(args.block), "--batch", str(args.batch)],
                     tmp, timeout=args.timeout)
            with open(out) as fh:
                results[name] = json.load(fh)
        print(f"{LABELS[name]}: done in {time.perf_counter() - t0:.0f} s", flush=True)
    first = results[args.variants[0]]
    print(f"\nGPT {first['n_params']:,} parameters ({args.n_layer} x {args.n_embd}, vocab {args.vocab}, block "
          f"{args.block}), batch {args.batch} per rank, {first['world']} ranks on {first['nodes']} node(s); "
          f"{args.warmup} warm-up + {args.steps} measured steps per option\n")
    print("| option | step s (median, slowest rank) | steps s | forward | backward | gather wait | reduce wait "
          "| optimizer | all-gather MB intra / inter | secondary MB intra / inter | grad MB intra / inter "
          "| peak secondary MB |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for name, r in results.items():
        t = r["timers"]
        mb = [" / ".join(f"{r['recv_bytes'].get(k, {}).get(s, 0) / 1e6:.1f}" for s in ("intra", "inter"))
              for k in KINDS]
        print(f"| {LABELS[name]} | {statistics.median(r['step_seconds']):.2f} | "
              f"{', '.join(f'{s:.2f}' for s in r['step_seconds'])} | {t['forward_seconds']:.2f} | "
              f"{t['backward_seconds']:.2f} | {t['wait_seconds']:.2f} | {t['reduce_wait_seconds']:.2f} | "
              f"{t['optimizer_seconds']:.2f} | {' | '.join(mb)} | {r['peak_secondary_bytes'] / 1e6:.1f} |")
    print("\ntimers and bytes: rank 0's last measured step (engine.last_step_metrics)")


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    import zero3
    from gpt import GPT, GPTConfig, synthetic_batch

    # Every agent of a benchmark runs on this machine: its cores are shared by all the ranks.
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ["WORLD_SIZE"])))
    dist.init_process_group("gloo")
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        cfg = GPTConfig(vocab_size=args.vocab, block_size=args.block, n_layer=args.n_layer, n_head=12,
                        n_embd=args.n_embd)
        torch.manual_seed(0)
        with zero3.Init():
            model = GPT(cfg)
        blk = 12 * args.n_embd ** 2 + 13 * args.n_embd
        config = {"param_persistence_threshold": 0, "prefetch_bucket_size": blk, "max_reuse_distance": 0,
                  "max_live_parameters": 3 * blk, **OPTIONS[args.variant][1]}
        engine = zero3.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-4), config)
        seconds = []
        for step in range(args.warmup + args.steps):
            x, y = synthetic_batch(step * world + rank, args.batch, cfg)
            dist.barrier()
            t0 = time.perf_counter()
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            elapsed = torch.tensor([time.perf_counter() - t0])
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            if step >= args.warmup:
                seconds.append(elapsed.item())
        m = engine.last_step_metrics
        if rank == 0:
            timers = {k: getattr(m, k) for k in ("forward_seconds", "backward_seconds", "wait_seconds",
                                                 "reduce_wait_seconds", "optimizer_seconds")}
            with open(args.json, "w") as fh:
                json.dump({"step_seconds": seconds, "timers": timers, "recv_bytes": m.recv_bytes,
                           "peak_secondary_bytes": m.peak_secondary_bytes, "world": world,
                           "nodes": len(set(engine.comm.nodes)), "n_params": sum(p.ds_numel for p in engine.params),
                           "memory": engine.memory_report()}, fh)
    finally:
        dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("curves", help="example GPT loss curves per option, 2 nodes x 2 ranks")
    c.add_argument("--variants", default="exact,hpz,qwz,qgz,all")
    c.add_argument("--steps", type=int, default=200)
    c.add_argument("--timeout", type=float, default=900)
    sub.add_parser("plot", help="redraw docs/multinode_loss.png and the table from docs/multinode_loss.json")
    for name in ("step-time", "worker"):
        s = sub.add_parser(name, help="step time of the 86.7M GPT per option" if name == "step-time" else
                           "(internal) one rank of a step-time run, started by torchrun")
        s.add_argument("--steps", type=int, default=3)
        s.add_argument("--warmup", type=int, default=1)
        s.add_argument("--n-layer", type=int, default=12)
        s.add_argument("--n-embd", type=int, default=768)
        s.add_argument("--vocab", type=int, default=2048)
        s.add_argument("--block", type=int, default=128)
        s.add_argument("--batch", type=int, default=2, help="sequences per rank")
    st = sub.choices["step-time"]
    st.add_argument("--variants", default="exact,qwz,qgz,qwz+qgz")
    st.add_argument("--nodes", type=int, default=1)
    st.add_argument("--nproc-per-node", type=int, default=2)
    st.add_argument("--timeout", type=float, default=900)
    w = sub.choices["worker"]
    w.add_argument("--variant", required=True, choices=sorted(OPTIONS))
    w.add_argument("--json", required=True)
    args = ap.parse_args()
    if args.cmd == "worker":
        worker(args)
        return
    if args.cmd == "plot":
        plot(_load_curves())
        return
    args.variants = args.variants.split(",")
    unknown = [v for v in args.variants if v not in OPTIONS]
    if unknown:
        raise SystemExit(f"unknown variants {unknown}; choose from {sorted(OPTIONS)}")
    run_curves(args) if args.cmd == "curves" else run_step_time(args)


if __name__ == "__main__":
    main()
