"""zero3.checkpointing on one process: exact gradients (dropout and the RNG tracker included), argument
and output structures, every flag of ``configure`` and of the config section, and the recompute as
part of zero3's recorded step."""

from __future__ import annotations

import copy
import json
import logging

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import zero3
import zero3.activation.rng
import zero3.checkpointing as ckpt
import zero3.deepspeed as deepspeed
from zero3 import ZeroConfigError, ZeroStateError
from zero3.config import ActivationCheckpointingConfig

from _reference import assert_same_weights, twins
from gpt import GPT, GPTConfig, synthetic_batch


@pytest.fixture(autouse=True)
def _fresh_state(monkeypatch):
    """Each test starts unconfigured, with an empty tracker (both are process-wide)."""
    monkeypatch.setattr(ckpt, "_STATE", ckpt._State())
    monkeypatch.setattr(zero3.activation.rng, "_TRACKER", ckpt.RNGStatesTracker("cpu"))


def _blocks(n: int = 3, dropout: float = 0.3) -> nn.ModuleList:
    torch.manual_seed(0)
    return nn.ModuleList([nn.Sequential(nn.Linear(8, 8), nn.Dropout(dropout), nn.GELU()) for _ in range(n)])


def _grads(blocks: nn.Module, x: torch.Tensor, use_checkpoint: bool, seed: int = 1) -> list[torch.Tensor]:
    """Forward the blocks (each checkpointed or not) from RNG seed ``seed``, backward, return grads."""
    torch.manual_seed(seed)
    h = x
    for b in blocks:
        h = ckpt.checkpoint(b, h) if use_checkpoint else b(h)
    h.pow(2).sum().backward()
    out = [p.grad.clone() for p in blocks.parameters()] + ([x.grad.clone()] if x.grad is not None else [])
    blocks.zero_grad(set_to_none=True)
    x.grad = None
    return out


def _equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(u, v) for u, v in zip(a, b))


def _count_saved(fn):
    """(result of fn(), bytes of every tensor saved for backward while it ran, those tensors)."""
    saved: list[torch.Tensor] = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, sum(t.numel() * t.element_size() for t in saved), saved


# -- exact gradients ------------------------------------------------------------------------------------
def test_gradients_with_dropout_equal_the_plain_models_bit_for_bit():
    blocks = _blocks()
    x = torch.randn(4, 8, requires_grad=True)
    plain = _grads(blocks, x, False)
    assert _equal(_grads(blocks, x, True), plain)
    assert not _equal(_grads(blocks, x, True, seed=2), plain)  # the masks do depend on the RNG


def test_the_recompute_restores_the_trackers_states():
    ckpt.get_cuda_rng_tracker().add("tp", 1234)
    lin = nn.Linear(8, 8)

    def region(h):
        with ckpt.get_cuda_rng_tracker().fork("tp"):
            return F.dropout(lin(h), 0.5)

    x = torch.randn(4, 8, requires_grad=True)
    start = ckpt.get_cuda_rng_tracker().get_states()
    region(x).sum().backward()
    plain = [lin.weight.grad.clone(), x.grad.clone()]
    lin.zero_grad(set_to_none=True)
    x.grad = None
    ckpt.get_cuda_rng_tracker().set_states(start)
    ckpt.checkpoint(region, x).sum().backward()
    assert _equal([lin.weight.grad, x.grad], plain)


def test_non_tensor_arguments_nested_tensors_and_non_differentiable_outputs():
    lin = nn.Linear(4, 4)

    def fn(pair, scale, tag, mask=None):
        a, b = pair
        y = lin(a) * scale + b["bias"]
        return {"y": y, "tag": tag, "argmax": y.argmax(-1), "mask": mask, "none": None}

    a = torch.randn(3, 4, requires_grad=True)
    b = torch.randn(4, requires_grad=True)
    out = ckpt.checkpoint(fn, (a, {"bias": b}), 2.0, "hello", torch.ones(3, dtype=torch.bool))
    assert out["tag"] == "hello" and out["none"] is None and out["mask"].dtype == torch.bool
    assert not out["argmax"].requires_grad and out["argmax"].dtype == torch.int64
    out["y"].sum().backward()
    got = [lin.weight.grad.clone(), a.grad.clone(), b.grad.clone()]
    lin.zero_grad(set_to_none=True)
    a.grad = b.grad = None
    fn((a, {"bias": b}), 2.0, "hello")["y"].sum().backward()
    assert _equal(got, [lin.weight.grad, a.grad, b.grad])


