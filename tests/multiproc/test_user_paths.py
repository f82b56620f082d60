"""What users meet first on several ranks, against plain torch: per-rank seeds around zero3.Init,
forwards that return a dataclass or a view of a parameter."""

from __future__ import annotations

import contextlib

import dataclasses
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.utils import parameters_to_vector, vector_to_parameters

import zero3

from _reference import twins

pytestmark = pytest.mark.multiproc


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


def _twin_mlps(threshold: int) -> tuple:
    """The MLP plainly and under Init from one seed, AdamW over each, the second initialized with
    ``param_persistence_threshold=threshold``: (ref, model, ref_opt, opt, engine)."""
    ref, model = twins(_mlp)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, eps=1e-6)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-6)
    engine = zero3.initialize(model, opt, {"param_persistence_threshold": threshold})
    return ref, model, ref_opt, opt, engine


def _two_steps_beside(ref: nn.Module, ref_opt: torch.optim.Optimizer, model: nn.Module, engine: zero3.Engine,
                      g: torch.Generator | None = None) -> float:
    """Two steps of torch's model on the full batch and of zero3's on this rank's quarter-rows;
    the largest difference of their weights after."""
    rank, world = dist.get_rank(), dist.get_world_size()
    g = g if g is not None else torch.Generator().manual_seed(1)
    mine = slice(4 * rank, 4 * (rank + 1))
    for _ in range(2):
        x, y = torch.randn(4 * world, 8, generator=g), torch.randn(4 * world, 4, generator=g)
        ref_opt.zero_grad()
        ((ref(x) - y) ** 2).mean().backward()
        ref_opt.step()
        engine.backward(((model(x[mine]) - y[mine]) ** 2).mean())
        engine.step()
    with zero3.GatheredParameters(list(model.parameters())):
        return max((a - b).abs().max().item() for a, b in zip(model.parameters(), ref.parameters()))


def per_rank_seeds() -> dict:
    """nanoGPT's pattern: a seed per rank, the model built afterwards, batches drawn from the
    global generator."""
    rank = dist.get_rank()
    torch.manual_seed(1337 + rank)
    with zero3.Init():
        model = _mlp()
    drawn = torch.randint(1000, (6,)).tolist()
    with zero3.GatheredParameters(list(model.parameters())):
        weights = [p.detach().clone() for p in model.parameters()]
    torch.manual_seed(1337 + rank)
    own = torch.randint(1000, (6,)).tolist()  # the rank's stream, not advanced by a build
    torch.manual_seed(1337)
    plain = [p.detach().clone() for p in _mlp().parameters()]
    after_plain = torch.randint(1000, (6,)).tolist()  # rank 0's stream after a plain build
    return {"drawn": drawn, "own": own, "after_plain": after_plain,
            "weights_are_rank0_seed": all(torch.equal(a, b) for a, b in zip(weights, plain))}


def one_seed() -> dict:
    torch.manual_seed(5)
    with zero3.Init():
        _mlp()
    after_init = torch.randint(1000, (6,)).tolist()
    torch.manual_seed(5)
    _mlp()
    return {"after_init": after_init, "after_plain": torch.randint(1000, (6,)).tolist()}


def test_per_rank_seeds_keep_their_own_stream_after_init(pools):
    results = pools.get(2).run(per_rank_seeds)
    for r in results:
        assert r["weights_are_rank0_seed"]  # the model is rank 0's, as a plain build with its seed
    assert results[0]["drawn"] == results[0]["after_plain"]  # rank 0: where its plain build leaves it
    assert results[1]["drawn"] == results[1]["own"]  # rank 1: its own stream back, not rank 0's
    assert results[0]["drawn"] != results[1]["drawn"]


def test_one_seed_everywhere_leaves_the_rng_where_a_plain_build_does(pools):
    for r in pools.get(2).run(one_seed):
        assert r["after_init"] == r["after_plain"]


# -- what a forward returns ([Note: module outputs], runtime/outputs.py) ---------------------------
@dataclasses.dataclass
class _Out:
    loss: torch.Tensor
    hidden: torch.Tensor


class _Box:
    """An object neither pytree nor dataclasses open."""

    def __init__(self, value: torch.Tensor) -> None:
        self.value = value


class _Scale(nn.Module):
    """A module with a parameter of its own, returning its result inside ``kind``'s container."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, 16))

    def forward(self, h: torch.Tensor) -> Any:
        h = h * self.scale
        return _Box(h) if self.kind == "box" else _Out(h.sum(), h) if self.kind == "dataclass" else h


class _Table(nn.Module):
    """A learned table sliced to the length asked: its output is a view of its parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.table = nn.Parameter(torch.randn(12, 16))

    def forward(self, n: int) -> torch.Tensor:
        return self.table[:n]


class _Net(nn.Module):
    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.inp = nn.Linear(8, 16)
        self.pos = _Table()
        self.mid = _Scale(kind)
        self.out = nn.Linear(16, 4)
        self.bias = nn.Parameter(torch.zeros(4))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> Any:
        h = self.inp(x) + self.pos(2).sum(0)  # a view of the table, reduced: one row for every sample
        m = self.mid(h)
        h = m.value if self.kind == "box" else m.hidden if self.kind == "dataclass" else m
        loss = ((self.out(torch.tanh(h)) + self.bias - y) ** 2).mean()
        return _Out(loss, h)  # the root, with a parameter of its own, returns a dataclass


def train_outputs(kind: str) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    ref, model = twins(lambda: _Net(kind))
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, eps=1e-6)
    engine = zero3.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-6),
                              {"param_persistence_threshold": 0, "max_reuse_distance": 0})
    g = torch.Generator().manual_seed(1)
    views = []
    for _ in range(3):
        x, y = torch.randn(4 * world, 8, generator=g), torch.randn(4 * world, 4, generator=g)
        ref_opt.zero_grad()
        ref(x, y).loss.backward()  # the whole batch: the mean over every rank's part
        ref_opt.step()
        mine = slice(4 * rank, 4 * (rank + 1))
        out = model(x[mine], y[mine])
        out.loss.backward()
        engine.step()
        views.append(model.pos(3).detach().clone())  # read after the table was released
    with zero3.GatheredParameters(list(model.parameters())):
        diff = max((a - b).abs().max().item() for a, b in zip(model.parameters(), ref.parameters()))
        table = model.pos.table.detach().clone()
    return {"diff": diff, "view_is_the_table": torch.equal(views[-1], table[:3])}


@pytest.mark.parametrize("kind", ["tensor", "dataclass", "box"])
def test_dataclass_and_opaque_outputs_and_views_of_parameters_train_as_torch(pools, kind):
    for r in pools.get(2).run(train_outputs, kind):
        assert r["diff"] < 1e-6, r
        assert r["view_is_the_table"]


