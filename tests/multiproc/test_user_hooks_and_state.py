"""What user code does around the model on several ranks, against plain torch: gradient hooks
registered after initialize, reading the optimizer's state by parameter, weight_norm in a model
built under zero3.Init."""

from __future__ import annotations

import gc

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.utils.parametrizations import weight_norm

import zero3

from _reference import LinearReadingItsWeightLate, twins

pytestmark = pytest.mark.multiproc


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))


def _batches(world: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(4 * world, 8, generator=g), torch.randn(4 * world, 4, generator=g)) for _ in range(3)]


def _step_both(ref: nn.Module, ref_opt: torch.optim.Optimizer, model: nn.Module, opt: torch.optim.Optimizer,
               x: torch.Tensor, y: torch.Tensor) -> None:
    """A plain torch step of each: the reference on the whole batch, the model on this rank's part."""
    mine = slice(4 * dist.get_rank(), 4 * (dist.get_rank() + 1))
    for net, o, xs, ys in ((ref, ref_opt, x, y), (model, opt, x[mine], y[mine])):
        ((net(xs) - ys) ** 2).mean().backward()
        o.step()
        o.zero_grad()


def _weights_diff(model: nn.Module, ref: nn.Module) -> float:
    with zero3.GatheredParameters(list(model.parameters())):
        return max((a - b).abs().max().item() for a, b in zip(model.parameters(), ref.parameters()))


# -- post-accumulate-grad hooks registered after initialize (runtime/last_grad_hook.py) -------------
def hooks_after_initialize(threshold: int) -> dict:
    """One hook zeroes l2.weight's gradient (holds it still), one doubles l0.bias's; the second is
    removed before the last step. SGD, which Adam's scale invariance would hide a doubling from."""
    world = dist.get_world_size()
    ref, model = twins(_mlp)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    zero3.initialize(model, opt, {"param_persistence_threshold": threshold})
    seen: list[tuple[int, ...] | None] = []

    def hold(p: torch.Tensor) -> None:
        seen.append(None if p.grad is None else tuple(p.grad.shape))
        if p.grad is not None:
            p.grad.zero_()

    def double(p: torch.Tensor) -> None:
        p.grad.mul_(2)

    handles = []
    for net in (ref, model):
        net[2].weight.register_post_accumulate_grad_hook(hold)
        handles.append(net[0].bias.register_post_accumulate_grad_hook(double))
    still = ref[2].weight.detach().clone()
    for step, (x, y) in enumerate(_batches(world)):
        if step == 2:
            for h in handles:
                h.remove()
        _step_both(ref, ref_opt, model, opt, x, y)
    with zero3.GatheredParameters([model[2].weight]):
        held = torch.equal(model[2].weight.detach(), still)
    return {"seen": seen, "held": held, "diff": _weights_diff(model, ref)}


@pytest.mark.parametrize("threshold", [0, 10**6])  # released after use, and kept gathered (persistent)
def test_gradient_hooks_registered_after_initialize_act_as_in_torch(pools, threshold):
    for r in pools.get(2).run(hooks_after_initialize, threshold):
        # torch sees each hook twice per step (once per net); zero3's rank once per step: the full shape
        assert r["seen"][::2] == r["seen"][1::2] == [(16, 16)] * 3, r
        assert r["held"], r
        assert r["diff"] < 1e-6, r


# -- the optimizer's state, read by parameter (optim/rank_state.py ShardKeyedState) ----------------
def state_by_parameter() -> dict:
    world = dist.get_world_size()
    ref, model = twins(_mlp)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, eps=1e-6)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-6)
    zero3.initialize(model, opt, {"param_persistence_threshold": 0})
    for x, y in _batches(world)[:2]:
        _step_both(ref, ref_opt, model, opt, x, y)
    refused = []
    for read in (lambda p: opt.state[p], lambda p: opt.state.__setitem__(p, {}), lambda p: opt.state.setdefault(p, {}),
                 lambda p: opt.state.get(p), lambda p: p in opt.state):
        try:
            read(model[0].weight)
            refused.append(False)
        except zero3.ZeroStateError as exc:
            refused.append("safe_get_full_optimizer_state" in str(exc))
    opt.load_state_dict(opt.state_dict())  # torch's load puts a new dict in place: still guarded
    try:
        opt.state[model[2].bias]
        refused.append(False)
    except zero3.ZeroStateError:
        refused.append(True)
    full = zero3.safe_get_full_optimizer_state(model[0].weight, "exp_avg")
    return {"refused": refused, "entries": len(opt.state),
            "exp_avg_diff": (full - ref_opt.state[ref[0].weight]["exp_avg"]).abs().max().item()}