def test_parameters_get_gradients_when_no_input_requires_grad():
    """Frozen embeddings feed the first block an input without grad: its weights still train (torch's
    reentrant checkpoint would give them no gradient unless the input were made to require grad)."""
    blocks = _blocks(dropout=0.0)
    x = torch.randn(4, 8)
    assert _equal(_grads(blocks, x, True), _grads(blocks, x, False))


def test_without_grad_mode_the_function_just_runs():
    blocks = _blocks()
    x = torch.randn(4, 8)
    with torch.no_grad():
        (out, nbytes, _) = _count_saved(lambda: ckpt.checkpoint(blocks[0], x))
    assert nbytes == 0 and out.grad_fn is None


def test_autograd_grad_through_a_checkpoint_is_refused_by_name():
    lin = nn.Linear(4, 4)
    x = torch.randn(2, 4, requires_grad=True)
    y = ckpt.checkpoint(lin, x).sum()
    with pytest.raises(ZeroStateError, match="torch.autograd.grad"):
        torch.autograd.grad(y, [x])


# -- the RNG tracker --------------------------------------------------------------------------------------
def test_tracker_fork_continues_its_stream_and_leaves_the_default_one_alone():
    tracker = ckpt.RNGStatesTracker("cpu")
    tracker.add("a", 7)
    torch.manual_seed(0)
    before = torch.get_rng_state()
    with tracker.fork("a"):
        first = torch.rand(3)
    with tracker.fork("a"):
        second = torch.rand(3)
    assert torch.equal(torch.get_rng_state(), before)
    expected = torch.rand(6, generator=torch.Generator().manual_seed(7))
    assert torch.equal(torch.cat([first, second]), expected)
    states = tracker.get_states()
    with tracker.fork("a"):
        torch.rand(1)
    tracker.set_states(states)
    with tracker.fork("a"):
        assert torch.equal(torch.rand(3), torch.rand(9, generator=torch.Generator().manual_seed(7))[6:])


def test_tracker_refuses_a_used_name_or_seed_and_an_unknown_fork():
    tracker = ckpt.RNGStatesTracker("cpu")
    tracker.add("a", 7)
    with pytest.raises(ValueError, match="seed 7"):
        tracker.add("b", 7)
    with pytest.raises(ValueError, match="'a' already exists"):
        tracker.add("a", 8)
    with pytest.raises(ValueError, match="no state named 'b'"):
        with tracker.fork("b"):
            pass
    tracker.reset()
    tracker.add("a", 7)  # forgotten: free again


def test_model_parallel_seed_gives_the_tracker_seed_plus_2718_plus_the_model_parallel_rank():
    class Unit:  # model-parallel rank 1 of 2, without torch.distributed
        def get_model_parallel_group(self):
            return None

        def get_model_parallel_rank(self):
            return 1

        def get_model_parallel_world_size(self):
            return 2

    ckpt.configure(Unit())
    ckpt.model_parallel_cuda_manual_seed(5)
    assert torch.equal(torch.rand(2), torch.rand(2, generator=torch.Generator().manual_seed(5)))
    with ckpt.get_cuda_rng_tracker().fork():
        drawn = torch.rand(2)
    assert torch.equal(drawn, torch.rand(2, generator=torch.Generator().manual_seed(5 + 2718 + 1)))