# -- writing a gradient between backward and step --------------------------------------------------
def grad_writes(threshold: int) -> dict:
    """Skip one parameter's gradient, set another's, at step 2 of 3; torch does the same with p.grad."""
    rank, world = dist.get_rank(), dist.get_world_size()
    ref, model, ref_opt, opt, engine = _twin_mlps(threshold)
    g = torch.Generator().manual_seed(1)
    refused = []
    for step in range(3):
        x, y = torch.randn(4 * world, 8, generator=g), torch.randn(4 * world, 4, generator=g)
        ref_opt.zero_grad()
        ((ref(x) - y) ** 2).mean().backward()
        mine = slice(4 * rank, 4 * (rank + 1))
        ((model(x[mine]) - y[mine]) ** 2).mean().backward()
        if step == 1:
            ref[0].weight.grad = None
            ref[2].bias.grad = torch.full((4,), 0.25)
            ref[0].bias.grad = ref[0].bias.grad * 2
            for write in (lambda: setattr(model[0].weight, "grad", None), lambda: delattr(model[0].weight, "grad"),
                          lambda: setattr(model[2].bias, "grad", torch.zeros(4))):
                try:
                    write()
                except zero3.ZeroStateError as exc:
                    refused.append("safe_set_full_grad" in str(exc))
            zero3.safe_set_full_grad(model[0].weight, None)
            zero3.safe_set_full_grad(model[2].bias, torch.full((4,), 0.25))
            local = zero3.safe_get_local_grad(model[0].bias)
            zero3.safe_set_local_grad(model[0].bias, local * 2)
        ref_opt.step()
        opt.step()
        opt.zero_grad()
    with zero3.GatheredParameters(list(model.parameters())):
        diff = max((a - b).abs().max().item() for a, b in zip(model.parameters(), ref.parameters()))
    return {"diff": diff, "refused": refused, "steps": engine.global_steps}


@pytest.mark.parametrize("threshold", [0, 10**6])  # partitioned, and kept gathered (persistent)
def test_gradient_writes_between_backward_and_step_are_refused_and_the_setters_act_as_torch(pools, threshold):
    for r in pools.get(2).run(grad_writes, threshold):
        assert r["refused"] == [True, True, True], r
        assert r["steps"] == 3, r  # the user's optimizer.step() is the engine's step
        assert r["diff"] < 1e-6, r


class _WithUnused(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.unused = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.a(x).pow(2).mean()


def grad_writes_without_gradient(threshold: int) -> dict:
    """``p.grad = g`` on a parameter whose shard holds no gradient (one the backward did not reach, or
    before any backward): probe 35B found it taken and ignored (torch steps on it: 0.1 off after one
    SGD step). Refused, naming the setter, which then trains as torch's write does."""
    rank, world = dist.get_rank(), dist.get_world_size()
    ref, model = twins(_WithUnused)
    ref_opt, opt = torch.optim.SGD(ref.parameters(), lr=0.1), torch.optim.SGD(model.parameters(), lr=0.1)
    engine = zero3.initialize(model, opt, {"param_persistence_threshold": threshold})
    refused = []

    def write(p: torch.Tensor) -> None:
        try:
            p.grad = torch.ones(4, 4)
        except zero3.ZeroStateError as exc:
            refused.append("safe_set_full_grad" in str(exc))

    write(model.a.weight)  # before the first forward
    x = torch.randn(2 * world, 4, generator=torch.Generator().manual_seed(1))
    ref(x).backward()
    ref.unused.weight.grad = torch.ones(4, 4)
    ref_opt.step()
    model(x[2 * rank:2 * rank + 2]).backward()
    write(model.unused.weight)  # the backward did not reach it
    model.unused.weight.grad = None  # clearing what is not there is taken (torch's zero_grad does it)
    zero3.safe_set_full_grad(model.unused.weight, torch.ones(4, 4))
    opt.step()
    opt.zero_grad()
    write(model.unused.weight)  # between steps
    with torch.no_grad():
        model(x[2 * rank:2 * rank + 2])
    write(model.a.weight)  # after an evaluation forward (review 35R1: a kept-gathered one was torch's again)
    with zero3.GatheredParameters([model.unused.weight]):
        write(model.unused.weight)  # gathered between steps (review 35R1: taken and ignored)
    model.unused.weight.all_gather()  # DeepSpeed's own gather (review 35R2: taken and ignored)
    write(model.unused.weight)
    model.unused.weight.partition()
    return {"refused": refused, "diff": _largest_difference(model, ref), "steps": engine.global_steps}


def _largest_difference(model: nn.Module, ref: nn.Module) -> float:
    with zero3.GatheredParameters(list(model.parameters())):
        return max((a - b).abs().max().item() for a, b in zip(model.parameters(), ref.parameters()))


@pytest.mark.parametrize("threshold", [0, 10**6])  # partitioned, and kept gathered (persistent)
def test_a_gradient_assigned_where_the_shard_holds_none_is_refused(pools, threshold):
    for r in pools.get(2).run(grad_writes_without_gradient, threshold):
        assert r["refused"] == [True] * 6, r
        assert r["steps"] == 1 and r["diff"] < 1e-6, r


def set_grads_without_backward(threshold: int, who: str) -> dict:
    """DP-SGD as docs/api.md (torch.func) has it: gradients computed on a plain copy, set through
    safe_set_full_grad (``who``: "every rank", or "rank 0" alone), then engine.step() with no backward;
    torch steps the assigned p.grad. Three AdamW steps, then one ordinary step."""
    rank, world = dist.get_rank(), dist.get_world_size()
    ref, model, ref_opt, opt, engine = _twin_mlps(threshold)
    g = torch.Generator().manual_seed(2)
    refused, steps = [], []
    for step in range(3):
        grads = [torch.randn(p.shape, generator=g) for p in ref.parameters()]
        if who == "every rank" or rank == 0:
            for p, gr in zip(model.parameters(), grads):
                zero3.safe_set_full_grad(p, gr)
        try:
            steps.append(engine.step())
        except zero3.ZeroStateError as exc:
            refused.append(str(exc))
            engine.zero_grad()  # rank 0's set gradients stay until dropped, as an assigned p.grad does
            break
        for p, gr in zip(ref.parameters(), grads):
            p.grad = gr.clone()
        ref_opt.step()
    x, y = torch.randn(4 * world, 8, generator=g), torch.randn(4 * world, 4, generator=g)
    ref_opt.zero_grad()  # and a step after a backward as before
    ((ref(x) - y) ** 2).mean().backward()
    ref_opt.step()
    mine = slice(4 * rank, 4 * (rank + 1))
    ((model(x[mine]) - y[mine]) ** 2).mean().backward()
    after = engine.step()
    with zero3.GatheredParameters(list(model.parameters())):
        diff = max((a - b).abs().max().item() for a, b in zip(model.parameters(), ref.parameters()))
    return {"diff": diff, "refused": refused, "steps": steps, "after": after, "global_steps": engine.global_steps}


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("threshold", [0, 10**6])
def test_gradients_set_without_a_backward_are_stepped_on_as_torch_steps_assigned_grads(pools, world, threshold):
    """Probe 33V: the step was refused ("no backward reached the model") though the setters set the
    gradient the next step uses; torch's step moved the weights by up to 0.26."""
    for r in pools.get(world).run(set_grads_without_backward, threshold, "every rank"):
        assert r["refused"] == [] and r["steps"] == [True] * 3, r
        assert r["after"] is True and r["global_steps"] == 4, r
        assert r["diff"] < 1e-6, r


def test_gradients_set_on_some_ranks_only_are_refused_on_every_rank_before_anything_steps(pools):
    for rank, r in enumerate(pools.get(2).run(set_grads_without_backward, 0, "rank 0")):
        assert len(r["refused"]) == 1 and "without a backward on ranks [0] but not on ranks [1]" in r["refused"][0], r
        assert r["steps"] == [] and r["global_steps"] == 1, r  # the refused step counted nothing
        assert r["diff"] < 1e-6, r  # nothing stepped: the ordinary step after it trains as torch's


# -- in-place writes to persistent parameters (runtime/persistent.py `take_writes`) ------------------
_OFFLOADS = {
    "in memory": {},
    # the master on the drive: the write was skipped (0.077 off after 4 steps); now read in and taken
    "optimizer on nvme": {"offload_optimizer": {"device": "nvme", "nvme_path": "{dir}"}},
    # the step in backward stepped before engine.step took the write (0.077 off); now taken before it steps
    "step in backward": {"offload_optimizer": {"device": "none", "step_in_backward": True}},
    "step in backward, optimizer on nvme": {"offload_optimizer": {"device": "nvme", "nvme_path": "{dir}",
                                                                 "step_in_backward": True}},
}


def persistent_writes(where: str, offload: str = "in memory", directory: str = "") -> dict:
    """Weights written in place after initialize, outside GatheredParameters, on parameters the
    default budgets keep gathered: torch keeps the write and steps from it; so must zero3."""
    rank, world = dist.get_rank(), dist.get_world_size()
    ref, model = twins(_mlp)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, eps=1e-6)
    offload = {k: {**v, **({"nvme_path": f"{directory}/rank{rank}"} if "nvme_path" in v else {})}
               for k, v in _OFFLOADS[offload].items()}
    engine = zero3.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-6),
                              {"param_persistence_threshold": 10**6, **offload})
    assert all(p._zero.persistent for p in model.parameters())

    def write(m: nn.Module) -> None:
        nn.init.zeros_(m[2].bias)
        m[0].weight.data.mul_(0.5)
        with torch.no_grad():
            m[0].bias.fill_(0.1)

    g = torch.Generator().manual_seed(1)
    for step in range(3):
        x, y = torch.randn(4 * world, 8, generator=g), torch.randn(4 * world, 4, generator=g)
        if step == 1 and where == "before forward":
            write(ref)
            write(model)
        ref_opt.zero_grad()
        ((ref(x) - y) ** 2).mean().backward()
        mine = slice(4 * rank, 4 * (rank + 1))
        ((model(x[mine]) - y[mine]) ** 2).mean().backward()
        if step == 1 and where == "before step":
            write(ref)
            write(model)
        ref_opt.step()
        engine.step()
    with zero3.GatheredParameters(list(model.parameters())):
        return {"diff": max((a - b).abs().max().item() for a, b in zip(model.parameters(), ref.parameters()))}


