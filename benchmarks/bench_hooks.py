"""Hook overhead of zero3 at world size 1 (no process group), on models made of many small modules.

    python benchmarks/bench_hooks.py           # full run, under a minute
    python benchmarks/bench_hooks.py --quick   # a few seconds

For each model, the plain model and zero3 copies of it are built from the same seed in this one
process and timed *interleaved* (round after round, each variant K steps per round, the order rotated
every round), so drift on a noisy machine hits every variant alike. A step is forward + backward +
AdamW step (+ zero_grad); its phases are timed too. The overhead per module call is
``(median zero3 step - median plain step) / module calls per step``, where a module call is one
forward invocation of a module (counted with a forward pre-hook on the plain model; containers
that are never called, like ``nn.ModuleList``, do not count).

zero3 variants (``zero3.initialize`` on the plain-built model; world size 1, so a "gather" is a local
copy from the shard):
- default config: what a user gets (parameters under 1e5 elements persistent). On the three models
  here every parameter is under 1e5 elements, so this is the same setup as "persist all" (0
  all-gathers per step; the script says so under the table): judge the gathering cost by the
  "threshold 0" rows.
- persist all: ``param_persistence_threshold`` = 10**9: every parameter stays gathered; what remains
  is the hooks' bookkeeping.
- threshold 0: every parameter is gathered and released by the schedule (other knobs at defaults,
  i.e. prefetch buckets of 5e7 elements and reuse distance 1e9).
- threshold 0, no prefetch/reuse: ``prefetch_bucket_size`` = 0 and ``max_reuse_distance`` = 0, so
  each module's parameters are gathered on demand and released right after it: the worst case.

With ``--floor``, one more row on the models that are a plain chain of modules (SimpleModel, the
Sequential): what torch itself charges for the mechanisms a ZeRO-3 at threshold 0 rests on, with
no zero3 code (`FloorHooks`). It is the lower bound of the "threshold 0" row for any design built
on these hooks.
"GC runs/step" counts the collections of Python's cyclic GC that started during a variant's timed
steps: objects a step keeps alive from forward to backward count toward its threshold (700).
Every variant trains the same model from the same seed on the same batch for the same number of
steps, so its loss after the last step must match the plain model's within ``LOSS_RTOL`` (fp32 at
world size 1: the same arithmetic but for summation order); a row that does not is marked in the
loss column and left out of the ratio and overhead columns, which would otherwise compare different
work. Figures are printed, never asserted.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import importlib
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from types import ModuleType
from typing import Callable

import torch
from torch import nn

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples"))

import zero3  # noqa: E402
from gpt import GPT, GPTConfig, synthetic_batch  # noqa: E402

ZERO3_VARIANTS = {
    "zero3, default config": {},
    "zero3, persist all": {"param_persistence_threshold": 10**9},
    "zero3, threshold 0": {"param_persistence_threshold": 0},
    "zero3, threshold 0, no prefetch/reuse": {"param_persistence_threshold": 0, "prefetch_bucket_size": 0,
                                               "max_reuse_distance": 0},
}


LOSS_RTOL = 1e-5
"""Relative difference from the plain model's last loss above which a row is flagged, not compared."""

CLOCKS = {"wall": time.perf_counter, "thread": time.thread_time}
"""``--clock``: "thread" counts this thread's CPU time only, so time spent descheduled on a shared
machine does not count (all the work a variant does still does)."""
clock = time.perf_counter


class Case:
    """A model factory plus a loss on a fixed input."""

    def __init__(self, name: str, build: Callable[[], nn.Module], batch: Callable[[], tuple],
                 loss: Callable[[nn.Module, tuple], torch.Tensor], chain: bool = False) -> None:
        self.name, self.build, self.batch, self.loss = name, build, batch, loss
        self.chain = chain  # a plain chain of modules, each called once on one tensor (`FloorHooks` fits)


def mlp_case(n: int, width: int, rows: int) -> Case:
    def build() -> nn.Module:
        layers: list[nn.Module] = []
        for _ in range(n):
            layers += [nn.Linear(width, width), nn.GELU()]
        return nn.Sequential(*layers)

    def batch() -> tuple:
        g = torch.Generator().manual_seed(0)
        return torch.randn(rows, width, generator=g), torch.randn(rows, width, generator=g)

    return Case(f"Sequential of {n} x (Linear({width},{width}) + GELU), input {rows}x{width}, MSE loss", build,
                batch, lambda m, b: (m(b[0]) - b[1]).pow(2).mean(), chain=True)