# -- configure and the config section --------------------------------------------------------------------
def test_configure_reads_the_config_section_and_explicit_arguments_win(tmp_path):
    assert not ckpt.is_configured()
    section = {"partition_activations": True, "cpu_checkpointing": True, "contiguous_memory_optimization": True,
               "number_checkpoints": 4, "synchronize_checkpoint_boundary": True, "profile": True}
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 3}, "activation_checkpointing": section}))
    ckpt.configure(None, deepspeed_config=str(path))
    assert ckpt.is_configured() and ckpt.current_config() == ActivationCheckpointingConfig(**section)
    ckpt.configure(None, deepspeed_config={"activation_checkpointing": section}, partition_activations=True,
                   contiguous_checkpointing=False, num_checkpoints=2, checkpoint_in_cpu=False, synchronize=False,
                   profile=False)
    assert ckpt.current_config() == ActivationCheckpointingConfig(partition_activations=True, number_checkpoints=2)
    ckpt.configure(None)  # every call starts from the defaults
    assert ckpt.current_config() == ActivationCheckpointingConfig()


@pytest.mark.parametrize("kwargs,needle", [
    ({"contiguous_checkpointing": True, "num_checkpoints": 2}, "needs partition_activations"),
    ({"contiguous_checkpointing": True, "partition_activations": True}, "needs number_checkpoints"),
    ({"num_checkpoints": 0}, "number_checkpoints must be None or an int >= 1, got 0"),
    ({"profile": "yes"}, "profile must be a bool, got 'yes'"),
])
def test_configure_refuses_bad_values_by_name(kwargs, needle):
    with pytest.raises(ZeroConfigError, match=needle):
        ckpt.configure(None, **kwargs)


def test_deepspeed_namespace_exposes_the_checkpointing_api():
    assert deepspeed.checkpointing.checkpoint is ckpt.checkpoint
    assert deepspeed.checkpointing.CudaRNGStatesTracker is ckpt.RNGStatesTracker
    deepspeed.checkpointing.configure(None, profile=True)
    assert deepspeed.checkpointing.is_configured() and ckpt.current_config().profile
    assert deepspeed.checkpointing.get_cuda_rng_tracker() is ckpt.get_cuda_rng_tracker()


# -- each flag changes what is kept -------------------------------------------------------------------------
def test_partition_activations_keeps_a_flat_slice_and_leaves_integer_inputs_alone():
    """One process is model-parallel rank 0 of 1: the slice is a flat copy of the whole input (the
    1/mp split across ranks is tested in tests/multiproc/test_megatron_gpt.py)."""
    ckpt.configure(None, partition_activations=True)
    lin = nn.Linear(8, 8)
    x = torch.randn(2, 3, 8, requires_grad=True)
    ids = torch.arange(6).view(2, 3)
    (out, nbytes, saved) = _count_saved(lambda: ckpt.checkpoint(lambda h, i: lin(h) + i.unsqueeze(-1), x, ids))
    assert [tuple(t.shape) for t in saved] == [(48,), (2, 3)]
    assert saved[0].untyped_storage().data_ptr() != x.untyped_storage().data_ptr()
    assert saved[1] is ids
    out.sum().backward()
    got = [lin.weight.grad.clone(), x.grad.clone()]
    lin.zero_grad(set_to_none=True)
    x.grad = None
    (lin(x) + ids.unsqueeze(-1)).sum().backward()
    assert _equal(got, [lin.weight.grad, x.grad])


@pytest.mark.parametrize("partition", [False, True])
def test_cpu_checkpointing_saves_a_host_copy_not_the_input(partition):
    """On a CPU-only machine the copy is what is observable: the saved input no longer aliases the
    caller's tensor, so changing that tensor in place after the forward does not change (or break)
    the backward. The move to and from an accelerator is tested in tests/gpu."""
    ckpt.configure(None, checkpoint_in_cpu=True, partition_activations=partition)
    lin = nn.Linear(8, 8)
    x = torch.randn(4, 8, requires_grad=True)
    expected = torch.autograd.grad(lin(x).pow(2).sum(), [lin.weight])[0]
    h = x * 1.0
    (out, _, saved) = _count_saved(lambda: ckpt.checkpoint(lin, h))
    assert all(t.device.type == "cpu" and t.untyped_storage().data_ptr() != h.untyped_storage().data_ptr()
               for t in saved)
    with torch.no_grad():
        h.mul_(10.0)  # the plain checkpoint keeps h itself: its backward would see the change and raise
    out.pow(2).sum().backward()
    assert torch.equal(lin.weight.grad, expected)


