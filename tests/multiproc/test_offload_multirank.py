"""Offload on 2 gloo ranks: parameter offload (CPU, NVMe) and optimizer offload to NVMe train exactly
like no offload in fp32; engine.offload_states / reload_states frees the states and the next steps
equal an uninterrupted run; resident memory (RSS) drops by about the bytes moved to NVMe."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

import zero3
from gpt import GPT, GPTConfig, synthetic_batch

pytestmark = pytest.mark.multiproc

CFG = GPTConfig()
PER_RANK = 2
BASE = {"param_persistence_threshold": 100, "max_reuse_distance": 0, "prefetch_bucket_size": 20000,
        "max_live_parameters": 60000, "gradient_clipping": 0.5}
SCRIPT = os.path.join(os.path.dirname(__file__), "_offload_memory_script.py")


def _engine(cfg: dict, init: bool):
    torch.manual_seed(0)
    if init:
        with zero3.Init(config_dict_or_path=cfg):
            model = GPT(CFG)
    else:
        model = GPT(CFG)
    return zero3.initialize(model, torch.optim.AdamW(model.parameters(), lr=3e-3, eps=1e-6, weight_decay=0.1), cfg)


def _steps(engine, start: int, n: int) -> list[float]:
    rank, world = dist.get_rank(), dist.get_world_size()
    losses = []
    for step in range(start, start + n):
        x, y = synthetic_batch(step, PER_RANK * world, CFG)
        loss = engine(x[rank * PER_RANK:(rank + 1) * PER_RANK], y[rank * PER_RANK:(rank + 1) * PER_RANK])
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def _weights(engine) -> list[torch.Tensor]:
    with zero3.GatheredParameters(list(engine.module.parameters())):
        return [p.detach().clone() for p in engine.module.parameters()]


def offload_parity(path: str) -> dict:
    """Train 5 steps without offload and under every offload setting; report what differs."""
    nv = {"device": "nvme", "nvme_path": path}
    params = {**nv, "max_in_cpu": 5000, "buffer_size": 40000, "buffer_count": 3}
    ref = _engine(BASE, init=False)
    expected, weights = _steps(ref, 0, 5), _weights(ref)
    out = {}
    for name, extra, init in [("param cpu", {"offload_param": {"device": "cpu"}}, False),
                              ("param nvme", {"offload_param": params}, False),
                              ("param nvme, Init", {"offload_param": params}, True),
                              ("optimizer nvme", {"offload_optimizer": nv, "sub_group_size": 20000}, False),
                              ("both nvme, Init", {"offload_param": params, "offload_optimizer": nv,
                                                   "sub_group_size": 20000}, True)]:
        engine = _engine({**BASE, **extra}, init=init)
        losses = _steps(engine, 0, 5)
        same = all(torch.equal(a, b) for a, b in zip(_weights(engine), weights))
        m = engine.last_step_metrics
        out[name] = {"losses": losses == expected, "weights": same, "nvme": engine.memory_report()["nvme_bytes"],
                     "ahead": m.nvme_reads_ahead}
    return out


def test_parameter_and_optimizer_offload_match_no_offload_bit_for_bit_on_two_ranks(pools, tmp_path):
    for rank, r in enumerate(pools.get(2).run(offload_parity, str(tmp_path), timeout=240)):
        for name, got in r.items():
            assert got["losses"] and got["weights"], (rank, name, got)
            if "nvme" in name:
                assert got["nvme"] > 0, (rank, name)
            if name.startswith("param nvme") or name.startswith("both"):
                assert got["ahead"] > 0, (rank, name)  # shards were read ahead of their gathers
    assert list(tmp_path.iterdir()) == []  # swap files are unlinked: nothing left on the drive


def states_round_trip(path: str) -> dict:
    cfg = {**BASE, "dtype": "bf16"}
    expected = _steps(_engine(cfg, init=True), 0, 8)
    engine = _engine(cfg, init=True)
    losses = _steps(engine, 0, 3)
    before = engine.memory_report()
    scalars = sum(v.nbytes for st in engine.optimizer.state.values() for v in st.values() if v.dim() == 0)  # "step"
    moved = engine.offload_states(device="nvme", nvme_path=path)
    after = engine.memory_report()
    empty = all(p.ds_tensor.untyped_storage().nbytes() == 0 for p in engine.params)
    refused = ""
    try:
        _steps(engine, 3, 1)
    except zero3.ZeroStateError as exc:
        refused = str(exc)
    engine.reload_states()
    same = engine.memory_report() == before
    losses += _steps(engine, 3, 5)
    return {"before": before, "after": after, "moved": moved, "empty": empty, "refused": refused, "same": same,
            "equal": losses == expected, "scalars": scalars}


def test_offload_states_round_trip_on_two_ranks_frees_the_states_and_the_next_five_steps_are_exact(pools, tmp_path):
    for r in pools.get(2).run(states_round_trip, str(tmp_path), timeout=240):
        before, after = r["before"], r["after"]
        resident = before["param_shard_bytes"] + before["optimizer_state_bytes"] + before["gathered_param_bytes"]
        # bf16: the flat shard and master buffers, the moments (and Adam's step counters), persistent params
        assert r["moved"] == resident + r["scalars"] and resident > 0, r
        for key in ("param_shard_bytes", "optimizer_state_bytes", "master_bytes", "gathered_param_bytes"):
            assert after[key] == 0, (key, r)
        assert after["nvme_bytes"] == r["moved"] and r["empty"] and r["same"], r
        assert "call engine.reload_states() first" in r["refused"], r
        assert r["equal"], r


def _rss_run(mode: str, tmp_path) -> list[dict]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path / mode
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="131072")  # freed tensors go back to the OS (docs/debugging.md)
    subprocess.run([sys.executable, SCRIPT, mode, str(port), str(out), str(tmp_path / "swap")], check=True, env=env,
                   timeout=240)
    return [json.loads((tmp_path / f"{mode}.{r}").read_text()) for r in range(2)]


def test_resident_memory_drops_by_about_the_bytes_on_nvme(tmp_path):
    plain, offloaded = _rss_run("plain", tmp_path), _rss_run("nvme", tmp_path)
    for p, o in zip(plain, offloaded):
        assert o["losses"] == p["losses"], (p, o)
        saved = p["rss_between_steps"] - o["rss_between_steps"]
        assert saved >= 0.75 * (o["nvme_bytes"] - o["pool_bytes"]), (saved, o)  # pool: the price of reading ahead
        dropped = p["rss_between_steps"] - p["rss_offloaded"]
        assert dropped >= 0.9 * p["moved"] > 0, (dropped, p)
        assert p["rss_reloaded"] - p["rss_offloaded"] >= 0.9 * p["moved"], p
