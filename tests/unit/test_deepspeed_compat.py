"""DeepSpeed call signatures: Init's keyword names, config-built optimizers and schedulers, the
parameter helpers, and constructors that touch partitioned parameters (Hugging Face's post_init)."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import zero3
import zero3.deepspeed as deepspeed
from zero3 import ZeroConfigError

from gpt import GPT, GPTConfig, synthetic_batch

CFG = GPTConfig(block_size=16)


def _full(p: nn.Parameter) -> torch.Tensor:
    with zero3.GatheredParameters([p]):
        return p.detach().clone()


# -- Init ---------------------------------------------------------------------------------------------
def test_init_takes_deepspeeds_names_and_builds_low_precision_shards_from_the_config(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"bf16": {"enabled": True}, "zero_optimization": {"stage": 3}}))

    class MPU:
        def get_data_parallel_group(self):
            return None

    with zero3.Init(data_parallel_group=None, remote_device="cpu", pin_memory=False, config_dict_or_path=str(path),
                    enabled=True, mpu=MPU(), mem_efficient_linear=True):
        model = nn.Linear(8, 8)
    assert model.weight.ds_tensor.dtype == torch.bfloat16 and model.weight.dtype == torch.bfloat16
    with deepspeed.zero.Init(deepspeed_config={"fp16": {"enabled": True}}):
        half = nn.Linear(8, 8)
    assert half.weight.ds_tensor.dtype == torch.float16


@pytest.mark.parametrize("kwargs,needle", [
    ({"zero_quantized_weights": True}, "zero_quantized_weights=True (quantized weight gathers"),
    ({"param_swapper": object()}, "param_swapper"),
    ({"zero_param_parallel_group": object()}, "come from zero_hpz_partition_size in the config"),
    ({"no_such_option": 1}, "no_such_option"),
    ({"remote_device": "nvme"}, "remote_device='nvme') needs offload_param.nvme_path"),
    ({"remote_device": "floppy"}, "remote_device='floppy'"),
    ({"config": {}, "config_dict_or_path": {}}, "more than one"),
])
def test_init_refuses_what_it_does_not_support_by_name(kwargs, needle):
    with pytest.raises(ZeroConfigError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        zero3.Init(**kwargs)


def test_init_accepts_deepspeeds_off_values_of_features_it_lacks():
    with zero3.Init(zero_quantized_weights=False, zero_param_parallel_group=None):
        model = nn.Linear(4, 4)
    assert zero3.is_zero_param(model.weight)


def test_init_with_module_partitions_a_built_model_with_its_values():
    torch.manual_seed(0)
    model = GPT(CFG)
    ref = {k: v.clone() for k, v in model.state_dict().items()}
    zero3.Init(module=model)
    for name, p in model.named_parameters():
        assert zero3.is_zero_param(p), name
        torch.testing.assert_close(_full(p), ref[name], rtol=0, atol=0)


def test_init_disabled_builds_a_plain_model():
    with zero3.Init(enabled=False, config_dict_or_path={"bf16": {"enabled": True}}):
        model = nn.Linear(4, 4)
    assert not zero3.is_zero_param(model.weight) and model.weight.dtype == torch.float32


# -- constructors that touch partitioned parameters ---------------------------------------------------
class Touchy(nn.Module):
    """Does in its constructor what Hugging Face models do in post_init, after the children exist."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 6, padding_idx=0)
        self.proj = nn.Linear(6, 6)
        self.head = nn.Linear(6, 10, bias=True)
        self.head.weight = self.emb.weight  # tying after both were partitioned
        nn.init.normal_(self.emb.weight, std=0.5)
        nn.init.zeros_(self.emb.weight[self.emb.padding_idx])  # a view of a partitioned parameter
        self.emb.weight.data[3].fill_(0.25)  # a view through .data
        rows = self.proj.weight[:2]  # a slice kept and written later
        with torch.no_grad():
            rows.mul_(2.0)
        self.scale = float(self.proj.weight.detach().abs().max())  # reading a value
        self.head.bias.data = F.pad(self.head.bias.data[:8], (0, 2), value=1.0)  # .data assignment

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(self.proj(self.emb(idx)) * self.scale)


