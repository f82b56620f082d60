"""CUDA paths: side-stream gathers with event waits, device memory actually freed. Skipped without CUDA.

One GPU is enough: at world size 1 the "all-gather" is a copy from the shard, but it still runs on
the side stream and the compute stream still waits on its event, so the stream logic is exercised.
"""

from __future__ import annotations

import pytest
import torch

import zero3
from gpt import GPT, GPTConfig, synthetic_batch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_cuda_training_matches_reference_with_side_stream():
    cfg = GPTConfig(n_layer=2, n_embd=64)
    torch.manual_seed(0)
    ref = GPT(cfg).cuda()
    torch.manual_seed(0)
    with torch.device("cuda"), zero3.Init():
        model = GPT(cfg)
    assert model.wte.weight.ds_tensor.is_cuda
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-6)
    engine = zero3.initialize(model, opt, {"param_persistence_threshold": 0, "prefetch_bucket_size": 20000,
                                           "max_reuse_distance": 0})
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, eps=1e-6)
    for step in range(4):
        x, y = (t.cuda() for t in synthetic_batch(step, 4, cfg))
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        ref_loss = ref(x, y)
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        assert abs(loss.item() - ref_loss.item()) <= 1e-5 * abs(ref_loss.item())
    assert engine.comm.side_stream is not None, "the side stream was not used"
    assert engine.last_step_metrics.prefetch_hits > 0


def test_released_parameters_free_device_memory():
    cfg = GPTConfig(n_layer=4, n_embd=256, vocab_size=1024)
    with torch.device("cuda"), zero3.Init():
        model = GPT(cfg)
    engine = zero3.initialize(model, None, {"param_persistence_threshold": 0, "max_reuse_distance": 0,
                                            "prefetch_bucket_size": 0})
    torch.cuda.synchronize()
    shards = sum(p.ds_tensor.numel() * p.ds_tensor.element_size() for p in engine.params)
    full = sum(p.ds_numel * 4 for p in engine.params)
    before = torch.cuda.memory_allocated()
    with torch.no_grad():
        engine(torch.zeros(2, 64, dtype=torch.long, device="cuda"))
    torch.cuda.synchronize()
    after = torch.cuda.memory_allocated()
    assert engine.coordinator.live_params == []
    # Everything gathered for the forward was released: allocated memory is back where it was.
    assert after - before < 0.05 * full, (before, after, full, shards)
