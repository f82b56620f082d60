"""``see_memory_usage`` and the step timers, tested through their log records and figures."""

from __future__ import annotations

import logging

import torch

import zero3
from gpt import GPT, GPTConfig, synthetic_batch

CFG = GPTConfig(block_size=16)


def _engine(extra: dict | None = None):
    torch.manual_seed(0)
    model = GPT(CFG)
    return zero3.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-3),
                            {"param_persistence_threshold": 0, **(extra or {})})


def test_see_memory_usage_logs_resident_memory_and_model_state_by_tier(caplog):
    engine = _engine({"dtype": "bf16"})
    x, y = synthetic_batch(0, 2, CFG)
    engine.backward(engine(x, y))
    engine.step()
    assert zero3.see_memory_usage("quiet") is None  # DeepSpeed's force=False: nothing at all
    with caplog.at_level(logging.INFO, logger="zero3.memory"):
        figures = zero3.see_memory_usage("after a step", force=True)
    records = [r for r in caplog.records if r.name == "zero3.memory"]
    assert len(records) == 1 and records[0].getMessage().startswith("after a step | RSS ")
    report = engine.memory_report()
    assert figures["param_shard_bytes"] >= report["param_shard_bytes"] > 0
    assert figures["master_bytes"] >= report["master_bytes"] > 0  # bf16: separate fp32 masters
    assert figures["optimizer_state_bytes"] >= report["optimizer_state_bytes"] - report["master_bytes"] > 0
    assert figures["rss_bytes"] > 0 and figures["available_bytes"] > 0
    for word in ("gathered", "shards", "masters", "optimizer", "gradients", "offloaded"):
        assert word in records[0].getMessage()


def test_timers_fill_the_step_metrics_and_log_every_steps_per_print(caplog):
    engine = _engine({"wall_clock_breakdown": True, "steps_per_print": 2})
    with caplog.at_level(logging.INFO, logger="zero3.engine"):
        for step in range(4):
            x, y = synthetic_batch(step, 2, CFG)
            engine.backward(engine(x, y))
            engine.step()
            m = engine.last_step_metrics
            assert m.forward_seconds > 0 and m.backward_seconds > 0 and m.optimizer_seconds > 0
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("zero3::timers")]
    assert [line.split(" |")[0] for line in lines] == ["zero3::timers step 2", "zero3::timers step 4"]
    assert all("forward" in line and "reduction wait" in line and "optimizer" in line for line in lines)


def test_timers_do_not_log_without_wall_clock_breakdown(caplog):
    engine = _engine()
    with caplog.at_level(logging.INFO, logger="zero3.engine"):
        for step in range(3):
            x, y = synthetic_batch(step, 2, CFG)
            engine.backward(engine(x, y))
            engine.step()
    assert not [r for r in caplog.records if r.getMessage().startswith("zero3::timers")]
    assert engine.last_step_metrics.forward_seconds > 0


def test_deepspeed_config_keys_set_the_timers():
    cfg = zero3.ZeroConfig.from_dict({"zero_optimization": {"stage": 3}, "wall_clock_breakdown": True,
                                      "steps_per_print": 5})
    assert cfg.training.wall_clock_breakdown is True and cfg.training.steps_per_print == 5


def test_see_memory_usage_counts_a_model_once_when_a_new_engine_took_it_over():
    """An engine kept referenced after remove_hooks, its model under a new engine: the shards were
    counted twice (a probe session); the old engine's optimizer state is its own and still counted."""
    import gc
    gc.collect()
    before = zero3.see_memory_usage("before", force=True)
    old = _engine()
    x, y = synthetic_batch(0, 2, CFG)
    old.backward(old(x, y))
    old.step()
    old.remove_hooks()
    model = old.module
    new = zero3.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-3), {"param_persistence_threshold": 0})
    new.backward(new(x, y))
    new.step()
    gc.collect()
    after = zero3.see_memory_usage("after", force=True)
    report_old, report_new = old.memory_report(), new.memory_report()
    assert report_old["param_shard_bytes"] == report_new["param_shard_bytes"] > 0
    assert after["param_shard_bytes"] - before["param_shard_bytes"] == report_new["param_shard_bytes"]
    assert after["optimizer_state_bytes"] - before["optimizer_state_bytes"] == \
        report_old["optimizer_state_bytes"] + report_new["optimizer_state_bytes"] > 0
    new.remove_hooks()
    newer = zero3.initialize(torch.nn.ModuleDict({"inner": model}), None, {})  # a wrapper over the same parameters
    gc.collect()
    wrapped = zero3.see_memory_usage("wrapped", force=True)
    assert wrapped["param_shard_bytes"] - before["param_shard_bytes"] == newer.memory_report()["param_shard_bytes"]
