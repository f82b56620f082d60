"""Bad arguments to the public API are refused naming the value and what is allowed, before anything
changes (each of these was accepted silently, or failed with an error from torch's or Python's
internals, before)."""

from __future__ import annotations

import argparse
import json

import pytest
import torch
from torch import nn

import zero3
import zero3.deepspeed as deepspeed
from zero3 import ZeroConfigError


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


def _engine(**cfg) -> zero3.Engine:
    model = _model()
    return zero3.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), {"param_persistence_threshold": 0,
                                                                                 **cfg})


def test_deepspeed_initialize_reads_the_config_from_args_or_refuses_args_that_carry_none(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_micro_batch_size_per_gpu": 2}))
    with pytest.raises(ZeroConfigError, match="args must be an argparse.Namespace.*got dict"):
        deepspeed.initialize(args={"deepspeed_config": str(path)}, model=_model())
    with pytest.raises(ZeroConfigError, match="args must be an argparse.Namespace.*got str"):
        deepspeed.initialize(args=str(path), model=_model())
    with pytest.raises(ZeroConfigError, match="without a deepspeed_config attribute and no config"):
        deepspeed.initialize(args=argparse.Namespace(local_rank=0), model=_model())
    engine, *_ = deepspeed.initialize(args=argparse.Namespace(deepscale_config=str(path)), model=_model())
    assert engine.train_micro_batch_size_per_gpu() == 2  # DeepSpeed's old name still carries it
    engine, *_ = deepspeed.initialize(args=argparse.Namespace(deepspeed_config=str(path)), model=_model())
    assert engine.train_micro_batch_size_per_gpu() == 2
    with pytest.raises(ZeroConfigError, match=r"got no config \(DeepSpeed requires one\).*config=\{\} takes"):
        deepspeed.initialize(args=None, model=_model(), model_parameters=_model().parameters())


def test_add_config_arguments_takes_deepspeeds_deprecated_deepscale_flags_and_initialize_reads_them(tmp_path):
    """DeepSpeed's parser adds --deepscale and --deepscale_config beside --deepspeed(_config); zero3's stopped in
    argparse on them, though initialize reads args.deepscale_config."""
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_micro_batch_size_per_gpu": 2}))
    parser = deepspeed.add_config_arguments(argparse.ArgumentParser())
    args = parser.parse_args(["--deepscale", "--deepscale_config", str(path)])
    assert args.deepscale is True and args.deepscale_config == str(path) and args.deepspeed_config is None
    assert parser.parse_args([]).deepscale is False and parser.parse_args([]).deepscale_config is None
    engine, *_ = deepspeed.initialize(args=args, model=_model())
    assert engine.train_micro_batch_size_per_gpu() == 2
    both = parser.parse_args(["--deepspeed_config", str(path), "--deepscale_config", str(path)])
    with pytest.raises(ZeroConfigError, match=r"args.deepspeed_config=.* and args.deepscale_config=.*: pass only "
                                              r"--deepspeed_config"):
        deepspeed.initialize(args=both, model=_model())


def test_args_without_deepspeed_config_are_refused_saying_it_was_not_passed():
    """The attribute exists (None) on args from add_config_arguments: the refusal said it was missing."""
    args = deepspeed.add_config_arguments(argparse.ArgumentParser()).parse_args(["--deepspeed"])
    with pytest.raises(ZeroConfigError) as err:
        deepspeed.initialize(args=args, model=_model())
    message = str(err.value)
    assert "whose deepspeed_config is None (--deepspeed_config was not passed) and no config" in message
    assert "without a deepspeed_config attribute" not in message
    assert "pass the config as config= (a dict or a JSON path), or args from deepspeed.add_config_arguments" in message


@pytest.mark.parametrize("max_norm, norm_type, match", [
    (-1.0, 2.0, "max_norm must be a finite number > 0, got -1.0"), (0.0, 2.0, "max_norm must be"),
    (float("nan"), 2.0, "max_norm must be"), ("1.0", 2.0, "max_norm must be"), (True, 2.0, "max_norm must be"),
    (1.0, 0, "norm_type must be a number > 0 or inf, got 0"), (1.0, -1, "norm_type must be"),
    (1.0, float("nan"), "norm_type must be"), (1.0, "fro", "norm_type must be"),
])
def test_clip_grad_norm_refuses_a_bad_max_norm_or_norm_type_and_clips_nothing(max_norm, norm_type, match):
    engine = _engine()
    engine.backward(engine(torch.randn(3, 4)).sum())
    before = [zero3.safe_get_full_grad(p).clone() for p in engine.params]
    with pytest.raises(ZeroConfigError, match=match):
        zero3.clip_grad_norm_(engine, max_norm, norm_type)
    assert all(torch.equal(a, zero3.safe_get_full_grad(p)) for a, p in zip(before, engine.params))
    assert float(zero3.clip_grad_norm_(engine, 1e9, "inf")) > 0  # "inf" as torch takes it


def test_a_scheduler_that_is_not_one_or_schedules_another_optimizer_is_refused_before_anything_changes():
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    other = torch.optim.SGD(_model().parameters(), lr=0.1)
    with pytest.raises(ZeroConfigError, match="lr_scheduler must be a scheduler.*got str"):
        zero3.initialize(model, opt, {}, lr_scheduler="cosine")
    with pytest.raises(ZeroConfigError, match="schedules another optimizer than the one given"):
        zero3.initialize(model, opt, {}, lr_scheduler=torch.optim.lr_scheduler.StepLR(other, 1))
    assert all(type(p) is nn.Parameter for p in model.parameters())
    with pytest.raises(ZeroConfigError, match="factory returned a int, not a scheduler"):
        zero3.initialize(model, opt, {}, lr_scheduler=lambda o: 5)


def test_gathered_parameters_refuses_what_is_not_parameters_and_a_rank_that_is_not_one():
    engine = _engine()
    model = engine.module
    with pytest.raises(TypeError, match="got Sequential: pass model.parameters"):
        zero3.GatheredParameters(model)
    with pytest.raises(TypeError, match="got str"):
        zero3.GatheredParameters("0.weight")
    with pytest.raises(TypeError, match="got NoneType"):
        zero3.GatheredParameters(None)
    for rank in ("0", True, 0.5):
        with pytest.raises(TypeError, match=r"modifier_rank=\.\.\.\) must be None or a rank"):
            zero3.GatheredParameters(model.parameters(), modifier_rank=rank)
    for rank in (-3, -1):  # -1 was Init's internal "every rank made the change": a write of one rank was lost
        with pytest.raises(ValueError, match=rf"modifier_rank={rank}\): a rank .* does not count from the end"):
            zero3.GatheredParameters(model.parameters(), modifier_rank=rank)
    with pytest.raises(TypeError, match="enabled=...\\) must be True or False"):
        zero3.GatheredParameters(model.parameters(), enabled="no")
    with pytest.raises(ValueError, match=r"modifier_rank=5\): the parameters' group has 1 rank"):
        with zero3.GatheredParameters(list(model.parameters()), modifier_rank=5):
            pass
    with zero3.GatheredParameters(list(model.parameters()), modifier_rank=0):  # a rank of the group: fine
        model[0].bias.data.fill_(1.0)
    assert torch.all(zero3.safe_get_full_fp32_param(model[0].bias) == 1.0)


def test_generation_entered_inside_itself_ends_with_the_outermost_block():
    engine = _engine()
    engine.module.eval()
    with torch.no_grad():
        engine(torch.randn(2, 4))
        with engine.generation():
            engine(torch.randn(2, 4))
            with engine.generation():
                engine(torch.randn(2, 4))
            assert engine.coordinator.generating  # the inner exit left the outer mode on
            engine(torch.randn(2, 4))
        assert not engine.coordinator.generating


def test_one_class_or_name_alone_is_a_target_and_a_refused_compile_marks_nothing():
    model = _model()
    assert len(zero3.set_leaf_modules(model, nn.Linear)) == 2  # a class alone, not an iterable of them
    model = _model()
    assert len(zero3.set_leaf_modules(model, "Linear")) == 2  # a name alone, not its letters
    model = _model()
    with pytest.raises(TypeError, match="mod"):  # torch.compile's own refusal of a misspelled keyword
        zero3.compile_blocks(model, [nn.Linear], backend="eager", mod="max-autotune")
    assert not any(getattr(m, "_zero3_leaf", False) for m in model.modules())


@pytest.mark.parametrize("kwargs, match", [
    ({"enabled": "false"}, r"must be bools, got True, False, 'false'"),
    ({"dtype": torch.int8}, "must be a floating-point torch.dtype"),
    ({"remote_device": "meta"}, "shards need real storage"),
])
def test_init_refuses_arguments_that_would_lose_the_weights_or_be_read_the_other_way(kwargs, match):
    with pytest.raises(ZeroConfigError, match=match):
        with zero3.Init(**kwargs):
            nn.Linear(4, 4)
    assert not zero3.is_partitioned(nn.Linear(4, 4).weight)  # no patch of Init's left behind


def test_a_model_built_in_bf16_under_init_with_an_fp32_config_is_said_and_its_config_gives_masters(caplog):
    """The optimizer then steps on the bf16 shards with no fp32 masters (pure bf16 training, which
    some choose: said in a warning, not refused); the config given to Init keeps fp32 masters."""
    cfg = {"bf16": {"enabled": True}, "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
    with zero3.Init(config_dict_or_path=cfg):
        model = _model()
    with caplog.at_level("WARNING", logger="zero3"):
        engine = zero3.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), {})
    assert "no fp32 masters" in caplog.text and "'0.weight'" in caplog.text
    assert engine.optimizer.param_groups[0]["params"][0].dtype == torch.bfloat16
    engine.remove_hooks()
    with zero3.Init(config_dict_or_path=cfg):
        model = _model()
    engine = zero3.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), cfg)
    assert engine.optimizer.param_groups[0]["params"][0].dtype == torch.float32  # fp32 masters


