"""DeepSpeed's engine names and its refusals, in one process (issue 20, items 3-5): the engine's
attributes with DeepSpeed's meaning, ``save_16bit_model``, ``init_distributed`` and
``dist_init_required``, the 4-tuple habit on ``zero3.initialize``, and training that would silently do
nothing."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from torch import nn

import zero3
import zero3.deepspeed as deepspeed
from zero3.errors import ZeroConfigError, ZeroStateError

ADAMW = {"optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}}


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


def _train_step(engine, seed: int = 0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    loss = engine(torch.randn(3, 8, generator=g).to(dtype)).float().pow(2).mean()
    engine.backward(loss)
    engine.step()
    return loss


# -- item 4: the 4-tuple habit ----------------------------------------------------------------------
def test_unpacking_zero3_initialize_like_deepspeed_says_where_the_tuple_is():
    with pytest.raises(TypeError, match="zero3.initialize returns the engine alone.*zero3.deepspeed.initialize"):
        engine, optimizer, _, scheduler = zero3.initialize(_model(), config=ADAMW)  # noqa: F841


def test_no_sync_is_refused_naming_the_accumulation_that_works():
    """DDP's ``with model.no_sync():`` (DeepSpeed refuses it under ZeRO-3 too); the loop the message
    names, a backward per micro-batch and one step, equals torch's accumulation."""
    engine = zero3.initialize(_model(), config=ADAMW)
    ref = _model()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.0)  # DeepSpeed's AdamW: no decay by default
    with pytest.raises(ZeroConfigError, match="no_sync.*Drop the no_sync"):
        engine.no_sync()
    for seed in (0, 1):
        x = torch.randn(3, 8, generator=torch.Generator().manual_seed(seed))
        engine.backward(engine(x).pow(2).mean() / 2)
        (ref(x).pow(2).mean() / 2).backward()
    engine.step()
    ref_opt.step()
    for p, q in zip(engine.module.parameters(), ref.parameters()):
        torch.testing.assert_close(zero3.safe_get_full_fp32_param(p), q.detach(), rtol=0, atol=1e-6)
    engine.remove_hooks()


def test_deepspeed_initialize_returns_the_4_tuple():
    engine, optimizer, loader, scheduler = deepspeed.initialize(model=_model(), config=ADAMW)
    assert isinstance(engine, zero3.Engine) and optimizer is engine.sharded_optimizer and loader is None
    assert scheduler is None


# -- item 3: DeepSpeed's engine names ----------------------------------------------------------------
def test_engine_names_with_deepspeeds_meaning(monkeypatch):
    engine = zero3.initialize(_model(), config=ADAMW)
    assert engine.global_rank == 0 and engine.zero_optimization_stage() == 3
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    assert engine.local_rank == 0
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert engine.local_rank == 3


def test_batch_sizes_without_batch_keys_in_the_config_name_the_key_to_set():
    engine = zero3.initialize(_model(), config=ADAMW)
    with pytest.raises(ZeroConfigError, match="set train_micro_batch_size_per_gpu"):
        engine.train_micro_batch_size_per_gpu()
    with pytest.raises(ZeroConfigError, match="set train_micro_batch_size_per_gpu"):
        engine.train_batch_size()


def test_batch_sizes_follow_the_config():
    engine = zero3.initialize(_model(), config=dict(ADAMW, train_micro_batch_size_per_gpu=4,
                                                    gradient_accumulation_steps=2))
    assert engine.train_micro_batch_size_per_gpu() == 4 and engine.train_batch_size() == 8
    derived = zero3.initialize(_model(), config=dict(ADAMW, train_batch_size=12, gradient_accumulation_steps=3))
    assert derived.train_micro_batch_size_per_gpu() == 4 and derived.gradient_accumulation_steps() == 3


def test_global_grad_norm_is_the_last_clippings():
    engine = zero3.initialize(_model(), config=dict(ADAMW, gradient_clipping=0.5))
    assert engine.get_global_grad_norm() is None
    ref = _model()
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.0)  # DeepSpeed's AdamW: no decay by default
    for step in range(2):
        _train_step(engine, step)
        g = torch.Generator().manual_seed(step)
        ref(torch.randn(3, 8, generator=g)).pow(2).mean().backward()
        norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
        opt.step()
        opt.zero_grad()
        assert engine.get_global_grad_norm() == pytest.approx(norm.item(), rel=1e-6)