def test_a_constructor_touching_partitioned_parameters_gets_the_plain_builds_values():
    torch.manual_seed(3)
    plain = Touchy()
    torch.manual_seed(3)
    with zero3.Init():
        model = Touchy()
    assert model.scale == plain.scale
    assert model.head.weight is model.emb.weight
    for (name, p), q in zip(model.named_parameters(), plain.parameters()):
        assert zero3.is_zero_param(p) and p.ds_status is zero3.ParamStatus.NOT_AVAILABLE, name
        torch.testing.assert_close(_full(p), q.detach(), rtol=0, atol=0, msg=name)
    x = torch.tensor([[0, 3, 5]])
    engine = zero3.initialize(model, None, {"param_persistence_threshold": 0})
    with torch.no_grad():
        torch.testing.assert_close(engine(x), plain(x), rtol=0, atol=0)


def test_assigning_data_of_a_partitioned_parameter_outside_init_is_refused():
    with zero3.Init():
        model = nn.Linear(4, 4)
    with pytest.raises(zero3.ZeroStateError, match="assigning .data"):
        model.weight.data = torch.zeros(4, 4)


# -- parameter helpers --------------------------------------------------------------------------------
def test_all_gather_and_partition_helpers_and_fwd_module():
    with zero3.Init():
        model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    w = model[0].weight
    w.all_gather()
    assert w.ds_status is zero3.ParamStatus.AVAILABLE
    with torch.no_grad():
        w.fill_(1.0)
    w.partition(has_been_updated=True)
    assert w.ds_status is zero3.ParamStatus.NOT_AVAILABLE
    assert torch.equal(_full(w), torch.ones(4, 4))
    with zero3.GatheredParameters([model[0].bias], fwd_module=model[1], enabled=False):  # DeepSpeed returns first
        pass
    assert not any(p is model[0].bias for p in zero3.runtime.gathered.external_parameters(model[1]))
    with zero3.GatheredParameters([model[0].weight], fwd_module=model[1]):
        pass
    assert any(p is model[0].weight for p in zero3.runtime.gathered.external_parameters(model[1]))
    assert zero3.is_zero_param(w) and not zero3.is_zero_param(nn.Parameter(torch.ones(1)))


# -- optimizer and scheduler from the config ---------------------------------------------------------
def _expected_lrs(kind: str, base: float, params: dict, steps: int) -> list[float]:
    """DeepSpeed's schedules written out as closed forms, for comparison."""
    out = []
    w = max(2, params["warmup_num_steps"])
    for i in range(steps):
        if i == 0:  # DeepSpeed's schedules write their start into the optimizer when built
            out.append(0.0 if kind == "WarmupCosineLR" else params["warmup_min_lr"])
            continue
        it = i - 1
        warm = math.log(it + 1) / math.log(w) if params.get("warmup_type", "log") == "log" else it / w
        if kind == "WarmupLR":
            g = warm if it < w else 1.0
            out.append(params["warmup_min_lr"] + (params["warmup_max_lr"] - params["warmup_min_lr"]) * g)
        elif kind == "WarmupDecayLR":
            g = warm if it < w else max(0.0, (params["total_num_steps"] - it) / max(1, params["total_num_steps"] - w))
            out.append(params["warmup_min_lr"] + (params["warmup_max_lr"] - params["warmup_min_lr"]) * g)
        else:
            if it < w:
                r = params["warmup_min_ratio"] + (1 - params["warmup_min_ratio"]) * warm
            else:
                c = (1 + math.cos(math.pi * (it - w + 1) / (params["total_num_steps"] - w))) / 2
                r = params["cos_min_ratio"] + (1 - params["cos_min_ratio"]) * c
            out.append(base * r)
    return out


SCHEDULES = {
    "WarmupLR": {"warmup_min_lr": 1e-4, "warmup_max_lr": 3e-3, "warmup_num_steps": 4, "warmup_type": "linear"},
    "WarmupDecayLR": {"total_num_steps": 8, "warmup_min_lr": 0.0, "warmup_max_lr": 2e-3, "warmup_num_steps": 3},
    "WarmupCosineLR": {"total_num_steps": 8, "warmup_min_ratio": 0.1, "warmup_num_steps": 3, "cos_min_ratio": 0.05},
}


