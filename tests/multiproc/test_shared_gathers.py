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


def _engine(impl: str, extra: dict | None = None) -> zero3.Engine:
    torch.manual_seed(0)
    with zero3.Init():
        model = GPT(CFG)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, eps=1e-6, weight_decay=0.1)
    return zero3.initialize(model, opt, {**LEAN, "allgather_impl": impl, **(extra or {})})


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


def run(impl: str, tmp: str, extra: dict | None = None) -> dict:
    """Train 6 steps, changing the shards between steps in every way a user can; record everything."""
    engine = _engine(impl, extra)
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
    flat = any(fg.low is not None for fg in engine.sharded_optimizer.groups)
    return {"losses": losses, "evals": evals, "shared": shared, "wire": wire, "weights": _weights(engine),
            "state": state, "impl": engine.comm.config.allgather_impl, "flat_low": flat,
            "dtype": str(engine.params[0].ds_tensor.dtype)}


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


@pytest.mark.parametrize("extra", [{"dtype": "bf16"}, {"offload_optimizer": "cpu"}],
                         ids=["bf16", "optimizer-on-cpu"])
def test_shards_beside_separate_fp32_masters_are_shared_too(pools, tmp_path, extra):
    """Under bf16 (fp32 masters) and with the optimizer on the CPU side, the shards stay in their
    arenas (no flat low-precision buffer) and the masters are cast into them: the same training as
    gathers on the wire, bit for bit, through the same writes between and inside steps."""
    shm = pools.get(2).run(run, "shm", str(tmp_path), extra)
    wire = pools.get(2).run(run, "p2p", str(tmp_path), extra)
    for a, b in zip(shm, wire):
        assert a["losses"] == b["losses"] and a["evals"] == b["evals"], (a, b)
        assert all(torch.equal(x, y) for x, y in zip(a["weights"], b["weights"]))
        assert all(n > 0 for n in a["shared"]) and a["wire"][:2] == [0, 0] and a["wire"][3:] == [0, 0, 0], a
        assert b["shared"] == [0] * 6 and all(n > 0 for n in b["wire"]), b
        assert not a["flat_low"] and b["flat_low"], (a["flat_low"], b["flat_low"])
        assert a["dtype"] == ("torch.bfloat16" if "dtype" in extra else "torch.float32"), a["dtype"]


def offload_round_trip(path: str, extra: dict | None = None) -> dict:
    """fp32 shards in the arenas go to NVMe with offload_states and come back: training goes on exactly,
    its gathers now on the wire (a mapped arena cannot be emptied in place)."""
    expected = [_step(e, s) for e in [_engine("shm", extra)] for s in range(6)]
    engine = _engine("shm", extra)
    losses = [_step(engine, s) for s in range(3)]
    before = engine.last_step_metrics.shared_read_bytes
    engine.offload_states(device="nvme", nvme_path=path)
    empty = all(p.ds_tensor.untyped_storage().nbytes() == 0 for p in engine.params)
    engine.reload_states()
    losses += [_step(engine, s) for s in range(3, 6)]
    m = engine.last_step_metrics
    return {"equal": losses == expected, "before": before, "after": m.shared_read_bytes,
            "wire": m.received("all-gather"), "empty": empty, "state": engine.comm.shared.state.name}


@pytest.mark.parametrize("extra", [None, {"param_persistence_threshold": 100}], ids=["lean", "persistent"])
def test_offload_states_to_nvme_moves_shards_out_of_the_arenas_and_training_goes_on_exactly(pools, tmp_path, extra):
    # "persistent": biases and norms stay gathered between steps; their shards left the arena too.
    for r in pools.get(2).run(offload_round_trip, str(tmp_path), extra, timeout=240):
        assert r["equal"] and r["empty"], r
        assert r["before"] > 0 and r["after"] == 0 and r["wire"] > 0 and r["state"] == "OFF", r


