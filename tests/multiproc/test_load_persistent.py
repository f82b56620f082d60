"""``model.load_state_dict`` on a model whose parameters zero3 keeps gathered (persistent): torch copies
the values into the gathered full tensors, and zero3 writes them into the shards and masters
(runtime/gathered.py `write_back_loaded`). Before, on 2 ranks the first step re-gathered the old values
from the shards, silently (at world size 1 the full data is the shard, so only the bf16 master was
left behind). Trained after the load, the engine follows a plain model that loaded the same
weights. Under bf16 the masters take the file's fp32 values, as `zero3.pretrained.load_state_dict`
gives them, not their bf16 rounding that torch copied into the gathered parameters."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import zero3
from _reference import step_my_part
from gpt import GPT, GPTConfig, synthetic_batch

pytestmark = pytest.mark.multiproc

CFG = GPTConfig(block_size=16, n_layer=2, n_embd=32, n_head=2)


def load_then_train(dtype: str) -> dict:
    world = dist.get_world_size()
    torch.manual_seed(0)
    source = GPT(CFG)  # the weights to load
    torch.manual_seed(1)
    with zero3.Init():
        model = GPT(CFG)
    engine = zero3.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-6),
                              {"param_persistence_threshold": 10**9, "dtype": dtype})
    assert all(p.ds_persist for p in model.parameters())
    model.load_state_dict(source.state_dict())
    masters_loaded = all(torch.equal(zero3.safe_get_full_fp32_param(p), q.detach().float())  # not rounded to bf16
                         for p, q in zip(model.parameters(), source.parameters()))  # (6e-3 off before, probe 31H)
    ref = GPT(CFG).to(torch.bfloat16 if dtype == "bf16" else torch.float32)
    ref.load_state_dict(source.state_dict())
    masters = [p.detach().float().clone() for p in source.parameters()]  # as loaded into the engine
    start = [m.clone() for m in masters]
    ref_opt = torch.optim.AdamW(masters, lr=1e-3, eps=1e-6)
    losses, ref_losses = [], []
    for step in range(3):
        x, y = synthetic_batch(step, 2 * world, CFG)
        losses.append(step_my_part(engine, x, y))
        ref_loss = ref(x, y)
        ref_loss.backward()
        for m, p in zip(masters, ref.parameters()):
            m.grad = p.grad.float()
            p.grad = None
        ref_opt.step()
        with torch.no_grad():
            for m, p in zip(masters, ref.parameters()):
                p.copy_(m)
        ref_losses.append(ref_loss.item())
    mine = [zero3.safe_get_full_fp32_param(p) for p in model.parameters()]
    drift = sum((a - m).square().sum() for a, m in zip(mine, masters)).sqrt().item()
    travel = sum((m - s0).square().sum() for m, s0 in zip(masters, start)).sqrt().item()
    rounded = all(torch.equal(p.data, a.to(p.dtype)) for p, a in zip(model.parameters(), mine))  # persistent: gathered
    engine.remove_hooks()
    return {"losses": losses, "ref_losses": ref_losses, "masters_loaded": masters_loaded, "drift": drift,
            "travel": travel, "rounded": rounded}


@pytest.mark.parametrize("world,dtype", [(2, "fp32"), (2, "bf16"), (1, "bf16")])
def test_a_load_into_persistent_parameters_reaches_the_shards(pools, world, dtype):
    tol = 1e-5 if dtype == "fp32" else 2e-2
    for r in pools.get(world).run(load_then_train, dtype, timeout=120):
        assert r["masters_loaded"]  # what the optimizer steps on holds the loaded weights
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(r["ref_losses"]), rtol=tol, atol=0)
        # the loaded weights trained as the reference's did (bf16: to its rounding), and the persistent
        # copies the forwards use were refreshed from the stepped masters
        assert r["drift"] < (1e-5 if dtype == "fp32" else 0.1) * r["travel"], (r["drift"], r["travel"])
        assert r["rounded"]