@pytest.mark.parametrize("kind", sorted(SCHEDULES))
@pytest.mark.parametrize("opt", ["Adam", "AdamW"])
def test_a_config_with_optimizer_and_scheduler_trains_like_the_same_built_by_hand(kind, opt):
    steps, base = 7, 2e-3
    ds = {"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
          "optimizer": {"type": opt, "params": {"lr": base, "betas": [0.9, 0.95], "eps": 1e-6, "weight_decay": 0.1,
                                                "torch_adam": True}},
          "scheduler": {"type": kind, "params": SCHEDULES[kind]}}
    torch.manual_seed(0)
    with deepspeed.zero.Init(config_dict_or_path=ds):
        model = GPT(CFG)
    engine, optimizer, _, scheduler = deepspeed.initialize(model=model, config=ds)
    torch.manual_seed(0)
    ref = GPT(CFG)
    # DeepSpeed's "Adam" means decoupled weight decay (adam_w_mode defaults to true): AdamW.
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=base, betas=(0.9, 0.95), eps=1e-6, weight_decay=0.1)
    lrs = _expected_lrs(kind, base, SCHEDULES[kind], steps)
    for step in range(steps):
        for g in ref_opt.param_groups:
            g["lr"] = lrs[step]
        assert engine.get_lr() == pytest.approx([lrs[step]])
        x, y = synthetic_batch(step, 2, CFG)
        loss, ref_loss = engine(x, y), ref(x, y)
        engine.backward(loss)
        engine.step()
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=0)
    assert scheduler is engine.lr_scheduler and optimizer.overflow is False and not engine.was_step_skipped()
    assert isinstance(engine.optimizer, torch.optim.AdamW) and engine.device == torch.device("cpu")
    d = engine.optimizer.defaults  # the config's settings reached the optimizer (losses alone barely see them)
    assert (d["betas"], d["eps"], d["weight_decay"]) == ((0.9, 0.95), 1e-6, 0.1), d
    worst = max((zero3.safe_get_full_fp32_param(p) - q.detach()).abs().max().item()
                for p, q in zip(model.parameters(), ref.parameters()))
    assert worst < 1e-6, worst


def test_adam_w_mode_false_is_adam_with_l2_weight_decay():
    model = nn.Linear(4, 4)
    engine = zero3.initialize(model=model, config={"optimizer": {"type": "Adam", "params": {
        "lr": 1e-3, "weight_decay": 0.1, "adam_w_mode": False}}})
    assert type(engine.optimizer) is torch.optim.Adam
    assert (engine.optimizer.defaults["lr"], engine.optimizer.defaults["weight_decay"]) == (1e-3, 0.1)


def test_fused_adam_keys_deepspeed_configs_carry_are_accepted_where_they_change_nothing():
    """FusedAdam's set_grad_none, and adam_w_mode=true under AdamW, were refused as unknown keys."""
    for kind in ("Adam", "AdamW"):
        model = nn.Linear(4, 4)
        engine = zero3.initialize(model=model, config={"optimizer": {"type": kind, "params": {
            "lr": 1e-3, "weight_decay": 0.1, "set_grad_none": True, "adam_w_mode": True}}})
        assert type(engine.optimizer) is torch.optim.AdamW and "set_grad_none" not in engine.optimizer.defaults
    with pytest.raises(zero3.ZeroConfigError, match="AdamW with adam_w_mode=false is contradictory"):
        zero3.initialize(model=nn.Linear(4, 4), config={"optimizer": {"type": "AdamW", "params": {"adam_w_mode": False}}})
    model = nn.Linear(4, 4)  # values torch refuses together: the config's error, naming the section (probe 30A)
    with pytest.raises(zero3.ZeroConfigError, match=r"optimizer section .*'nesterov': True.*torch.optim.SGD refused it: "
                                                    r"Nesterov momentum requires a momentum"):
        zero3.initialize(model=model, config={"optimizer": {"type": "SGD", "params": {"lr": 0.1, "nesterov": True}}})
    zero3.initialize(model=model, config={"optimizer": {"type": "SGD", "params": {"lr": 0.1}}})  # the model is intact


def test_model_parameters_with_a_config_optimizer_keep_their_param_groups():
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    groups = [{"params": list(model[0].parameters()), "weight_decay": 0.0},
              {"params": list(model[1].parameters())}]
    engine = zero3.initialize(model=model, model_parameters=groups,
                              config={"optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.1}}})
    assert [g["weight_decay"] for g in engine.optimizer.param_groups] == [0.0, 0.1]


@pytest.mark.parametrize("config,needle", [
    ({"optimizer": {"type": "Lamb", "params": {}}}, "optimizer.type 'Lamb' is not supported"),
    ({"optimizer": {"type": "Adam", "params": {"lrr": 1}}}, "unknown config key 'lrr'"),
    ({"scheduler": {"type": "OneCycle", "params": {}}}, "scheduler.type 'OneCycle' is not supported"),
    ({"scheduler": {"type": "WarmupDecayLR", "params": {"warmup_num_steps": 3}}}, "needs params.total_num_steps"),
])
def test_bad_optimizer_and_scheduler_sections_are_refused(config, needle):
    with pytest.raises(ZeroConfigError, match=needle):
        zero3.ZeroConfig.from_dict(config)


def test_an_optimizer_both_given_and_configured_is_refused_before_anything_changes():
    model = nn.Linear(4, 4)
    with pytest.raises(ZeroConfigError, match="pass one"):
        zero3.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1),
                         {"optimizer": {"type": "SGD", "params": {"lr": 0.1}}})
    assert not zero3.is_zero_param(model.weight)