@pytest.mark.parametrize("where", ["before forward", "before step"])
def test_in_place_writes_to_persistent_parameters_are_kept_as_in_torch(pools, where):
    for r in pools.get(2).run(persistent_writes, where):
        assert r["diff"] < 1e-6, r


@pytest.mark.parametrize("world", [1, 2])  # at 1 a persistent parameter viewed its shard, which the drive's master missed
@pytest.mark.parametrize("offload", [k for k in _OFFLOADS if k != "in memory"])
def test_in_place_writes_to_persistent_parameters_are_kept_with_offload_and_the_step_in_backward(pools, tmp_path,
                                                                                                   offload, world):
    for r in pools.get(world).run(persistent_writes, "before forward", offload, str(tmp_path)):
        assert r["diff"] < 1e-6, r


def persistent_write_then_save(directory: str, precision: str) -> dict:
    """An in-place write to kept-gathered parameters after initialize, then every way of reading or
    saving the trained values before any step: they read the shards or masters, which took the write
    only at the next step (a checkpoint resumed with the old weights)."""
    config = {"param_persistence_threshold": 10**6, **({"bf16": {"enabled": True}} if precision == "bf16" else {})}

    def build() -> tuple:
        ref, model = twins(_mlp)
        return ref, model, zero3.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-6), config)

    ref, model, engine = build()
    for m in (ref, model):
        nn.init.zeros_(m[2].bias)
        m[0].weight.data.mul_(0.5)
        with torch.no_grad():
            m[0].bias.fill_(0.25)
    want = {k: v.detach().clone() for k, v in ref.state_dict().items()}

    def off(got: dict) -> float:
        return max((got[k].float() - v).abs().max().item() for k, v in want.items())

    diffs = {"consolidated_state_dict": off(engine.consolidated_state_dict(rank0_only=False)),
             "safe_get_full_fp32_param": off({"0.weight": zero3.safe_get_full_fp32_param(model[0].weight),
                                              **{k: want[k] for k in want if k != "0.weight"}})}
    engine.save_16bit_model(directory, "model16.bin")
    diffs["save_16bit_model"] = off(torch.load(f"{directory}/model16.bin"))
    engine.save_checkpoint(directory, tag="written")
    _, resumed, resumed_engine = build()
    resumed_engine.load_checkpoint(directory, tag="written")
    diffs["load_checkpoint"] = off(resumed_engine.consolidated_state_dict(rank0_only=False))
    return diffs


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_a_write_to_persistent_parameters_reaches_every_save_before_the_next_step(pools, tmp_path, precision):
    tol = 1e-6 if precision == "fp32" else 1e-2  # bf16: the 16-bit model's and the written copy's rounding
    for r in pools.get(2).run(persistent_write_then_save, str(tmp_path), precision):
        assert max(r.values()) < tol, r


def one_element_write(dtype: str) -> dict:
    """An in-place write to one element of a persistent weight whose fp32 masters hold values a
    low-precision copy cannot: the step (lr 0) must change that element's master and no other."""
    with zero3.Init():
        model = nn.Sequential(nn.Linear(8, 16))
    engine = zero3.initialize(model, torch.optim.SGD(model.parameters(), lr=0.0),
                              {"param_persistence_threshold": 10**6, "dtype": dtype})
    w = model[0].weight
    zero3.safe_set_full_fp32_param(w, torch.full((16, 8), 1.0 + 2**-12))  # not a bf16 or fp16 value
    before = zero3.safe_get_full_fp32_param(w)
    engine.backward(engine(torch.randn(2, 8).to(w.dtype)).float().sum())
    with torch.no_grad():
        w[0, 0] = 0.5
    engine.step()
    after = zero3.safe_get_full_fp32_param(w)
    return {"changed": int((after != before).sum()), "written": after[0, 0].item()}


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_an_in_place_write_to_one_element_reaches_that_element_s_master_only(pools, dtype):
    for r in pools.get(2).run(one_element_write, dtype):
        assert r == {"changed": 1, "written": 0.5}, r