def test_global_grad_norm_from_clip_grad_norm_():
    engine = zero3.initialize(_model(), config=ADAMW)
    loss = engine(torch.ones(2, 8)).sum()
    engine.backward(loss)
    norm = zero3.clip_grad_norm_(engine, 1e9)
    assert engine.get_global_grad_norm() == pytest.approx(norm.item()) and math.isfinite(norm.item())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_save_16bit_model_writes_the_consolidated_model_in_the_parameters_dtype(tmp_path, dtype):
    config = dict(ADAMW, bf16={"enabled": dtype is torch.bfloat16})
    torch.manual_seed(0)
    with deepspeed.zero.Init(config_dict_or_path=config):
        model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    model.register_buffer("scale", torch.full((2,), 0.5))
    engine, *_ = deepspeed.initialize(model=model, config=config)
    _train_step(engine, dtype=dtype)
    assert engine.save_16bit_model(tmp_path / "out", "model.bin") is True
    saved = torch.load(tmp_path / "out" / "model.bin")
    masters = engine.consolidated_state_dict()
    assert list(saved) == list(masters) == ["scale", "0.weight", "0.bias", "2.weight", "2.bias"]
    for key, value in saved.items():
        expected = masters[key] if key == "scale" else masters[key].to(dtype)
        assert value.dtype == expected.dtype and torch.equal(value, expected), key