# -- config translation (zero3/deepspeed/config.py) --------------------------------------------------
@pytest.mark.parametrize("config,names", [
    ({"max_live_parameters": 5, "zero_optimization": {"stage3_max_live_parameters": 7}},
     ["max_live_parameters (5)", "zero_optimization.stage3_max_live_parameters (7)"]),
    ({"zero_optimization": {"stage3_max_live_parameters": 7, "max_live_parameters": 5}},
     ["zero_optimization.stage3_max_live_parameters (7)", "zero_optimization.max_live_parameters (5)"]),
    ({"bf16": {"enabled": True}, "dtype": "fp16"}, ["bf16.enabled ('bf16')", "dtype ('fp16')"]),
    ({"aio": {"thread_count": 2}, "aio_thread_count": 3}, ["aio.thread_count (2)", "aio_thread_count (3)"]),
    ({"offload_param": {"device": "cpu"}, "offload_param_pin_memory": False,
      "zero_optimization": {"offload_param": {"pin_memory": True}}},
     ["offload_param_pin_memory (False)", "zero_optimization.offload_param.pin_memory (True)"]),
    ({"offload_optimizer": {"device": "cpu", "pin_memory": False}, "offload_optimizer_pin_memory": True},  # ours
     ["offload_optimizer.pin_memory (False)", "offload_optimizer_pin_memory (True)"]),
])
def test_one_knob_spelled_twice_with_different_values_is_refused_naming_both(config, names):
    with pytest.raises(ZeroConfigError, match="given twice with different values") as err:
        zero3.ZeroConfig.from_dict(config)
    for name in names:
        assert name in str(err.value)


def test_one_knob_spelled_twice_with_the_same_value_is_accepted():
    cfg = zero3.ZeroConfig.from_dict({"max_live_parameters": 7,
                                      "zero_optimization": {"stage3_max_live_parameters": 7e0}})
    assert cfg.budget.max_live_parameters == 7


@pytest.mark.parametrize("key", ["gradient_clipping", "gradient_accumulation_steps", "optimizer", "train_batch_size"])
def test_a_top_level_deepspeed_key_inside_zero_optimization_is_refused(key):
    with pytest.raises(ZeroConfigError, match=rf"zero_optimization.{key}: '{key}' is a top-level key of a DeepSpeed "
                                              r"config, not a zero_optimization one; move it out"):
        zero3.ZeroConfig.from_dict({"zero_optimization": {"stage": 3, key: 1.0}})


@pytest.mark.parametrize("stage", [3.0, True])
def test_a_stage_that_only_equals_3_is_refused(stage):
    with pytest.raises(ZeroConfigError, match=rf"zero_optimization.stage must be 3 .*got {stage!r}"):
        zero3.ZeroConfig.from_dict({"zero_optimization": {"stage": stage}})


@pytest.mark.parametrize("config", [
    {"zero_optimizaton": {"stage": 3}},  # not recognised as DeepSpeed's: the flat names' path
    {"train_batch_size": 8, "zero_optimizaton": {"stage": 3}},
])
def test_a_misspelled_section_is_compared_with_the_section_names(config):
    with pytest.raises(ZeroConfigError, match=r"unknown config section 'zero_optimizaton'; did you mean "
                                              r"'zero_optimization'\? Known sections: .*activation_checkpointing"):
        zero3.ZeroConfig.from_dict(config)