class SimpleModel(nn.Module):
    """DeepSpeed's unit-test model (``SimpleModel(hidden_dim, nlayers=78)`` in its ZeRO-3 tests): a stack
    of square Linear layers and a cross-entropy loss."""

    def __init__(self, hidden: int, nlayers: int) -> None:
        super().__init__()
        self.linears = nn.ModuleList([nn.Linear(hidden, hidden) for _ in range(nlayers)])
        self.loss = nn.CrossEntropyLoss()

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        for layer in self.linears:
            x = layer(x)
        return self.loss(x, y)


def simple_case(n: int, width: int, rows: int) -> Case:
    def batch() -> tuple:
        g = torch.Generator().manual_seed(0)
        return torch.randn(rows, width, generator=g), torch.randint(0, width, (rows,), generator=g)

    return Case(f"DeepSpeed's SimpleModel: {n} x Linear({width},{width}) + cross-entropy, input {rows}x{width}",
                lambda: SimpleModel(width, n), batch, lambda m, b: m(*b), chain=True)


def gpt_case(cfg: GPTConfig, rows: int) -> Case:
    def build() -> nn.Module:
        return GPT(cfg)

    def batch() -> tuple:
        return synthetic_batch(0, rows, cfg)

    return Case(f"GPT n_layer={cfg.n_layer} n_embd={cfg.n_embd} block={cfg.block_size} vocab={cfg.vocab_size}, "
                f"batch {rows}", build, batch, lambda m, b: m(*b))


def count_calls(model: nn.Module, case: Case, data: tuple) -> tuple[int, int, int]:
    """(module forward calls per step, modules, modules with own parameters)."""
    calls = [0]
    handles = [m.register_forward_pre_hook(lambda *a: calls.__setitem__(0, calls[0] + 1)) for m in model.modules()]
    with torch.no_grad():
        case.loss(model, data)
    for h in handles:
        h.remove()
    mods = list(model.modules())
    with_params = sum(1 for m in mods if any(True for _ in m.parameters(recurse=False)))
    return calls[0], len(mods), with_params


def load_baseline(tree: str) -> ModuleType:
    """Import ``tree/zero3`` as the package ``zero3_baseline`` (zero3 imports itself relatively, so a
    renamed copy runs side by side with the installed one in this process)."""
    src = os.path.join(tree, "zero3")
    if not os.path.isfile(os.path.join(src, "__init__.py")):
        raise SystemExit(f"--baseline {tree!r} holds no zero3/__init__.py")
    dst = os.path.join(tempfile.mkdtemp(prefix="zero3-baseline-"), "zero3_baseline")
    shutil.copytree(src, dst)
    sys.path.insert(0, os.path.dirname(dst))
    return importlib.import_module("zero3_baseline")