class _Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 4)
        self.mid = nn.Linear(4, 4)
        self.head = nn.Linear(4, 10, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(self.mid(self.emb(idx)))


def test_save_16bit_model_keeps_tied_parameters_tied_and_can_drop_frozen_ones(tmp_path):
    torch.manual_seed(0)
    model = _Tied()
    model.mid.bias.requires_grad_(False)
    engine = zero3.initialize(model, config=ADAMW)
    engine.save_16bit_model(tmp_path)
    saved = torch.load(tmp_path / "pytorch_model.bin")
    assert list(saved) == ["emb.weight", "mid.weight", "mid.bias", "head.weight"]
    assert saved["emb.weight"].data_ptr() == saved["head.weight"].data_ptr()  # one storage, as torch.save keeps ties
    engine.save_16bit_model(tmp_path, "trainable.bin", exclude_frozen_parameters=True)
    assert list(torch.load(tmp_path / "trainable.bin")) == ["emb.weight", "mid.weight", "head.weight"]


# -- init_distributed and dist_init_required ---------------------------------------------------------
def test_dist_init_required_false_without_a_process_group_is_refused():
    assert not dist.is_initialized()
    with pytest.raises(ZeroConfigError, match="dist_init_required=False.*not initialized"):
        deepspeed.initialize(model=_model(), config=ADAMW, dist_init_required=False)


def test_dist_init_required_none_without_a_launcher_keeps_the_single_process_mode(monkeypatch):
    for var in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    engine, *_ = deepspeed.initialize(model=_model(), config=ADAMW)
    assert not dist.is_initialized() and engine.world_size == 1


def test_init_distributed_without_a_launcher_makes_a_world_of_one(monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    assert not dist.is_initialized()
    try:
        deepspeed.init_distributed()
        assert dist.is_initialized() and dist.get_world_size() == 1 and dist.get_backend() == "gloo"
        deepspeed.init_distributed()  # a no-op now
        engine, *_ = deepspeed.initialize(model=_model(), config=ADAMW, dist_init_required=True)
        assert engine.global_rank == 0 and engine.world_size == 1
        _train_step(engine)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def test_init_distributed_with_a_partial_launcher_environment_names_what_is_missing(monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    monkeypatch.delenv("MASTER_PORT", raising=False)
    with pytest.raises(ZeroConfigError, match="MASTER_ADDR, MASTER_PORT not set"):
        deepspeed.init_distributed()
    assert not dist.is_initialized()


# -- item 5: training that would silently do nothing ---------------------------------------------------
def test_backward_without_an_optimizer_is_refused_but_forward_and_generation_work():
    engine = zero3.initialize(_model())
    out = engine(torch.ones(2, 8))
    with pytest.raises(ZeroConfigError, match="must provide optimizer during init in order to use backward"):
        engine.backward(out.sum())
    engine.step()  # ends the forward's step: nothing to step without an optimizer
    with torch.no_grad(), engine.generation():
        assert engine(torch.ones(2, 8)).shape == (2, 4)


@pytest.mark.parametrize("threshold", [0, 10**6])  # every parameter partitioned / every one kept gathered
def test_an_optimizer_over_the_partitioned_parameters_themselves_is_refused_at_its_step(threshold):
    """FSDP2's order (shard, then build the optimizer over model.parameters()) steps nothing under
    zero3, whose gradients go to the shards: refused at the step, with nothing changed. The same
    optimizer passed to initialize steps; an optimizer over other parameters is not touched."""
    model = _model()
    engine = zero3.initialize(model, None, {"param_persistence_threshold": threshold})
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    before = [zero3.safe_get_full_fp32_param(p) for p in model.parameters()]
    model(torch.ones(2, 8)).sum().backward()
    with pytest.raises(ZeroStateError, match=r"AdamW.step\(\): this optimizer holds 4 zero3-partitioned parameters.*"
                                             r"Build it before zero3.initialize and pass it in"):
        opt.step()
    assert all(torch.equal(a, zero3.safe_get_full_fp32_param(p)) for a, p in zip(before, model.parameters()))
    other = nn.Linear(2, 2)
    plain = torch.optim.SGD(other.parameters(), lr=0.1)
    other(torch.ones(1, 2)).sum().backward()
    w = other.weight.detach().clone()
    plain.step()  # the hook is global; an optimizer over plain parameters steps as ever
    assert not torch.equal(w, other.weight)

    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    engine = zero3.initialize(model, opt, {"param_persistence_threshold": threshold})
    model(torch.ones(2, 8)).sum().backward()
    with pytest.raises(ZeroConfigError, match=r"AdamW.step\(closure\): zero3 does not take a closure"):
        opt.step(lambda: 0.0)
    opt.step()  # passed in: its step is engine.step() (optim/routed_step.py)
    assert engine.global_steps == 1
    assert not torch.equal(before[0], zero3.safe_get_full_fp32_param(model[0].weight))
    opt.add_param_group({"params": [nn.Parameter(torch.zeros(2))]})  # plain parameters may join
    model(torch.ones(2, 8)).sum().backward()
    opt.step()
    with zero3.Init():
        late = nn.Linear(2, 2)
    groups = len(opt.param_groups)
    with pytest.raises(ZeroStateError, match=r"add_param_group\(\) after zero3.initialize with a zero3 parameter"):
        opt.add_param_group({"params": late.parameters()})  # partitioned ones may not
    with pytest.raises(ZeroStateError, match=r"add_param_group\(\) with 2.weight, which this optimizer steps already"
                                             r".*one group only"):  # probe 37D: it was told 'would get no gradient'
        opt.add_param_group({"params": [model[2].weight], "lr": 1e-3})
    assert len(opt.param_groups) == groups
    model.head = nn.Linear(4, 2)  # a module added after initialize: not partitioned
    with pytest.raises(ZeroStateError, match=r"'head.weight' \(2, 4\) is a parameter of a model zero3 manages"):
        opt.add_param_group({"params": model.head.parameters()})
    assert len(opt.param_groups) == groups
    head_opt = torch.optim.SGD(model.head.parameters(), lr=0.1)  # its own optimizer drifts across ranks too
    model(torch.ones(2, 8)).sum().backward()  # the Sequential now ends in it
    w = model.head.weight.detach().clone()
    with pytest.raises(ZeroStateError, match=r"SGD.step\(\): 'head.weight'.*drift apart.*Nothing was stepped"):
        head_opt.step()
    assert torch.equal(w, model.head.weight)
    engine.remove_hooks()  # no longer managed: torch's rules
    head_opt.step()
    assert not torch.equal(w, model.head.weight)


def test_optimizer_step_inside_an_accumulation_window_is_refused_and_engine_step_counts_it():
    """With gradient_accumulation_steps=2, optimizer.step() after the first micro-batch would only be
    counted by engine.step(); a loop that accumulates itself would step every 4 backwards."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    engine = zero3.initialize(model, opt, {"gradient_accumulation_steps": 2, "train_micro_batch_size_per_gpu": 1})
    model(torch.ones(2, 8)).sum().backward()
    with pytest.raises(ZeroStateError, match=r"SGD.step\(\) at micro-batch 1 of 2 \(gradient_accumulation_steps\)"
                                             r".*nothing was counted"):
        opt.step()
    assert engine.micro_steps == 0 and engine.global_steps == 0
    engine.step()  # the first micro-batch, counted
    model(torch.ones(2, 8)).sum().backward()
    opt.step()  # the window's last: optimizer.step() steps
    assert engine.micro_steps == 2 and engine.global_steps == 1


def test_torch_amp_grad_scaler_is_refused_at_its_step_on_every_rank_and_nothing_steps():
    """Its overflow check sees one rank's shards; zero3's fp16 section agrees on overflow instead."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    engine = zero3.initialize(model, opt, {"param_persistence_threshold": 0})
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    before = [zero3.safe_get_full_fp32_param(p) for p in model.parameters()]
    scaler.scale(model(torch.ones(2, 8)).sum()).backward()
    with pytest.raises(ZeroConfigError, match=r"torch.amp.GradScaler over a zero3 optimizer.*fp16 section"):
        scaler.step(opt)
    assert all(torch.equal(a, zero3.safe_get_full_fp32_param(p)) for a, p in zip(before, model.parameters()))
    assert not hasattr(opt, "found_inf")  # the flags GradScaler set are gone: engine.step() works again
    engine.zero_grad()
    model(torch.ones(2, 8)).sum().backward()
    opt.step()
    assert engine.global_steps == 1


@pytest.mark.parametrize("how", ["object", "factory", "section"])
def test_a_scheduler_zero3_steps_refuses_a_second_step_from_the_loop(how, tmp_path):
    """engine.step() steps the scheduler given to initialize (or built from the config); the loop's
    habitual scheduler.step() as well would advance it twice per optimizer step, silently."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    decay = {"object": torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5),
             "factory": lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.5), "section": None}[how]
    config = {"scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 1.0,
                                                           "warmup_num_steps": 4, "warmup_type": "linear"}}}
    engine = zero3.initialize(model, opt, config if how == "section" else {}, lr_scheduler=decay)
    lrs = []
    for step in range(3):
        _train_step(engine, step)
        lrs.append(opt.param_groups[0]["lr"])
        with pytest.raises(ZeroStateError, match=r"stepped by engine.step\(\).*would advance it twice"):
            engine.lr_scheduler.step()
    assert lrs == ([0.5, 0.25, 0.125] if how != "section" else [0.0, 0.25, 0.5]), lrs  # once per step
    engine.save_checkpoint(str(tmp_path), tag="t")  # the refusal is no state of the scheduler's
    _train_step(engine, 3)
    engine.load_checkpoint(str(tmp_path), tag="t")
    _train_step(engine, 3)
    assert opt.param_groups[0]["lr"] == (0.0625 if how != "section" else 0.75)
    with pytest.raises(ZeroStateError, match="would advance it twice"):
        engine.lr_scheduler.step()


def test_reduce_lr_on_plateau_is_refused_at_initialize_and_works_stepped_by_the_loop():
    """It needs a metric at each step, which engine.step() does not have."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, patience=0, factor=0.5)
    with pytest.raises(ZeroConfigError, match="ReduceLROnPlateau .* needs a metric"):
        zero3.initialize(model, opt, {}, lr_scheduler=plateau)
    assert not zero3.is_zero_param(model[0].weight)  # refused before anything was partitioned
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, patience=0, factor=0.5)
    engine = zero3.initialize(model, opt, {})
    for step in range(2):
        _train_step(engine, step)
        plateau.step(1.0)  # the same metric twice: no improvement, the lr halves
    assert opt.param_groups[0]["lr"] == 0.5


@pytest.mark.parametrize("factory, message", [
    (lambda o: torch.optim.lr_scheduler.ReduceLROnPlateau(o), "ReduceLROnPlateau .* needs a metric"),
    (lambda o: 5, "returned a int, not a scheduler"),
    (torch.optim.lr_scheduler.StepLR, "StepLR \\(a class\\) was called over the optimizer"),
])
def test_a_scheduler_factory_is_refused_before_anything_changes_and_a_retry_trains(factory, message):
    """Probe 35B2: the factory's result was refused after the optimizer was pointed at the shards, so the
    same optimizer was refused again with the corrected factory ("an earlier engine ... remove_hooks()")."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    shapes = [tuple(p.shape) for g in opt.param_groups for p in g["params"]]
    with pytest.raises(ZeroConfigError, match=message):
        zero3.initialize(model, opt, {}, lr_scheduler=factory)
    assert not zero3.is_zero_param(model[0].weight)
    assert [tuple(p.shape) for g in opt.param_groups for p in g["params"]] == shapes
    engine = zero3.initialize(model, opt, {}, lr_scheduler=lambda o: torch.optim.lr_scheduler.StepLR(o, 1, 0.5))
    _train_step(engine, 0)
    assert opt.param_groups[0]["lr"] == 0.5


def test_a_scheduler_factory_is_called_once_over_the_optimizer_given():
    """Review 35R2: called first over a stand-in optimizer, a factory that caches its scheduler (transformers'
    Trainer.create_scheduler, which its DeepSpeed integration passes as a callable) handed that one back,
    and the lr never changed; one reading the optimizer's class or defaults failed."""
    made = []

    def create_scheduler(optimizer):
        assert isinstance(optimizer, torch.optim.AdamW) and optimizer.defaults["betas"] == (0.9, 0.999)
        if not made:
            made.append(torch.optim.lr_scheduler.StepLR(optimizer, 1, 0.5))
        return made[0]

    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1.0)
    engine = zero3.initialize(model, opt, {}, lr_scheduler=create_scheduler)
    _train_step(engine, 0)
    assert len(made) == 1 and made[0].optimizer is opt and opt.param_groups[0]["lr"] == 0.5


@pytest.mark.parametrize("how", ["section", "lr_scheduler"])
def test_a_schedule_without_an_optimizer_is_refused_at_initialize(how):
    model = _model()
    sched = {"type": "WarmupLR", "params": {"warmup_num_steps": 3}}
    with pytest.raises(ZeroConfigError, match="no optimizer"):
        if how == "section":
            zero3.initialize(model, config={"scheduler": sched})
        else:
            zero3.initialize(model, lr_scheduler=lambda opt: zero3.WarmupLR(opt))
    assert not zero3.is_zero_param(model[0].weight)


@pytest.mark.parametrize("accumulation", [1, 2])
def test_step_without_a_backward_is_refused_and_changes_nothing(accumulation):
    config = dict(ADAMW, gradient_accumulation_steps=accumulation,
                  scheduler={"type": "WarmupLR", "params": {"warmup_min_lr": 1e-3, "warmup_max_lr": 1e-2,
                                                            "warmup_num_steps": 4}})
    engine, *_ = deepspeed.initialize(model=_model(), config=config)
    for _ in range(accumulation):
        _train_step(engine)
    state = (engine.global_steps, engine.micro_steps, engine.get_lr(), engine.lr_scheduler.last_batch_iteration)
    with pytest.raises(ZeroStateError, match="no backward reached the model since the last engine.step"):
        engine.step()
    engine(torch.ones(2, 8))  # a forward alone is no backward either
    with pytest.raises(ZeroStateError, match="no backward reached the model"):
        engine.step()
    assert (engine.global_steps, engine.micro_steps, engine.get_lr(),
            engine.lr_scheduler.last_batch_iteration) == state
    _train_step(engine)  # and training goes on
    assert engine.micro_steps == state[1] + 1


def test_add_config_arguments_gives_initialize_its_config(tmp_path):
    import argparse
    import json

    path = tmp_path / "ds.json"
    path.write_text(json.dumps(ADAMW))
    parser = deepspeed.add_config_arguments(argparse.ArgumentParser())
    args = parser.parse_args(["--deepspeed", "--deepspeed_config", str(path)])
    assert args.deepspeed is True
    engine, optimizer, _, _ = deepspeed.initialize(args=args, model=_model())
    assert isinstance(engine.optimizer, torch.optim.AdamW)


@pytest.mark.parametrize("how", ["built", "callable"])
def test_a_schedule_passed_in_sets_the_first_steps_lr_too(how):
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    kwargs = {"warmup_min_lr": 1e-4, "warmup_max_lr": 1e-2, "warmup_num_steps": 4}
    sched = zero3.WarmupLR(opt, **kwargs) if how == "built" else (lambda o: zero3.WarmupLR(o, **kwargs))
    engine = zero3.initialize(model, opt, lr_scheduler=sched)
    assert engine.get_lr() == [1e-4] and engine.lr_scheduler.get_last_lr() == [1e-4]
    _train_step(engine)
    assert engine.get_lr() == [1e-4]  # DeepSpeed's iteration 0: gamma log(1) = 0
    _train_step(engine)
    assert engine.get_lr() == pytest.approx([1e-4 + (1e-2 - 1e-4) * math.log(2) / math.log(4)])


@pytest.mark.parametrize("threshold", [None, 0], ids=["persistent", "threshold 0"])
def test_the_optimizer_deepspeed_initialize_returns_steps_like_engine_step(threshold):
    """DeepSpeed's loop may step the returned optimizer: ``engine.backward(loss); optimizer.step();
    optimizer.zero_grad()``. Its step stepped the shards alone: the kept-gathered (persistent)
    parameters computed with their old values (2 ranks: losses 1.1687 against torch's 1.1408 at the
    third step, weights 0.04 off) and ``global_steps`` stayed 0. It is ``engine.step()`` now, its
    ``zero_grad`` is ``engine.zero_grad()`` (a loop calling it before every micro-batch accumulates),
    and it has DeepSpeed's ``state_dict``/``load_state_dict``."""
    zero = {"stage": 3} if threshold is None else {"stage": 3, "stage3_param_persistence_threshold": threshold}
    config = {"optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "eps": 1e-6}}, "zero_optimization": zero,
              "gradient_accumulation_steps": 2, "train_micro_batch_size_per_gpu": 3}
    engine, optimizer, _, _ = deepspeed.initialize(model=_model(), config=config)
    ref = _model()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, eps=1e-6, weight_decay=0.0)
    for step in range(3):
        for micro in range(2):
            optimizer.zero_grad()  # before every micro-batch: the window's gradients stay
            x = torch.randn(3, 8, generator=torch.Generator().manual_seed(10 * step + micro))
            loss = engine(x).pow(2).mean()
            ref_loss = ref(x).pow(2).mean()
            torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=1e-7)
            engine.backward(loss)
            (ref_loss / 2).backward()
            if micro == 1:
                optimizer.step()
            else:
                engine.step()  # DeepSpeed's engine.step() after every micro-batch; optimizer.step() at the last
        ref_opt.step()
        ref_opt.zero_grad()
    assert engine.global_steps == 3
    for p, q in zip(engine.module.parameters(), ref.parameters()):
        torch.testing.assert_close(zero3.safe_get_full_fp32_param(p), q.detach(), rtol=1e-6, atol=1e-6)
    state = optimizer.state_dict()
    assert state["zero3"] == {"rank": 0, "world_size": 1} and len(state["state"]) == 4
    optimizer.load_state_dict(state)
    engine.remove_hooks()