def write_without_optimizer() -> dict:
    """An engine without an optimizer (evaluation, a frozen reference model) still gathers its
    persistent parameters again at engine.step(): a write before it must survive."""
    with zero3.Init():
        model = _mlp()
    engine = zero3.initialize(model, None, {"param_persistence_threshold": 10**6})
    with torch.no_grad():
        model[0].bias.fill_(0.25)
    engine.step()
    with zero3.GatheredParameters([model[0].bias]):
        return {"kept": bool((model[0].bias == 0.25).all())}


def test_an_in_place_write_survives_the_step_of_an_engine_without_an_optimizer(pools):
    for r in pools.get(2).run(write_without_optimizer):
        assert r["kept"], r


def data_replaced(how: str) -> dict:
    """``p.data = t`` on a persistent parameter between steps: a fresh tensor, or (torch's
    vector_to_parameters) a view into one long vector, which the release must leave alone."""
    ref, model, ref_opt, _, engine = _twin_mlps(10**6)
    vectors = []
    with torch.no_grad():
        for net in (ref, model):
            if how == "vector":
                vectors.append(parameters_to_vector(net.parameters()) * 0.5)
                vector_to_parameters(vectors[-1], net.parameters())
            elif how == "transposed":  # a non-contiguous t
                net[0].weight.data = torch.linspace(-1, 1, 128).view(8, 16).t()
            else:
                net[0].weight.data = torch.full((16, 8), 0.1)
    kept = vectors[1].clone() if vectors else None
    diff = _two_steps_beside(ref, ref_opt, model, engine)
    return {"diff": diff, "vector_intact": kept is None or torch.equal(vectors[1], kept)}


@pytest.mark.parametrize("how", ["fresh", "vector", "transposed"])
def test_parameter_data_replaced_between_steps_is_kept_as_in_torch(pools, how):
    for r in pools.get(2).run(data_replaced, how):
        assert r["diff"] < 1e-6, r
        # The user's vector keeps its values: zero3 took them and left its storage (emptying it broke the
        # next gather). Unlike torch's, whose parameters are views of it, it does not follow the steps.
        assert r["vector_intact"], r


def modifier_sets_noncontiguous_data(threshold: int) -> dict:
    """``p.data = t`` of a non-contiguous ``t`` on rank 0 inside ``GatheredParameters(modifier_rank=0)``
    (it failed in the publish's copy back from the broadcast), then two steps beside torch's."""
    rank = dist.get_rank()
    ref, model, ref_opt, _, engine = _twin_mlps(threshold)
    t = torch.linspace(-1, 1, 128).view(8, 16).t()
    ref[0].weight.data = t.clone()
    with zero3.GatheredParameters([model[0].weight], modifier_rank=0):
        if rank == 0:
            model[0].weight.data = t
        else:
            model[0].weight.data = torch.full((16, 8), 7.0)  # rank 0's broadcast overwrites it
    diff = _two_steps_beside(ref, ref_opt, model, engine)
    return {"diff": diff}


@pytest.mark.parametrize("threshold", [0, 10**6])
def test_a_non_contiguous_value_published_by_rank_0_trains_as_torch(pools, threshold):
    for r in pools.get(2).run(modifier_sets_noncontiguous_data, threshold):
        assert r["diff"] < 1e-6, r


class _LoadFailed(Exception):
    pass


def modifier_block_raises(who: str, threshold: int, in_forward: bool) -> dict:
    """Rank 0 writes into both layers inside ``GatheredParameters(modifier_rank=0)`` (a fill, and
    ``.data =`` a new tensor), then ``who`` raises before the exit (a load failing halfway). The
    persistent parameters (threshold 100: the biases) kept rank 0's write on rank 0 only, which the
    next step took into rank 0's slice; with one rank raising, the other's broadcast met no peer.
    Now nothing is published on any rank: the values are the ones before the block, and two steps
    train as torch's without the write."""
    rank = dist.get_rank()
    ref, model, ref_opt, _, engine = _twin_mlps(threshold)
    params = [model[0].weight, model[0].bias, model[2].weight, model[2].bias]
    outer = zero3.GatheredParameters([model[2].weight]) if in_forward else contextlib.nullcontext()
    error = ""
    with outer:  # a parameter another holder keeps gathered across the block
        try:
            with zero3.GatheredParameters(params, modifier_rank=0):
                if rank == 0:
                    with torch.no_grad():
                        for p in params[:2]:
                            p.fill_(0.05)
                        params[2].copy_(params[2].flip(0))  # a permutation: a sum of its words stays
                    params[3].data = torch.full((4,), 0.05)
                if who == "all" or rank == 0:
                    raise _LoadFailed("rank 0's checkpoint read failed")
        except _LoadFailed:
            error = "own"
        except zero3.ZeroStateError as e:
            error = str(e)
        with zero3.GatheredParameters(params):
            unchanged = all(torch.equal(p, r) for p, r in zip(params, ref.parameters()))
    return {"error": error, "unchanged": unchanged, "diff": _two_steps_beside(ref, ref_opt, model, engine)}


@pytest.mark.parametrize("who", ["all", "rank 0"])
@pytest.mark.parametrize("threshold,in_forward", [(100, False), (0, True), (10**6, False)])
def test_a_modifier_block_that_raised_publishes_nothing_on_any_rank(pools, who, threshold, in_forward):
    results = pools.get(2).run(modifier_block_raises, who, threshold, in_forward)
    for rank, r in enumerate(results):
        assert r["unchanged"] and r["diff"] < 1e-6, r
        if who == "all" or rank == 0:
            assert r["error"] == "own", r
        else:
            assert "rank(s) 0 left the block with an exception" in r["error"], r


def modifier_block_exit_fails(how: str) -> dict:
    """The exit's agreement cannot complete (rank 0 alone ran a collective inside the block: a
    divergence), or rank 0 alone gives a persistent parameter another shape after initialize (refused).
    The first left the block's parameters pinned and gathered on a rank for good (training 4e-3 off);
    the second hung: the refusing rank gathered the persistent parameters again while the other sat in
    the exit. Now both raise on every rank, nothing stays pinned, and training goes on as torch's."""
    rank = dist.get_rank()
    ref, model, ref_opt, _, engine = _twin_mlps(100)  # the biases persistent
    params = [model[0].weight, model[0].bias]
    error = ""
    try:
        with zero3.GatheredParameters(params, modifier_rank=0):
            if rank == 0:
                if how == "diverge":
                    zero3.safe_get_full_fp32_param(model[2].weight)  # a collective rank 1 does not run
                else:
                    model[0].bias.data = torch.zeros(5)
    except (zero3.ZeroStateError, zero3.ZeroDivergenceError) as e:
        error = type(e).__name__
    pins = [p._zero.user_pins for p in model.parameters()]
    return {"error": error, "pins": pins, "diff": _two_steps_beside(ref, ref_opt, model, engine)}


