"""Offload with CUDA compute (one GPU, world size 1): shards in CPU memory or on NVMe are copied to
the device by each gather, masters and optimizer state on NVMe are streamed through the CPU-side
step, and offload_states moves device storages to host memory or NVMe and back. Skipped without CUDA.
"""

from __future__ import annotations

import pytest
import torch

import zero3
from gpt import GPT, GPTConfig, synthetic_batch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

CFG = GPTConfig(n_layer=2, n_embd=64)
BASE = {"param_persistence_threshold": 100, "prefetch_bucket_size": 20000, "max_reuse_distance": 0}


def _engine(cfg: dict):
    torch.manual_seed(0)
    with torch.device("cuda"), zero3.Init(config_dict_or_path=cfg):
        model = GPT(CFG)
    return zero3.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-6), cfg)


def _train(engine, start: int, steps: int) -> list[float]:
    out = []
    for step in range(start, start + steps):
        x, y = (t.cuda() for t in synthetic_batch(step, 4, CFG))
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        out.append(loss.item())
    return out


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_offloaded_shards_and_optimizer_state_train_like_device_resident_ones(tmp_path, dtype):
    nvme = {"device": "nvme", "nvme_path": str(tmp_path)}
    expected = _train(_engine({**BASE, "dtype": dtype}), 0, 4)
    for extra in ({"offload_param": {"device": "cpu", "pin_memory": True}},
                  {"offload_param": {**nvme, "max_in_cpu": 0, "buffer_size": 20000, "pin_memory": True}},
                  {"offload_param": {**nvme, "max_in_cpu": 0, "buffer_size": 20000},
                   "offload_optimizer": {**nvme, "pin_memory": True}, "sub_group_size": 5000}):
        engine = _engine({**BASE, "dtype": dtype, **extra})
        big = [p for p in engine.params if not p.ds_persist]
        assert all(p.ds_tensor.device.type == "cpu" for p in big) and big[0].device.type == "cuda"
        got = _train(engine, 0, 4)
        torch.testing.assert_close(torch.tensor(got), torch.tensor(expected), rtol=1e-5, atol=0, msg=str(extra))


@pytest.mark.parametrize("device", ["cpu", "nvme"])
def test_offload_states_frees_device_memory_and_training_continues_exactly(tmp_path, device):
    cfg = {**BASE, "dtype": "bf16"}
    expected = _train(_engine(cfg), 0, 6)
    engine = _engine(cfg)
    got = _train(engine, 0, 3)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    moved = engine.offload_states(device=device, nvme_path=str(tmp_path))
    torch.cuda.synchronize()
    freed = before - torch.cuda.memory_allocated()
    assert moved > 0 and freed >= moved - 4096 * len(engine.params), (moved, freed)  # allocator rounding
    with pytest.raises(zero3.ZeroStateError, match="reload_states"):
        _train(engine, 3, 1)
    engine.reload_states()
    got += _train(engine, 3, 3)
    assert got == expected


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_the_step_in_backward_trains_like_the_step_after_it_on_cuda(tmp_path, dtype):
    """Sub-groups stepped inside the backward (optimizer on NVMe, in pinned CPU memory, or on the
    device) give the same losses, bit for bit, as the same config stepping after the backward."""
    nvme = {"device": "nvme", "nvme_path": str(tmp_path)}
    for optimizer in ({**nvme, "pin_memory": True}, {"device": "cpu", "pin_memory": True}, {"device": "none"}):
        runs = []
        for in_backward in (False, True):
            cfg = {**BASE, "dtype": dtype, "sub_group_size": 5000,
                   "offload_optimizer": {**optimizer, "step_in_backward": in_backward}}
            engine = _engine(cfg)
            runs.append(_train(engine, 0, 4))
            if in_backward:
                assert engine.context.optimizer.backward_step.steps_in_backward > 4, optimizer
        assert runs[0] == runs[1], (optimizer, runs)