def test_without_cpu_checkpointing_the_input_itself_is_kept():
    lin = nn.Linear(8, 8)
    h = torch.randn(4, 8, requires_grad=True) * 1.0
    (_, _, saved) = _count_saved(lambda: ckpt.checkpoint(lin, h))
    assert saved[0].untyped_storage().data_ptr() == h.untyped_storage().data_ptr()
    out = ckpt.checkpoint(lin, h)  # (saved-tensor hooks turn autograd's version check off: none here)
    with torch.no_grad():
        h.mul_(10.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.sum().backward()


def test_contiguous_memory_keeps_the_slices_of_a_pass_in_one_buffer_of_number_checkpoints_slots():
    ckpt.configure(None, partition_activations=True, contiguous_checkpointing=True, num_checkpoints=3)
    blocks = _blocks()
    x = torch.randn(4, 8, requires_grad=True)
    plain = _grads(blocks, x, False)

    def forward():
        h = x
        for b in blocks:
            h = ckpt.checkpoint(b, h)
        return h

    torch.manual_seed(1)
    (out, _, saved) = _count_saved(forward)
    bases = {t.untyped_storage().data_ptr() for t in saved}
    assert len(bases) == 1 and saved[0].untyped_storage().nbytes() == 3 * 32 * 4  # 3 slots of 4 x 8 floats
    assert [t.storage_offset() for t in saved] == [0, 32, 64]
    out.pow(2).sum().backward()
    got = [p.grad.clone() for p in blocks.parameters()] + [x.grad.clone()]
    assert _equal(got, plain)
    # The backward handed the buffers over: the next pass starts at slot 0 in a buffer of its own.
    (_, _, again) = _count_saved(lambda: ckpt.checkpoint(blocks[0], x))
    assert again[0].storage_offset() == 0 and again[0].untyped_storage().data_ptr() not in bases


def test_contiguous_memory_refuses_more_checkpoints_than_slots_and_uneven_sizes():
    ckpt.configure(None, partition_activations=True, contiguous_checkpointing=True, num_checkpoints=2)
    lin = nn.Linear(8, 8)
    x = torch.randn(4, 8, requires_grad=True)
    ckpt.checkpoint(lin, x)
    ckpt.checkpoint(lin, x)
    with pytest.raises(ZeroStateError, match="checkpoint 3 of this forward pass, but number_checkpoints=2"):
        ckpt.checkpoint(lin, x)
    ckpt.reset()  # forward passes without backward (evaluation): start over
    ckpt.checkpoint(lin, x)
    with pytest.raises(ZeroStateError, match="same sizes"):
        ckpt.checkpoint(lin, torch.randn(2, 8, requires_grad=True))


@pytest.mark.parametrize("synchronize", [False, True])
def test_synchronize_waits_for_the_device_at_the_four_boundaries(monkeypatch, synchronize):
    calls = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: calls.append(1))
    ckpt.configure(None, synchronize=synchronize)
    lin = nn.Linear(4, 4)
    ckpt.checkpoint(lin, torch.randn(2, 4, requires_grad=True)).sum().backward()
    assert len(calls) == (4 if synchronize else 0)  # forward start and end, backward start and end


@pytest.mark.parametrize("profile", [False, True])
def test_profile_times_and_logs_every_forward_and_backward(caplog, profile):
    ckpt.configure(None, profile=profile)
    blocks = _blocks(2)
    with caplog.at_level(logging.INFO, logger="zero3.activation.checkpointing"):
        _grads(blocks, torch.randn(4, 8, requires_grad=True), True)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("zero3::checkpoint ")]
    t = ckpt.timings()
    if profile:
        assert [line.split()[1] for line in lines] == ["forward", "forward", "backward", "backward"]
        assert t.forward_calls == t.backward_calls == 2 and t.backward_seconds > 0 and t.forward_seconds > 0
    else:
        assert lines == [] and t == ckpt.Timings()


