"""A small tensor-parallel GPT trained with zero3 beside Megatron-style model parallelism.

    python examples/megatron_gpt.py                      # 4 gloo ranks: 2 tensor-parallel x 2 data-parallel
    python examples/megatron_gpt.py --steps 20 --dropout 0.1 --partition-activations
    python examples/megatron_gpt.py --no-checkpointing --tp 1 --dp 2

Each block's attention and MLP are split across the tensor-parallel ranks the way Megatron splits
them: a column-parallel linear (every rank computes some output features: a few attention heads, a
slice of the MLP's hidden layer) followed by a row-parallel linear (every rank multiplies its slice
of the input features; an all-reduce sums the partial outputs). zero3 partitions every parameter
(each rank's tensor-parallel slice, and the replicated LayerNorms and embeddings) over the
data-parallel ranks only. Dropout inside the tensor-parallel region (attention probabilities) draws
from the model-parallel RNG stream (``zero3.checkpointing.get_cuda_rng_tracker().fork()``), so the
tensor-parallel ranks drop different entries of their different heads; dropout elsewhere uses the
default generator, the same on every tensor-parallel rank. Every block runs under
``zero3.checkpointing.checkpoint`` (optionally partitioning the saved activations across the
tensor-parallel ranks), and gradients are clipped by their global norm.

The same classes build the same model on one process (``TinyMPU(1)``, with ``virtual_tp`` drawing the
parallel run's attention dropout), which is how tests/multiproc/test_megatron_gpt.py checks that the
parallel run trains exactly like a single process.
"""

from __future__ import annotations

import argparse
import math
import os
import socket
import sys
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn import functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import zero3  # noqa: E402
import zero3.checkpointing  # noqa: E402


# -- the model-parallel unit ----------------------------------------------------------------------------
class TinyMPU:
    """Megatron's model-parallel unit, reduced to what zero3 reads: ranks ``r`` with the same
    ``r // tp`` form a tensor-parallel group (adjacent ranks), ranks with the same ``r % tp`` a
    data-parallel group. Every rank creates every group, in the same order, as Megatron does. Without
    ``torch.distributed`` (one process) every group is None and every size 1."""

    def __init__(self, tp: int) -> None:
        self.tp = tp
        if not (dist.is_available() and dist.is_initialized()):
            if tp != 1:
                raise ValueError(f"tensor-parallel size {tp} needs torch.distributed; start the ranks first")
            self.world, self.rank = 1, 0
            self._tp_group = self._dp_group = None
            return
        self.world, self.rank = dist.get_world_size(), dist.get_rank()
        if self.world % tp:
            raise ValueError(f"world size {self.world} is not a multiple of the tensor-parallel size {tp}")
        dp = self.world // tp
        for d in range(dp):
            g = dist.new_group(list(range(d * tp, (d + 1) * tp)))
            if self.rank // tp == d:
                self._tp_group = g
        for t in range(tp):
            g = dist.new_group(list(range(t, self.world, tp)))
            if self.rank % tp == t:
                self._dp_group = g

    def get_model_parallel_group(self) -> Any:
        return self._tp_group

    def get_model_parallel_rank(self) -> int:
        return self.rank % self.tp

    def get_model_parallel_world_size(self) -> int:
        return self.tp

    def get_data_parallel_group(self) -> Any:
        return self._dp_group

    def get_data_parallel_rank(self) -> int:
        return self.rank // self.tp

    def get_data_parallel_world_size(self) -> int:
        return self.world // self.tp


# -- tensor-parallel layers -------------------------------------------------------------------------------
def _all_reduce(x: torch.Tensor, mpu: TinyMPU) -> torch.Tensor:
    if mpu.get_model_parallel_world_size() > 1:
        x = x.contiguous()
        dist.all_reduce(x, group=mpu.get_model_parallel_group())
    return x