def test_the_optimizer_state_read_by_parameter_names_the_accessors_and_breaks_nothing(pools):
    for r in pools.get(2).run(state_by_parameter):
        assert r["refused"] == [True] * 6, r
        assert r["entries"] == 6, r  # one per shard: the refused reads inserted nothing
        assert r["exp_avg_diff"] < 1e-6, r


# -- weight_norm applied while the model is built under Init (runtime/init.py) ---------------------
class _Doubled(nn.Module):
    """A parametrization without right_inverse: torch keeps the weight itself as ``original``."""

    def forward(self, w: torch.Tensor) -> torch.Tensor:
        return 2 * w


class _Normed(nn.Module):
    def __init__(self, how: str) -> None:
        super().__init__()
        self.l1 = nn.Linear(8, 16)
        if how == "kept":
            self.l2 = nn.utils.parametrize.register_parametrization(nn.Linear(16, 4), "weight", _Doubled())
        else:
            self.l2 = (nn.utils.weight_norm if how == "deprecated" else weight_norm)(nn.Linear(16, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l2(torch.tanh(self.l1(x)))


def weight_norm_under_init(how: str) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    ref, model = twins(lambda: _Normed(how))
    gc.collect()  # the weight weight_norm dropped: no longer driven by the context, so gone
    ctx = next(model.parameters())._zero.ctx
    alive = sorted(o._zero.name for o in gc.get_objects() if isinstance(o, zero3.ZeroParameter) and o._zero.ctx is ctx)
    names = [n for n, _ in model.named_parameters()]
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, eps=1e-6)
    engine = zero3.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-6),
                              {"param_persistence_threshold": 0})
    mine = slice(4 * rank, 4 * (rank + 1))
    for x, y in _batches(world):
        ((ref(x) - y) ** 2).mean().backward()
        ref_opt.step()
        ref_opt.zero_grad()
        engine.backward(((model(x[mine]) - y[mine]) ** 2).mean())
        engine.step()
    return {"names": names, "ref_names": [n for n, _ in ref.named_parameters()], "diff": _weights_diff(model, ref),
            "alive": alive}


@pytest.mark.parametrize("how", ["parametrization", "deprecated", "kept"])  # parametrizations.weight_norm;
def test_weight_norm_in_a_model_built_under_init_trains_like_torch(pools, how):  # nn.utils.weight_norm; _Doubled
    for r in pools.get(2).run(weight_norm_under_init, how):
        assert r["names"] == r["ref_names"], r
        assert {"deprecated": "l2.weight_v", "parametrization": "l2.parametrizations.weight.original1",
                "kept": "l2.parametrizations.weight.original"}[how] in r["names"], r
        assert r["diff"] < 1e-6, r
        assert len(r["alive"]) == len(r["names"]), r  # no dropped weight left with its shard


# -- torch's clip_grad_norm_ over the optimizer's param_groups (optim/routed_clip.py) ---------------
def _clip(tensors: list[torch.Tensor], how: str) -> torch.Tensor:
    if how == "clip_grad_norm_":
        return torch.nn.utils.clip_grad_norm_(tensors, torch.tensor(0.05))
    norm = torch.nn.utils.get_total_norm([t.grad for t in tensors if t.grad is not None])  # torch 2.6's two steps
    torch.nn.utils.clip_grads_with_norm_(tensors, 0.05, norm)
    return norm