@pytest.mark.parametrize("how", ["diverge", "reshape"])
def test_a_modifier_block_whose_exit_fails_on_one_rank_leaves_nothing_pinned(pools, how):
    for r in pools.get(2).run(modifier_block_exit_fails, how):
        # a refused shape: rank 0 names it, rank 1 names rank 0 (its broadcast met no peer before)
        assert r["error"] == ("ZeroDivergenceError" if how == "diverge" else "ZeroStateError"), r
        assert r["pins"] == [0, 0, 0, 0] and r["diff"] < 1e-6, r


def data_resized() -> dict:
    """``p.data = t`` of another shape after initialize (a bias of 16 given one element, which the
    forward broadcasts): its gradient then has another size than the shards'. Refused by name in the
    backward on every rank; with data of its own shape again, training goes on as torch's."""
    rank, world = dist.get_rank(), dist.get_world_size()
    ref, model, ref_opt, opt, engine = _twin_mlps(10**6)
    g = torch.Generator().manual_seed(1)
    mine = slice(4 * rank, 4 * (rank + 1))
    x, y = torch.randn(4 * world, 8, generator=g), torch.randn(4 * world, 4, generator=g)
    model[0].bias.data = torch.full((1,), 0.5)
    try:
        engine.backward(((model(x[mine]) - y[mine]) ** 2).mean())
        error = ""
    except zero3.ZeroStateError as e:
        error = str(e)
    with torch.no_grad():
        model[0].bias.data = torch.full((16,), 0.5)
        ref[0].bias.fill_(0.5)
    opt.zero_grad()
    return {"error": error, "diff": _two_steps_beside(ref, ref_opt, model, engine, g)}


def test_parameter_data_of_another_shape_is_refused_in_the_backward_and_training_goes_on(pools):
    for r in pools.get(2).run(data_resized):
        assert "0.bias got a gradient of shape (1,) (its shape is (16,))" in r["error"], r
        assert r["diff"] < 1e-6, r


class _Boom(torch.autograd.Function):
    """Passes its input on; its backward raises (a NaN check in a custom function, a failing hook)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        raise FloatingPointError("boom in backward")


def skip_failed_backward(how: str, config: dict) -> dict:
    """Step 1's backward raises after the last two layers' gradients were made; the loop catches it
    and goes on: torch's skip-a-batch loop (``zero_grad``) drops that step. zero3 kept the queued
    gradients of a bare ``loss.backward()`` and reduced them with the next backward's; after
    ``engine.backward`` those reduced before the failure stayed, as many as the buckets allowed."""
    rank, world = dist.get_rank(), dist.get_world_size()
    build = lambda: nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))  # noqa: E731
    ref, model = twins(build)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    engine = zero3.initialize(model, opt, config)
    g = torch.Generator().manual_seed(1)
    mine = slice(4 * rank, 4 * (rank + 1))

    def loss_of(net: nn.Module, x: torch.Tensor, y: torch.Tensor, boom: bool) -> torch.Tensor:
        h = net[1](net[0](x))
        return ((net[4](net[3](net[2](_Boom.apply(h) if boom else h))) - y) ** 2).mean()

    raised = []
    for step in range(4):
        x, y = torch.randn(4 * world, 8, generator=g), torch.randn(4 * world, 4, generator=g)
        try:
            loss_of(ref, x, y, step == 1).backward()
            ref_opt.step()
        except FloatingPointError:
            pass
        ref_opt.zero_grad()
        try:
            loss = loss_of(model, x[mine], y[mine], step == 1)
            engine.backward(loss) if how == "engine" else loss.backward()
            engine.step()
        except FloatingPointError:
            raised.append(step)
            if how == "plain":
                opt.zero_grad()
    with zero3.GatheredParameters(list(model.parameters())):
        diff = max((a - b).abs().max().item() for a, b in zip(model.parameters(), ref.parameters()))
    return {"diff": diff, "raised": raised}


@pytest.mark.parametrize("config", [{}, {"param_persistence_threshold": 0, "reduce_bucket_size": 10,
                                         "prefetch_bucket_size": 10}], ids=["defaults", "small buckets"])
@pytest.mark.parametrize("how", ["plain", "engine"])
def test_a_micro_batch_whose_backward_raised_is_dropped_as_torch_s_loop_drops_it(pools, how, config):
    for r in pools.get(2).run(skip_failed_backward, how, config):
        assert r["raised"] == [1], r
        assert r["diff"] < 1e-6, r


def loss_term_from_gathered(where: str) -> dict:
    """A regulariser on a partitioned weight (``w.pow(2)`` saves ``w`` for its backward) built inside
    GatheredParameters after the forward, backpropagated inside the block or after it (it read storage
    that the exit, or the release after its module's backward, had freed: a segfault), or built in
    two nested blocks; two steps beside torch's ([Note: a loss term from GatheredParameters])."""
    rank, world = dist.get_rank(), dist.get_world_size()
    ref, model, ref_opt, _, engine = _twin_mlps(0)
    g = torch.Generator().manual_seed(1)
    mine = slice(4 * rank, 4 * (rank + 1))
    for _ in range(2):
        x, y = torch.randn(4 * world, 8, generator=g), torch.randn(4 * world, 4, generator=g)
        ref_opt.zero_grad()
        ref_loss = ((ref(x) - y) ** 2).mean() + 0.1 * ref[2].weight.pow(2).sum()
        (ref_loss + (ref[0].weight.pow(2).sum() if where == "nested" else 0)).backward()
        ref_opt.step()
        loss = ((model(x[mine]) - y[mine]) ** 2).mean()
        with zero3.GatheredParameters([model[0].weight] if where == "nested" else []):
            with zero3.GatheredParameters([model[2].weight]):
                loss = loss + 0.1 * model[2].weight.pow(2).sum()
                if where == "nested":
                    loss = loss + model[0].weight.pow(2).sum()
                if where == "inside":
                    loss.backward()
        if where != "inside":
            loss.backward()
        engine.step()
    with zero3.GatheredParameters(list(model.parameters())):
        diff = max((a - b).abs().max().item() for a, b in zip(model.parameters(), ref.parameters()))
    return {"diff": diff, "live": [p._zero.name for p in engine.coordinator.live_params]}


@pytest.mark.parametrize("where", ["inside", "after", "nested"])
def test_a_loss_term_built_inside_gathered_parameters_trains_as_torch(pools, where):
    for r in pools.get(2).run(loss_term_from_gathered, where):
        assert r["diff"] < 1e-6, r
        assert r["live"] == [], r  # what the blocks kept for the step was released with it


def loss_term_backpropagated_after_its_block(order: str) -> dict:
    """A term built inside GatheredParameters, whose backward runs after the block released the weight
    it saved (runtime/saved_params.py [Note: a saved parameter outlives its gather]): it read freed
    storage, a segfault on every rank. ``order``: the term's own backward before the model's ("first")
    or after it ("last"); a term on a view of the weight (``w.t() @ w``); a block entered inside the
    step whose term is backpropagated after the step's backward ("in step"); all under torch's
    ``save_on_cpu`` hooks ("outer hooks"). Two steps beside torch's, the same order there."""
    rank, world = dist.get_rank(), dist.get_world_size()
    ref, model = twins(_mlp)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    engine = zero3.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1),
                              {"param_persistence_threshold": 0, "max_reuse_distance": 0, "prefetch_bucket_size": 0})
    g = torch.Generator().manual_seed(1)
    mine = slice(4 * rank, 4 * (rank + 1))

    def term(w: torch.Tensor) -> torch.Tensor:
        return 0.1 * ((w.t() @ w).sum() if order == "view" else w.pow(2).sum())

    def step(net: nn.Module, x: torch.Tensor, y: torch.Tensor, gathered: bool) -> None:
        modifier = 0 if order == "modifier block" else None  # a block that may write, and writes nothing
        block = zero3.GatheredParameters([net[2].weight], modifier) if gathered else contextlib.nullcontext()
        if order != "in step":
            with block:
                reg = term(net[2].weight)
        if order == "first":
            reg.backward()
        loss = ((net(x) - y) ** 2).mean()
        if order == "in step":
            with block:
                reg = term(net[2].weight)
        loss.backward()
        if order != "first":
            reg.backward()

    outer = torch.autograd.graph.save_on_cpu() if order == "outer hooks" else contextlib.nullcontext()
    with outer:
        for _ in range(2):
            x, y = torch.randn(4 * world, 8, generator=g), torch.randn(4 * world, 4, generator=g)
            step(ref, x, y, False)
            ref_opt.step()
            ref_opt.zero_grad()
            step(model, x[mine], y[mine], True)
            engine.step()
    with zero3.GatheredParameters(list(model.parameters())):
        diff = max((a - b).abs().max().item() for a, b in zip(model.parameters(), ref.parameters()))
    return {"diff": diff, "live": [p._zero.name for p in engine.coordinator.live_params]}