class _CopyToTensorParallel(torch.autograd.Function):
    """Identity forward; the backward sums the input's gradient over the tensor-parallel ranks."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, mpu: TinyMPU) -> torch.Tensor:  # type: ignore[override]
        ctx.mpu = mpu
        return x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:  # type: ignore[override]
        return _all_reduce(grad.clone(), ctx.mpu), None


class _ReduceFromTensorParallel(torch.autograd.Function):
    """Sums the partial outputs over the tensor-parallel ranks; identity backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, mpu: TinyMPU) -> torch.Tensor:  # type: ignore[override]
        return _all_reduce(x.clone(), mpu)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:  # type: ignore[override]
        return grad, None


def _slice_of_full(shape: tuple[int, int], dim: int, mpu: TinyMPU, std: float) -> torch.Tensor:
    """This rank's slice (along ``dim``) of a full weight drawn from the default generator: every rank
    draws the same full weight, so the slices fit together into the single-process model's weight."""
    full = torch.empty(shape).normal_(0.0, std)
    return full.chunk(mpu.get_model_parallel_world_size(), dim)[mpu.get_model_parallel_rank()].clone()


def _mark_tensor_parallel(p: nn.Parameter) -> nn.Parameter:
    p.tensor_model_parallel = True  # type: ignore[attr-defined]  # Megatron's attribute: zero3's clipping reads it
    return p