def test_the_returned_optimizer_of_an_engine_whose_hooks_were_removed_is_refused():
    """Its zero_grad() dropped the gradients of the engine that took the model over (weights 0.02 off);
    its step() inside an accumulation window named the window, not the removal (review of round 23)."""
    config = {"optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}, "gradient_accumulation_steps": 2,
              "train_micro_batch_size_per_gpu": 3}
    model = _model()
    old, optimizer, _, _ = deepspeed.initialize(model=model, config=config)
    old.remove_hooks()
    engine, *_ = deepspeed.initialize(model=model, config=config)
    engine.backward(engine(torch.randn(3, 8)).pow(2).mean())
    engine.step()  # micro-batch 1 of 2: the window's gradients are in the shards
    with pytest.raises(ZeroStateError, match=r"engine.zero_grad\(\) after engine.remove_hooks"):
        optimizer.zero_grad()
    with pytest.raises(ZeroStateError, match="after engine.remove_hooks"):
        optimizer.step()
    assert any(p._zero.train_tensor.grad is not None for p in engine.params)  # the new engine's window stays
    engine.remove_hooks()


@pytest.mark.parametrize("flag, expected", [(None, False), (True, True), ("yes", True), (0, False)])
def test_the_calls_frameworks_make_to_save_a_zero3_model_answer_as_deepspeed_s(tmp_path, flag, expected):
    """Hugging Face's Trainer reads ``engine.config.get("zero_optimization", {}).get("stage")``;
    Accelerate asks ``zero_gather_16bit_weights_on_model_save()`` and then takes
    ``_zero3_consolidated_16bit_state_dict()`` (each was an AttributeError: every save crashed)."""
    zero = {"stage": 3} if flag is None else {"stage": 3, "stage3_gather_16bit_weights_on_model_save": flag}
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))
    engine = zero3.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1),
                              {"zero_optimization": {**zero, "stage3_param_persistence_threshold": 0}})
    assert engine.config.get("zero_optimization", {}).get("stage") == 3
    assert engine.config.get("zero_optimization")["stage3_param_persistence_threshold"] == 0
    assert engine.config.get("no such key", "default") == "default"
    assert engine.zero_gather_16bit_weights_on_model_save() is expected
    state = engine._zero3_consolidated_16bit_state_dict()
    engine.save_16bit_model(tmp_path)
    saved = torch.load(tmp_path / "pytorch_model.bin")
    assert sorted(state) == sorted(saved) == ["0.bias", "0.weight", "1.bias", "1.weight"]
    assert all(torch.equal(state[k], saved[k]) for k in state)