def test_save_calls_refuse_a_dtype_that_is_not_a_floating_dtype_and_export_names_every_suffix(tmp_path):
    engine = _engine()
    engine.backward(engine(torch.randn(3, 4)).sum())
    engine.step()
    for dtype in ("bf16", torch.int8):  # a string failed as an 'invalid device'; int8 truncated the weights
        with pytest.raises(ValueError, match="dtype=...\\) must be a floating-point torch.dtype"):
            engine.consolidated_state_dict(dtype=dtype)
    with pytest.raises(ValueError, match=r"use \.json \(the trace.*\.graphml or \.dot"):
        engine.export_trace(str(tmp_path / "trace.txt"))
    engine.export_trace(str(tmp_path / "trace.JSON"))  # the suffix in any case
    assert json.loads((tmp_path / "trace.JSON").read_text())


def test_load_checkpoint_refuses_a_tag_that_is_not_a_name(tmp_path):
    engine = _engine()
    engine.backward(engine(torch.randn(3, 4)).sum())
    engine.step()
    engine.save_checkpoint(tmp_path, tag="t")
    for tag in (5.0, True, "../t", ".hidden"):  # a float failed inside pathlib with a TypeError
        with pytest.raises(ValueError, match="must be a plain directory name"):
            engine.load_checkpoint(tmp_path, tag=tag)
    engine.load_checkpoint(tmp_path, tag="t")
    engine.save_checkpoint(tmp_path, tag=5)  # an int is its digits, as DeepSpeed takes str(tag)
    assert (tmp_path / "5").is_dir() and (tmp_path / "latest").read_text() == "5"
    engine.load_checkpoint(tmp_path, tag=5)