def clip_over_param_groups(threshold: int, how: str = "clip_grad_norm_") -> dict:
    """PyTorch Lightning's clip: torch.nn.utils.clip_grad_norm_ over the tensors of the optimizer's
    param groups, which zero3 re-points at this rank's shards; or torch's two steps, get_total_norm
    and clip_grads_with_norm_ (which measured this rank's shards alone, probe 25B)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    ref, model = twins(_mlp)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    zero3.initialize(model, opt, {"param_persistence_threshold": threshold})
    tensors = [t for g in opt.param_groups for t in g["params"]]
    mine = slice(4 * rank, 4 * (rank + 1))
    norms = []
    for x, y in _batches(world):
        ((ref(x) - y) ** 2).mean().backward()
        ref_norm = _clip(list(ref.parameters()), how)
        ref_opt.step()
        ref_opt.zero_grad()
        ((model(x[mine]) - y[mine]) ** 2).mean().backward()
        norms.append((_clip(tensors, how).item(), ref_norm.item()))
        opt.step()
        opt.zero_grad()
    ((model(x[mine]) - y[mine]) ** 2).mean().backward()
    refused = []
    for part in (tensors[:2], tensors + [torch.zeros(3, requires_grad=True)]):
        if how != "clip_grad_norm_":
            part = [t.grad for t in part if t.grad is not None] + ([torch.zeros(3)] if len(part) > 2 else [])
        try:
            if how == "clip_grad_norm_":
                torch.nn.utils.clip_grad_norm_(part, 0.05)
            else:  # a part is the norm of those gradients (one all-reduce, as many on every rank)
                torch.nn.utils.get_total_norm(part)
            refused.append(False)
        except zero3.ZeroStateError:
            refused.append(True)
    extra = {}
    if how != "clip_grad_norm_":  # the shards themselves (a parameter norm), a gradient given twice (review 2)
        grads = [t.grad for t in tensors if t.grad is not None]
        extra = {"param norm": (torch.nn.utils.get_total_norm(tensors).item(),
                                torch.nn.utils.get_total_norm([p.detach() for p in ref.parameters()]).item()),
                 "twice": (torch.nn.utils.get_total_norm(grads + grads).item(),
                           2 ** 0.5 * torch.nn.utils.get_total_norm(grads).item())}
    opt.zero_grad()
    return {"norms": norms, "refused": refused, "diff": _weights_diff(model, ref), **extra}


@pytest.mark.parametrize("how", ["clip_grad_norm_", "get_total_norm"])
@pytest.mark.parametrize("threshold", [0, 10**6])
def test_torch_clip_over_the_optimizer_s_param_groups_clips_by_the_global_norm(pools, threshold, how):
    for r in pools.get(2).run(clip_over_param_groups, threshold, how):
        for got, want in r["norms"]:
            assert abs(got - want) < 1e-5 * want and want > 0.05, r  # the global norm, and it clipped
        # a part of them (refused by the one-call clip); a mix with other tensors
        assert r["refused"] == [how == "clip_grad_norm_", True], r
        assert r["diff"] < 1e-6, r
        for got, want in (r["param norm"], r["twice"]) if how != "clip_grad_norm_" else ():
            assert abs(got - want) < 1e-5 * want, r


def clip_value_fp16() -> dict:
    """torch.nn.utils.clip_grad_value_ over an fp16 engine's optimizer tensors, against torch in fp32:
    the shards hold loss-scaled gradients until unscaled (the clip value acted as 0.01 / 256, probe 25B)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    ref, model = twins(_mlp)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    engine = zero3.initialize(model, opt, {"fp16": {"enabled": True, "initial_scale_power": 8},
                                           "param_persistence_threshold": 0})
    tensors = [t for g in opt.param_groups for t in g["params"]]
    mine = slice(4 * rank, 4 * (rank + 1))
    clipped = 0
    for x, y in _batches(world)[:2]:
        ((ref(x) - y) ** 2).mean().backward()
        clipped += sum(int((p.grad.abs() > 0.01).sum()) for p in ref.parameters())
        torch.nn.utils.clip_grad_value_(ref.parameters(), 0.01)
        with torch.no_grad():
            for p in ref.parameters():
                p -= 0.5 * p.grad
                p.grad = None
        engine.backward(((model(x[mine].half()) - y[mine].half()) ** 2).float().mean())
        torch.nn.utils.clip_grad_value_(tensors, 0.01)
        engine.step()
    return {"clipped": clipped, "diff": _weights_diff(model, ref)}


def test_torch_clip_grad_value_over_an_fp16_engine_s_shards_clamps_true_gradients(pools):
    for r in pools.get(2).run(clip_value_fp16):
        assert r["clipped"] > 10, r  # the clip acted in torch
        assert r["diff"] < 2e-3, r  # fp16 rounding; clamping scaled gradients was 1e-2 off


# -- a backward node reading a weight after its module's backward (late_read.py [Note: a parameter read
# after its module's backward]) ----------------------------------------------------------------------
def _mlp_with_custom_op() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), LinearReadingItsWeightLate(16), nn.Tanh(), nn.Linear(16, 4))


def late_reads(threshold: int, gather: str) -> dict:
    """The custom op's read and a root backward hook's read of the last layer's weight, against torch."""
    world = dist.get_world_size()
    ref, model = twins(_mlp_with_custom_op)
    norms: dict[str, list[float]] = {"torch": [], "zero3": []}
    for name, net in (("torch", ref), ("zero3", model)):
        net.register_full_backward_hook(lambda m, gi, go, out=norms[name]: out.append(m[4].weight.detach().norm().item()))
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    zero3.initialize(model, opt, {"param_persistence_threshold": threshold, "allgather_impl": gather})
    for x, y in _batches(world):
        _step_both(ref, ref_opt, model, opt, x.requires_grad_(), y)
    return {"diff": _weights_diff(model, ref), "norms": norms}


@pytest.mark.parametrize("threshold,gather", [(0, "auto"), (0, "all_gather"), (0, "p2p"), (10**6, "auto")])
def test_backward_nodes_reading_weights_late_train_like_torch(pools, threshold, gather):
    for r in pools.get(2).run(late_reads, threshold, gather):
        assert r["diff"] < 1e-6, r
        torch.testing.assert_close(r["norms"]["zero3"], r["norms"]["torch"], rtol=1e-6, atol=0)