class FloorHooks:
    """The threshold-0 mechanisms without any bookkeeping, on a plain model: every parameter's data is
    a 0-byte storage between uses and its values live in a separate flat "shard"; a module's forward
    pre-hook refills its parameters' storage from the shards (resize + copy, what a world-size-1
    gather is); its forward hook puts a pre-hook on the output's autograd node (where a pre-backward would
    gather); each parameter's post-accumulate-grad hook hands its gradient to its shard and, once all
    of its module's parameters have theirs, frees them (the post-backward zero3 takes from the
    gradients, hooks.py [Note: post-backward from the gradients]); AdamW steps on the shards. No
    schedule, trace, status, counters or checks: a lower bound, not a runtime."""

    def __init__(self, model: nn.Module, lr: float) -> None:
        params = list(model.parameters())
        self.shards = {id(p): p.detach().clone().view(-1) for p in params}
        self.optimizer = torch.optim.AdamW([self.shards[id(p)] for p in params], lr=lr)
        self.own = {id(m): list(m.parameters(recurse=False)) for m in model.modules()}
        self.owner: dict[int, nn.Module] = {}
        self.arrived: dict[int, set[int]] = {}
        for m in model.modules():
            if self.own[id(m)]:
                self.free(m)
                self.arrived[id(m)] = set()
                for p in self.own[id(m)]:
                    self.owner[id(p)] = m
                m.register_forward_pre_hook(self._pre_forward, prepend=True, with_kwargs=True)
                m.register_forward_hook(self._post_forward, with_kwargs=True, always_call=True)
        for p in params:
            p.register_post_accumulate_grad_hook(self._on_grad)

    def free(self, module: nn.Module) -> None:
        for p in self.own[id(module)]:
            p.untyped_storage().resize_(0)

    def _pre_forward(self, module: nn.Module, args: tuple, kwargs: dict):
        for p in self.own[id(module)]:
            if p.untyped_storage().nbytes() == 0:
                p.untyped_storage().resize_(p.numel() * p.element_size())
                p.data.view(-1).copy_(self.shards[id(p)])
        return None

    def _post_forward(self, module: nn.Module, args: tuple, kwargs: dict, output):
        if torch.is_grad_enabled() and isinstance(output, torch.Tensor) and output.requires_grad:
            if output.grad_fn is not None:  # the cheaper of the two, as zero3's `_on_backward_entry`
                output.grad_fn.register_prehook(_ignore)
            else:
                output.register_hook(_ignore)
        return None

    def _on_grad(self, p: torch.Tensor) -> None:
        grad, p.grad = p.grad, None
        shard = self.shards[id(p)]
        if shard.grad is None:
            shard.grad = grad.reshape(-1)
        else:
            shard.grad.add_(grad.reshape(-1))
        m = self.owner[id(p)]
        arrived = self.arrived[id(m)]
        arrived.add(id(p))
        if len(arrived) == len(self.own[id(m)]):
            arrived.clear()
            self.free(m)


def _ignore(grad: torch.Tensor) -> None:
    return None


_GC_RUNS = [0]  # collections of Python's cyclic GC, counted by the callback below (any generation)


def _count_gc(phase: str, info: dict) -> None:
    if phase == "start":
        _GC_RUNS[0] += 1


gc.callbacks.append(_count_gc)


class Runner:
    def __init__(self, name: str, case: Case, zero_cfg: dict | None, lr: float, lib: ModuleType = zero3,
                 floor: bool = False) -> None:
        torch.manual_seed(0)
        model = case.build()
        self.name = name
        self.data = case.batch()
        self.case = case
        opt = FloorHooks(model, lr).optimizer if floor else torch.optim.AdamW(model.parameters(), lr=lr)
        self.engine = lib.initialize(model, opt, zero_cfg) if zero_cfg is not None else None
        self.model, self.opt = model, opt
        self.times: list[float] = []
        self.gc_runs = 0  # cyclic GC collections that started during its recorded steps
        self.phases: list[tuple[float, float, float]] = []
        self.loss = float("nan")

    def step(self, record: bool) -> None:
        collections = _GC_RUNS[0]
        t0 = clock()
        loss = self.case.loss(self.model, self.data)
        t1 = clock()
        loss.backward()
        t2 = clock()
        if self.engine is not None:
            self.engine.step()
        else:
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)
        t3 = clock()
        self.loss = loss.item()
        if record:
            self.times.append(t3 - t0)
            self.phases.append((t1 - t0, t2 - t1, t3 - t2))
            self.gc_runs += _GC_RUNS[0] - collections