def test_setting_the_engine_s_lr_scheduler_to_none_hands_it_back_as_lightning_does():
    """Lightning's DeepSpeed strategy sets ``engine.lr_scheduler = None`` and steps the scheduler itself."""
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)
    engine = zero3.initialize(model, opt, {"param_persistence_threshold": 0}, lr_scheduler=sched)
    with pytest.raises(ZeroConfigError, match="only None may be set"):
        engine.lr_scheduler = torch.optim.lr_scheduler.StepLR(opt, 1)
    assert engine.lr_scheduler is sched
    engine.lr_scheduler = None
    assert engine.lr_scheduler is None and type(sched) is torch.optim.lr_scheduler.StepLR
    for _ in range(2):
        engine.backward(engine(torch.ones(3, 4)).sum())
        engine.step()  # no longer steps the scheduler
    assert engine.get_lr() == [0.1]
    sched.step()  # its own step works again
    assert engine.get_lr() == [0.05]


@pytest.mark.parametrize("fp16", [False, True], ids=["fp32", "fp16"])
def test_the_returned_optimizer_has_the_names_frameworks_read_off_deepspeed_s_zero_optimizer(fp16):
    """``state``, ``defaults``, ``loss_scale``/``cur_scale`` and ``dynamic_loss_scale`` were
    AttributeErrors (probe 28C): Accelerate's optimizer wrapper forwards ``state`` and ``defaults``,
    Lightning moves ``state`` at teardown, Megatron-style loops log ``cur_scale``."""
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-6)
    config = {"fp16": {"enabled": True, "initial_scale_power": 8}} if fp16 else {}
    engine, ret, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=config)
    dtype = torch.float16 if fp16 else torch.float32
    _train_step(engine, 0, dtype)
    assert ret.state is opt.state and ret.defaults is opt.defaults
    assert {id(t) for t in ret.state} == {id(t) for g in opt.param_groups for t in g["params"]}  # the shards'
    assert ret.loss_scale == ret.cur_scale == engine.loss_scale == (256.0 if fp16 else 1.0)
    assert ret.dynamic_loss_scale is fp16 and not ret.overflow
    if fp16:  # an overflow: skipped, and the names follow the scaler (hysteresis 2: the second halves it)
        for _ in range(2):
            engine.backward(engine(torch.randn(3, 8).half()).float().pow(2).mean() * math.inf)
            assert not engine.step() and ret.overflow
        assert ret.loss_scale == ret.cur_scale == engine.loss_scale == 128.0
    for name in ("loss_scale", "cur_scale"):
        with pytest.raises(ZeroConfigError, match=rf"optimizer.{name} = 4.0: zero3's loss scale is set by the "
                                                  r"config's fp16 section"):
            setattr(ret, name, 4.0)
    groups = ret.param_groups
    ret.param_groups = groups  # Accelerate's setter hands them back
    assert opt.param_groups is groups
    ret.param_groups[0]["lr"] = 0.0  # a write through it takes effect at the next step
    with zero3.GatheredParameters(list(model.parameters())):
        before = [p.detach().clone() for p in model.parameters()]
    _train_step(engine, 1, dtype)
    with zero3.GatheredParameters(list(model.parameters())):
        assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))