@pytest.mark.parametrize("order", ["first", "last", "view", "in step", "outer hooks", "modifier block"])
def test_a_term_from_gathered_parameters_backpropagated_after_the_block_trains_as_torch(pools, order):
    for r in pools.get(2).run(loss_term_backpropagated_after_its_block, order):
        assert r["diff"] < 1e-6, r
        assert r["live"] == [], r  # the weight gathered again for the term's backward was released


def term_saved_across_a_step() -> dict:
    """The weight changes (an optimizer step) between the term's build and its backward: torch's backward
    raises (the saved tensor was modified in place); zero3's must too, naming the weight, and train on."""
    ref, model = twins(_mlp)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    engine = zero3.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), {"param_persistence_threshold": 0})
    out = {}
    for net, opt, name in ((ref, ref_opt, "torch"), (model, engine, "zero3")):
        x = torch.ones(4, 8)
        with zero3.GatheredParameters([net[2].weight]) if name == "zero3" else contextlib.nullcontext():
            reg = net[2].weight.pow(2).sum()
        net(x).sum().backward()
        opt.step()
        try:
            reg.backward()
            out[name] = "no error"
        except RuntimeError as e:
            out[name] = f"{type(e).__name__}: {e}"
    return out


def test_a_term_whose_weight_changed_before_its_backward_is_refused_as_torch_refuses_it(pools):
    for r in pools.get(2).run(term_saved_across_a_step):
        assert "modified by an inplace operation" in r["torch"], r
        assert r["zero3"].startswith("ZeroStateError") and "2.weight" in r["zero3"], r


def resize_with_a_second_init_block() -> dict:
    """transformers 4.x's resize under DeepSpeed: the new embedding built under an Init block of its
    own, the old rows copied with GatheredParameters([old.weight, new.weight], modifier_rank=0), the
    new one swapped in, then initialize. It was refused ('parameters of two different models or
    zero3.Init contexts'). Two steps beside torch doing the same."""
    rank, world = dist.get_rank(), dist.get_world_size()

    def build() -> nn.Module:
        return nn.Sequential(nn.Embedding(10, 8), nn.Linear(8, 4))

    ref, model = twins(build)
    torch.manual_seed(1)
    ref_new = nn.Embedding(14, 8)
    torch.manual_seed(1)
    with zero3.Init():
        new = nn.Embedding(14, 8)
    with torch.no_grad():
        ref_new.weight[:10] = ref[0].weight
    with zero3.GatheredParameters([model[0].weight, new.weight], modifier_rank=0), torch.no_grad():
        if rank == 0:
            new.weight[:10] = model[0].weight
    ref[0], model[0] = ref_new, new
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    engine = zero3.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), {"param_persistence_threshold": 0})
    g = torch.Generator().manual_seed(2)
    for _ in range(2):
        idx, y = torch.randint(0, 14, (4 * world,), generator=g), torch.randn(4 * world, 4, generator=g)
        ((ref(idx) - y) ** 2).mean().backward()
        ref_opt.step()
        ref_opt.zero_grad()
        engine.backward(((model(idx[4 * rank:4 * rank + 4]) - y[4 * rank:4 * rank + 4]) ** 2).mean())
        engine.step()
    with zero3.GatheredParameters(list(model.parameters())):
        return {"diff": max((a - b).abs().max().item() for a, b in zip(model.parameters(), ref.parameters()))}


def test_a_resize_with_the_new_embedding_from_its_own_init_block_trains_as_torch(pools):
    for r in pools.get(2).run(resize_with_a_second_init_block):
        assert r["diff"] < 1e-6, r


def initialized_under_inference_mode() -> dict:
    """An eval-first script: initialize (and a first evaluation) under torch.inference_mode(), then
    training outside it. The shards and masters made there must stay trainable."""
    rank, world = dist.get_rank(), dist.get_world_size()
    ref, model = twins(_mlp)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, eps=1e-6)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-6)
    with torch.inference_mode():
        zero3.initialize(model, opt, {"param_persistence_threshold": 0})
        model(torch.ones(1, 8))
    g = torch.Generator().manual_seed(1)
    mine = slice(4 * rank, 4 * (rank + 1))
    for _ in range(2):
        x, y = torch.randn(4 * world, 8, generator=g), torch.randn(4 * world, 4, generator=g)
        ((ref(x) - y) ** 2).mean().backward()
        ref_opt.step()
        ref_opt.zero_grad()
        ((model(x[mine]) - y[mine]) ** 2).mean().backward()
        opt.step()
        opt.zero_grad()
    with zero3.GatheredParameters(list(model.parameters())):
        return {"diff": max((a - b).abs().max().item() for a, b in zip(model.parameters(), ref.parameters()))}


