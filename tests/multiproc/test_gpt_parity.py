"""Multi-rank training parity: zero3 on N gloo ranks vs single-process training on the same batch."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import zero3
from gpt import GPT, GPTConfig, synthetic_batch

pytestmark = pytest.mark.multiproc

PER_RANK = 2


def _make(cfg: GPTConfig, zero_cfg: dict):
    torch.manual_seed(0)
    ref = GPT(cfg)
    torch.manual_seed(0)
    with zero3.Init():
        model = GPT(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, eps=1e-6, weight_decay=0.1)
    engine = zero3.initialize(model, opt, zero_cfg)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=3e-3, eps=1e-6, weight_decay=0.1)
    return engine, ref, ref_opt


def train_parity(steps: int, zero_cfg: dict, checkpoint: str | None = None, plain_loop: bool = False) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = GPTConfig(checkpoint=checkpoint)
    engine, ref, ref_opt = _make(cfg, zero_cfg)
    worst_loss, worst_norm = 0.0, 0.0
    for step in range(steps):
        x, y = synthetic_batch(step, PER_RANK * world, cfg)
        xs, ys = x[rank * PER_RANK:(rank + 1) * PER_RANK], y[rank * PER_RANK:(rank + 1) * PER_RANK]
        if plain_loop:
            loss = engine.module(xs, ys)
            loss.backward()
        else:
            loss = engine(xs, ys)
            engine.backward(loss)
        norm = zero3.clip_grad_norm_(engine, 0.5)
        memory = engine.memory_report()  # gradients and (after step 0) optimizer state present
        engine.step()
        global_loss = loss.detach().clone()
        dist.all_reduce(global_loss)
        global_loss /= world

        ref_loss = ref(x, y)
        ref_loss.backward()
        ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
        ref_opt.step()
        ref_opt.zero_grad()
        worst_loss = max(worst_loss, abs(global_loss.item() - ref_loss.item()) / abs(ref_loss.item()))
        worst_norm = max(worst_norm, abs(norm.item() - ref_norm.item()) / ref_norm.item())
        assert engine.coordinator.live_params == [], "parameters left gathered after a step"
        engine.coordinator.check_valid()
    worst_param = 0.0
    params = list(engine.module.parameters())
    with zero3.GatheredParameters(params):
        for (name, p), q in zip(engine.module.named_parameters(), ref.parameters()):
            worst_param = max(worst_param, (p - q).abs().max().item())
    m = engine.last_step_metrics
    return {"loss": worst_loss, "norm": worst_norm, "param": worst_param, "memory": memory,
            "reduce_calls": m.reduce_calls, "shared_read_bytes": m.shared_read_bytes,
            "wire_gather_bytes": m.received("all-gather"), "impl": engine.comm.config.allgather_impl}


@pytest.mark.parametrize("world", [2, 4])
def test_gpt_adamw_clipping_matches_single_process(pools, world):
    results = pools.get(world).run(train_parity, 10, {"param_persistence_threshold": 0})
    for r in results:
        assert r["loss"] < 1e-5, r
        assert r["norm"] < 1e-5, r
        assert r["param"] < 1e-5, r
        # auto on gloo, every rank on this host: the step's gathers read the peers' shared-memory arenas
        assert r["impl"] == "shm" and r["shared_read_bytes"] > 0 and r["wire_gather_bytes"] == 0, r


@pytest.mark.parametrize("wire", [{"allgather_impl": "all_gather", "reduce_scatter_impl": "all_reduce"},
                                  {"allgather_impl": "p2p", "reduce_scatter_impl": "reduce_scatter"},
                                  {"allgather_impl": "all_gather", "reduce_scatter_impl": "p2p", "reduce_bucket_size": 5000},
                                  {"allgather_impl": "all_gather", "reduce_scatter_impl": "reduce_scatter",
                                   "allgather_bucket_size": 100, "reduce_bucket_size": 100, "overlap_comm": False}],
                         ids=["collectives", "p2p-gather+reduce-scatter", "p2p-reduce-small-buckets",
                              "tiny-buckets-no-overlap"])
def test_every_wire_implementation_matches_single_process(pools, wire):
    results = pools.get(3).run(train_parity, 4, {"param_persistence_threshold": 0, **wire})
    for r in results:
        assert r["loss"] < 1e-5 and r["norm"] < 1e-5 and r["param"] < 1e-5, r


def _parity_with_gather_path(direct_min_bytes: int, steps: int, zero_cfg: dict) -> dict:
    """train_parity with pairwise gathers forced to pieces (0) or rows (huge), counting each path."""
    from zero3.comm import gather, wire

    counts = {"pieces": 0, "rows": 0}
    saved = wire.DIRECT_MIN_BYTES, gather.ParamGatherer._direct, gather.ParamGatherer._chunked

    def counted(name, fn):
        def wrapper(self, *args, **kwargs):
            counts[name] += 1
            return fn(self, *args, **kwargs)
        return wrapper

    wire.DIRECT_MIN_BYTES = direct_min_bytes
    gather.ParamGatherer._direct = counted("pieces", saved[1])
    gather.ParamGatherer._chunked = counted("rows", saved[2])
    try:
        result = train_parity(steps, zero_cfg)
    finally:
        wire.DIRECT_MIN_BYTES, gather.ParamGatherer._direct, gather.ParamGatherer._chunked = saved
    return {**result, **counts}


@pytest.mark.parametrize("path", ["pieces", "rows"])
def test_pairwise_gathers_by_pieces_and_by_rows_match_single_process(pools, path):
    """Pairwise gathers send pieces straight into storage for large parameters and one row per peer
    for small ones (wire.DIRECT_MIN_BYTES); either way the numbers are the single process's."""
    results = pools.get(2).run(_parity_with_gather_path, 0 if path == "pieces" else 1 << 40, 3,
                               {"param_persistence_threshold": 0, "allgather_impl": "p2p",
                                "reduce_scatter_impl": "p2p"})
    for r in results:
        assert r["loss"] < 1e-5 and r["norm"] < 1e-5 and r["param"] < 1e-5, r
        other = "rows" if path == "pieces" else "pieces"
        assert r[path] > 0 and r[other] == 0, r


