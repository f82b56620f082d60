"""DeepSpeed's engine names and refusals on 2 gloo ranks (issue 20, items 3 and 5): the global
gradient norm equals torch's clip norm on the whole batch, ``save_16bit_model`` writes the model a
single process trains, and a step without a backward is refused on every rank without breaking the
run."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import zero3
import zero3.deepspeed as deepspeed
from gpt import GPT, GPTConfig, synthetic_batch

pytestmark = pytest.mark.multiproc

PER_RANK = 2
DS = {"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}, "gradient_clipping": 0.5,
      "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "eps": 1e-6, "weight_decay": 0.1}}}


def names_and_refusals(save_dir: str) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = GPTConfig()
    torch.manual_seed(0)
    ref = GPT(cfg)
    torch.manual_seed(0)
    with deepspeed.zero.Init(config_dict_or_path=DS):
        model = GPT(cfg)
    engine, *_ = deepspeed.initialize(model=model, config=DS)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=3e-3, eps=1e-6, weight_decay=0.1)
    out = {"global_rank": engine.global_rank, "stage": engine.zero_optimization_stage(), "norm": 0.0,
           "refused": 0}
    assert engine.get_global_grad_norm() is None
    for step in range(3):
        x, y = synthetic_batch(step, PER_RANK * world, cfg)
        engine.backward(engine(x[rank * PER_RANK:(rank + 1) * PER_RANK], y[rank * PER_RANK:(rank + 1) * PER_RANK]))
        engine.step()
        ref(x, y).backward()
        ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5).item()
        ref_opt.step()
        ref_opt.zero_grad()
        out["norm"] = max(out["norm"], abs(engine.get_global_grad_norm() - ref_norm) / ref_norm)
        try:
            engine.step()  # no backward since the last step
        except zero3.ZeroStateError:
            out["refused"] += 1
    assert engine.global_steps == 3
    assert engine.save_16bit_model(save_dir) is True
    saved = torch.load(f"{save_dir}/pytorch_model.bin")  # there on every rank once the call returns
    expected = ref.state_dict()
    out["keys"] = list(saved) == list(expected)
    out["param"] = max((saved[k] - v).abs().max().item() for k, v in expected.items())
    return out


def test_engine_names_and_refusals_on_two_ranks(pools, tmp_path):
    results = pools.get(2).run(names_and_refusals, str(tmp_path))
    assert [r["global_rank"] for r in results] == [0, 1]
    for r in results:
        assert r["stage"] == 3 and r["refused"] == 3 and r["keys"], r
        assert r["norm"] < 1e-5 and r["param"] < 1e-5, r


def save_16bit_in_own_group(save_dir: str) -> dict:
    """Each rank trains its own model in a group of its own: the group's first rank writes the file,
    global rank 0 or not (rank 1's group wrote nothing and returned True, probe 25D)."""
    rank = dist.get_rank()
    groups = [dist.new_group([r]) for r in range(dist.get_world_size())]
    torch.manual_seed(rank)
    model = torch.nn.Linear(4, 3)
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    engine = zero3.initialize(model, None, {"param_persistence_threshold": 0}, group=groups[rank])
    assert engine.save_16bit_model(f"{save_dir}/group{rank}") is True
    saved = torch.load(f"{save_dir}/group{rank}/pytorch_model.bin")
    return {"rank": engine.rank, "diff": max((saved[k] - v).abs().max().item() for k, v in expected.items())}


def test_save_16bit_model_writes_in_a_group_without_global_rank_0(pools, tmp_path):
    results = pools.get(2).run(save_16bit_in_own_group, str(tmp_path))
    assert [r["rank"] for r in results] == [0, 0]
    assert all(r["diff"] == 0.0 for r in results), results


def batch_names_and_misuse() -> dict:
    """Items 2-5 on every rank: the batch accessors with DeepSpeed's keys, the 4-tuple habit on
    ``zero3.initialize``, ``backward`` without an optimizer, a schedule without an optimizer."""
    world = dist.get_world_size()
    cfg = GPTConfig()
    out: dict = {}
    with deepspeed.zero.Init():
        model = GPT(cfg)
    engine, *_ = deepspeed.initialize(model=model, config=dict(DS, train_batch_size=8 * world,
                                                               train_micro_batch_size_per_gpu=4))
    out["batch"] = (engine.train_micro_batch_size_per_gpu(), engine.gradient_accumulation_steps(),
                    engine.train_batch_size(), engine.local_rank)
    with zero3.Init():
        model = GPT(cfg)
    try:
        _engine, _opt, _, _sched = zero3.initialize(model, torch.optim.AdamW(model.parameters()))
    except TypeError as e:
        out["unpack"] = "zero3.deepspeed.initialize" in str(e)
    with zero3.Init():
        model = GPT(cfg)
    no_opt = zero3.initialize(model)
    x, y = synthetic_batch(0, PER_RANK, cfg)
    try:
        no_opt.backward(no_opt(x, y))
    except zero3.ZeroConfigError as e:
        out["backward"] = "must provide optimizer" in str(e)
    with zero3.Init():
        model = GPT(cfg)
    try:
        zero3.initialize(model, config={"scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 2}}})
    except zero3.ZeroConfigError as e:
        out["scheduler"] = "no optimizer" in str(e)
    return out


def test_batch_names_and_misuse_on_two_ranks(pools):
    for r in pools.get(2).run(batch_names_and_misuse):
        assert r["batch"] == (4, 2, 16, 0), r  # 16 = 4 per rank x 2 accumulation steps x 2 ranks
        assert r.get("unpack") and r.get("backward") and r.get("scheduler"), r