def test_initialize_under_inference_mode_then_training_acts_as_torch(pools):
    for r in pools.get(2).run(initialized_under_inference_mode):
        assert r["diff"] < 1e-6, r


# -- torch modules that deep-copy a layer, built under Init (runtime/init.py `_deepcopy`) ------------
class _Encoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
        self.enc = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)  # deep-copies the layer
        self.head = nn.Linear(16, 4)

    def forward(self, x):
        return self.head(self.enc(x)).pow(2).mean()


def encoder_under_init(threshold: int) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    ref, model = twins(_Encoder)  # under Init: "cannot deepcopy partitioned parameter" before
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)  # Adam: see the in_proj_bias note in test_init
    engine = zero3.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                              {"param_persistence_threshold": threshold})
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(3):
        x = torch.randn(2 * world, 5, 16, generator=g)
        ref_loss = ref(x)
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        loss = engine(x[2 * rank: 2 * (rank + 1)])
        engine.backward(loss)
        engine.step()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(abs(total.item() / world - ref_loss.item()))
    with zero3.GatheredParameters(list(model.parameters())):
        diff = max((a - b).abs().max().item() for a, b in zip(model.parameters(), ref.parameters()))
    return {"loss": max(losses), "diff": diff}


@pytest.mark.parametrize("threshold", [0, 10**6])
def test_a_transformer_encoder_built_under_init_trains_as_torch(pools, threshold):
    for r in pools.get(2).run(encoder_under_init, threshold):
        assert r["loss"] < 1e-5 and r["diff"] < 1e-5, r


def submodule_pretrained_load() -> dict:
    """zero3.pretrained.load_state_dict into a submodule of a managed model (what load_checkpoint's own
    message suggests for part of a model): its persistent parameters kept their old gathered values
    until the next step (the load refreshed them only when given the root or the engine)."""
    ref, model = twins(_mlp)
    engine = zero3.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), {"param_persistence_threshold": 10**6})
    assert all(p._zero.persistent for p in model.parameters())
    new = {k: torch.randn_like(v) for k, v in ref[0].state_dict().items()}
    zero3.pretrained.load_state_dict(model[0], new)
    ref[0].load_state_dict(new)
    x = torch.randn(3, 8)
    with torch.no_grad():
        return {"forward": (engine(x) - ref(x)).abs().max().item(),
                "weights": max((a - b).abs().max().item() for a, b in zip(model.parameters(), ref.parameters()))}


def test_a_pretrained_load_into_a_submodule_reaches_its_persistent_parameters(pools):
    for r in pools.get(2).run(submodule_pretrained_load):
        assert r["forward"] < 1e-6 and r["weights"] == 0, r


def merge_unmerge_read_only() -> dict:
    """TRL's LoRA weight sync to vLLM: inside ``GatheredParameters`` without ``modifier_rank``, a delta
    is merged into the weight, the merged weight read, and the delta unmerged; W + D - D is W up to
    rounding, which the exit raised on (every rank; probe 28B) and now discards. A write to a row that
    rank 0's slice holds is reported on every rank: the ranks agree on what they found in their slices
    (review 28Y: rank 1 went on alone, and hung in its next collective)."""
    ref, model = twins(_mlp)
    engine = zero3.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), {"param_persistence_threshold": 0})
    d = torch.randn(16, 8, generator=torch.Generator().manual_seed(3)) * 0.3
    with zero3.GatheredParameters(list(model.parameters())), torch.no_grad():
        model[0].weight.data += d
        merged = torch.equal(model[0].weight, ref[0].weight + d)
        model[0].weight.data -= d
        rounding = (model[0].weight - ref[0].weight).abs().max().item()
    with zero3.GatheredParameters(list(model.parameters())):
        exact = all(torch.equal(a, b) for a, b in zip(model.parameters(), ref.parameters()))
    try:
        with zero3.GatheredParameters(list(model.parameters())), torch.no_grad():
            model[0].weight.data[0] += 1.0  # row 0: the first 8 of 128 elements, in rank 0's slice
        row = "no error"
    except zero3.ZeroStateError as exc:
        row = str(exc)
    engine.remove_hooks()
    return {"merged": merged, "rounding": rounding, "exact": exact, "row": row}


def test_a_merge_and_unmerge_inside_a_read_only_context_is_discarded_without_an_error(pools):
    results = pools.get(2).run(merge_unmerge_read_only)
    for rank, r in enumerate(results):
        assert r["merged"] and 0 < r["rounding"] < 1e-6 and r["exact"], r
        assert "0.weight changed inside the context" in r["row"], (rank, r)



def reshaped_on_one_rank(same_values: bool, threshold: int = 0) -> dict:
    """Rank 0 alone gives a weight data of another shape inside a read-only context: it raises the
    shape refusal, rank 1 the write the ranks agreed on, and neither waits for the other (rank 1 hung
    in the exit's agreement while rank 0 had raised before it; review 28Z1), the next collective works;
    also when the new data holds the same values (a reshape: the fingerprint does not change; 28Z3)."""
    ref, model = twins(_mlp)
    engine = zero3.initialize(model, None, {"param_persistence_threshold": threshold})
    try:
        with zero3.GatheredParameters([model[0].weight]), torch.no_grad():
            if dist.get_rank() == 0:
                w = model[0].weight
                w.data = w.data.reshape(-1) if same_values else torch.zeros(3, 3)
        error = "no error"
    except zero3.ZeroStateError as exc:
        error = str(exc)
    with zero3.GatheredParameters(list(model.parameters())):
        same = all(torch.equal(a, b) for a, b in zip(model.parameters(), ref.parameters()))
    engine.remove_hooks()
    return {"error": error, "same": same}


@pytest.mark.parametrize("same_values, threshold", [(False, 0), (True, 0), (True, 10**5)],
                         ids=["new values", "same values", "persistent"])
def test_a_new_shape_on_one_rank_in_a_read_only_context_raises_on_every_rank_without_a_hang(pools, same_values,
                                                                                           threshold):
    """The persistent case (the default threshold; review 28Z4): the reshaping rank gathered the
    persistent parameters again alone, a collective no other rank joined."""
    results = pools.get(2).run(reshaped_on_one_rank, same_values, threshold, timeout=60)
    assert "shape" in results[0]["error"], results
    assert "0.weight changed inside the context" in results[1]["error"], results
    assert all(r["same"] for r in results), results