def test_the_returned_optimizer_refuses_what_would_break_it(tmp_path):
    """Review 28X: groups that are not the shards (a deep copy) were taken and trained nothing; a new
    ``state`` mapping was an AttributeError; ``state`` with the optimizer state on NVMe handed out
    tensors without bytes, and moving one (Lightning's teardown) crashed the process."""
    import copy

    model = _model()
    engine, ret, _, _ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2),
                                             config={"param_persistence_threshold": 0})
    _train_step(engine)
    for groups in (copy.deepcopy(ret.param_groups), [{"params": list(model.parameters())}], ret.param_groups[:0]):
        with pytest.raises(ZeroConfigError, match=r"the new groups must hold exactly the tensors the optimizer steps"):
            ret.param_groups = groups
    ret.state = ret.state  # Accelerate's setter hands back what it read
    with pytest.raises(ZeroConfigError, match=r"optimizer.state = ...: zero3 keys this rank's optimizer state"):
        ret.state = {}
    model = _model()
    engine, ret, _, _ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2),
                                             config={"param_persistence_threshold": 0, "offload_optimizer": {
                                                 "device": "nvme", "nvme_path": str(tmp_path)}})
    _train_step(engine)
    with pytest.raises(ZeroStateError, match=r"optimizer.state: the optimizer state lives on NVMe between steps"):
        ret.state
    assert zero3.safe_get_local_optimizer_state(model[0].weight, "exp_avg").abs().sum() > 0  # the way it names


