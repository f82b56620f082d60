"""A second copy of a zero3 model (an EMA), the way the deepcopy refusal names (docs/api.md "A second
copy of a model"), against torch's EMA of the same training on one process.

``copy.deepcopy(model)`` and ``pickle`` of a model zero3 manages used to fail inside the process group
("cannot pickle 'ProcessGroup' object"); they now raise `ZeroStateError` naming this recipe: another
instance built under ``zero3.Init`` with an engine of its own (no optimizer), its weights set shard by
shard from the trained model's with the local accessors, and ``refresh_from_masters`` for the
parameters it keeps gathered."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
import torch.distributed as dist

import zero3
from gpt import GPT, GPTConfig, synthetic_batch

pytestmark = pytest.mark.multiproc

CFG = GPTConfig(block_size=16, n_layer=2, n_embd=32, n_head=2)
DECAY = 0.8


def ema_of_a_model(threshold: int) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    config = {"param_persistence_threshold": threshold}
    torch.manual_seed(0)
    with zero3.Init():
        model = GPT(CFG)
    torch.manual_seed(1)  # other weights: the first update copies the model's in
    with zero3.Init():
        ema = GPT(CFG)
    engine = zero3.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-6), config)
    ema_engine = zero3.initialize(ema, None, config)
    refusals = []
    for copier in (copy.deepcopy, pickle.dumps):
        for what in (model, engine):  # the engine: torch's TypeError on the process group before (probe 36H)
            try:
                copier(what)
            except zero3.ZeroStateError as exc:
                refusals.append(str(exc))
    assert copy.copy(engine).module is model  # a shallow copy is another handle, as before (review 36R2)

    def update(decay: float) -> None:
        with torch.no_grad():
            for pe, pm in zip(ema.parameters(), model.parameters()):
                e = zero3.safe_get_local_fp32_param(pe)
                zero3.safe_set_local_fp32_param(pe, e.lerp_(zero3.safe_get_local_fp32_param(pm), 1 - decay))
        ema_engine.refresh_from_masters()

    torch.manual_seed(0)
    ref = GPT(CFG)
    ref_ema = copy.deepcopy(ref)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, eps=1e-6)
    update(0.0)
    for i in range(4):
        x, y = synthetic_batch(i, 2 * world, CFG)
        engine.backward(engine(x[2 * rank:2 * rank + 2], y[2 * rank:2 * rank + 2]))
        engine.step()
        update(DECAY)
        ref(x, y).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        with torch.no_grad():
            for pe, pm in zip(ref_ema.parameters(), ref.parameters()):
                pe.lerp_(pm, 1 - DECAY)
    worst = max((zero3.safe_get_full_fp32_param(pe) - qe.detach()).abs().max().item()
                for pe, qe in zip(ema.parameters(), ref_ema.parameters()))
    x, y = synthetic_batch(9, 2, CFG)
    ema.eval()
    ref_ema.eval()
    with torch.no_grad():
        loss, ref_loss = ema_engine(x, y).item(), ref_ema(x, y).item()
    ema_engine.remove_hooks()
    engine.remove_hooks()
    return {"refusals": refusals, "worst": worst, "loss": loss, "ref_loss": ref_loss}


@pytest.mark.parametrize("threshold", [0, 10**9])  # every parameter gathered per use; every one kept gathered
def test_an_ema_copy_follows_torch_and_deepcopy_names_it(pools, threshold):
    for r in pools.get(2).run(ema_of_a_model, threshold, timeout=120):
        assert len(r["refusals"]) == 4 and all("safe_set_local_fp32_param" in m for m in r["refusals"]), r["refusals"]
        assert r["worst"] <= 1e-5
        assert r["loss"] == pytest.approx(r["ref_loss"], rel=1e-5)


def copy_while_modified(modifier: int) -> dict:
    """A deep copy made under another ``zero3.Init`` inside ``GatheredParameters(modifier_rank=r)``
    after rank r changed the weight (probe 36H: each rank partitioned its own values, so half the
    copy was the unchanged weight)."""
    rank = dist.get_rank()
    config = {"param_persistence_threshold": 0}
    torch.manual_seed(0)
    with zero3.Init(config_dict_or_path=config):
        model = torch.nn.Linear(6, 8)
    with zero3.GatheredParameters(list(model.parameters()), modifier_rank=modifier):
        if rank == modifier:
            with torch.no_grad():
                model.weight.fill_(5.0)
        with zero3.Init(config_dict_or_path=config):
            twin = copy.deepcopy(model)
    with zero3.GatheredParameters(list(model.parameters()) + list(twin.parameters())):
        return {"model": float((model.weight == 5).float().mean()), "twin": float((twin.weight == 5).float().mean()),
                "bias": torch.equal(model.bias, twin.bias)}


@pytest.mark.parametrize("modifier", [0, 1])
def test_a_copy_made_inside_a_modifier_block_takes_the_modifier_rank_s_values(pools, modifier):
    for r in pools.get(2).run(copy_while_modified, modifier, timeout=60):
        assert r == {"model": 1.0, "twin": 1.0, "bias": True}