def writes_on_one_rank(case: str) -> dict:
    """``other``: rank 0 alone writes rows that only the last rank's slice holds; each rank's own slice
    was unchanged on the rank that holds it, so nothing was reported and the edit vanished (probe 28F:
    the WARNING even called it rounding). ``keyerror``: rank 0 writes its own rows, rank 1 raises a
    KeyError of its own, which it must see (it got rank 0's write error instead). ``owner_raised``:
    rank 0 writes rank 1's rows and rank 1 raises: rank 0 cannot see those rows' size, so it reports a
    write (it called it rounding; review 28Z5). ``rounding_one_rank``: rank 0 alone merges and unmerges
    a delta: a change on some ranks only is a write, whatever its size (the ranks cannot tell rounding
    outside their own slices)."""
    torch.manual_seed(0)
    with zero3.Init():
        emb = nn.Embedding(32, 8)
    engine = zero3.initialize(emb, None, {"param_persistence_threshold": 0})
    rank = dist.get_rank()
    try:
        with zero3.GatheredParameters([emb.weight]), torch.no_grad():
            if rank == 0 and case == "rounding_one_rank":
                d = torch.randn(32, 8, generator=torch.Generator().manual_seed(1)) * 0.3
                emb.weight.data += d
                emb.weight.data -= d
            elif rank == 0:
                rows = slice(0, 2) if case == "keyerror" else slice(30, 32)
                emb.weight[rows] += 1.0
            if case in ("keyerror", "owner_raised") and rank == 1:
                raise KeyError("mine")
        error = "no error"
    except (zero3.ZeroStateError, KeyError) as exc:
        error = f"{type(exc).__name__}: {exc}"
    engine.remove_hooks()
    return {"error": error}


@pytest.mark.parametrize("case", ["other", "keyerror", "owner_raised", "rounding_one_rank"])
def test_a_write_on_one_rank_only_is_reported_on_every_rank_and_a_rank_s_own_error_wins(pools, case):
    results = [r["error"] for r in pools.get(2).run(writes_on_one_rank, case, timeout=60)]
    assert "ZeroStateError" in results[0] and "weight changed inside the context" in results[0], results
    assert results[1].startswith("KeyError") if case in ("keyerror", "owner_raised") else \
        "weight changed inside the context" in results[1], results


def random_pruning_per_rank_seed() -> dict:
    """Each rank prunes with its own RNG state (as data loaders leave it) inside a gather."""
    import torch.nn.utils.prune as prune

    rank = dist.get_rank()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    engine = zero3.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), {"param_persistence_threshold": 0})
    torch.manual_seed(100 + rank)
    with zero3.GatheredParameters(list(model[2].parameters()), modifier_rank=0):
        prune.random_unstructured(model[2], "weight", amount=0.5)
        pruned = model[2].weight.detach().clone()  # torch set it from the rank's own mask (review 31RD)
    g = torch.Generator().manual_seed(1)
    for _ in range(2):
        x = torch.randn(8, 8, generator=g)
        engine.backward(engine(x[4 * rank:4 * rank + 4]).square().mean())
        engine.step()
    return {"mask": model[2].weight_mask.clone(), "pruned": pruned}


def test_random_pruning_inside_a_gather_gives_every_rank_rank_0_s_mask(pools):
    """Each rank drew its own mask: 36 of 64 entries differed and the ranks trained different models,
    0.25 apart, without a word (review 31RC)."""
    first, second = pools.get(2).run(random_pruning_per_rank_seed)
    assert torch.equal(first["mask"], second["mask"]) and 0 < int(first["mask"].sum()) < first["mask"].numel()
    assert torch.equal(first["pruned"], second["pruned"])


def mutation_on_saved_tensors() -> dict:
    """The example GPT at a lean budget, 3 Adam steps with and without torch's
    allow_mutation_on_saved_tensors() around forward and backward: the weights after each."""
    from gpt import GPT, GPTConfig, synthetic_batch

    rank, cfg, out = dist.get_rank(), GPTConfig(block_size=16), {}
    for mode in ("none", "mutation"):
        torch.manual_seed(0)
        model = GPT(cfg)
        engine = zero3.initialize(model, torch.optim.Adam(model.parameters(), lr=1e-2, eps=1e-6), {
            "param_persistence_threshold": 0, "max_live_parameters": 3000, "prefetch_bucket_size": 1000})
        for step in range(3):
            x, y = synthetic_batch(step, 4, cfg)
            with torch.autograd.graph.allow_mutation_on_saved_tensors() if mode == "mutation" else \
                    contextlib.nullcontext():
                engine.backward(engine(x[2 * rank:2 * rank + 2], y[2 * rank:2 * rank + 2]))
            engine.step()
        with zero3.GatheredParameters(list(model.parameters())):
            out[mode] = torch.cat([p.detach().flatten() for p in model.parameters()])
        engine.remove_hooks()
    return {"diff": (out["mutation"] - out["none"]).abs().max().item()}


def test_allow_mutation_on_saved_tensors_trains_as_without_it(pools):
    """Review 34RB: at world 2 on a lean budget the backward's gathers, run under the mode, were cloned
    half-made ("illegal status change AVAILABLE -> AVAILABLE", or a segfault); now outside every mode."""
    for r in pools.get(2).run(mutation_on_saved_tensors):
        assert r["diff"] == 0.0, r


@dataclasses.dataclass
class _Features:
    z: torch.Tensor
    note: str


class _Teacher(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l1, self.l2 = nn.Linear(6, 8), nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> _Features:
        return _Features(self.l2(torch.tanh(self.l1(x))), "teacher")


def frozen_teacher_in_grad_mode(threshold: int) -> dict:
    """A DINO-style teacher: frozen, run without no_grad, returning a dataclass, updated by the EMA recipe."""
    torch.manual_seed(0)
    teacher = _Teacher().requires_grad_(False)
    engine = zero3.initialize(teacher, None, {"param_persistence_threshold": threshold, "allgather_impl": "p2p"})
    verifier = engine.context.comm._verifier
    epochs, logs = [], []
    for _ in range(30):
        teacher(torch.randn(3, 6))
        epochs.append(verifier.state.epoch)
        logs.append(len(verifier._log))
    w = teacher.l1.weight
    zero3.safe_set_local_fp32_param(w, zero3.safe_get_local_fp32_param(w) * 0.5)  # the EMA recipe, between steps
    return {"epochs": epochs, "logs": logs, "open": engine.context.step_open}


@pytest.mark.parametrize("threshold", [0, 10**6])
def test_a_frozen_teacher_in_grad_mode_ends_its_step_and_epoch_every_forward(pools, threshold):
    """Its step stayed open for good (the record grew by its events per forward, the EMA setter after the
    student's step was refused: probe 37H); ended, the verifier's epoch did not, and its log grew by the
    forward's requests each time (review 37R3). A dataclass output hides no tensor that needs grad."""
    for r in pools.get(2).run(frozen_teacher_in_grad_mode, threshold):
        assert not r["open"], r
        assert max(r["logs"]) <= 4, r  # all persistent: no collective at all
        if threshold == 0:
            assert r["epochs"] == list(range(r["epochs"][0], r["epochs"][0] + 30)), r
