"""Greedy decoding on 2 gloo ranks: plain eval forwards against ``engine.generation()``.

    python benchmarks/bench_generation.py            # 64 tokens, the example GPT widened to 4 x 256
    python benchmarks/bench_generation.py --tokens 16 --n-embd 128
    python benchmarks/bench_generation.py --repeat 5   # every variant 5 times, interleaved: medians
    python benchmarks/bench_generation.py --gather p2p # gathers on the wire, as across nodes

Every rank decodes the same prompt (the example GPT of examples/gpt.py, every parameter partitioned:
``param_persistence_threshold`` 0). Variants, in one run: plain eval forwards (zero3's ordinary
forwards, not in generation mode: each follows the step's recorded trace and gathers every weight
again) at the default live budget and at half the model, ``engine.generation()`` with the live
budget at the whole model, and with it at half the model, with and without prefetch (only what does
not fit is gathered again, along the planned decode cycle). Tokens per second is the slower rank's, the median over
``--repeat`` interleaved rounds (the machine may be shared: compare within a run); the decoded
tokens are compared with the same model run plainly in one process, on every rank: greedy decoding
in fp32 must give exactly the same tokens, and a row that does not (on any rank or repeat) did other
work, so its ratios print as "excluded" (and a reference row that does not voids the ratios to it). A last row decodes with that
model itself, no zero3 at all (every rank holds it whole): the ceiling for a mode that gathers
nothing per token. Figures are printed, never asserted.
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import os
import socket
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))


UNWRAPPED = "torch without zero3 (the whole model on each rank)"


def _decode(model, tokens: int, block: int) -> torch.Tensor:
    x = torch.zeros(1, 1, dtype=torch.long)
    with torch.no_grad():
        for _ in range(tokens):
            logits = model(x[:, -block:])
            x = torch.cat([x, logits[:, -1].argmax(-1, keepdim=True)], 1)
    return x


def _rank(rank: int, world: int, port: int, args: argparse.Namespace) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=600))
    import zero3
    from gpt import GPT, GPTConfig

    cfg = GPTConfig(block_size=args.tokens + 1, n_layer=args.n_layer, n_embd=args.n_embd, n_head=args.n_head)
    torch.manual_seed(0)
    want = _decode(GPT(cfg).eval(), args.tokens, cfg.block_size)
    variants = (("plain eval forwards", None, False, True), ("plain eval forwards, budget = half the model", 0.5, False, True),
                ("generation(), budget = model", None, True, True),
                ("generation(), budget = half the model", 0.5, True, True),
                ("generation(), budget = half the model, no prefetch", 0.5, True, False),
                (UNWRAPPED, None, False, False))
    runs: dict[str, list[tuple[float, float, bool]]] = {name: [] for name, *_ in variants}
    for _, (name, fraction, generation, prefetch) in itertools.product(range(args.repeat), variants):
        if name == UNWRAPPED:  # the ceiling: the same decode with no hook, no gather
            torch.manual_seed(0)
            model = GPT(cfg).eval()
            _decode(model, 2, cfg.block_size)
            dist.barrier()
            t0 = time.perf_counter()
            got = _decode(model, args.tokens, cfg.block_size)
            elapsed = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            runs[name].append((args.tokens / elapsed.item(), 0.0, torch.equal(got, want)))
            continue
        torch.manual_seed(0)
        with zero3.Init():
            model = GPT(cfg)
        model.eval()
        numel = sum(p.numel() for p in model.parameters())
        zcfg = {"param_persistence_threshold": 0, "max_reuse_distance": 0, "allgather_impl": args.gather}
        if not prefetch:
            zcfg["prefetch_bucket_size"] = 0
        if fraction is not None:
            zcfg["max_live_parameters"] = int(numel * fraction)
        engine = zero3.initialize(model, None, zcfg)
        _decode(engine, 2, cfg.block_size)  # warm-up: records the step's trace
        before = engine.metrics.allgather_numel
        dist.barrier()
        t0 = time.perf_counter()
        if generation:
            with engine.generation():
                got = _decode(engine, args.tokens, cfg.block_size)
        else:
            got = _decode(engine, args.tokens, cfg.block_size)
        elapsed = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        gathered = engine.metrics.allgather_numel - before
        runs[name].append((args.tokens / elapsed.item(), gathered / args.tokens / numel, torch.equal(got, want)))
        engine.remove_hooks()
    # A row's tokens are equal only if they are on every rank and in every repeat.
    equal = torch.tensor([all(r[2] for r in rs) for rs in runs.values()], dtype=torch.int32)
    dist.all_reduce(equal, op=dist.ReduceOp.MIN)
    rows = [(name, statistics.median(r[0] for r in rs), rs[0][1], bool(ok))
            for (name, rs), ok in zip(runs.items(), equal.tolist())]
    if rank == 0:
        print(f"# bench_generation  {datetime.datetime.now().isoformat(timespec='seconds')}  torch {torch.__version__}  "
              f"{world} gloo ranks x 1 thread; GPT n_layer={cfg.n_layer} n_embd={cfg.n_embd} ({numel:,} parameters), "
              f"greedy decode of {args.tokens} tokens, median of {args.repeat}; allgather_impl {args.gather}\n")
        ceiling, ceiling_ok = next((tps, ok) for name, tps, _, ok in rows if name == UNWRAPPED)
        plain_tps, plain_ok = rows[0][1], rows[0][3]

        def vs(tps: float, ok: bool, ref: float, ref_ok: bool) -> str:
            return f"{tps / ref:.2f}x" if ok and ref_ok else "excluded"

        print("| variant | tokens/s | vs plain | vs torch without zero3 | weights gathered per token (x model) | "
              "tokens equal the plain model's |")
        print("|---|---:|---:|---:|---:|---|")
        for name, tps, per_token, ok in rows:
            print(f"| {name} | {tps:.1f} | {vs(tps, ok, plain_tps, plain_ok)} | {vs(tps, ok, ceiling, ceiling_ok)} | "
                  f"{'—' if name == UNWRAPPED else f'{per_token:.2f}'} | {ok} |")
        print("\nTokens must equal the plain model's exactly (greedy, fp32), on every rank and repeat; a row "
              "where they do not is left out of the ratios (\"excluded\").")
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--n-layer", type=int, default=4)
    ap.add_argument("--n-embd", type=int, default=256)
    ap.add_argument("--n-head", type=int, default=4)
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--gather", default="auto", choices=("auto", "all_gather", "p2p", "shm"),
                    help="zero3's allgather_impl (auto: shared memory on one node under gloo)")
    args = ap.parse_args()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    mp.spawn(_rank, args=(2, port, args), nprocs=2)


if __name__ == "__main__":
    main()
