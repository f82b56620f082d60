"""DeepSpeed's optimizer x scheduler configs on 2 gloo ranks: the lr of every optimizer step, the first
included, is DeepSpeed's (its formulas written out here by hand), and losses and final parameters
equal a single-process torch optimizer stepped by hand with that schedule (issue 20, item 1)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

import zero3
import zero3.deepspeed as deepspeed
from gpt import GPT, GPTConfig, synthetic_batch

pytestmark = pytest.mark.multiproc

PER_RANK = 2
STEPS = 6
BASE_LR = 3e-3


def deepspeed_lr(kind: str, p: dict, step: int) -> float:
    """DeepSpeed's lr for optimizer step ``step`` (0-based): the start value its schedulers write into
    the optimizer when built (warmup_min_lr; 0 for WarmupCosineLR), then the value at
    last_batch_iteration = step - 1 after each scheduler.step()."""
    it = step - 1
    if it < 0:
        return 0.0 if kind == "WarmupCosineLR" else p["warmup_min_lr"]
    w = max(2, p["warmup_num_steps"])
    warm = math.log(it + 1) / math.log(w) if p.get("warmup_type", "log") == "log" else it / w
    if kind == "WarmupLR":
        return p["warmup_min_lr"] + (p["warmup_max_lr"] - p["warmup_min_lr"]) * (warm if it < w else 1.0)
    if kind == "WarmupDecayLR":
        gamma = warm if it < w else max(0.0, (p["total_num_steps"] - it) / max(1.0, p["total_num_steps"] - w))
        return p["warmup_min_lr"] + (p["warmup_max_lr"] - p["warmup_min_lr"]) * gamma
    if it < w:
        ratio = p["warmup_min_ratio"] + (1.0 - p["warmup_min_ratio"]) * warm
    else:
        cos = (1 + math.cos(math.pi * (it - w + 1) / (p["total_num_steps"] - w))) / 2
        ratio = max(0.0, p["cos_min_ratio"] + (1.0 - p["cos_min_ratio"]) * cos)
    return BASE_LR * ratio


ADAM = {"lr": BASE_LR, "betas": [0.9, 0.95], "eps": 1e-6, "weight_decay": 0.1}
CASES = {
    "adamw-warmup": ("AdamW", ADAM, "WarmupLR",
                     {"warmup_min_lr": 1e-4, "warmup_max_lr": BASE_LR, "warmup_num_steps": 4}, 1),
    "adamw-linear-warmup-accum2": ("AdamW", ADAM, "WarmupLR",
                                   {"warmup_min_lr": 1e-4, "warmup_max_lr": BASE_LR, "warmup_num_steps": 4,
                                    "warmup_type": "linear"}, 2),
    "adam-warmup-decay": ("Adam", ADAM, "WarmupDecayLR",
                          {"total_num_steps": 5, "warmup_min_lr": 2e-4, "warmup_max_lr": BASE_LR,
                           "warmup_num_steps": 3}, 1),
    "adam-l2-warmup-cosine": ("Adam", dict(ADAM, adam_w_mode=False), "WarmupCosineLR",
                              {"total_num_steps": 6, "warmup_min_ratio": 0.1, "warmup_num_steps": 3,
                               "cos_min_ratio": 0.05}, 1),
    "sgd-warmup": ("SGD", {"lr": 0.05, "momentum": 0.9, "weight_decay": 0.01}, "WarmupLR",
                   {"warmup_min_lr": 0.01, "warmup_max_lr": 0.05, "warmup_num_steps": 3}, 1),
}


def _reference_optimizer(opt: str, params: dict, model: torch.nn.Module) -> torch.optim.Optimizer:
    p = dict(params)
    if opt == "SGD":
        return torch.optim.SGD(model.parameters(), **p)
    p["betas"] = tuple(p["betas"])
    l2 = p.pop("adam_w_mode", True) is False
    return (torch.optim.Adam if l2 else torch.optim.AdamW)(model.parameters(), **p)


def _nonzero_attention_biases(ref: torch.nn.Module, model: torch.nn.Module) -> None:
    """Start every qkv bias away from 0 in both models. The key part of it has no gradient in exact
    arithmetic (softmax ignores a shift all keys share): from 0 its gradient is pure rounding noise,
    which Adam in L2 mode (gradient + weight_decay * p) normalises into full-size steps that differ
    with the number of ranks; from a non-zero start the decay term dominates that noise."""
    gen = torch.Generator().manual_seed(1)
    for (name, q), p in zip(ref.named_parameters(), model.parameters()):
        if name.endswith("c_attn.bias"):
            with torch.no_grad():
                q.copy_(0.02 * torch.randn(q.shape, generator=gen))
            with zero3.GatheredParameters([p], modifier_rank=0), torch.no_grad():
                p.copy_(q)


def train_with_schedule(case: str) -> dict:
    opt, opt_params, kind, sched_params, accum = CASES[case]
    rank, world = dist.get_rank(), dist.get_world_size()
    ds = {"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
          "gradient_accumulation_steps": accum,
          "optimizer": {"type": opt, "params": opt_params},
          "scheduler": {"type": kind, "params": sched_params}}
    cfg = GPTConfig()
    torch.manual_seed(0)
    ref = GPT(cfg)
    torch.manual_seed(0)
    with deepspeed.zero.Init(config_dict_or_path=ds):
        model = GPT(cfg)
    _nonzero_attention_biases(ref, model)
    engine, _, _, scheduler = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds)
    ref_opt = _reference_optimizer(opt, opt_params, ref)
    lrs, expected, worst_loss = [], [], 0.0
    for step in range(STEPS):
        lr = deepspeed_lr(kind, sched_params, step)
        expected.append(lr)
        lrs.append(engine.get_lr()[0])
        for g in ref_opt.param_groups:
            g["lr"] = lr
        for micro in range(accum):
            x, y = synthetic_batch(step * accum + micro, PER_RANK * world, cfg)
            loss = engine(x[rank * PER_RANK:(rank + 1) * PER_RANK], y[rank * PER_RANK:(rank + 1) * PER_RANK])
            engine.backward(loss)
            stepped = engine.step()
            assert stepped == (micro == accum - 1)
            global_loss = loss.detach().clone()
            dist.all_reduce(global_loss)
            ref_loss = ref(x, y)
            (ref_loss / accum).backward()
            worst_loss = max(worst_loss, abs(global_loss.item() / world - ref_loss.item()) / abs(ref_loss.item()))
        ref_opt.step()
        ref_opt.zero_grad()
    worst_param = 0.0
    with zero3.GatheredParameters(list(engine.module.parameters())):
        for p, q in zip(engine.module.parameters(), ref.parameters()):
            worst_param = max(worst_param, (p - q).abs().max().item())
    assert scheduler is engine.lr_scheduler and engine.global_steps == STEPS
    return {"lrs": lrs, "expected": expected, "loss": worst_loss, "param": worst_param}


@pytest.mark.parametrize("case", sorted(CASES))
def test_every_step_runs_at_deepspeeds_lr_and_trains_like_torch(pools, case):
    for r in pools.get(2).run(train_with_schedule, case):
        assert r["lrs"] == pytest.approx(r["expected"], rel=1e-12, abs=0), r
        assert r["loss"] < 1e-5, r
        assert r["param"] < 1e-5, r
