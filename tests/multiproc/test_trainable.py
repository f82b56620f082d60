"""Changing ``requires_grad`` after ``zero3.initialize`` ([Note: unfreezing after initialize] in
runtime/trainable.py), against torch on one process with the same schedule.

Freezing a parameter after initialize, and unfreezing one that was trainable at initialize, train as in
torch. Unfreezing one that was frozen at initialize used to leave it untrained, silently (nothing
reduced its gradient into its shard); now the forward is refused before it runs, nothing changes, and
freezing it again goes on as before. The lr=0 param group the refusal names holds a parameter fixed,
and raising the lr trains it as torch does."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import zero3
from _reference import step_my_part
from gpt import GPT, GPTConfig, synthetic_batch

pytestmark = pytest.mark.multiproc

CFG = GPTConfig(block_size=16, n_layer=2, n_embd=32, n_head=2)


class _Reference:
    """The same model on one process, whole batch, AdamW over fp32 masters (copied into the model in its dtype)."""

    def __init__(self, dtype: torch.dtype, groups: list[dict]) -> None:
        torch.manual_seed(0)
        self.model = GPT(CFG).to(dtype)
        self.masters = {n: p.detach().float().clone() for n, p in self.model.named_parameters()}
        self.opt = torch.optim.AdamW([dict(g, params=[self.masters[n] for n in g["params"]]) for g in groups])

    def step(self, x: torch.Tensor, y: torch.Tensor) -> float:
        loss = self.model(x, y)
        loss.backward()
        for n, p in self.model.named_parameters():
            self.masters[n].grad = None if p.grad is None else p.grad.float()
            p.grad = None
        self.opt.step()
        with torch.no_grad():
            for n, p in self.model.named_parameters():
                p.copy_(self.masters[n])
        return loss.item()


def _set(models: list, prefix: str, flag: bool) -> None:
    for m in models:
        for n, p in m.named_parameters():
            if n.startswith(prefix):
                p.requires_grad_(flag)


def freeze_and_unfreeze(dtype: str) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    low = torch.bfloat16 if dtype == "bf16" else torch.float32
    torch.manual_seed(0)
    with zero3.Init():
        model = GPT(CFG)
    names = [n for n, _ in model.named_parameters()]
    ref = _Reference(low, [{"params": names}])
    _set([model, ref.model], "h.1.", False)  # frozen at initialize
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, eps=1e-6)
    ref.opt.param_groups[0].update(lr=1e-2, weight_decay=0.1, eps=1e-6)
    engine = zero3.initialize(model, opt, {"param_persistence_threshold": 0, "dtype": dtype})
    start = {n: m.clone() for n, m in ref.masters.items()}
    losses, ref_losses, refused = [], [], ""
    unchanged = False
    h0 = [p for n, p in model.named_parameters() if n.startswith("h.0.")]
    frozen_at: list[torch.Tensor] = []

    def step(i: int) -> None:
        x, y = synthetic_batch(i, 2 * world, CFG)
        losses.append(step_my_part(engine, x, y))
        ref_losses.append(ref.step(x, y))

    for i in range(8):
        if i == 2:
            _set([model, ref.model], "h.0.", False)  # frozen after initialize: its updates stop
            frozen_at = [zero3.safe_get_full_fp32_param(p).clone() for p in h0]
        if i == 4:
            _set([model, ref.model], "h.0.", True)  # trainable at initialize: trains again
            held = all(torch.equal(a, zero3.safe_get_full_fp32_param(p)) for a, p in zip(frozen_at, h0))
        if i == 6:
            _set([model], "h.1.", True)  # frozen at initialize: refused, nothing changes
            before = [zero3.safe_get_full_fp32_param(p).clone() for p in model.parameters()]
            x, y = synthetic_batch(i, 2 * world, CFG)
            try:
                engine(x[2 * rank:2 * rank + 2], y[2 * rank:2 * rank + 2])
            except zero3.ZeroStateError as exc:
                refused = str(exc)
            unchanged = all(torch.equal(b, zero3.safe_get_full_fp32_param(p))
                            for b, p in zip(before, model.parameters()))
            _set([model], "h.1.", False)  # and training goes on
        step(i)
    final = {n: (zero3.safe_get_full_fp32_param(p) - ref.masters[n]).abs().max().item()
             for n, p in model.named_parameters()}
    masters = {n: zero3.safe_get_full_fp32_param(p) for n, p in model.named_parameters()}
    drift = sum((masters[n] - ref.masters[n]).square().sum() for n in masters).sqrt().item()
    travel = sum((ref.masters[n] - start[n]).square().sum() for n in masters).sqrt().item()
    with zero3.GatheredParameters(list(model.parameters())):  # the weights computed with: the masters, rounded
        rounded = all(torch.equal(p.data, masters[n].to(p.dtype)) for n, p in model.named_parameters())
    engine.remove_hooks()
    moved = max((zero3.safe_get_full_fp32_param(p) - a).abs().max().item() for a, p in zip(frozen_at, h0))
    return {"losses": losses, "ref_losses": ref_losses, "refused": refused, "unchanged": unchanged,
            "final": final, "held": held, "moved": moved, "drift": drift, "travel": travel, "rounded": rounded}


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_requires_grad_changes_after_initialize_follow_torch_or_are_refused(pools, dtype):
    tol = 2e-5 if dtype == "fp32" else 3e-2
    for r in pools.get(2).run(freeze_and_unfreeze, dtype, timeout=180):
        assert "h.1." in r["refused"] and "frozen (requires_grad=False) when zero3.initialize" in r["refused"], r["refused"]
        assert r["unchanged"]
        assert r["held"] and r["moved"] > 1e-3  # no step while frozen (weight decay, momentum), then steps again
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(r["ref_losses"]), rtol=tol, atol=0)
        assert r["rounded"]  # the gathered weights are the masters (rounded to bf16)
        if dtype == "fp32":
            worst = max(r["final"], key=r["final"].get)
            assert r["final"][worst] <= 1e-5, (worst, r["final"][worst])
        else:  # the masters differ by bf16's rounding of the forward: far less than training moved them
            assert r["drift"] < 0.1 * r["travel"], (r["drift"], r["travel"])


def held_by_lr_zero() -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    with zero3.Init():
        model = GPT(CFG)
    later = [n for n, _ in model.named_parameters() if n.startswith("h.1.")]
    now = [n for n, _ in model.named_parameters() if not n.startswith("h.1.")]
    groups = [{"params": now, "lr": 1e-2, "eps": 1e-6}, {"params": later, "lr": 0.0, "eps": 1e-6}]
    ref = _Reference(torch.float32, groups)
    by_name = dict(model.named_parameters())
    opt = torch.optim.AdamW([dict(g, params=[by_name[n] for n in g["params"]]) for g in groups])
    engine = zero3.initialize(model, opt, {"param_persistence_threshold": 0})
    start = {n: zero3.safe_get_full_fp32_param(by_name[n]).clone() for n in later}
    held = True
    for i in range(5):
        if i == 3:
            for o in (opt, ref.opt):
                o.param_groups[1]["lr"] = 1e-2
        x, y = synthetic_batch(i, 2 * world, CFG)
        engine.backward(engine(x[2 * rank:2 * rank + 2], y[2 * rank:2 * rank + 2]))
        engine.step()
        ref.step(x, y)
        if i == 2:
            held = all(torch.equal(start[n], zero3.safe_get_full_fp32_param(by_name[n])) for n in later)
    moved = max((zero3.safe_get_full_fp32_param(by_name[n]) - start[n]).abs().max().item() for n in later)
    worst = max((zero3.safe_get_full_fp32_param(p) - ref.masters[n]).abs().max().item()
                for n, p in model.named_parameters())
    engine.remove_hooks()
    return {"held": held, "moved": moved, "worst": worst}


def test_a_param_group_at_lr_zero_holds_parameters_until_its_lr_rises(pools):
    for r in pools.get(2).run(held_by_lr_zero, timeout=120):
        assert r["held"]
        assert r["moved"] > 1e-3
        assert r["worst"] <= 1e-5


def resume_with_another_frozen_set(dtype: str, saved_frozen: str, loaded_frozen: str, ckpt: str) -> dict:
    """Train 2 steps with the parameters under ``saved_frozen`` frozen at initialize, save; load into a
    new engine whose frozen set is ``loaded_frozen`` (the same ``AdamW(model.parameters())``) and train 3
    more; the reference is torch changing ``requires_grad`` between the same steps. A parameter frozen
    at the save has only its weights (under bf16, rounded: it had no master), so the reference takes
    those too."""
    world = dist.get_world_size()
    low = torch.bfloat16 if dtype == "bf16" else torch.float32
    zcfg = {"param_persistence_threshold": 0, "dtype": dtype}
    torch.manual_seed(0)
    with zero3.Init():
        model = GPT(CFG)
    ref = _Reference(low, [{"params": [n for n, _ in model.named_parameters()], "lr": 1e-2, "eps": 1e-6}])
    _set([model, ref.model], saved_frozen, False)
    engine = zero3.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-6), zcfg)
    start = {n: m.clone() for n, m in ref.masters.items()}
    losses, ref_losses = [], []
    for i in range(2):
        x, y = synthetic_batch(i, 2 * world, CFG)
        step_my_part(engine, x, y)
        ref.step(x, y)
    engine.save_checkpoint(ckpt, tag="t")
    engine.remove_hooks()
    torch.manual_seed(1)  # another init: the weights come from the checkpoint
    with zero3.Init():
        model = GPT(CFG)
    _set([model], loaded_frozen, False)
    engine = zero3.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-6), zcfg)
    engine.load_checkpoint(ckpt, tag="t")
    _set([ref.model], saved_frozen, True)
    _set([ref.model], loaded_frozen, False)
    with torch.no_grad():
        for n, p in ref.model.named_parameters():
            if n.startswith(saved_frozen):
                ref.masters[n].copy_(p)
    for i in range(2, 5):
        x, y = synthetic_batch(i, 2 * world, CFG)
        losses.append(step_my_part(engine, x, y))
        ref_losses.append(ref.step(x, y))
    masters = {n: zero3.safe_get_full_fp32_param(p) for n, p in model.named_parameters()}
    steps = {n: float(engine.optimizer_state(p).get("step", -1)) for n, p in model.named_parameters()}
    engine.remove_hooks()
    return {"losses": losses, "ref_losses": ref_losses, "steps": steps,
            "final": {n: (masters[n] - ref.masters[n]).abs().max().item() for n in masters},
            "drift": sum((masters[n] - ref.masters[n]).square().sum() for n in masters).sqrt().item(),
            "travel": sum((ref.masters[n] - start[n]).square().sum() for n in masters).sqrt().item()}


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("saved_frozen,loaded_frozen", [("none", "h.1."), ("h.1.", "none")])
def test_a_checkpoint_loads_into_a_run_with_another_frozen_set_as_torch(pools, tmp_path, dtype, saved_frozen,
                                                                         loaded_frozen):
    """Under bf16/fp16 a parameter frozen at initialize is in no param group, so the groups of a run
    with another frozen set differed from the checkpoint's and the load was refused ("optimizer param
    groups differ: checkpoint [17] params per group, engine [15]"), where fp32 loaded. Now both load:
    a parameter frozen now takes its weights (its saved optimizer state is dropped under bf16), one
    trainable now but frozen at the save starts its optimizer state afresh, as torch's does."""
    tol = 2e-5 if dtype == "fp32" else 3e-2
    for r in pools.get(2).run(resume_with_another_frozen_set, dtype, saved_frozen, loaded_frozen,
                              str(tmp_path / "ckpt"), timeout=180):
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(r["ref_losses"]), rtol=tol, atol=0)
        for n, step in r["steps"].items():  # AdamW's step count: 2 before the save, 3 after
            if n.startswith(loaded_frozen):  # the saved state, kept in its group (fp32) or dropped (no group)
                want = 2.0 if dtype == "fp32" else -1.0
            else:  # a start after the load where it was frozen at the save
                want = 3.0 if n.startswith(saved_frozen) else 5.0
            assert step == want, (n, step, want)
        if dtype == "fp32":
            worst = max(r["final"], key=r["final"].get)
            assert r["final"][worst] <= 2e-5, (worst, r["final"][worst])
        else:  # the masters differ by bf16's rounding of the forward: far less than training moved them
            assert r["drift"] < 0.1 * r["travel"], (r["drift"], r["travel"])