def test_pretrained_refuses_values_it_cannot_load_before_copying_any():
    """A meta tensor failed inside the copy with earlier parameters already overwritten; a list was
    reported as a missing key."""
    engine = _engine()
    sd = {k: torch.full_like(v, 0.5) for k, v in engine.consolidated_state_dict().items()}
    before = [zero3.safe_get_full_fp32_param(p).clone() for p in engine.params]
    for key, value, match in (("2.bias", torch.empty(2, device="meta"), "2.bias: a meta tensor"),
                              ("2.bias", [0.5, 0.5], "2.bias: a list, not a tensor")):
        with pytest.raises(ValueError, match=match):
            zero3.pretrained.load_state_dict(engine, {**sd, key: value})
        assert all(torch.equal(a, zero3.safe_get_full_fp32_param(p)) for a, p in zip(before, engine.params))
    zero3.pretrained.load_state_dict(engine, sd)
    assert all(torch.all(zero3.safe_get_full_fp32_param(p) == 0.5) for p in engine.params)


def test_an_engine_whose_hooks_were_removed_says_so_at_its_next_forward():
    engine = _engine()
    engine.remove_hooks()
    with pytest.raises(zero3.ZeroStateError, match=r"engine.forward\(\) after engine.remove_hooks\(\)"):
        engine(torch.randn(2, 4))
    again = zero3.initialize(engine.module, torch.optim.SGD(engine.module.parameters(), lr=0.1), {})
    again(torch.randn(2, 4))  # a new engine over the same model works
    with pytest.raises(zero3.ZeroStateError, match="after engine.remove_hooks"):
        engine(torch.randn(2, 4))  # and the old one still says so