@pytest.mark.parametrize("params", [{}, {"warmup_max_lr": None}], ids=["left out", "null"])
def test_warmup_lr_without_a_maximum_warms_up_to_the_optimizer_s_lr_as_deepspeed_s(params):
    """DeepSpeed's WarmupLR takes the first param group's lr when ``warmup_max_lr`` is not given (it
    was 0.001 here: a config's lr of 3e-4 trained at 3.3x after the warm-up, probe 30A)."""
    model = _model()
    config = {"optimizer": {"type": "AdamW", "params": {"lr": 3e-4}},
              "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 4, "warmup_type": "linear", **params}}}
    engine = zero3.initialize(model, config=config)
    lrs = []
    for step in range(6):
        _train_step(engine, step)
        lrs.append(engine.get_lr()[0])
    assert lrs == pytest.approx([0.0, 7.5e-5, 1.5e-4, 2.25e-4, 3e-4, 3e-4], rel=1e-12)


def test_was_step_applied_and_global_samples_count_as_deepspeed_s_and_global_samples_is_saved(tmp_path):
    """DeepSpeed's ``engine.was_step_applied()`` (False between accumulation boundaries and on an fp16
    overflow) and ``engine.global_samples`` (``train_batch_size`` per boundary, a skipped one included),
    which were missing (probes 30A and 30D)."""
    config = {**ADAMW, "train_micro_batch_size_per_gpu": 3, "gradient_accumulation_steps": 2,
              "fp16": {"enabled": True, "initial_scale_power": 4}}
    engine = zero3.initialize(_model(), config=config)
    applied, samples = [], []
    for seed in range(4):
        _train_step(engine, seed, torch.float16)
        applied.append(engine.was_step_applied())
        samples.append(engine.global_samples)
    assert applied == [False, True, False, True] and samples == [0, 6, 6, 12]
    with pytest.raises(ZeroStateError, match="no backward reached the model"):
        engine.step()  # a step that raises applied nothing (review 30Y: it kept the last step's True)
    assert not engine.was_step_applied()
    g = torch.Generator().manual_seed(9)
    for i in range(2):  # an overflow in the window's first micro-batch: its step is skipped
        x = torch.randn(3, 8, generator=g).half() * (float("inf") if i == 0 else 1.0)
        engine.backward(engine(x).float().pow(2).mean())
        engine.step()
    assert not engine.was_step_applied() and engine.was_step_skipped() and engine.global_samples == 18
    engine.save_checkpoint(str(tmp_path), tag="t")
    other = zero3.initialize(_model(), config=config)
    assert other.global_samples == 0 and not other.was_step_applied()
    other.load_checkpoint(str(tmp_path), tag="t")
    assert other.global_samples == 18 and other.global_steps == 3
    plain = zero3.initialize(_model(), config=ADAMW)  # no batch size in the config: refused by name
    with pytest.raises(ZeroConfigError, match="train_micro_batch_size_per_gpu"):
        plain.global_samples


def test_a_checkpoint_of_another_kind_of_scheduler_is_refused_before_anything_is_loaded(tmp_path):
    """Probe 35F: torch's SequentialLR.load_state_dict raised a bare KeyError after the weights, the optimizer
    state and the counters were the checkpoint's; refused now, naming the scheduler, with nothing loaded."""
    model = _model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    src = zero3.initialize(model, opt, {}, lr_scheduler=lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(o, 10))
    for step in range(2):
        _train_step(src, step)
    src.save_checkpoint(str(tmp_path), tag="c")
    model = _model()
    sequential = lambda o: torch.optim.lr_scheduler.SequentialLR(  # noqa: E731
        o, [torch.optim.lr_scheduler.ConstantLR(o, 0.5, 2), torch.optim.lr_scheduler.CosineAnnealingLR(o, 10)], [2])
    engine = zero3.initialize(model, torch.optim.Adam(model.parameters(), lr=1e-2), {}, lr_scheduler=sequential)
    _train_step(engine, 5)
    with zero3.GatheredParameters(list(model.parameters())):
        before = [p.detach().clone() for p in model.parameters()]
    state, lr = str(engine.lr_scheduler.state_dict()), engine.get_lr()
    with pytest.raises(zero3.CheckpointMismatchError, match="does not load into this engine's SequentialLR"):
        engine.load_checkpoint(str(tmp_path), tag="c")
    with zero3.GatheredParameters(list(model.parameters())):
        assert all(torch.equal(a, b) for a, b in zip(model.parameters(), before))
    assert engine.global_steps == 1 and engine.get_lr() == lr and str(engine.lr_scheduler.state_dict()) == state
    engine.load_checkpoint(str(tmp_path), tag="c", load_lr_scheduler_states=False)
    assert engine.global_steps == 2


def test_a_refusal_before_partitioning_leaves_the_optimizers_lr_for_the_scheduler_of_a_retry():
    """Review 35R3: the factory ran before later checks (here a memory_budget too small), and a warmup
    scheduler's first step stayed in the groups' lr: the retry's schedule was a third off for good."""
    import functools
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.3)
    warmup = functools.partial(torch.optim.lr_scheduler.ConstantLR, factor=1 / 3, total_iters=2)
    with pytest.raises(ZeroConfigError, match="memory_budget"):
        zero3.initialize(model, opt, {"memory_budget": 64}, lr_scheduler=warmup)
    assert opt.param_groups[0]["lr"] == 0.3 and "initial_lr" not in opt.param_groups[0]
    engine = zero3.initialize(model, opt, {}, lr_scheduler=warmup)
    lrs = []
    for step in range(3):
        lrs.append(opt.param_groups[0]["lr"])
        _train_step(engine, step)
    assert lrs == pytest.approx([0.1, 0.1, 0.3])
