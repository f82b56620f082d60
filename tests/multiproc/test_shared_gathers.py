"""Shared-memory gathers (comm/shared.py, ``allgather_impl="shm"``) on 2 gloo ranks of one host: the
same training as gathers on the wire, bit for bit, with shards changed between steps by the
optimizer, by ``GatheredParameters(modifier_rank=0)`` and by a checkpoint load, and once inside a
step (``GatheredParameters`` between forward and backward), inference forwards in between, and ``offload_states`` to NVMe (which moves the shards out of the arenas, after which
gathers travel on the wire again)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import zero3
from gpt import GPT, GPTConfig, synthetic_batch

pytestmark = pytest.mark.multiproc

CFG = GPTConfig()
PER_RANK = 2
LEAN = {"param_persistence_threshold": 0, "max_reuse_distance": 0, "prefetch_bucket_size": 20000,
        "max_live_parameters": 60000, "gradient_clipping": 0.5}


def _engine(impl: str) -> zero3.Engine:
    torch.manual_seed(0)
    with zero3.Init():
        model = GPT(CFG)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, eps=1e-6, weight_decay=0.1)
    return zero3.initialize(model, opt, {**LEAN, "allgather_impl": impl})


def _step(engine: zero3.Engine, step: int, modify_inside: bool = False) -> float:
    rank, world = dist.get_rank(), dist.get_world_size()
    x, y = synthetic_batch(step, PER_RANK * world, CFG)
    loss = engine(x[rank * PER_RANK:(rank + 1) * PER_RANK], y[rank * PER_RANK:(rank + 1) * PER_RANK])
    if modify_inside:  # a collective write-back between forward and backward: the window pauses
        with zero3.GatheredParameters([engine.module.ln_f.weight], modifier_rank=0):
            if rank == 0:
                engine.module.ln_f.weight.data.mul_(0.5)
    engine.backward(loss)
    engine.step()
    return loss.item()


def _weights(engine: zero3.Engine) -> list[torch.Tensor]:
    with zero3.GatheredParameters(list(engine.module.parameters())):
        return [p.detach().clone() for p in engine.module.parameters()]


def _eval_loss(engine: zero3.Engine, step: int) -> float:
    x, y = synthetic_batch(1000 + step, PER_RANK, CFG)
    with torch.no_grad():
        return engine(x, y).item()


def run(impl: str, tmp: str) -> dict:
    """Train 6 steps, changing the shards between steps in every way a user can; record everything."""
    engine = _engine(impl)
    losses, evals, shared, wire = [], [], [], []
    for step in range(6):
        losses.append(_step(engine, step, modify_inside=step == 4))
        m = engine.last_step_metrics
        shared.append(m.shared_read_bytes)
        wire.append(m.received("all-gather"))
        evals.append(_eval_loss(engine, step))  # an inference forward: a step (and a window) of its own
        if step == 1:
            with zero3.GatheredParameters([engine.module.ln_f.weight], modifier_rank=0):
                if dist.get_rank() == 0:
                    engine.module.ln_f.weight.data.mul_(1.5)
        if step == 2:
            engine.save_checkpoint(tmp, tag=f"{impl}-2")
        if step == 3:
            _step(engine, 99)  # a step the checkpoint load below undoes
            engine.load_checkpoint(tmp, tag=f"{impl}-2")
    state = engine.comm.shared.state.name if engine.comm.shared is not None else None
    return {"losses": losses, "evals": evals, "shared": shared, "wire": wire, "weights": _weights(engine),
            "state": state, "impl": engine.comm.config.allgather_impl}


def test_shared_memory_gathers_train_bit_for_bit_like_gathers_on_the_wire(pools, tmp_path):
    shm = pools.get(2).run(run, "shm", str(tmp_path))
    wire = pools.get(2).run(run, "p2p", str(tmp_path))
    for a, b in zip(shm, wire):
        assert a["impl"] == "shm" and b["impl"] == "p2p"
        assert a["losses"] == b["losses"] and a["evals"] == b["evals"], (a, b)
        assert all(torch.equal(x, y) for x, y in zip(a["weights"], b["weights"]))
        # Every gather of every step read the arenas; none went on the wire, except GatheredParameters'
        # between steps 1 and 2 (outside a step: on the wire, counted with step 2). Without shm: all on the wire.
        # (Step 4's GatheredParameters, inside the step, read the arenas too: 0 on the wire; its write is
        # seen by backward's gather after the pause, or the weights above would differ.)
        assert all(n > 0 for n in a["shared"]) and a["wire"] == [0, 0, CFG.n_embd * 4 // 2, 0, 0, 0], a
        assert b["shared"] == [0] * 6 and all(n > 0 for n in b["wire"]), b
        assert a["state"] == "IDLE"  # between steps the window is closed


def offload_round_trip(path: str) -> dict:
    """fp32 shards in the arenas go to NVMe with offload_states and come back: training goes on exactly,
    its gathers now on the wire (a mapped arena cannot be emptied in place)."""
    expected = [_step(e, s) for e in [_engine("shm")] for s in range(6)]
    engine = _engine("shm")
    losses = [_step(engine, s) for s in range(3)]
    before = engine.last_step_metrics.shared_read_bytes
    engine.offload_states(device="nvme", nvme_path=path)
    empty = all(p.ds_tensor.untyped_storage().nbytes() == 0 for p in engine.params)
    engine.reload_states()
    losses += [_step(engine, s) for s in range(3, 6)]
    m = engine.last_step_metrics
    return {"equal": losses == expected, "before": before, "after": m.shared_read_bytes,
            "wire": m.received("all-gather"), "empty": empty, "state": engine.comm.shared.state.name}


def test_offload_states_to_nvme_moves_shards_out_of_the_arenas_and_training_goes_on_exactly(pools, tmp_path):
    for r in pools.get(2).run(offload_round_trip, str(tmp_path), timeout=240):
        assert r["equal"] and r["empty"], r
        assert r["before"] > 0 and r["after"] == 0 and r["wire"] > 0 and r["state"] == "OFF", r