def racing_write() -> dict:
    """A rank-local safe_set_local_fp32_param inside a step, while peers may read the shard: refused
    before it writes; the same call between steps goes through. Against an engine that never saw it."""
    from zero3.accessors import safe_get_local_fp32_param, safe_set_local_fp32_param

    engine, reference = _engine("shm"), _engine("shm")
    rank, world = dist.get_rank(), dist.get_world_size()
    x, y = synthetic_batch(0, PER_RANK * world, CFG)
    x, y = x[rank * PER_RANK:(rank + 1) * PER_RANK], y[rank * PER_RANK:(rank + 1) * PER_RANK]
    p = engine.module.ln_f.weight
    before = safe_get_local_fp32_param(p).clone()
    loss = engine(x, y)  # forward read the arenas: the window is open
    opened = engine.comm.shared.state.name
    try:
        safe_set_local_fp32_param(p, before + 1.0)
        message = ""
    except zero3.ZeroStateError as exc:
        message = str(exc)
    unchanged = torch.equal(safe_get_local_fp32_param(p), before)
    engine.backward(loss)
    engine.step()
    _step(reference, 0)
    same = all(torch.equal(a, b) for a, b in zip(_weights(engine), _weights(reference)))
    value = safe_get_local_fp32_param(p) + 1.0
    safe_set_local_fp32_param(p, value)  # between steps: allowed
    return {"opened": opened, "message": message, "unchanged": unchanged, "same": same,
            "after": torch.equal(safe_get_local_fp32_param(p), value)}


def test_a_rank_local_write_inside_an_open_window_is_refused_before_it_writes(pools):
    for r in pools.get(2).run(racing_write):
        assert r["opened"] == "OPEN", r
        assert "inside a step" in r["message"] and "allgather_impl='p2p'" in r["message"], r
        assert r["unchanged"] and r["same"] and r["after"], r


def aborted_mid_forward(impl: str, tmp: str) -> dict:
    """Both ranks raise in Block 1's forward at step 2, after the step's first gathers opened the
    window; each catches it, loads the checkpoint of step 1 (a write to every shard) and trains on."""
    engine = _engine(impl)
    boom = {"on": False}

    def hook(module, args):
        if boom["on"]:
            raise RuntimeError("boom in Block 1")

    engine.module.h[1].register_forward_pre_hook(hook)
    losses, errors, shared, wire, states = [], [], [], [], []
    for step in range(5):
        boom["on"] = step == 2
        try:
            losses.append(_step(engine, step))
            shared.append(engine.last_step_metrics.shared_read_bytes)
            wire.append(engine.last_step_metrics.received("all-gather"))
        except RuntimeError as exc:
            errors.append(f"{type(exc).__name__}: {exc}"[:60])
            engine.load_checkpoint(tmp, tag=f"{impl}-1")
        states.append(engine.comm.shared.state.name if engine.comm.shared is not None else None)
        if step == 1:
            engine.save_checkpoint(tmp, tag=f"{impl}-1")
    return {"losses": losses, "errors": errors, "shared": shared, "wire": wire, "states": states,
            "weights": _weights(engine),
            "in_arena": len(engine.comm.shared.params) if engine.comm.shared is not None else None}


def test_a_step_aborted_while_ranks_read_each_other_moves_the_shards_out_and_training_goes_on(pools, tmp_path):
    shm = pools.get(2).run(aborted_mid_forward, "shm", str(tmp_path), timeout=240)
    wire = pools.get(2).run(aborted_mid_forward, "p2p", str(tmp_path), timeout=240)
    for a, b in zip(shm, wire):
        assert a["errors"] == b["errors"] == ["RuntimeError: boom in Block 1"], (a["errors"], b["errors"])
        assert a["losses"] == b["losses"], (a["losses"], b["losses"])
        assert all(torch.equal(x, y) for x, y in zip(a["weights"], b["weights"]))
        # Before the abort the gathers read the arenas; after it, sharing is off and they go on the wire
        # (step 3's metrics also count what the aborted step read before it raised).
        assert a["states"] == ["IDLE", "IDLE", "OFF", "OFF", "OFF"] and a["in_arena"] == 0, a
        assert all(n > 0 for n in a["shared"][:2]) and a["shared"][-1] == 0, a
        assert a["wire"][:2] == [0, 0] and all(n > 0 for n in a["wire"][2:]), a