# -- the recompute inside zero3's step -----------------------------------------------------------------------
def _engine_pair(cfg: GPTConfig, frozen: str | None = None):
    torch.manual_seed(0)
    ref = GPT(cfg)
    if frozen is not None:
        for name, p in ref.named_parameters():
            if frozen in name:
                p.requires_grad_(False)
    model = copy.deepcopy(ref)
    engine = zero3.initialize(model, torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2),
                              {"param_persistence_threshold": 0, "max_reuse_distance": 0,
                               "prefetch_bucket_size": 5000})
    return ref, torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=1e-2), engine


@pytest.mark.parametrize("frozen", [None, ".attn."])
def test_engine_follows_its_trace_through_the_recompute_and_trains_like_the_plain_model(caplog, frozen):
    cfg = GPTConfig(block_size=16, n_layer=3, dropout=0.1)
    ref, ref_opt, engine = _engine_pair(GPTConfig(**{**cfg.__dict__, "checkpoint": None}), frozen)
    engine.module.cfg.checkpoint = "zero3"
    with caplog.at_level(logging.WARNING, logger="zero3"):
        for step in range(4):
            x, y = synthetic_batch(step, 2, cfg)
            torch.manual_seed(100 + step)
            ref_loss = ref(x, y)
            ref_loss.backward()
            ref_opt.step()
            ref_opt.zero_grad()
            torch.manual_seed(100 + step)
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            assert torch.equal(loss, ref_loss)
            assert engine.coordinator.live_params == []
            m = engine.last_step_metrics
            assert m.divergences == 0
    assert not [r for r in caplog.records if "left trace" in r.getMessage()]
    assert engine.coordinator.record_count == 1
    # The recompute's visits are in the trace, and the schedule prefetched for them: every block's
    # parameters are used three times per step (forward, recompute, backward) and fetched ahead each time.
    trace = engine.coordinator.last_trace
    visits = [e for e in trace.events if e.kind.value == "pre_forward" and e.module == "h.1.mlp.c_fc"]
    assert len(visits) == 2
    assert m.prefetch_hits > m.demand_fetches


def _head_frozen_model():
    """Checkpointed layers followed only by a frozen, persistent head: no hooked module runs in the
    enclosing backward before the first recompute."""

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(64, 64), nn.GELU()) for _ in range(3)])
            self.head = nn.Linear(64, 4)

        def forward(self, x):
            for b in self.blocks:
                x = ckpt.checkpoint(b, x)
            return self.head(x).pow(2).mean()

    torch.manual_seed(0)
    model = Model()
    model.head.requires_grad_(False)
    return model


def test_a_step_ends_with_the_outermost_backward_not_with_a_recomputes():
    ref = _head_frozen_model()
    model = copy.deepcopy(ref)
    ref_opt = torch.optim.SGD([p for p in ref.parameters() if p.requires_grad], lr=0.1)
    engine = zero3.initialize(model, torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1),
                              {"param_persistence_threshold": 300, "max_reuse_distance": 0})
    for step in range(3):
        x = torch.randn(8, 64, generator=torch.Generator().manual_seed(step))
        ref_loss = ref(x)
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        loss = engine(x)
        engine.backward(loss)
        engine.step()
        assert torch.equal(loss, ref_loss)
        assert engine.coordinator.live_params == []
    assert engine.coordinator.record_count == 1  # one step per backward, not one per recompute


def test_a_checkpointed_root_is_a_training_step_not_an_inference_forward():
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(16, 16), nn.GELU(), nn.Linear(16, 16))
    model = copy.deepcopy(ref)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    engine = zero3.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), {"param_persistence_threshold": 0})
    for step in range(3):
        x = torch.randn(4, 16, generator=torch.Generator().manual_seed(step))
        ref_loss = ref(x).pow(2).mean()
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        loss = ckpt.checkpoint(model, x).pow(2).mean()
        engine.backward(loss)
        engine.step()
        assert torch.equal(loss, ref_loss)
    assert engine.coordinator.record_count == 1
    assert [e.kind.value for e in engine.coordinator.last_trace.events].count("pre_forward") == 4  # 2 runs x 2


