"""DeepSpeed's batch keys and config spellings on 2 gloo ranks (issue 20, items 2 and 6).

Any two of ``train_batch_size``, ``train_micro_batch_size_per_gpu`` and
``gradient_accumulation_steps`` fix the third with the data-parallel world size (DeepSpeed's rule
``train_batch_size = micro x accumulation x world``), fixed at ``initialize`` where the world size is
known; an inconsistent triple, and one knob spelled twice with different values, raise
`ZeroConfigError` on every rank before anything trains.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import zero3
import zero3.deepspeed as deepspeed
from gpt import GPT, GPTConfig, synthetic_batch

pytestmark = pytest.mark.multiproc

CFG = GPTConfig(block_size=8)
ZERO = {"stage": 3, "stage3_param_persistence_threshold": 0}
OPT = {"type": "AdamW", "params": {"lr": 1e-3}}


def build(config: dict) -> dict:
    """``deepspeed.initialize`` under ``config``, then 4 micro-steps: what the engine derived, or the
    error every rank got."""
    torch.manual_seed(0)
    try:
        with deepspeed.zero.Init(config_dict_or_path=config):
            model = GPT(CFG)
        engine, *_ = deepspeed.initialize(model=model, config=config)
    except zero3.ZeroConfigError as exc:
        return {"error": type(exc).__name__, "message": str(exc)}
    rank = dist.get_rank()
    for step in range(4):
        x, y = synthetic_batch(step * 2 + rank, engine.train_micro_batch_size_per_gpu(), CFG)
        engine.backward(engine(x, y))
        engine.step()
    return {"error": None, "accumulation": engine.gradient_accumulation_steps(),
            "micro": engine.train_micro_batch_size_per_gpu(), "batch": engine.train_batch_size(),
            "optimizer_steps": engine.global_steps}


@pytest.mark.parametrize("given, derived", [
    ({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 8}, {"accumulation": 2, "micro": 8, "batch": 32}),
    ({"train_batch_size": 16, "gradient_accumulation_steps": 4}, {"accumulation": 4, "micro": 2, "batch": 16}),
    ({"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2},
     {"accumulation": 2, "micro": 4, "batch": 16}),
], ids=["batch+micro", "batch+accumulation", "micro+accumulation"])
def test_two_batch_keys_fix_the_third_with_the_world_size(pools, given, derived):
    for r in pools.get(2).run(build, {"zero_optimization": ZERO, "optimizer": OPT, **given}, timeout=120):
        assert r["error"] is None, r
        assert {k: r[k] for k in derived} == derived
        assert r["optimizer_steps"] == 4 // derived["accumulation"]  # every accumulation-th call steps


@pytest.mark.parametrize("config, named", [
    ({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 3},
     ["train_batch_size (32)", "train_micro_batch_size_per_gpu (8)", "gradient_accumulation_steps (3)", "= 48"]),
    ({"train_batch_size": 30, "train_micro_batch_size_per_gpu": 8}, ["train_batch_size (30)", "2 data-parallel"]),
    ({"zero_optimization": {**ZERO, "max_live_parameters": 5, "stage3_max_live_parameters": 7}},
     ["zero_optimization.max_live_parameters (5)", "zero_optimization.stage3_max_live_parameters (7)"]),
], ids=["inconsistent-triple", "not-a-multiple", "two-spellings"])
def test_a_bad_batch_triple_or_two_spellings_raise_on_every_rank(pools, config, named):
    config = {"zero_optimization": ZERO, "optimizer": OPT, **config}
    for r in pools.get(2).run(build, config, timeout=120):
        assert r["error"] == "ZeroConfigError", r
        for text in named:
            assert text in r["message"], (text, r["message"])