def test_the_unknown_key_error_lists_the_names_of_the_dicts_kind():
    with pytest.raises(ZeroConfigError) as ours:
        zero3.ZeroConfig.from_dict({"max_live_parameter": 5})
    listed = str(ours.value).split("Known keys: ")[1].split(", ")
    assert "prefetch_bucket_size" in listed and "zero_optimization" not in listed and "bf16" not in listed
    with pytest.raises(ZeroConfigError) as theirs:
        zero3.ZeroConfig.from_dict({"train_batch_sizes": 8, "zero_optimization": {"stage": 3}})
    listed = str(theirs.value).split("Known DeepSpeed keys: ")[1].split(";")[0].split(", ")
    assert "train_micro_batch_size_per_gpu" in listed and "prefetch_bucket_size" not in listed
    with pytest.raises(ZeroConfigError) as zero:
        zero3.ZeroConfig.from_dict({"zero_optimization": {"stage": 3, "stage3_prefetch_bucket": 1}})
    listed = str(zero.value).split("Known DeepSpeed keys: ")[1].split(";")[0].split(", ")
    assert "did you mean 'stage3_prefetch_bucket_size'" in str(zero.value)
    assert "zero_hpz_partition_size" in listed and "max_live_parameters" not in listed


def test_initialize_fixes_the_batch_sizes_from_the_data_parallel_world_size():
    engine = zero3.initialize(nn.Linear(4, 4), None, {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2})
    training = engine.config.training
    assert (training.train_batch_size, training.train_micro_batch_size_per_gpu) == (8, 2)
    assert training.gradient_accumulation_steps == 4 == engine.gradient_accumulation_steps()


def test_initialize_refuses_batch_sizes_that_disagree_before_anything_changes():
    model = nn.Linear(4, 4)
    with pytest.raises(ZeroConfigError, match=r"must equal .* = 4"):
        zero3.initialize(model, None, {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2,
                                       "gradient_accumulation_steps": 2})
    assert not zero3.is_zero_param(model.weight)


def _deepspeed_cosine_ratio(it: int, total: int, warmup: int, min_ratio: float, cos_min: float) -> float:
    """DeepSpeed's WarmupCosineLR (deepspeed/runtime/lr_schedules.py today) written out: log warm-up,
    then a cosine whose progress is clamped to 1, so the ratio stays at cos_min_ratio from the end on."""
    w = max(2, warmup)
    if it < w:
        return min_ratio + (1 - min_ratio) * math.log(it + 1) / math.log(w)
    progress = min(1.0, (it - w + 1) / max(1, total - w))
    return max(0.0, cos_min + (1 - cos_min) * (1 + math.cos(math.pi * progress)) / 2)


@pytest.mark.parametrize("total, warmup", [(10, 2), (3, 5), (5, 5), (2, 1), (1, 1)])
def test_warmup_cosine_lr_stays_at_its_floor_past_the_end_and_in_short_runs_as_deepspeed_s(total, warmup, caplog):
    """Probe 26B: past total_num_steps the cosine rose again (1.0 at twice the span), and with
    total_num_steps <= warmup_num_steps the lr jumped between full and the floor every step; DeepSpeed
    clamps the cosine's progress and warns when the run ends inside the warm-up."""
    opt = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=1.0)
    with caplog.at_level("WARNING", logger="zero3"):
        sched = zero3.WarmupCosineLR(opt, total_num_steps=total, warmup_num_steps=warmup, warmup_min_ratio=0.1,
                                     cos_min_ratio=0.05)
    got = []
    for _ in range(3 * max(total, 2) + 4):
        sched.step()
        got.append(opt.param_groups[0]["lr"])
    want = [_deepspeed_cosine_ratio(it, total, warmup, 0.1, 0.05) for it in range(len(got))]
    assert got == pytest.approx(want, rel=1e-12, abs=0)
    short = total < max(2, warmup)
    assert any("is less than warmup_num_steps" in r.getMessage() for r in caplog.records) == short


def test_warmup_cosine_lr_refuses_a_warm_up_of_zero_steps_as_deepspeed_s():
    with pytest.raises(ZeroConfigError, match="warmup_num_steps must be a positive integer, got 0"):
        zero3.ZeroConfig.from_dict({"scheduler": {"type": "WarmupCosineLR",
                                                  "params": {"total_num_steps": 10, "warmup_num_steps": 0}}})


