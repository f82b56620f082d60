"""memory_budget's account of a reduce bucket (comm/reduce.py `hold_bytes`) against an outside census:
a TorchDispatchMode active inside every reduction, its issue and its landing, records each tensor an op
returns (weakly, with the bucket's gradients) and, after every op, sums the live ones' distinct storages. Unlike the reducer's gauge,
which samples at hand-over, issue and landing, it sees the temporaries inside a reduction (qgZ's
quantization copies, a cast to the reduction's dtype: review 39R1). 2 gloo ranks."""

from __future__ import annotations

import weakref

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import zero3
from zero3.comm.shared_reduce import SLOT_BYTES

pytestmark = pytest.mark.multiproc


class _Census(TorchDispatchMode):
    """Live storages, sampled after every op while active: the bucket's gradients, and every tensor an
    op returned (both held weakly: a storage counts while a tensor on it lives)."""

    def __init__(self, grads: list[torch.Tensor]) -> None:
        super().__init__()
        self.made: dict[int, tuple[int, list]] = {}
        self.peak = 0
        for g in grads:
            self._note(g)

    def _note(self, t: torch.Tensor) -> None:
        st = t.untyped_storage()
        if not st.data_ptr() or st.nbytes() == 2 * SLOT_BYTES:  # the outbox arena: not in the budget
            return
        nbytes, refs = self.made.get(st.data_ptr(), (0, []))
        if not any(r() is not None for r in refs):  # a new storage at a freed one's address: its own size
            nbytes, refs = st.nbytes(), []  # (a 4-byte cast once counted as the 128 bytes freed there before)
            self.made[st.data_ptr()] = nbytes, refs
        refs.append(weakref.ref(t))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self._note(t)
        self.peak = max(self.peak, sum(n for n, refs in self.made.values() if any(r() is not None for r in refs)))
        return out


class PrefixNet(nn.Module):
    """A learnt prefix concatenated with the input (prompt tuning without a batch dim): its gradient is
    a slice of the whole concatenation's."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.prefix = nn.Parameter(torch.randn(4, 32))
        self.body = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 32), nn.Tanh(), nn.Linear(32, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(torch.cat([self.prefix, x], 0)).square().mean()


def census(zero_cfg: dict, model_name: str, sequence_parallel: bool = False) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = PrefixNet() if model_name == "prefix" else nn.Sequential(
        nn.Linear(48, 96), nn.Tanh(), nn.Linear(96, 48), nn.Tanh(), nn.Linear(48, 1))
    if sequence_parallel:  # Megatron's mark (summed over a model-parallel group, here none): the account
        model[0].bias.sequence_parallel = True  # must not shrink (review 39R2: it dropped the others' cast)
    scale = 6 if zero_cfg.get("zero_quantized_gradients") else 3  # qgZ's messages and temporaries take more
    budget = scale * sum(p.numel() * 4 for p in model.parameters())
    engine = zero3.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1),
                              {"memory_budget": budget, **zero_cfg})
    comm = engine.coordinator.comm
    issue, peaks = comm.reduce_grads, []

    def counted(pieces, *args, **kwargs):
        mode = _Census([p.grad for p in pieces if p.grad is not None])
        with mode:
            work = issue(pieces, *args, **kwargs)
        peaks.append(mode)
        land = work.wait

        def wait():  # the landing too: gloo's reduce-scatter holds its own copy of the input until then
            with mode:
                return land()

        work.wait = wait
        return work

    comm.reduce_grads = counted
    steps = []  # (census, gauge, the account of the bucket the step ran with: the first step's, then the chosen one)
    for step in range(3):
        account = engine.coordinator.budget.reduce_bucket_bytes
        g = torch.Generator().manual_seed(step)
        x = torch.randn(16 if model_name == "prefix" else 4, 32 if model_name == "prefix" else 48, generator=g)
        x = x.to(torch.bfloat16) if zero_cfg.get("dtype") == "bf16" else x
        engine.backward(engine(x[rank::world]) if model_name == "prefix" else engine(x[rank::world]).square().mean())
        engine.step()
        steps.append((max(m.peak for m in peaks), engine.last_step_metrics.peak_reduce_held_bytes, account))
        peaks.clear()
    del comm.reduce_grads
    return {"steps": steps}


@pytest.mark.parametrize("zero_cfg", [{"reduce_scatter_impl": "p2p"}, {"reduce_scatter_impl": "reduce_scatter"},
                                      {"reduce_scatter_impl": "all_reduce"}, {"zero_quantized_gradients": True},
                                      {"zero_quantized_gradients": True, "quantized_gradient_bits": 4},
                                      {"dtype": "bf16"}, {"dtype": "bf16", "reduce_scatter_impl": "reduce_scatter"}],
                         ids=["p2p", "rs", "ar", "qgz8", "qgz4", "bf16", "bf16-rs"])
@pytest.mark.parametrize("model_name", ["mlp", "prefix"])
def test_the_account_holds_what_a_reduction_holds(pools, zero_cfg, model_name):
    for r in pools.get(2).run(census, zero_cfg, model_name):
        for census_peak, gauge, account in r["steps"]:
            assert 0 < census_peak <= account, r
            assert gauge <= account, r


def test_a_sequence_parallel_mark_keeps_the_account_whole(pools):
    for r in pools.get(2).run(census, {"dtype": "bf16"}, "mlp", True):
        for census_peak, gauge, account in r["steps"]:
            assert 0 < census_peak <= account, r
            assert gauge <= account, r