def test_initialize_configures_checkpointing_from_the_config_section_unless_configured_before():
    def engine(section):
        torch.manual_seed(0)
        return zero3.initialize(nn.Linear(4, 4), None, {"activation_checkpointing": section})

    engine({"profile": True, "cpu_checkpointing": True})
    assert ckpt.is_configured()
    assert ckpt.current_config() == ActivationCheckpointingConfig(profile=True, cpu_checkpointing=True)
    ckpt.configure(None, synchronize=True)
    engine({"profile": True})
    assert ckpt.current_config() == ActivationCheckpointingConfig(synchronize_checkpoint_boundary=True)


def test_a_later_initializes_section_replaces_an_earlier_ones_and_configure_stands():
    """A second initialize (a sweep, a teacher and a student) kept the first one's section, silently:
    profile stayed off where the second asked for it (probe 23D)."""
    def build(section):
        torch.manual_seed(0)
        return zero3.initialize(nn.Linear(4, 4), None, {"activation_checkpointing": section})

    build({"profile": False})
    assert not ckpt.configured_by_user() and not ckpt.current_config().profile
    build({"profile": True, "cpu_checkpointing": True})
    assert ckpt.current_config() == ActivationCheckpointingConfig(profile=True, cpu_checkpointing=True)
    ckpt.configure(None, synchronize=True)  # the user's own call stands over a later section
    build({"profile": True})
    assert ckpt.configured_by_user() and ckpt.current_config() == ActivationCheckpointingConfig(
        synchronize_checkpoint_boundary=True)


class _LeafTwice(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 16), nn.Tanh())
        self.out = nn.Linear(16, 1)

    def forward(self, xs):
        return sum(self.out(ckpt.checkpoint(self.body, x)).mean() for x in xs)


@pytest.mark.parametrize("calls", [1, 2, 3])
def test_a_leaf_module_checkpointed_in_each_of_its_calls_gets_every_calls_gradient(calls):
    """Each call's recompute runs a nested backward, which accumulates the leaf's gradients once per
    call before the leaf's unit is reduced: the second overwrote the first (body.0.weight 0.12 off)."""
    torch.manual_seed(0)
    ref = _LeafTwice()
    model = copy.deepcopy(ref)
    engine = zero3.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1),
                              {"param_persistence_threshold": 0, "leaf_modules": ["Sequential"]})
    xs = [torch.randn(4, 8, generator=torch.Generator().manual_seed(i)) for i in range(calls)]
    engine.backward(engine(xs))
    ref(xs).backward()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(zero3.safe_get_full_grad(p), q.grad, rtol=1e-6, atol=1e-7, msg=name)


@pytest.mark.parametrize("threshold", [0, None], ids=["threshold 0", "default persistence"])
def test_torch_non_reentrant_checkpoint_of_the_whole_model_with_its_early_stop_trains_as_torch(threshold):
    """Review 26X: torch's non-reentrant checkpoint stops the recompute early by raising through the
    forward (its default); the root's always_call post-hook took that for a failed forward and aborted
    the step, and the backward failed inside torch on a released parameter. The recompute's end is no
    failure: the step goes on, and trains as torch's."""
    import torch.utils.checkpoint as torch_checkpoint
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 4))
    model = copy.deepcopy(ref)
    engine = zero3.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-6),
                              {} if threshold is None else {"param_persistence_threshold": threshold})
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, eps=1e-6)
    for step in range(3):
        x = torch.randn(4, 8, requires_grad=True, generator=torch.Generator().manual_seed(step))
        torch_checkpoint.checkpoint(ref, x, use_reentrant=False).square().mean().backward()
        ref_opt.step()
        ref_opt.zero_grad()
        engine.backward(torch_checkpoint.checkpoint(model, x, use_reentrant=False).square().mean())
        engine.step()
        engine.coordinator.check_valid()
    assert_same_weights(model, ref)


