"""zero3.checkpointing on CUDA: saved inputs offloaded to the CPU and moved back for the recompute, the
CUDA RNG state (and a tracker of CUDA states) restored for exact dropout, synchronize calling the
device. Skipped without CUDA."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import zero3
import zero3.activation.rng
import zero3.checkpointing as ckpt
from gpt import GPT, GPTConfig, synthetic_batch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.fixture(autouse=True)
def _fresh_state(monkeypatch):
    monkeypatch.setattr(ckpt, "_STATE", ckpt._State())
    monkeypatch.setattr(zero3.activation.rng, "_TRACKER", ckpt.RNGStatesTracker())


def _blocks() -> nn.ModuleList:
    torch.manual_seed(0)
    return nn.ModuleList([nn.Sequential(nn.Linear(64, 64), nn.Dropout(0.3), nn.GELU()) for _ in range(3)]).cuda()


def _run(blocks, x, use_checkpoint):
    torch.cuda.manual_seed(7)
    saved = []

    def pack(t):
        saved.append(t.device.type)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        h = x
        for b in blocks:
            h = ckpt.checkpoint(b, h) if use_checkpoint else b(h)
    h.pow(2).sum().backward()
    grads = [p.grad.clone() for p in blocks.parameters()] + [x.grad.clone()]
    blocks.zero_grad(set_to_none=True)
    x.grad = None
    return grads, saved


@pytest.mark.parametrize("flags", [
    {},
    {"checkpoint_in_cpu": True},
    {"checkpoint_in_cpu": True, "partition_activations": True, "contiguous_checkpointing": True,
     "num_checkpoints": 3},
])
def test_cuda_dropout_is_exact_and_cpu_checkpointing_keeps_the_inputs_on_the_host(flags):
    ckpt.configure(None, **flags)
    blocks = _blocks()
    x = torch.randn(8, 64, device="cuda", requires_grad=True)
    plain, _ = _run(blocks, x, False)
    got, saved = _run(blocks, x, True)
    assert all(torch.equal(a, b) for a, b in zip(got, plain))
    assert saved == (["cpu"] * 3 if flags else ["cuda"] * 3)


def test_tracker_of_cuda_states_is_restored_by_the_recompute():
    assert ckpt.get_cuda_rng_tracker().device.type == "cuda"
    ckpt.model_parallel_cuda_manual_seed(3)
    lin = nn.Linear(64, 64).cuda()

    def region(h):
        with ckpt.get_cuda_rng_tracker().fork():
            return F.dropout(lin(h), 0.5)

    x = torch.randn(8, 64, device="cuda", requires_grad=True)
    start = ckpt.get_cuda_rng_tracker().get_states()
    region(x).sum().backward()
    plain = lin.weight.grad.clone()
    lin.zero_grad(set_to_none=True)
    ckpt.get_cuda_rng_tracker().set_states(start)
    ckpt.checkpoint(region, x).sum().backward()
    assert torch.equal(lin.weight.grad, plain)


def test_synchronize_calls_the_device_at_the_four_boundaries(monkeypatch):
    calls = []
    real = torch.cuda.synchronize
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: (calls.append(1), real(*a)))
    ckpt.configure(None, synchronize=True)
    lin = nn.Linear(8, 8).cuda()
    ckpt.checkpoint(lin, torch.randn(2, 8, device="cuda", requires_grad=True)).sum().backward()
    assert len(calls) == 4


def test_engine_on_cuda_with_checkpointed_dropout_blocks_trains_like_the_plain_model():
    cfg = GPTConfig(n_layer=3, n_embd=64, dropout=0.1)
    torch.manual_seed(0)
    ref = GPT(cfg).cuda()
    model = copy.deepcopy(ref)
    model.cfg = GPTConfig(n_layer=3, n_embd=64, dropout=0.1, checkpoint="zero3")
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    engine = zero3.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-3),
                              {"param_persistence_threshold": 0, "max_reuse_distance": 0,
                               "prefetch_bucket_size": 20000})
    for step in range(3):
        x, y = (t.cuda() for t in synthetic_batch(step, 4, cfg))
        torch.cuda.manual_seed(100 + step)
        ref_loss = ref(x, y)
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        torch.cuda.manual_seed(100 + step)
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=0)
        assert engine.last_step_metrics.divergences == 0
