"""Predict a run without running it: ``python -m zero3.plan``.

Given a model (built on the meta device, so nothing is allocated or computed) or a trace file
exported with ``engine.export_trace("x.json")``, and a config, predict per-rank peak gathered
parameter memory, the number of all-gathers and the elements and bytes they move. The model is run
once, forward and backward on meta tensors, under zero3's own hooks at world size 1 (world size does
not change what a rank gathers, only how much of it arrives over the wire), which records the same
trace a real run records; ``schedule.plan`` then computes what the coordinator will do.

    python -m zero3.plan --model examples/gpt.py:GPT --model-arg 'GPTConfig(n_layer=12)' \\
        --input-shape 8,64 --config '{"param_persistence_threshold": 0, "max_live_parameters": 2e4}' \\
        --world-size 8
    python -m zero3.plan --trace last_step.json --config ds_config.json

A model whose parameters are all under ``param_persistence_threshold`` (the example GPT at its
default width, with the default config) gathers nothing during a step: the prediction is then 0
gathers with every element persistent, not an error.
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree
from torch import nn

from .comm.process_group import group_exists
from .errors import ZeroConfigError
from .config import ZeroConfig, resolve_config
from .config.json_file import loads_config_text
from .optim.precision import torch_dtype
from .comm.reduce import hold_bytes
from .planning.budget import choose_split, choose_static
from .runtime.coordinator import plan_config
from .planning.schedule import PlanStats, Schedule, plan
from .planning.trace import ParamInfo, Trace, trace_from_json, write_trace

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Prediction:
    """What one rank will do per training step (after the first, recording, step)."""

    trace: Trace
    schedule: Schedule
    world_size: int

    @property
    def stats(self) -> PlanStats:
        return self.schedule.stats

    @property
    def bytes_received_per_rank(self) -> int:
        """All-gathered bytes arriving at one rank (its own shard is local)."""
        return self.stats.allgather_bytes * (self.world_size - 1) // self.world_size

    def table(self) -> str:
        s = self.stats
        rows = [
            ("events in the trace", f"{len(self.trace.events):,}"),
            ("peak gathered parameter elements", f"{s.peak_live_numel:,}"),
            ("peak gathered parameter bytes", f"{s.peak_live_bytes:,}"),
            ("persistent elements (always gathered)", f"{s.persistent_numel:,}"),
            ("all-gathers per step", f"{s.num_allgathers:,}"),
            ("elements gathered per step", f"{s.allgather_numel:,}"),
            ("bytes gathered per step (full tensors)", f"{s.allgather_bytes:,}"),
            (f"bytes received per rank (world size {self.world_size})", f"{self.bytes_received_per_rank:,}"),
            ("parameters prefetched / demand-fetched", f"{s.num_prefetched_params:,} / {s.num_demand_fetches:,}"),
        ]
        width = max(len(k) for k, _ in rows)
        return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def record_trace(model: nn.Module, make_inputs: Callable[[], Sequence[Any]], config: Any = None,
                 loss_fn: Callable[[Any], torch.Tensor] | None = None) -> Trace:
    """Run one forward+backward of ``model`` under zero3's hooks (world size 1) and return its trace.

    ``model`` may live on the meta device. It is partitioned in place and its hooks are removed
    afterwards. A launcher's ``RANK``/``WORLD_SIZE`` in the environment are not read (probe 36K: in a
    process that inherited them, ``initialize`` waited for ranks that never came); a process group of
    more than one rank is refused (the dry run is one process's).

    Raises:
        ZeroConfigError: this process is a rank of an initialised group of several ranks.
    """
    from .engine import initialize
    from .runtime.context import meta_dry_run

    if group_exists() and dist.get_world_size() > 1:
        raise ZeroConfigError(
            f"zero3.plan.record_trace runs the model alone (world size 1), and this process is rank {dist.get_rank()} "
            f"of a process group of {dist.get_world_size()}: record the trace in a process of its own (python -m "
            "zero3.plan, or before torch.distributed.init_process_group); nothing was run")
    hidden = {k: os.environ.pop(k) for k in ("RANK", "WORLD_SIZE") if k in os.environ}
    token = meta_dry_run.set(True)  # a meta model is partitioned here: the trace needs no values
    try:
        engine = initialize(model, None, resolve_config(config))
    finally:
        meta_dry_run.reset(token)
        os.environ.update(hidden)
    try:
        out = engine(*make_inputs())
        loss = loss_fn(out) if loss_fn is not None else _default_loss(out)
        if loss.requires_grad:
            loss.backward()
        elif any(p.requires_grad for p in model.parameters()):  # probe 35E: a forward-only prediction, silently
            logger.warning("zero3.plan: no output of the model needs a gradient%s, so the trace and the "
                           "prediction cover the forward only (a training step also gathers for the backward)",
                           "" if loss_fn is None else " through loss_fn")
        engine.step()
        trace = engine.coordinator.last_trace
        if trace is None:  # every parameter is persistent: no module gathers anything, a valid plan
            params = engine.coordinator.persistent
            infos = {p._zero.id: ParamInfo(id=p._zero.id, name=p._zero.name, numel=p._zero.numel,
                                           nbytes=p._zero.nbytes, persistent=True, trains=p.requires_grad) for p in params}
            trace = Trace("all-persistent", 0, (), infos)
        return trace
    finally:
        engine.remove_hooks()


def _default_loss(out: Any) -> torch.Tensor:
    """The sum of the first floating-point tensor of ``out`` (a tensor, or nested tuples, lists and
    dicts, Hugging Face's outputs among them) that needs a gradient, else of its first tensor: the
    backward a training step runs, without a loss of the user's (probe 35E: ``(logits.argmax(-1),
    logits)`` took the argmax, which needs none, and predicted the forward alone)."""
    tensors = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
    if not tensors:
        raise ValueError(f"cannot make a loss from a model output of type {type(out).__name__}; pass loss_fn "
                         "(zero3.plan.record_trace), or have the model return a tensor")
    wanted = [t for t in tensors if t.requires_grad and t.is_floating_point()]
    return (wanted or tensors)[0].float().sum()


BACKENDS = ("gloo", "nccl", "mpi", "ucc", "xccl")
"""The process-group backends ``predict`` plans for (only gloo resolves ``reduce_scatter_impl`` "auto" to p2p)."""


def predict(trace: Trace, config: Any = None, world_size: int = 1, backend: str = "gloo") -> Prediction:
    """Plan ``trace`` with ``config``'s budgets. With ``memory_budget`` (bytes) the knobs are chosen as
    the runtime chooses them after its first step (planning/budget.py), the largest trainable parameter
    counted as the largest gradient piece (a leaf module's unit, reduced whole, is not known to a trace);
    it was ignored before, and the default budgets planned (probe 35E: a peak above the budget itself).
    ``backend``: how ``reduce_scatter_impl`` "auto" resolves (on gloo p2p or shm, else reduce-scatter),
    which the budget's account of a reduce bucket follows. The runtime weighs gathers against reductions
    by what its first training step waited (planning/budget.py `Calibration`); a prediction cannot, so
    it weighs them alike, and on more than one rank may choose another reduce bucket and schedule."""
    if backend not in BACKENDS:
        raise ValueError(f"predict(backend={backend!r}): one of {', '.join(BACKENDS)} (torch.distributed's names)")
    cfg = resolve_config(config)
    budget = cfg.budget.memory_budget
    if budget is None:
        return Prediction(trace=trace, schedule=plan(trace, plan_config(cfg)), world_size=world_size)
    if budget == "auto":
        raise ValueError("predict(memory_budget='auto'): 'auto' takes the free memory of the machine that trains; "
                         "give the bytes per rank")
    sizes = [(info.name, info.numel, info.nbytes) for info in trace.params.values()]
    impl = cfg.comm.reduce_scatter_impl
    if impl == "auto":  # as the runtime resolves it: on gloo shm or p2p, which hold alike; reduce-scatter elsewhere
        impl = "p2p" if backend == "gloo" else "reduce_scatter"
    trained = [i.nbytes // i.numel for i in trace.params.values() if i.trains and i.numel]
    pieces, grad_itemsize = len(trained), max(trained, default=4)
    itemsize = 8 if grad_itemsize == 8 else torch_dtype(cfg.precision.reduce_dtype).itemsize  # fp64 reduced in fp64
    bits = cfg.comm.quantized_gradient_bits if cfg.comm.zero_quantized_gradients else 0

    def reduce_hold(n: int) -> int:  # as the runtime counts a bucket at this world size (comm/reduce.py `hold_bytes`)
        return hold_bytes(impl, world_size, n, pieces, grad_itemsize, itemsize, verify=cfg.comm.verify_collectives is not False,
                          quantized=(bits, cfg.comm.quantization_block_size) if bits else None, backend=backend)

    grad_numel = max((i.numel for i in trace.params.values() if i.trains), default=0)  # review 35R2: the largest trainable
    static = choose_static(sizes, budget, reduce_hold, grad_numel,
                           secondary_group=max(1, cfg.comm.zero_hpz_partition_size))  # -1 (per node): not known here
    # the bucket and the knobs as the runtime chooses them, but unweighed: its weights come from waits measured in training
    chosen = choose_split(trace, budget - static.persistent_bytes - static.secondary_bytes, reduce_hold, grad_numel,
                          static.reduce_bucket_size, grad_itemsize=grad_itemsize).config
    return Prediction(trace=trace, schedule=plan(trace, chosen), world_size=world_size)


def _load_factory(spec: str) -> Callable[..., nn.Module]:
    path, _, name = spec.rpartition(":")
    if not path or not name:
        raise ValueError(f"--model must look like path/to/file.py:Factory or package.module:Factory, got {spec!r}")
    if path.endswith(".py"):
        file = Path(path).resolve()
        sys.path.insert(0, str(file.parent))
        module_spec = importlib.util.spec_from_file_location(file.stem, file)
        assert module_spec is not None and module_spec.loader is not None
        module = importlib.util.module_from_spec(module_spec)
        sys.modules[file.stem] = module
        module_spec.loader.exec_module(module)
    else:
        module = importlib.import_module(path)
    return getattr(module, name)


def _is_file(text: str) -> bool:
    """Whether ``--config`` names a file (else it is JSON text): a text longer than a file name may be
    raises ENAMETOOLONG in ``Path.exists`` on Python 3.11 (review 32RE: a 335-character config crashed)."""
    try:
        return Path(text).is_file()
    except OSError:
        return False


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m zero3.plan", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", help="file.py:Factory or module:Factory returning an nn.Module")
    src.add_argument("--trace", help="a trace exported with engine.export_trace('x.json')")
    ap.add_argument("--model-arg", action="append", default=[],
                    help="argument for the factory, a Python expression evaluated in the factory's module")
    ap.add_argument("--input-shape", default="2,64", help="shape of one integer input tensor (default 2,64)")
    ap.add_argument("--input-dtype", default="long", choices=["long", "float"])
    ap.add_argument("--vocab", type=int, default=2, help="integer inputs are drawn below this (meta: ignored)")
    ap.add_argument("--config", default=None, help="ZeroConfig as JSON text or a JSON file (ours or DeepSpeed's)")
    ap.add_argument("--world-size", type=int, default=1)
    ap.add_argument("--backend", default="gloo", choices=BACKENDS, help="the process group's backend (gloo, nccl): how "
                    "reduce_scatter_impl 'auto' resolves, which memory_budget's account of a bucket follows")
    ap.add_argument("--export", default=None, help="also write the trace (.json, .graphml or .dot)")
    args = ap.parse_args(argv)

    config: ZeroConfig
    if args.config is None:
        config = ZeroConfig()
    elif _is_file(args.config):
        config = ZeroConfig.from_json(args.config)
    else:
        config = ZeroConfig.from_dict(loads_config_text(args.config, "--config"))  # as a file is read
    if args.trace:
        trace = trace_from_json(Path(args.trace).read_text())
    else:
        factory = _load_factory(args.model)
        namespace = vars(sys.modules[factory.__module__])
        fargs = [eval(a, namespace) for a in args.model_arg]  # noqa: S307 - a local developer tool
        with torch.device("meta"):
            model = factory(*fargs)
        shape = tuple(int(x) for x in args.input_shape.split(","))
        dtype = torch.long if args.input_dtype == "long" else torch.float32

        def make_inputs() -> tuple[torch.Tensor]:
            return (torch.zeros(shape, dtype=dtype, device="meta"),)

        trace = record_trace(model, make_inputs, config)
    prediction = predict(trace, config, args.world_size, args.backend)
    sys.stdout.write(prediction.table() + "\n")
    if args.export:
        write_trace(trace, args.export)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