def _save_matmuls(ctx, op, *args, **kwargs):
    import torch.utils.checkpoint as torch_checkpoint
    keep = op in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default)
    return torch_checkpoint.CheckpointPolicy.MUST_SAVE if keep else torch_checkpoint.CheckpointPolicy.PREFER_RECOMPUTE


def _save_all_but_gelu(ctx, op, *args, **kwargs):
    import torch.utils.checkpoint as torch_checkpoint
    keep = op is not torch.ops.aten.gelu.default
    return torch_checkpoint.CheckpointPolicy.MUST_SAVE if keep else torch_checkpoint.CheckpointPolicy.PREFER_RECOMPUTE


class _TorchCheckpointed(nn.Module):
    """Blocks run through ``torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False, **options)``."""

    def __init__(self, **options) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(16, 16), nn.GELU(), nn.LayerNorm(16)) for _ in range(3)])
        self.head = nn.Linear(16, 1)
        self.options = options

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        import torch.utils.checkpoint as torch_checkpoint
        for b in self.blocks:
            x = torch_checkpoint.checkpoint(b, x, use_reentrant=False, **self.options)
        return self.head(x).square().mean()


def _train_as_torch(threshold: int, **options) -> None:
    torch.manual_seed(0)
    ref = _TorchCheckpointed(**options)
    model = copy.deepcopy(ref)
    engine = zero3.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-6),
                              {"param_persistence_threshold": threshold})
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, eps=1e-6)
    for step in range(4):
        x = torch.randn(4, 16, requires_grad=True, generator=torch.Generator().manual_seed(step))
        ref(x).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        engine.backward(engine(x))
        engine.step()
        engine.coordinator.check_valid()
    assert_same_weights(model, ref)


@pytest.mark.parametrize("policy", [_save_matmuls, _save_all_but_gelu], ids=["save matmuls", "save all but gelu"])
@pytest.mark.parametrize("threshold", [0, 20], ids=["threshold 0", "biases and norms persistent"])
def test_torch_selective_checkpoint_of_partitioned_blocks_trains_as_torch(policy, threshold):
    """Probe 31I: torch's selective checkpoint replays the recompute against the ops its forward
    recorded, and zero3's hooks issued ops of their own there: from step 1 the recompute's
    `_PostBackward` wrap (a view the forward, its gathers prefetched, never issued) raised "aten.view.default
    encountered during backward but not found in storage"; saving all but gelu handed the user's ops
    the gather's tensors at step 0. The hooks' ops are no part of the region now."""
    import functools
    import torch.utils.checkpoint as torch_checkpoint
    _train_as_torch(threshold, context_fn=functools.partial(torch_checkpoint.create_selective_checkpoint_contexts,
                                                            policy))


@pytest.mark.parametrize("options", [{"determinism_check": "default"}, {"debug": True}], ids=["determinism", "debug"])
def test_torch_non_reentrant_checkpoint_checks_and_debug_mode_over_partitioned_blocks_train_as_torch(options):
    """The recompute's saved tensors match the forward's in metadata; debug mode records both runs'
    ops (a dispatch mode of its own) and finds nothing to report."""
    _train_as_torch(0, **options)


@pytest.mark.parametrize("threshold", [0, 10**6])
def test_torch_s_checkpoint_over_engine_call_trains_as_the_plain_model(threshold):
    """torch's non-reentrant checkpoint stops its recompute early by raising through ``engine(x)``, whose
    error path aborted the step: the backward then read released parameters ('setStorage ... out of
    bounds for storage of size 0', probe 37A). ``model(x)`` was right already; ``engine(x)`` must be too."""
    import torch.utils.checkpoint as torch_checkpoint

    def build():
        return nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))

    ref, model = twins(build)
    engine = zero3.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), {"param_persistence_threshold": threshold})
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for _ in range(3):
        x = torch.randn(4, 8)
        loss = torch_checkpoint.checkpoint(engine, x, use_reentrant=False).square().mean()
        engine.backward(loss)
        engine.step()
        ref_loss = torch_checkpoint.checkpoint(ref, x, use_reentrant=False).square().mean()
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=1e-7)