class ColumnParallelLinear(nn.Module):
    """``y = x A^T + b`` with A split by rows (output features): this rank computes its slice of y."""

    def __init__(self, n_in: int, n_out: int, mpu: TinyMPU, std: float = 0.02) -> None:
        super().__init__()
        self.mpu = mpu
        self.weight = _mark_tensor_parallel(nn.Parameter(_slice_of_full((n_out, n_in), 0, mpu, std)))
        self.bias = _mark_tensor_parallel(nn.Parameter(torch.zeros(n_out // mpu.get_model_parallel_world_size())))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(_CopyToTensorParallel.apply(x, self.mpu), self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """``y = x A^T + b`` with A split by columns (input features): this rank multiplies its slice of x,
    the partial products are summed over the tensor-parallel ranks, then the (replicated) bias added."""

    def __init__(self, n_in: int, n_out: int, mpu: TinyMPU, std: float = 0.02) -> None:
        super().__init__()
        self.mpu = mpu
        self.weight = _mark_tensor_parallel(nn.Parameter(_slice_of_full((n_out, n_in), 1, mpu, std)))
        self.bias = nn.Parameter(torch.zeros(n_out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _ReduceFromTensorParallel.apply(F.linear(x, self.weight), self.mpu) + self.bias


# -- the model ----------------------------------------------------------------------------------------------
@dataclass
class Config:
    vocab_size: int = 64
    block_size: int = 16
    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 32
    dropout: float = 0.0
    checkpoint: bool = True  # every block under zero3.checkpointing.checkpoint
    virtual_tp: int = 1
    """On one process (tp = 1): draw the attention-dropout mask of each group of ``n_head / virtual_tp``
    heads from its own tracker state ``model-parallel-rng/<g>``, as tensor-parallel rank g of a
    ``virtual_tp``-way run draws its heads' mask; `seed_like_tensor_parallel` adds those states. This is
    how one process reproduces the parallel run's dropout exactly (the tests' reference)."""


class Attention(nn.Module):
    def __init__(self, cfg: Config, mpu: TinyMPU) -> None:
        super().__init__()
        tp = mpu.get_model_parallel_world_size()
        self.heads = cfg.n_head // tp  # this rank's heads
        self.q = ColumnParallelLinear(cfg.n_embd, cfg.n_embd, mpu)
        self.k = ColumnParallelLinear(cfg.n_embd, cfg.n_embd, mpu)
        self.v = ColumnParallelLinear(cfg.n_embd, cfg.n_embd, mpu)
        self.proj = RowParallelLinear(cfg.n_embd, cfg.n_embd, mpu, std=0.02 / math.sqrt(2 * cfg.n_layer))
        self.dropout = cfg.dropout
        self.virtual_tp = cfg.virtual_tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        q, k, v = (f(x).view(B, T, self.heads, -1).transpose(1, 2) for f in (self.q, self.k, self.v))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(q.size(-1))
        causal = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()
        att = F.softmax(att.masked_fill(~causal, float("-inf")), dim=-1)
        if self.training and self.dropout > 0:
            att = self._dropout(att)
        y = (att @ v).transpose(1, 2).reshape(B, T, -1)
        return self.proj(y)

    def _dropout(self, att: torch.Tensor) -> torch.Tensor:
        tracker = zero3.checkpointing.get_cuda_rng_tracker()
        if self.virtual_tp == 1:
            with tracker.fork():
                return F.dropout(att, self.dropout)
        out = []
        for g, heads in enumerate(att.chunk(self.virtual_tp, dim=1)):
            with tracker.fork(f"{zero3.checkpointing.MODEL_PARALLEL_RNG}/{g}"):
                out.append(F.dropout(heads, self.dropout))
        return torch.cat(out, dim=1)


class MLP(nn.Module):
    def __init__(self, cfg: Config, mpu: TinyMPU) -> None:
        super().__init__()
        self.fc = ColumnParallelLinear(cfg.n_embd, 4 * cfg.n_embd, mpu)
        self.proj = RowParallelLinear(4 * cfg.n_embd, cfg.n_embd, mpu, std=0.02 / math.sqrt(2 * cfg.n_layer))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    def __init__(self, cfg: Config, mpu: TinyMPU) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd)
        self.attn = Attention(cfg, mpu)
        self.ln_2 = nn.LayerNorm(cfg.n_embd)
        self.mlp = MLP(cfg, mpu)
        self.dropout = cfg.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + F.dropout(self.attn(self.ln_1(x)), self.dropout, self.training)  # default generator
        return x + F.dropout(self.mlp(self.ln_2(x)), self.dropout, self.training)


class GPT(nn.Module):
    """Token and position embeddings, tensor-parallel blocks, a tied output layer (replicated)."""

    def __init__(self, cfg: Config, mpu: TinyMPU) -> None:
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        nn.init.normal_(self.wte.weight, std=0.02)
        nn.init.normal_(self.wpe.weight, std=0.02)
        self.h = nn.ModuleList([Block(cfg, mpu) for _ in range(cfg.n_layer)])
        self.ln_f = nn.LayerNorm(cfg.n_embd)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        T = idx.shape[1]
        x = F.dropout(self.wte(idx) + self.wpe(torch.arange(T, device=idx.device)), self.cfg.dropout, self.training)
        for block in self.h:
            x = zero3.checkpointing.checkpoint(block, x) if self.cfg.checkpoint else block(x)
        logits = F.linear(self.ln_f(x), self.wte.weight)
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


def seed_like_tensor_parallel(seed: int, tp: int) -> None:
    """One process: seed the default generator as `model_parallel_cuda_manual_seed` does on every
    rank, and add tensor-parallel rank g's model-parallel state as ``model-parallel-rng/<g>`` (for a
    model built with ``virtual_tp = tp``)."""
    torch.manual_seed(seed)
    tracker = zero3.checkpointing.get_cuda_rng_tracker()
    tracker.reset()
    for g in range(tp):
        tracker.add(f"{zero3.checkpointing.MODEL_PARALLEL_RNG}/{g}", seed + 2718 + g)


def synthetic_batch(step: int, batch: int, cfg: Config) -> tuple[torch.Tensor, torch.Tensor]:
    """A deterministic batch (the same on every rank) of something to learn: each sequence starts at a
    random token and continues with ``next = (5 * token + 3) mod vocab``, except that one token in eight
    is random (so the loss cannot reach 0)."""
    g = torch.Generator().manual_seed(1234 + step)
    data = torch.randint(0, cfg.vocab_size, (batch, cfg.block_size + 1), generator=g)
    keep = torch.rand(batch, cfg.block_size + 1, generator=g) < 0.875
    for i in range(1, cfg.block_size + 1):
        data[:, i] = torch.where(keep[:, i], (5 * data[:, i - 1] + 3) % cfg.vocab_size, data[:, i])
    return data[:, :-1], data[:, 1:]


# -- training ------------------------------------------------------------------------------------------------
@dataclass
class RunConfig:
    tp: int = 2
    steps: int = 10
    per_rank_batch: int = 2
    seed: int = 0
    lr: float = 3e-3
    clip: float = 0.5
    partition_activations: bool = False
    zero: dict | None = None  # zero3.initialize's config (default: nothing persistent, release after use)


def build(cfg: Config, run: RunConfig) -> tuple[zero3.Engine, TinyMPU]:
    """The MPU, seeds, activation-checkpointing settings and the engine, on every rank."""
    mpu = TinyMPU(run.tp)
    zero3.checkpointing.configure(mpu, partition_activations=run.partition_activations)
    zero3.checkpointing.model_parallel_cuda_manual_seed(run.seed)
    with zero3.Init(mpu=mpu):
        model = GPT(cfg, mpu)
    optimizer = torch.optim.AdamW(model.parameters(), lr=run.lr, weight_decay=0.1)
    engine = zero3.initialize(model, optimizer, run.zero or {"param_persistence_threshold": 0,
                                                             "max_reuse_distance": 0}, mpu=mpu)
    return engine, mpu


def train(cfg: Config, run: RunConfig, log: bool = False) -> dict[str, list[float]]:
    """Train ``run.steps`` steps; returns per step the global loss, the clipped gradient norm, and the
    divergences from zero3's recorded trace and prefetch hits (``engine.last_step_metrics``)."""
    engine, mpu = build(cfg, run)
    dp, dp_rank = mpu.get_data_parallel_world_size(), mpu.get_data_parallel_rank()
    out: dict[str, list[float]] = {"loss": [], "norm": [], "divergences": [], "prefetch_hits": []}
    for step in range(run.steps):
        x, y = synthetic_batch(step, run.per_rank_batch * dp, cfg)
        rows = slice(dp_rank * run.per_rank_batch, (dp_rank + 1) * run.per_rank_batch)
        loss = engine(x[rows], y[rows])
        engine.backward(loss)
        norm = zero3.clip_grad_norm_(engine, run.clip)
        engine.step()
        loss = loss.detach()
        if dp > 1:
            dist.all_reduce(loss, group=mpu.get_data_parallel_group())
        out["loss"].append(loss.item() / dp)
        out["norm"].append(norm.item())
        out["divergences"].append(engine.last_step_metrics.divergences)
        out["prefetch_hits"].append(engine.last_step_metrics.prefetch_hits)
        if log and mpu.rank == 0:
            sys.stdout.write(f"step {step:3d}  loss {out['loss'][-1]:.5f}  grad-norm {out['norm'][-1]:.4f}\n")
            sys.stdout.flush()
    return out


def _spawned(rank: int, world: int, port: int, cfg: Config, run: RunConfig) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        t0 = time.perf_counter()
        train(cfg, run, log=True)
        if rank == 0:
            sys.stdout.write(f"{run.steps} steps in {time.perf_counter() - t0:.1f} s on {world} ranks "
                             f"({run.tp} tensor-parallel x {world // run.tp} data-parallel)\n")
    finally:
        dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tp", type=int, default=2, help="tensor-parallel ranks")
    ap.add_argument("--dp", type=int, default=2, help="data-parallel ranks")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--dropout", type=float, default=0.1)
    ap.add_argument("--no-checkpointing", action="store_true", help="run the blocks without checkpointing")
    ap.add_argument("--partition-activations", action="store_true",
                    help="keep 1/tp of each checkpoint's saved input per rank")
    args = ap.parse_args()
    cfg = Config(dropout=args.dropout, checkpoint=not args.no_checkpointing)
    run = RunConfig(tp=args.tp, steps=args.steps, partition_activations=args.partition_activations)
    world = args.tp * args.dp
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_spawned, args=(world, port, cfg, run), nprocs=world)


if __name__ == "__main__":
    main()