def test_an_optimizer_that_fills_its_state_when_built_is_told_to_come_as_a_callable():
    """torch.optim.Adagrad fills its state from each parameter in __init__: over a model built under
    Init that met the generic 'used while partitioned' error; the error now names the way that works."""
    with zero3.Init():
        model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))
    with pytest.raises(zero3.ZeroStateError, match=r"torch.optim.Adagrad initialises its state .* lambda groups"):
        torch.optim.Adagrad(model.parameters(), lr=0.1)
    engine = zero3.initialize(model, lambda groups: torch.optim.Adagrad(groups, lr=0.1), {})
    loss = engine(torch.randn(3, 4)).sum()
    engine.backward(loss)
    engine.step()


@pytest.mark.parametrize("make", [
    lambda ps: torch.optim.Adafactor(ps, lr=1e-2),
    lambda ps: torch.optim.Muon([p for p in ps if p.ndim == 2], lr=1e-2),
    lambda ps: (lambda groups: torch.optim.Adafactor(groups, lr=1e-2)),  # a factory, called with the shards
], ids=["Adafactor", "Muon", "Adafactor factory"])
def test_an_optimizer_whose_update_depends_on_the_parameter_shape_is_refused(make):
    """Adafactor on flat shards kept an unfactored second moment (another update than torch's: loss
    0.904713 against 0.903736 after two steps on one rank); Muon failed in its step on a 1-D shard."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    optimizer = make(list(model.parameters()))
    factory = not isinstance(optimizer, torch.optim.Optimizer)
    with pytest.raises(ZeroConfigError, match=r"(Adafactor \(torch.optim\) keeps its second moment factored|Muon "
                       r"\(torch.optim\) transforms each gradient as a matrix).*flat 1-D shard.*" +
                       ("the model is partitioned already" if factory else "zero3.initialize changed nothing")):
        zero3.initialize(model, optimizer, {"param_persistence_threshold": 0})
    if not factory:  # refused before anything changed
        assert not any(zero3.is_zero_param(p) for p in model.parameters())
        assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_arguments_of_the_wrong_kind_are_refused_naming_them():
    """Each raised an AttributeError or TypeError from deep inside (found by a probe session)."""
    with pytest.raises(TypeError, match=r"zero3.initialize: model must be a torch.nn.Module, got int: 5"):
        zero3.initialize(5, None, {})
    with pytest.raises(TypeError, match=r"zero3.Init\(module=...\) must be a torch.nn.Module .*got int: 5"):
        zero3.Init(module=5)
    model = nn.Sequential(nn.Linear(4, 4))
    with pytest.raises(ZeroConfigError, match=r"set_leaf_modules: targets must be .* got None"):
        zero3.set_leaf_modules(model, None)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ZeroConfigError, match=r"lr_scheduler=StepLR \(a class\) was called over the optimizer.*"
                                              r"step_size.*functools.partial\(StepLR"):
        zero3.initialize(model, opt, {}, lr_scheduler=torch.optim.lr_scheduler.StepLR)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    engine = zero3.initialize(model, opt, {}, lr_scheduler=torch.optim.lr_scheduler.ConstantLR)  # a whole factory,
    assert isinstance(engine.lr_scheduler, torch.optim.lr_scheduler.ConstantLR)  # as DeepSpeed calls it
    engine.remove_hooks()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    engine = zero3.initialize(model, opt, {})
    engine(torch.randn(2, 4))
    for loss in (None, 1.0):
        with pytest.raises(TypeError, match=r"engine.backward\(loss\): loss must be the tensor the forward computed"):
            engine.backward(loss)
    engine.backward(engine(torch.randn(2, 4)).sum())  # the refusals lost nothing
    assert engine.step()


@pytest.mark.parametrize("factory", [False, True], ids=["optimizer", "factory"])
def test_lbfgs_is_refused_at_initialize(factory):
    """LBFGS was accepted, then every way to step it failed: ``step(closure)`` was refused naming
    ``loss.backward(); optimizer.step()``, which then raised a bare TypeError (no closure) from inside
    torch's step."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    opt = (lambda groups: torch.optim.LBFGS(groups)) if factory else torch.optim.LBFGS(model.parameters())
    with pytest.raises(ZeroConfigError, match=r"LBFGS \(torch.optim.lbfgs\) steps through a closure.*" +
                       ("partitioned already" if factory else "zero3.initialize changed nothing")):
        zero3.initialize(model, opt, {})
    if not factory:
        assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