def bench_case(case: Case, args: argparse.Namespace) -> str:
    runners = [Runner("plain", case, None, args.lr)]
    runners += [Runner(name, case, cfg, args.lr) for name, cfg in ZERO3_VARIANTS.items()]
    if args.floor and case.chain:
        runners.append(Runner("floor: threshold-0 hooks without zero3", case, None, args.lr, floor=True))
    if args.baseline_lib is not None:
        runners += [Runner(f"{name} [baseline]", case, cfg, args.lr, args.baseline_lib)
                    for name, cfg in ZERO3_VARIANTS.items()]
    calls, n_mods, n_param_mods = count_calls(runners[0].model, case, runners[0].data)
    n_params = sum(p.numel() for p in runners[0].model.parameters())
    for r in runners:
        for _ in range(args.warmup):
            r.step(record=False)
    for rnd in range(args.rounds):
        k = rnd % len(runners)
        for r in runners[k:] + runners[:k]:
            for _ in range(args.steps_per_round):
                r.step(record=True)
    base = statistics.median(runners[0].times)
    out = [f"### {case.name}",
           "",
           f"{n_mods} modules ({n_param_mods} with parameters), {calls} module calls per forward, "
           f"{n_params:,} parameters; {args.rounds} rounds x {args.steps_per_round} steps per variant "
           f"after {args.warmup} warm-up steps.",
           "",
           "| variant | median step (ms) | vs plain | overhead/step (ms) | overhead per module call (µs) "
           "| fwd / bwd / optim (ms) | all-gathers/step | GC runs/step | loss after last step |",
           "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    ref = runners[0].loss
    notes = [f"Loss column: every row must end on the plain model's loss within {LOSS_RTOL:g} relative; a row "
             "marked DIFFERS trained other numbers and is left out of the ratio and overhead columns."]
    for r in runners:
        med = statistics.median(r.times)
        fwd, bwd, opt = (statistics.median(p[i] for p in r.phases) * 1e3 for i in range(3))
        rel = abs(r.loss - ref) / max(abs(ref), 1e-30)
        same = rel <= LOSS_RTOL  # NaN compares False: flagged too
        ratio = f"{med / base:.2f}x" if same else "excluded"
        over = "—" if r is runners[0] else (f"{(med - base) * 1e3:+.2f}" if same else "excluded")
        per = "—" if r is runners[0] else (f"{(med - base) / calls * 1e6:+.1f}" if same else "excluded")
        loss = f"{r.loss:.7g}" + ("" if same else f" (DIFFERS from plain by {rel:.1e} relative)")
        gathers = "—" if r.engine is None else str(r.engine.last_step_metrics.allgather_calls)
        out.append(f"| {r.name} | {med * 1e3:.2f} | {ratio} | {over} | {per} | "
                   f"{fwd:.2f} / {bwd:.2f} / {opt:.2f} | {gathers} | {r.gc_runs / len(r.times):.2f} | {loss} |")
        if r.name == "zero3, default config":  # this tree's engine (a --baseline tree may lack these names)
            params = r.engine.params
            if all(p.ds_persist for p in params):
                notes.append(f"{r.name}: all {len(params)} parameters are persistent (largest "
                             f"{max(p.ds_numel for p in params):,} elements, under the persistence threshold), "
                             "so it is the same setup as \"persist all\": nothing is gathered.")
    return "\n".join(out + [""] + [f"- {n}" for n in notes])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="a few seconds: fewer rounds (defaults only: "
                    "--rounds, --steps-per-round, --warmup given win)")
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--steps-per-round", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (1: less noise)")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--floor", action="store_true",
                    help="add the row of `FloorHooks` (threshold-0 hook mechanisms without zero3) on chain models")
    ap.add_argument("--clock", choices=sorted(CLOCKS), default="wall",
                    help="wall: perf_counter; thread: this thread's CPU time (steadier on a busy machine)")
    ap.add_argument("--only", metavar="N", type=int, help="run only the N-th model (0: SimpleModel, 1: MLP, 2: GPT)")
    ap.add_argument("--baseline", metavar="DIR",
                    help="a source tree holding another zero3/ (e.g. a git worktree of an older commit): its "
                         "variants run interleaved with the current ones, labelled [baseline]")
    if ap.parse_known_args()[0].quick:  # the preset gives defaults; --rounds etc. given win
        ap.set_defaults(rounds=3, steps_per_round=2, warmup=2)
    args = ap.parse_args()
    args.baseline_lib = load_baseline(args.baseline) if args.baseline else None
    global clock
    clock = CLOCKS[args.clock]
    torch.set_num_threads(args.threads)
    cases = [
        simple_case(78, 64, 32),
        mlp_case(200, 64, 32),
        gpt_case(GPTConfig(n_layer=5, n_embd=64, n_head=4, block_size=32, vocab_size=256), 4),
    ]
    print(f"# bench_hooks  {datetime.datetime.now().isoformat(timespec='seconds')}  torch {torch.__version__}  "
          f"python {platform.python_version()}  {os.cpu_count()} CPUs, {args.threads} torch thread(s), "
          f"world size 1 (no process group), {args.clock} clock\n", flush=True)
    t0 = time.monotonic()
    for case in cases if args.only is None else [cases[args.only]]:
        print(bench_case(case, args) + "\n", flush=True)
    print(f"# total {time.monotonic() - t0:.0f} s", flush=True)


if __name__ == "__main__":
    main()