@pytest.mark.parametrize("prefetch", [5000, 0])
def test_reductions_start_at_module_ends_with_the_default_bucket(pools, prefetch):
    """With DeepSpeed's reduce bucket (larger than the model) the queued gradients are still reduced
    at a module's end once they reach the prefetch bucket (grad.py); without prefetch only the bucket
    and the end of backward issue them. Same numbers either way."""
    results = pools.get(2).run(train_parity, 3, {"param_persistence_threshold": 0, "prefetch_bucket_size": prefetch})
    for r in results:
        assert r["loss"] < 1e-5 and r["norm"] < 1e-5 and r["param"] < 1e-5, r
        assert (r["reduce_calls"] > 1) if prefetch else (r["reduce_calls"] == 1), r


@pytest.mark.parametrize("checkpoint,threshold", [("reentrant", 0), ("non_reentrant", 0), ("selective", 0),
                                                  ("selective", 2000)])
def test_gpt_with_activation_checkpointing_matches_single_process(pools, checkpoint, threshold):
    """selective: torch's, saving the matmuls (probe 31I: zero3's hooks issued ops of their own inside the
    region, and the recompute raised from step 1); at 2000 the biases and norms are persistent."""
    results = pools.get(2).run(train_parity, 4, {"param_persistence_threshold": threshold}, checkpoint=checkpoint)
    for r in results:  # the norm too: clipping would hide a gradient off by a factor (a reduction run twice)
        assert r["loss"] < 1e-5 and r["norm"] < 1e-5 and r["param"] < 1e-5, r


def test_plain_loop_and_persistent_params_match_single_process(pools):
    results = pools.get(2).run(train_parity, 4, {"param_persistence_threshold": 2000}, plain_loop=True)
    for r in results:  # the norm too: clipping would hide gradients summed over ranks instead of averaged
        assert r["loss"] < 1e-5 and r["norm"] < 1e-5 and r["param"] < 1e-5, r


def _expected_state_bytes(world: int) -> tuple[int, int]:
    """(per-rank bytes with padding, full-model bytes) of params + grads + AdamW moments, fp32."""
    torch.manual_seed(0)
    model = GPT(GPTConfig())
    per_rank = full = 0
    for p in model.parameters():
        shard = -(-p.numel() // world)
        per_rank += 4 * shard * 4  # param, grad, exp_avg, exp_avg_sq
        full += 4 * p.numel() * 4
    return per_rank, full


@pytest.mark.parametrize("world", [2, 4])
def test_each_rank_holds_one_nth_of_model_state(pools, world):
    results = pools.get(world).run(train_parity, 2, {"param_persistence_threshold": 0})
    per_rank, full = _expected_state_bytes(world)
    for r in results:
        m = r["memory"]  # measured before the second step: gradient shards and moments exist
        held = m["param_shard_bytes"] + m["grad_shard_bytes"] + m["optimizer_state_bytes"]
        assert held == per_rank, (held, per_rank)
        assert held <= full / world * 1.02
        assert m["gathered_param_bytes"] == 0