# -- deepspeed.utils' leaf-module calls -----------------------------------------------------------------
class _Experts(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


def test_deepspeed_utils_set_z3_leaf_modules_marks_the_leaf_zero3_trains_like_torch():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), _Experts(), nn.Linear(8, 1))
    ref = nn.Sequential(nn.Linear(8, 8), _Experts(), nn.Linear(8, 1))
    ref.load_state_dict(model.state_dict())
    assert deepspeed.utils.set_z3_leaf_modules(model, [_Experts]) == [model[1]]  # DeepSpeed's spelling
    assert deepspeed.utils.z3_leaf_module(model[1]) and not deepspeed.utils.z3_leaf_module(model[0])
    assert deepspeed.utils.get_z3_leaf_modules(model) == [model[1]]
    assert deepspeed.utils.unset_z3_leaf_modules(model, [_Experts]) == [model[1]]
    assert deepspeed.utils.get_z3_leaf_modules(model) == []
    deepspeed.utils.set_z3_leaf_modules(model, [_Experts])
    engine = zero3.initialize(model, torch.optim.Adam(model.parameters(), lr=1e-2, eps=1e-6), {})
    assert engine.module is model and deepspeed.utils.z3_leaf_module(model[1])
    opt = torch.optim.Adam(ref.parameters(), lr=1e-2, eps=1e-6)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    for _ in range(2):
        engine.backward(model(x).square().mean())
        engine.step()
        ref(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(_full(p), q.detach())
    with pytest.raises(zero3.ZeroStateError, match="before zero3.initialize"):
        deepspeed.utils.unset_z3_leaf_modules(model, [_Experts])
    engine.remove_hooks()


def _traced_modules(model: nn.Module, mark) -> set[str]:
    """The modules a threshold-0 zero3 step over ``model`` records, after ``mark(model)``."""
    mark(model)
    engine = zero3.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), {"param_persistence_threshold": 0})
    engine.backward(model(torch.randn(2, 8)).sum())
    engine.step()
    modules = {e.module for e in engine.coordinator.last_trace.events}
    engine.remove_hooks()
    return modules


def test_deepspeeds_own_leaf_flag_and_raise_if_not_found_are_honoured():
    """Code written for DeepSpeed marks leaves with DeepSpeed's flag (`m._z3_leaf = True`, or
    `set_z3_leaf_module(m, True)`) and passes `raise_if_not_found=False` for classes a model may lack
    (review 33RA: the flag was ignored, the module's children gathered one by one, and the keyword was a
    TypeError)."""
    def build() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(8, 8), _Experts(), nn.Linear(8, 1))

    unmarked = _traced_modules(build(), lambda m: None)
    assert {"1.a", "1.b"} <= unmarked  # a module that is no leaf: its children are gathered one by one
    for mark in (lambda m: setattr(m[1], "_z3_leaf", True),
                 lambda m: deepspeed.utils.set_z3_leaf_module(m[1], True),
                 lambda m: deepspeed.utils.set_z3_leaf_modules(m, [_Experts, nn.GRU], raise_if_not_found=False)):
        traced = _traced_modules(build(), mark)
        assert "1" in traced and not {"1.a", "1.b"} & traced, traced
    model = build()
    with pytest.raises(ValueError, match="no module of the model"):  # DeepSpeed's rule: refused where none matches
        deepspeed.utils.set_z3_leaf_modules(model, [nn.GRU])
    assert deepspeed.utils.set_z3_leaf_modules(model, [_Experts, nn.GRU]) == [model[1]]  # the others skipped
    model[1]._z3_leaf = False  # DeepSpeed's flag unmarks, as DeepSpeed's z3_leaf_module reads it
    assert not deepspeed.utils.z3_leaf_module(model[1])
    qualified = f"{_Experts.__module__}.{_Experts.__qualname__}"
    assert deepspeed.utils.set_z3_leaf_modules(model, [qualified]) == [model[1]]  # a qualified class name
    assert deepspeed.utils.z3_leaf_module(model[1]) and model[1]._z3_leaf
    assert deepspeed.utils.unset_z3_leaf_modules(model, [_Experts, nn.GRU], raise_if_not_found=False) == [model[1]]
    assert not deepspeed.utils.z3_leaf_module(model[1])
    engine = zero3.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), {})
    with pytest.raises(zero3.ZeroStateError, match="before zero3.initialize"):  # a submodule too
        deepspeed.utils.set_z3_leaf_module(model[1], True)
    with pytest.raises(zero3.ZeroStateError, match="before zero3.initialize"):  # zero3's own call on a submodule
        zero3.set_leaf_modules(model[1], [nn.Linear])
    assert not deepspeed.utils.z3_leaf_module(model[1]) and not deepspeed.utils.z3_leaf_module(model[1].a)
    engine.remove_hooks()
    deepspeed.utils.set_z3_leaf_module(model[1], True)  # a detached model takes marks for the next initialize
    assert deepspeed.utils.z3_leaf_module(model[1])
