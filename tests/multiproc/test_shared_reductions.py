"""Gradient reductions through shared memory (comm/shared_reduce.py, ``reduce_scatter_impl="shm"``,
chosen by ``auto`` with shared-memory gathers on gloo): the same training as pairwise reductions on
the wire, bit for bit, at 2 and 4 ranks, with padded shards, gradients missing on some ranks (MoE
experts a rank did not route to: presence counts), bf16, and buckets too large for a slot (which
travel pairwise in the same step)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import zero3
from zero3.comm import shared_reduce
from gpt import GPT, GPTConfig, synthetic_batch

pytestmark = pytest.mark.multiproc

PER_RANK = 2
LEAN = {"param_persistence_threshold": 0, "max_reuse_distance": 0, "prefetch_bucket_size": 20000,
        "max_live_parameters": 60000, "reduce_bucket_size": 3000, "allgather_impl": "shm"}


def run(reduce_impl: str | None, model: dict, extra: dict, slot_bytes: int | None = None) -> dict:
    """Train 4 steps; record losses, final weights and, per step, bytes read from outboxes and
    gradient-reduction bytes received on the wire."""
    shared_reduce.SLOT_BYTES = slot_bytes or (32 << 20)
    cfg = GPTConfig(**model)
    torch.manual_seed(0)
    with zero3.Init():
        net = GPT(cfg)
    if cfg.n_experts:  # each MoE reduces as one unit, with a presence count per parameter
        zero3.set_leaf_modules(net, ["MoE"])
    opt = torch.optim.AdamW(net.parameters(), lr=3e-3, eps=1e-6, weight_decay=0.1)
    config = {**LEAN, **extra}
    if reduce_impl is not None:
        config["reduce_scatter_impl"] = reduce_impl
    engine = zero3.initialize(net, opt, config)
    rank, world = dist.get_rank(), dist.get_world_size()
    losses, outbox, wire, calls = [], [], [], []
    for step in range(4):
        x, y = synthetic_batch(step, PER_RANK * world, cfg)
        loss = engine(x[rank * PER_RANK:(rank + 1) * PER_RANK], y[rank * PER_RANK:(rank + 1) * PER_RANK])
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        m = engine.last_step_metrics
        outbox.append(m.shared_reduce_bytes)
        wire.append(m.received("gradient reduction"))
        calls.append(m.reduce_calls)
    with zero3.GatheredParameters(list(engine.module.parameters())):
        weights = [p.detach().float().clone() for p in engine.module.parameters()]
    return {"impl": engine.comm.config.reduce_impl, "losses": losses, "weights": weights, "outbox": outbox,
            "wire": wire, "calls": calls}


def _same(a: dict, b: dict) -> None:
    assert a["losses"] == b["losses"], (a["losses"], b["losses"])
    assert all(torch.equal(x, y) for x, y in zip(a["weights"], b["weights"]))


@pytest.mark.parametrize("world,model,extra", [
    (2, {}, {}),
    (2, {}, {"dtype": "bf16"}),
    (4, {"n_embd": 30, "vocab_size": 61}, {}),  # 30- and 90-element parameters: padded shards at 4 ranks
    (2, {"n_experts": 8, "block_size": 4}, {}),  # 8 tokens a rank over 8 experts: some get no gradient there
], ids=["2-ranks", "bf16", "4-ranks-padded", "moe-presence"])
def test_shared_reductions_train_bit_for_bit_like_pairwise_ones(pools, world, model, extra):
    shm = pools.get(world).run(run, None, model, extra)  # auto: shm beside shm gathers
    wire = pools.get(world).run(run, "p2p", model, extra)
    for a, b in zip(shm, wire):
        assert a["impl"] == "shm" and b["impl"] == "p2p"
        _same(a, b)
        # Every step's reductions went through the outboxes. On the wire: a 16-byte ready message per
        # reduction and peer, counted as gradient bytes until the plan is agreed (steps 1-2), then
        # as verification (it is the header).
        assert all(n > 0 for n in a["outbox"]) and a["wire"][2:] == [0, 0], a
        assert all(n == 16 * c * (world - 1) for n, c in zip(a["wire"][:2], a["calls"][:2])), a
        assert b["outbox"] == [0] * 4 and all(n > 0 for n in b["wire"]), b


def test_buckets_larger_than_a_slot_travel_pairwise_in_the_same_step(pools):
    """A 12,000-byte slot: of each step's 7 buckets some fit (through the outboxes) and some do not
    (on the wire), in the same step; still the pairwise result bit for bit."""
    shm = pools.get(2).run(run, "shm", {}, {}, 12000)
    wire = pools.get(2).run(run, "p2p", {}, {})
    for a, b in zip(shm, wire):
        _same(a, b)
        assert all(n > 0 for n in a["outbox"]) and all(n > 0 for n in a["wire"]), a
        assert all(x < y for x, y in zip(a["wire"], b["wire"]))


def _live_bytes_after_steps(reduce_impl: str) -> int:
    """Bytes of the private (not /dev/shm) CPU tensor storages alive after 3 steps, beyond those alive
    before the model was built: what the run holds between steps."""
    import gc

    def storages() -> dict[int, int]:
        out = {}
        for o in gc.get_objects():
            if type(o) in (torch.Tensor, torch.nn.Parameter) or isinstance(o, zero3.ZeroParameter):
                if o.is_meta or o.is_shared():
                    continue
                try:
                    s = o.untyped_storage()
                    if s.nbytes():
                        out[s.data_ptr()] = s.nbytes()
                except RuntimeError:  # a fake tensor an earlier test's compile left in this pool process
                    continue
        return out

    gc.collect()
    base = storages()
    cfg = GPTConfig()
    torch.manual_seed(0)
    with zero3.Init():
        net = GPT(cfg)
    opt = torch.optim.AdamW(net.parameters(), lr=3e-3, eps=1e-6)
    engine = zero3.initialize(net, opt, {**LEAN, "reduce_scatter_impl": reduce_impl, "reduce_bucket_size": 10**6})
    rank = dist.get_rank()
    for step in range(3):
        x, y = synthetic_batch(step, PER_RANK * 2, cfg)
        engine.backward(engine(x[rank * PER_RANK:(rank + 1) * PER_RANK], y[rank * PER_RANK:(rank + 1) * PER_RANK]))
        engine.step()
    gc.collect()
    held = sum(n for ptr, n in storages().items() if ptr not in base)
    engine.remove_hooks()
    return held


def test_a_shared_reduction_holds_no_gradient_buffer_between_steps(pools):
    """Probe 38I: the last shared reduction of a step kept its result (a gradient shard's worth, the
    whole model's with one bucket) alive until the next step's first reduction, uncounted by
    memory_report; between steps a run through the outboxes holds what one on the wire holds."""
    shm = pools.get(2).run(_live_bytes_after_steps, "shm")
    wire = pools.get(2).run(_live_bytes_after_steps, "p2p")
    for a, b in zip(shm, wire):
        assert abs(a - b) < 4096, (a, b)
