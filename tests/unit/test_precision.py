"""Mixed precision at world size 1: config keys, the loss scaler, flat buffers, the engine's step.

The engine is compared with a hand-written recipe (a low-precision model copy for forward and
backward, fp32 master copies stepped by AdamW and copied back), which at world size 1 must match
bit for bit.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from gpt import GPT, GPTConfig, synthetic_batch
from torch import nn

import zero3
from zero3 import LossScaler, ZeroConfig, ZeroConfigError, ZeroStateError
from zero3.optim.optimizer import ALIGN_ELEMENTS

CFG = GPTConfig(block_size=16)
BATCH = 4
NO_PERSIST = {"param_persistence_threshold": 0}



def lossf(model, x, y):
    logits = model(x)
    return F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), y.reshape(-1))


class Recipe:
    """Single-process mixed precision by hand (see tests/multiproc/test_mixed_precision.py)."""

    def __init__(self, full: nn.Module, dtype: torch.dtype, scale: float = 1.0, **opt) -> None:
        self.names = [n for n, _ in full.named_parameters()]
        self.low = copy.deepcopy(full).to(dtype)
        self.masters = [p.detach().clone().float() for p in full.parameters()]
        self.opt = torch.optim.AdamW(self.masters, lr=1e-2, eps=1e-6, **opt)
        self.scale = scale

    def backward(self, x, y, divide: int = 1) -> torch.Tensor:
        """Accumulate the fp32 gradient of this micro-batch, divided by ``divide`` (in fp32, as zero3)."""
        loss = lossf(self.low, x, y)
        (loss * self.scale).backward()
        for m, p in zip(self.masters, self.low.parameters()):
            g = p.grad.float() / divide
            m.grad = g if m.grad is None else m.grad + g
            p.grad = None
        return loss

    def step(self) -> None:
        for m in self.masters:
            m.grad /= self.scale
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        with torch.no_grad():
            for m, p in zip(self.masters, self.low.parameters()):
                p.copy_(m)


def pair(dtype: str, opt_kwargs=None, **config):
    torch.manual_seed(0)
    full = GPT(CFG)
    model = copy.deepcopy(full)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-6, **(opt_kwargs or {}))
    engine = zero3.initialize(model, opt, {**NO_PERSIST, "dtype": dtype, **config})
    return full, engine


def masters_of(engine):
    return {p._zero.name: zero3.safe_get_full_fp32_param(p) for p in engine.params}


# -- config ---------------------------------------------------------------------------------------
def test_precision_defaults_change_nothing_and_fp16_defaults_equal_deepspeed():
    cfg = ZeroConfig()
    assert (cfg.precision.dtype, cfg.precision.reduce_dtype, cfg.training.gradient_accumulation_steps, cfg.training.gradient_clipping,
            cfg.offload.offload_optimizer) == ("fp32", "fp32", 1, 0.0, "none")
    # DeepSpeed fp16 defaults: loss_scale 0 (dynamic), 2**16, window 1000, hysteresis 2, min 1
    assert (cfg.precision.loss_scale, cfg.precision.initial_scale_power, cfg.precision.loss_scale_window, cfg.precision.hysteresis,
            cfg.precision.min_loss_scale) == (0.0, 16, 1000, 2, 1.0)


DEEPSPEED = {
    "train_micro_batch_size_per_gpu": 2,
    "gradient_accumulation_steps": 4,
    "gradient_clipping": 1,
    "communication_data_type": "bfloat16",
    "fp16": {"enabled": True, "loss_scale": 0, "initial_scale_power": 12, "loss_scale_window": 500,
             "hysteresis": 1, "consecutive_hysteresis": True, "min_loss_scale": 0.5, "auto_cast": False},
    "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": True, "buffer_count": 4}},
}


def test_deepspeed_precision_accumulation_clipping_and_offload_keys_map_onto_fields():
    cfg = ZeroConfig.from_dict(DEEPSPEED)
    assert cfg.precision.dtype == "fp16" and cfg.precision.reduce_dtype == "bf16"
    assert (cfg.precision.loss_scale, cfg.precision.initial_scale_power, cfg.precision.loss_scale_window, cfg.precision.hysteresis,
            cfg.precision.consecutive_hysteresis, cfg.precision.min_loss_scale) == (0.0, 12, 500, 1, True, 0.5)
    assert cfg.training.gradient_accumulation_steps == 4
    assert cfg.training.gradient_clipping == 1.0 and type(cfg.training.gradient_clipping) is float
    assert (cfg.offload.offload_optimizer, cfg.offload.offload_optimizer_pin_memory) == ("cpu", True)
    assert ZeroConfig.from_dict(cfg.to_dict()) == cfg


def test_deepspeed_bf16_section_sets_dtype_and_a_disabled_section_changes_nothing():
    assert ZeroConfig.from_dict({"bf16": {"enabled": True}}).precision.dtype == "bf16"
    assert ZeroConfig.from_dict({"bfloat16": {"enabled": True}}).precision.dtype == "bf16"
    off = ZeroConfig.from_dict({"fp16": {"enabled": False, "initial_scale_power": 3}, "bf16": {"enabled": False}})
    assert off == ZeroConfig()


def test_deepspeed_data_types_section_accepts_what_zero3_does():
    # refused as an unknown section before; fp32 accumulation is what zero3 does under every precision
    for value in ("fp32", "float32", "FP32", "torch.float32", None):
        cfg = ZeroConfig.from_dict({"bf16": {"enabled": True}, "data_types": {"grad_accum_dtype": value}})
        assert cfg == ZeroConfig.from_dict({"bf16": {"enabled": True}})


def test_our_field_names_accept_the_offload_dict_form():
    cfg = ZeroConfig.from_dict({"dtype": "bf16", "offload_optimizer": {"device": "cpu", "pin_memory": False}})
    assert (cfg.precision.dtype, cfg.offload.offload_optimizer, cfg.offload.offload_optimizer_pin_memory) == ("bf16", "cpu", False)


@pytest.mark.parametrize("d,pattern", [
    ({"bf16": {"enabled": True}, "fp16": {"enabled": True}}, r"bf16\.enabled and fp16\.enabled are both true"),
    ({"fp16": {"enabled": "auto"}}, r"fp16\.enabled must be a bool, got 'auto'"),
    ({"fp16": {"enabled": True, "loss_scal": 1}}, r"fp16: unknown config key 'loss_scal'; did you mean 'loss_scale'"),
    ({"communication_data_type": "int8"}, r"communication_data_type must be one of .*got 'int8'"),
    ({"zero_optimization": {"offload_optimizer": {"device": "nvme"}}},
     r"offload_optimizer='nvme' needs offload_optimizer_nvme_path"),
    ({"zero_optimization": {"offload_optimizer": {"devise": "cpu"}}},
     r"unknown config key 'devise'; did you mean 'device'"),
    ({"dtype": "float16"}, r"dtype must be one of \('fp32', 'bf16', 'fp16'\), got 'float16'"),
    ({"reduce_dtype": "int8"}, r"reduce_dtype must be one of"),
    ({"offload_optimizer": "gpu"}, r"offload_optimizer must be one of \('none', 'cpu', 'nvme'\), got 'gpu'"),
    ({"gradient_accumulation_steps": 0}, r"gradient_accumulation_steps must be >= 1, got 0"),
    ({"gradient_accumulation_steps": 2**64}, r"gradient_accumulation_steps must be at most 2147483647, got 1844"),
    ({"gradient_clipping": -1.0}, r"gradient_clipping must be >= 0, got -1\.0"),
    ({"gradient_clipping": "1"}, r"gradient_clipping must be a finite number >= 0, got '1' \(str\)"),
    ({"loss_scale": math.inf}, r"loss_scale must be a finite number"),
    ({"hysteresis": 0}, r"hysteresis must be >= 1, got 0"),
    ({"loss_scale_window": 0}, r"loss_scale_window must be >= 1, got 0"),
    ({"min_loss_scale": 0.0}, r"min_loss_scale must be > 0, got 0\.0"),
    ({"bf16": {"enabled": True}, "data_types": {"grad_accum_dtype": "bf16"}},
     r"data_types\.grad_accum_dtype='bf16' is not supported: zero3 accumulates gradients in fp32"),
    ({"data_types": {"grad_accum_dtype": ["fp32"]}}, r"data_types\.grad_accum_dtype=\['fp32'\] is not supported"),
    ({"data_types": {"grad_acum_dtype": "fp32"}}, r"data_types: unknown config key 'grad_acum_dtype'; did you mean"),
    ({"data_types": "fp32"}, r"data_types must be a dict"),
])
def test_invalid_precision_config_names_the_key_and_value(d, pattern):
    with pytest.raises(ZeroConfigError, match=pattern):
        ZeroConfig.from_dict(d)


# -- the loss scaler -----------------------------------------------------------------------------------
def run_scaler(scaler: LossScaler, overflows: str) -> list[float]:
    """Feed a pattern ('x' overflow, '.' clean); return the scale after each step."""
    out = []
    for c in overflows:
        scaler.update(c == "x")
        out.append(scaler.scale)
    return out


def test_dynamic_scaler_follows_deepspeed_hysteresis_and_window():
    s = LossScaler(scale=64, dynamic=True, window=3, hysteresis=2)
    # 1st overflow uses the hysteresis, the 2nd and 3rd halve; 3 clean steps double and refill it
    got = run_scaler(s, "xxx...x.x")
    assert got == [64, 32, 16, 16, 16, 32, 32, 32, 16]


def test_consecutive_hysteresis_refills_after_every_clean_step():
    s = LossScaler(scale=64, dynamic=True, window=100, hysteresis=2, consecutive_hysteresis=True)
    assert run_scaler(s, "x.x.xx") == [64, 64, 64, 64, 64, 32]


def test_dynamic_scale_never_drops_below_min_and_an_overflow_there_raises_as_deepspeed():
    s = LossScaler(scale=4, dynamic=True, window=100, hysteresis=1, min_scale=1.0)
    assert run_scaler(s, "xx") == [2, 1]
    # DeepSpeed's DynamicLossScaler (raise_error_at_min_scale, its default): every later step would be
    # skipped, so the run stops instead of going on without learning
    with pytest.raises(ZeroStateError, match=r"minimum loss scale \(min_loss_scale=1\)"):
        s.update(True)
    assert s.scale == 1 and s.overflows == 3
    # hysteresis left at the minimum is used up first, as there
    h = LossScaler(scale=2, dynamic=True, window=100, hysteresis=2, min_scale=2.0)
    assert run_scaler(h, "x") == [2]
    with pytest.raises(ZeroStateError, match="minimum loss scale"):
        h.update(True)
    # a scale that starts below the minimum rises to it at the first overflow (DeepSpeed's `==` test)
    low = LossScaler(scale=1, dynamic=True, window=100, hysteresis=1, min_scale=4.0)
    assert run_scaler(low, "x") == [4]
    static = LossScaler(scale=128, dynamic=False)
    assert run_scaler(static, "x" + "." * 5) == [128] * 6
    assert static.overflows == 1


def test_scaler_state_dict_round_trips():
    s = LossScaler(scale=64, dynamic=True, window=3, hysteresis=2)
    run_scaler(s, "x..")
    t = LossScaler(scale=1, dynamic=True, window=3, hysteresis=2)
    t.load_state_dict(s.state_dict())
    assert run_scaler(t, ".xx") == run_scaler(s, ".xx")


def test_a_static_checkpoint_restarts_a_running_dynamic_scaler_and_a_rollback_restores_every_field():
    """Review 36R1: a static checkpoint loaded into a dynamic scaler that had run kept that run's hysteresis
    and clean steps (a fresh one started anew: the same resume behaved two ways); a dynamic one below
    the config's min_loss_scale ran under it; and the step rollback, through the same policy, left a
    static scaler's clean steps advanced."""
    static = LossScaler(scale=128, dynamic=False)
    running = LossScaler(scale=256, dynamic=True, window=4, hysteresis=3, min_scale=1)
    run_scaler(running, "x..")
    running.load_state_dict(static.state_dict())
    fresh = LossScaler(scale=256, dynamic=True, window=4, hysteresis=3, min_scale=1)
    fresh.load_state_dict(static.state_dict())
    assert running.state_dict() == fresh.state_dict() == {"scale": 128.0, "dynamic": True, "hysteresis_left": 3,
                                                           "clean_steps": 0, "overflows": 0}
    floor = LossScaler(scale=2**16, dynamic=True, min_scale=4096)
    floor.load_state_dict(LossScaler(scale=1024, dynamic=True).state_dict())
    assert floor.scale == 4096
    kept = static.state_dict()
    static.update(False)
    static.restore(kept)
    assert static.state_dict() == kept


def test_scaler_from_config_only_for_fp16():
    assert LossScaler.from_config(ZeroConfig(dtype="bf16")) is None
    dyn = LossScaler.from_config(ZeroConfig(dtype="fp16", initial_scale_power=5))
    assert dyn is not None and dyn.dynamic and dyn.scale == 32.0
    static = LossScaler.from_config(ZeroConfig(dtype="fp16", loss_scale=8.0))
    assert static is not None and not static.dynamic and static.scale == 8.0


# -- buffers ---------------------------------------------------------------------------------------------
def test_fp32_engine_keeps_the_optimizer_on_the_shards_without_masters():
    _, engine = pair("fp32")
    for p in engine.params:
        assert p._zero.master is None and engine.master_shard(p) is p.ds_tensor
    assert engine.sharded_optimizer.groups == [] and engine.loss_scaler is None


def test_masters_are_aligned_views_of_one_fp32_buffer_per_param_group():
    torch.manual_seed(0)
    model = GPT(CFG)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=1e-3)
    engine = zero3.initialize(model, opt, {"dtype": "bf16"})
    assert engine.optimizer is opt and [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]
    assert len(engine.sharded_optimizer.groups) == 2
    for group, fg in zip(opt.param_groups, engine.sharded_optimizer.groups):
        assert fg.master.dtype == torch.float32 and fg.low.dtype == torch.bfloat16
        assert fg.master.numel() == fg.low.numel() and fg.master.numel() % ALIGN_ELEMENTS == 0
        for t, p, off in zip(group["params"], fg.params, fg.offsets):
            assert off % ALIGN_ELEMENTS == 0
            assert t is engine.master_shard(p)
            assert t.untyped_storage().data_ptr() == fg.master.untyped_storage().data_ptr()
            assert t.data_ptr() == fg.master.data_ptr() + 4 * off
            assert p.ds_tensor.data_ptr() == fg.low.data_ptr() + 2 * off
            assert p.ds_tensor.dtype == torch.bfloat16 and p.dtype == torch.bfloat16


def test_masters_start_from_the_fp32_weights_not_their_bf16_rounding():
    full, engine = pair("bf16")
    for (name, ref), p in zip(full.named_parameters(), engine.params):
        assert torch.equal(zero3.safe_get_full_fp32_param(p), ref.detach()), name
        with zero3.GatheredParameters([p]):
            assert torch.equal(p.detach(), ref.detach().to(torch.bfloat16)), name


def test_model_built_under_init_in_bf16_gets_masters_from_its_bf16_shards():
    torch.manual_seed(0)
    with zero3.Init(dtype=torch.bfloat16):
        model = GPT(CFG)
    engine = zero3.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-3), {"dtype": "bf16"})
    x, y = synthetic_batch(0, BATCH, CFG)
    engine.backward(lossf(engine, x, y))
    assert engine.step() is True
    assert all(engine.master_shard(p).dtype == torch.float32 for p in engine.params)


# -- training against the recipe -------------------------------------------------------------------------
@pytest.mark.parametrize("dtype,scaling,scale", [
    ("bf16", {}, 1.0),
    ("fp16", {"initial_scale_power": 6}, 64.0),  # dynamic: no overflow in 4 steps, window 1000
    ("fp16", {"loss_scale": 128.0}, 128.0),  # static
], ids=["bf16", "fp16_dynamic", "fp16_static"])
def test_mixed_precision_training_equals_the_hand_written_recipe_bit_for_bit(dtype, scaling, scale):
    full, engine = pair(dtype, **scaling)
    ref = Recipe(full, zero3.optim.precision.torch_dtype(dtype), scale=scale)
    sched = torch.optim.lr_scheduler.StepLR(engine.optimizer, step_size=2, gamma=0.1)
    ref_sched = torch.optim.lr_scheduler.StepLR(ref.opt, step_size=2, gamma=0.1)
    for step in range(4):
        x, y = synthetic_batch(step, BATCH, CFG)
        loss = lossf(engine, x, y)
        engine.backward(loss)
        assert torch.equal(loss, ref.backward(x, y))
        assert engine.step() is True
        ref.step()
        sched.step()
        ref_sched.step()
        assert engine.optimizer.param_groups[0]["lr"] == ref.opt.param_groups[0]["lr"]
    assert engine.optimizer.param_groups[0]["lr"] == pytest.approx(1e-4)
    assert engine.loss_scale == scale and engine.skipped_steps == 0
    got = masters_of(engine)
    for name, m in zip(ref.names, ref.masters):
        assert torch.equal(got[name], m), name


def test_bf16_plain_loss_backward_loop_equals_the_recipe():
    full, engine = pair("bf16")
    ref = Recipe(full, torch.bfloat16)
    for step in range(2):
        x, y = synthetic_batch(step, BATCH, CFG)
        lossf(engine.module, x, y).backward()
        ref.backward(x, y)
        assert engine.step() is True
        ref.step()
    got = masters_of(engine)
    for name, m in zip(ref.names, ref.masters):
        assert torch.equal(got[name], m), name


def test_fp16_backward_scales_the_loss_and_the_gradient_accessor_unscales_it():
    full, engine = pair("fp16", initial_scale_power=10)
    ref, unscaled = Recipe(full, torch.float16, scale=1024.0), Recipe(full, torch.float16)
    x, y = synthetic_batch(0, BATCH, CFG)
    engine.backward(lossf(engine, x, y))
    ref.backward(x, y)
    unscaled.backward(x, y)
    for p, m, u in zip(engine.params, ref.masters, unscaled.masters):
        stored = engine.master_shard(p).grad[: p.ds_numel]  # still scaled by 2**10
        true = zero3.safe_get_full_grad(p)
        assert torch.equal(stored.view(p.ds_shape), m.grad), p._zero.name
        assert torch.equal(true, m.grad / 1024), p._zero.name
    # the scale matters: without it small fp16 gradients lose their low bits or flush to zero
    assert any(not torch.equal(m.grad / 1024, u.grad) for m, u in zip(ref.masters, unscaled.masters))


def test_fp16_overflow_skips_the_step_backs_off_and_later_grows():
    _, engine = pair("fp16", initial_scale_power=4, hysteresis=2, loss_scale_window=2)
    x, y = synthetic_batch(0, BATCH, CFG)
    scales, returned = [], []
    for step, inject in enumerate([True, True, False, False, False]):
        engine.backward(lossf(engine, x, y))
        if inject:
            engine.master_shard(engine.params[1]).grad[0] = math.nan
        before = masters_of(engine)
        returned.append(engine.step())
        scales.append(engine.loss_scale)
        unchanged = all(torch.equal(before[n], v) for n, v in masters_of(engine).items())
        assert unchanged == inject, step
    assert returned == [False, False, True, True, True]
    assert scales == [16.0, 8.0, 8.0, 16.0, 16.0]  # hysteresis 2: the second overflow halves; window 2
    assert engine.skipped_steps == 2 and engine.global_steps == 5


def test_fp16_overflow_at_the_minimum_scale_raises_from_the_step_with_the_step_skipped():
    _, engine = pair("fp16", initial_scale_power=1, hysteresis=1, min_loss_scale=1)
    x, y = synthetic_batch(0, BATCH, CFG)
    engine.backward(lossf(engine, x, y))
    engine.master_shard(engine.params[1]).grad[0] = math.nan
    assert engine.step() is False and engine.loss_scale == 1.0  # 2 -> 1: backs off, as before
    engine.backward(lossf(engine, x, y))
    engine.master_shard(engine.params[1]).grad[0] = math.nan
    before = masters_of(engine)
    with pytest.raises(ZeroStateError, match="minimum loss scale"):
        engine.step()  # went on skipping every step for ever, logging at INFO only
    assert all(torch.equal(before[n], v) for n, v in masters_of(engine).items())
    assert engine.skipped_steps == 2 and engine.global_steps == 2  # a skipped step, counted as the first
    assert all(engine.master_shard(p).grad is None or not engine.master_shard(p).grad.any() for p in engine.params)


def test_after_the_minimum_scale_error_the_next_window_is_whole_and_steps_on_its_mean_gradient():
    """Probe 36I: the raise left the window open, so the next micro-batch alone was stepped on (divided
    by the accumulation count) and every later window straddled two."""
    full, engine = pair("fp16", initial_scale_power=1, hysteresis=1, min_loss_scale=1, gradient_accumulation_steps=2)
    ref = Recipe(full, torch.float16, scale=0.5)  # the scale 1 over the 2 micro-batches, as DeepSpeed's backward
    for window in range(2):  # both overflow: 2 -> 1, then at the minimum
        for micro in range(2):
            engine.backward(lossf(engine, *synthetic_batch(micro, BATCH, CFG)))
            if micro == 1:
                engine.master_shard(engine.params[1]).grad[0] = math.nan
                if window == 0:
                    assert engine.step() is False
                else:
                    with pytest.raises(ZeroStateError, match="minimum loss scale"):
                        engine.step()
            else:
                assert engine.step() is False
    assert (engine.global_steps, engine.micro_steps, engine.skipped_steps) == (2, 4, 2)
    returned = []
    for micro in (4, 5):
        x, y = synthetic_batch(micro, BATCH, CFG)
        assert engine.is_gradient_accumulation_boundary() == (micro == 5)
        engine.backward(lossf(engine, x, y))
        ref.backward(x, y, divide=2)
        returned.append(engine.step())
    ref.step()
    assert returned == [False, True] and engine.loss_scale == 1.0
    got = masters_of(engine)
    for name, m in zip(ref.names, ref.masters):
        torch.testing.assert_close(got[name], m, rtol=0, atol=1e-7, msg=name)


def test_skipped_steps_survive_a_checkpoint(tmp_path):
    _, engine = pair("fp16", initial_scale_power=4)
    x, y = synthetic_batch(0, BATCH, CFG)
    for inject in (True, False, True):
        engine.backward(lossf(engine, x, y))
        if inject:
            engine.master_shard(engine.params[1]).grad[0] = math.nan
        engine.step()
    assert (engine.global_steps, engine.skipped_steps) == (3, 2)
    engine.save_checkpoint(str(tmp_path))
    _, fresh = pair("fp16", initial_scale_power=4)
    fresh.load_checkpoint(str(tmp_path))
    assert (fresh.global_steps, fresh.skipped_steps) == (3, 2)  # was (3, 0): DeepSpeed keeps the count
    _, weights_only = pair("fp16", initial_scale_power=4)
    weights_only.load_checkpoint(str(tmp_path), load_module_only=True)
    assert (weights_only.global_steps, weights_only.skipped_steps) == (0, 0)


def test_a_checkpoint_s_loss_scaler_of_another_mode_leaves_the_config_s_mode(tmp_path, caplog):
    """Probe 36I: a run resumed with a static ``loss_scale: 128`` trained on the checkpoint's dynamic
    scale (1024, static from then on), and a static checkpoint gave a dynamic run its unused
    hysteresis (2 where the config said 1, so an overflow did not halve the scale)."""
    _, dynamic = pair("fp16", initial_scale_power=10, hysteresis=1)
    x, y = synthetic_batch(0, BATCH, CFG)
    dynamic.backward(lossf(dynamic, x, y))
    dynamic.step()
    dynamic.save_checkpoint(str(tmp_path / "dynamic"))
    _, static = pair("fp16", loss_scale=128.0)
    with caplog.at_level("WARNING", logger="zero3"):
        static.load_checkpoint(str(tmp_path / "dynamic"))
    assert static.loss_scale == 128.0 and "is static 128, which is kept" in caplog.text
    static.save_checkpoint(str(tmp_path / "static"))
    _, resumed = pair("fp16", initial_scale_power=10, hysteresis=1)
    resumed.load_checkpoint(str(tmp_path / "static"))
    assert resumed.loss_scale == 128.0  # the saved scale, as a start
    resumed.backward(lossf(resumed, x, y))
    resumed.master_shard(resumed.params[1]).grad[0] = math.nan
    assert resumed.step() is False and resumed.loss_scale == 64.0  # hysteresis 1, as configured


def test_clipping_under_fp16_unscales_first_and_equals_torch_on_the_true_gradients():
    _, engine = pair("fp16", initial_scale_power=12)
    x, y = synthetic_batch(0, BATCH, CFG)
    engine.backward(lossf(engine, x, y))
    holders = []
    for p in engine.params:
        h = torch.zeros(p.ds_shape)
        h.grad = zero3.safe_get_full_grad(p)
        holders.append(h)
    want = torch.nn.utils.clip_grad_norm_(holders, 0.1)
    got = zero3.clip_grad_norm_(engine, 0.1)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
    assert got > 0.1  # it clipped
    for p, h in zip(engine.params, holders):
        torch.testing.assert_close(zero3.safe_get_full_grad(p), h.grad, rtol=1e-6, atol=1e-9)
    with pytest.raises(ZeroStateError, match="after clip_grad_norm_ in the same accumulation window"):
        engine.backward(lossf(engine, x, y))


@pytest.mark.parametrize("window", ["alone", "after an engine.backward"])
def test_fp16_plain_loss_backward_is_refused_at_the_backward_and_loses_nothing(window):
    """Under fp16 loss scaling a plain ``loss.backward()`` gives unscaled gradients that the step
    would divide by the scale. It used to be refused at the step, and only when no engine.backward
    had run in the window (one that had made the mix silent), and the gradient accessors read it
    1/scale too small until then. Now the backward itself is refused before anything is reduced, and
    training with engine.backward afterwards equals the by-hand recipe."""
    full, engine = pair("fp16", initial_scale_power=10, gradient_accumulation_steps=2)
    ref = Recipe(full, torch.float16, scale=512.0)  # the scale over the 2 micro-batches, as DeepSpeed's backward
    x, y = synthetic_batch(0, BATCH, CFG)
    if window != "alone":
        engine.backward(lossf(engine, x, y))
        ref.backward(x, y, divide=2)
        assert not engine.step()  # the first micro-batch of two
    with pytest.raises(ZeroStateError, match=r"not engine\.backward\(loss\) .*fp16 loss scaling"):
        lossf(engine.module, x, y).backward()
    assert engine.coordinator.live_params == []
    if window == "alone":
        engine.backward(lossf(engine, x, y))
        ref.backward(x, y, divide=2)
        assert not engine.step()
    x, y = synthetic_batch(1, BATCH, CFG)
    engine.backward(lossf(engine, x, y))
    ref.backward(x, y, divide=2)
    assert engine.step()
    ref.step()
    got = masters_of(engine)
    for name, m in zip(ref.names, ref.masters):
        torch.testing.assert_close(got[name], m, rtol=0, atol=0, msg=name)


def test_gradient_accumulation_steps_the_optimizer_every_nth_call_on_the_mean_gradient():
    full, engine = pair("bf16", gradient_accumulation_steps=3)
    ref = Recipe(full, torch.bfloat16)
    returned = []
    for micro in range(6):
        x, y = synthetic_batch(micro, BATCH, CFG)
        assert engine.is_gradient_accumulation_boundary() == (micro % 3 == 2)
        engine.backward(lossf(engine, x, y))
        ref.backward(x, y, divide=3)
        if micro % 3 != 2:
            with pytest.raises(ZeroStateError, match=r"micro-batch \d of 3"):
                zero3.clip_grad_norm_(engine, 1.0)
        returned.append(engine.step())
        if micro % 3 == 2:
            ref.step()
    assert returned == [False, False, True] * 2
    assert (engine.global_steps, engine.micro_steps) == (2, 6)
    got = masters_of(engine)
    for name, m in zip(ref.names, ref.masters):
        torch.testing.assert_close(got[name], m, rtol=0, atol=1e-7, msg=name)


def test_gradient_clipping_key_clips_inside_step_like_torch():
    full, engine = pair("bf16", gradient_clipping=0.05)
    ref = Recipe(full, torch.bfloat16)
    for step in range(2):
        x, y = synthetic_batch(step, BATCH, CFG)
        engine.backward(lossf(engine, x, y))
        ref.backward(x, y)
        engine.step()
        assert torch.nn.utils.clip_grad_norm_(ref.masters, 0.05) > 0.05
        ref.opt.step()
        ref.opt.zero_grad(set_to_none=True)
        with torch.no_grad():
            for m, p in zip(ref.masters, ref.low.parameters()):
                p.copy_(m)
    got = masters_of(engine)
    for name, m in zip(ref.names, ref.masters):
        torch.testing.assert_close(got[name], m, rtol=1e-5, atol=1e-6, msg=name)


def test_at_world_size_one_gradients_go_straight_into_the_fp32_masters():
    seen = []
    _, engine = pair("bf16", reduce_dtype="bf16")
    real = engine.comm.reduce_grads
    engine.comm.reduce_grads = lambda pieces, dtype, device, tag: (seen.append(dtype), real(pieces, dtype, device, tag))[1]
    x, y = synthetic_batch(0, BATCH, CFG)
    engine.backward(lossf(engine, x, y))
    assert seen == []  # one rank: the average is the gradient, nothing is reduced (or copied)
    assert all(engine.master_shard(p).grad.dtype == torch.float32 for p in engine.params)


def test_weights_written_through_gathered_parameters_reach_the_masters():
    _, engine = pair("bf16")
    p = engine.module.ln_f.weight
    with zero3.GatheredParameters([p], modifier_rank=0), torch.no_grad():
        p.fill_(1.5)
    assert torch.equal(zero3.safe_get_full_fp32_param(p), torch.full(p.ds_shape, 1.5))


def test_persistent_params_are_regathered_from_the_new_bf16_shards_after_a_step():
    full, engine = pair("bf16", param_persistence_threshold=10**6)
    ref = Recipe(full, torch.bfloat16)
    x, y = synthetic_batch(0, BATCH, CFG)
    engine.backward(lossf(engine, x, y))
    ref.backward(x, y)
    engine.step()
    ref.step()
    for p, q in zip(engine.params, ref.low.parameters()):
        assert p.ds_persist and torch.equal(p.detach(), q.detach()), p._zero.name


def test_offload_keeps_masters_and_state_in_a_separate_cpu_buffer_and_copies_back():
    full, engine = pair("fp32", offload_optimizer="cpu", offload_optimizer_pin_memory=True)
    fg = engine.sharded_optimizer.groups[0]
    assert fg.master.device.type == "cpu" and not fg.master.is_pinned()  # no CUDA here: never pinned
    assert fg.master.untyped_storage().data_ptr() != fg.low.untyped_storage().data_ptr()
    ref_opt = torch.optim.AdamW(full.parameters(), lr=1e-2, eps=1e-6)
    x, y = synthetic_batch(0, BATCH, CFG)
    engine.backward(lossf(engine, x, y))
    lossf(full, x, y).backward()
    engine.step()
    ref_opt.step()
    for p, q in zip(engine.params, full.parameters()):
        with zero3.GatheredParameters([p]):
            assert torch.equal(p.detach(), q.detach())  # fp32 offload: exact
        assert engine.optimizer_state(p)["exp_avg"].device.type == "cpu"


def test_memory_report_counts_bf16_shards_fp32_grads_and_masters_in_the_optimizer_state():
    full, engine = pair("bf16")
    s = [p.numel() for p in full.parameters()]
    a = [-(-n // ALIGN_ELEMENTS) * ALIGN_ELEMENTS for n in s]
    x, y = synthetic_batch(0, BATCH, CFG)
    engine.backward(lossf(engine, x, y))
    m = engine.memory_report()
    assert m["param_shard_bytes"] == 2 * sum(a)
    assert m["grad_shard_bytes"] == 4 * sum(s)
    assert m["optimizer_state_bytes"] == 4 * sum(a)  # masters only: AdamW has not stepped yet
    engine.step()
    assert engine.memory_report()["optimizer_state_bytes"] == 4 * sum(a) + 8 * sum(s)


# -- buffers of modules with lowered parameters ------------------------------------------------------
class _Counter(nn.Module):
    """No parameters of its own: its float buffer keeps its dtype (as a rotary inv_freq)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("table", torch.linspace(0, 1, 8))

    def forward(self, x):
        return x + self.table.to(x.dtype)


def _bn_model():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.ReLU(), _Counter(), nn.Linear(8, 2))
    model[4].register_buffer("kept", torch.zeros(2))  # as an MoE router's fp32 bias, which HF keeps in fp32
    return model


@pytest.mark.parametrize("dtype,torch_dtype", [("bf16", torch.bfloat16), ("fp16", torch.float16)])
def test_batchnorm_under_mixed_precision_trains_as_module_to_dtype_does(dtype, torch_dtype):
    """DeepSpeed casts the module (``module.bfloat16()``), buffers included; zero3 cast the parameters
    only, so BatchNorm's fp32 running statistics beside its bf16 weight failed in torch's kernel."""
    full = _bn_model()
    model = copy.deepcopy(full)
    engine = zero3.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-6),
                              {**NO_PERSIST, "dtype": dtype})
    bn = model[1]
    assert bn.running_mean.dtype == torch_dtype and bn.running_var.dtype == torch_dtype
    assert bn.num_batches_tracked.dtype == torch.long and model[3].table.dtype == torch.float32
    assert model[4].kept.dtype == torch.float32  # another buffer of a module with parameters keeps its dtype
    low = copy.deepcopy(full).to(torch_dtype)
    low[3].table = low[3].table.float()
    low[4].kept = low[4].kept.float()
    _train_beside_torch_with_fp32_masters(engine, model, full, low, torch_dtype, 8)
    assert torch.equal(bn.running_mean, low[1].running_mean) and torch.equal(bn.running_var, low[1].running_var)


def _train_beside_torch_with_fp32_masters(engine, model, full, low, torch_dtype, width: int) -> torch.Generator:
    """Three AdamW steps of ``engine`` beside torch's ``low`` (``full`` cast) with fp32 masters and the
    engine's loss scale, losses and then masters bit-equal; returns the batch generator, for more."""
    masters = [p.detach().clone().float() for p in full.parameters()]
    opt = torch.optim.AdamW(masters, lr=1e-2, eps=1e-6)
    scale = (lambda: engine.loss_scale) if torch_dtype == torch.float16 else (lambda: 1.0)
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        x, y = torch.randn(16, width, generator=g), torch.randn(16, 2, generator=g)
        loss = F.mse_loss(engine(x.to(torch_dtype)).float(), y)
        engine.backward(loss)
        engine.step()
        ref = F.mse_loss(low(x.to(torch_dtype)).float(), y)
        (ref * scale()).backward()
        for m, p in zip(masters, low.parameters()):
            m.grad = p.grad.float() / scale()
            p.grad = None
        opt.step()
        opt.zero_grad()
        with torch.no_grad():
            for m, p in zip(masters, low.parameters()):
                p.copy_(m)
        assert torch.equal(loss.detach(), ref.detach())
    for name, m in zip([n for n, _ in full.named_parameters()], masters):
        assert torch.equal(zero3.safe_get_full_fp32_param(dict(model.named_parameters())[name]), m), name
    return g


def _sn_model(api: str):
    torch.manual_seed(0)
    sn = {"old": torch.nn.utils.spectral_norm, "new": torch.nn.utils.parametrizations.spectral_norm,
          "orthogonal": torch.nn.utils.parametrizations.orthogonal}[api]
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), sn(nn.Linear(8, 8)), nn.Linear(8, 2))


def _sn_vectors(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: b for n, b in model.named_buffers() if n.endswith(("_u", "_v", ".base"))}


@pytest.mark.parametrize("dtype,torch_dtype", [("bf16", torch.bfloat16), ("fp16", torch.float16)])
@pytest.mark.parametrize("api", ["old", "new"])
def test_spectral_norm_under_mixed_precision_trains_as_module_to_dtype_does(api, dtype, torch_dtype, tmp_path):
    """Spectral norm's power-iteration vectors (``weight_u``/``weight_v`` of the old hook, ``_u``/``_v``
    of the parametrization) stayed fp32 beside the bf16 weight: the first forward raised in torch
    ("addmv input tensors must have the same dtype"), where ``model.bfloat16()`` runs (loss 0.03008).
    They are cast with their weight, and train (and survive a checkpoint) as in torch with fp32 masters."""
    full = _sn_model(api)
    model = copy.deepcopy(full)
    cfg = {**NO_PERSIST, "dtype": dtype}
    engine = zero3.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-6), cfg)
    vectors = _sn_vectors(model)
    assert len(vectors) == 2 and all(b.dtype == torch_dtype for b in vectors.values())
    low = copy.deepcopy(full).to(torch_dtype)
    g = _train_beside_torch_with_fp32_masters(engine, model, full, low, torch_dtype, 6)
    vectors, ref_vectors = _sn_vectors(model), _sn_vectors(low)
    assert all(torch.equal(vectors[n], ref_vectors[n]) for n in ref_vectors)
    engine.save_checkpoint(str(tmp_path))
    fresh_model = _sn_model(api)
    fresh = zero3.initialize(fresh_model, torch.optim.AdamW(fresh_model.parameters(), lr=1e-2, eps=1e-6), cfg)
    fresh.load_checkpoint(str(tmp_path))
    loaded = _sn_vectors(fresh_model)
    assert all(loaded[n].dtype == torch_dtype and torch.equal(loaded[n], b) for n, b in vectors.items())
    x = torch.randn(16, 6, generator=g).to(torch_dtype)
    assert torch.equal(fresh(x), low(x))


class _LowerTriangular(nn.Module):
    """A user's parametrization with a buffer used beside the weight."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.register_buffer("mask", torch.tril(torch.ones(n, n)))

    def forward(self, w: torch.Tensor) -> torch.Tensor:
        return w * self.mask


@pytest.mark.parametrize("kind", ["orthogonal", "user"])
def test_every_buffer_of_a_parametrization_is_cast_with_its_weight(kind):
    """Orthogonal's ``base`` (a parametrization's buffer, used with the weight) stayed fp32 under bf16
    and the first forward raised in torch ("expected m1 and m2 to have the same dtype"), where
    ``model.bfloat16()`` runs (review 32RB); so did a user's parametrization's buffer. Each is cast as
    ``.to(dtype)`` casts it, and the loss (and, for the user's, the gradient) is torch's. (torch's
    orthogonal in bf16 gives NaN gradients: only its forward is compared.)"""
    if kind == "orthogonal":
        full, buffer = _sn_model("orthogonal"), "2.parametrizations.weight.0.base"
    else:
        torch.manual_seed(0)
        full, buffer = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 8), nn.Linear(8, 2)), \
            "2.parametrizations.weight.0.mask"
        torch.nn.utils.parametrize.register_parametrization(full[2], "weight", _LowerTriangular(8))
    model = copy.deepcopy(full)
    engine = zero3.initialize(model, torch.optim.SGD(model.parameters(), lr=0.0), {**NO_PERSIST, "dtype": "bf16"})
    assert dict(model.named_buffers())[buffer].dtype == torch.bfloat16
    low = copy.deepcopy(full).to(torch.bfloat16)
    x = torch.randn(16, 6, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    loss, ref = engine(x).float().square().mean(), low(x).float().square().mean()
    assert torch.equal(loss.detach(), ref.detach())
    assert torch.equal(dict(model.named_buffers())[buffer], dict(low.named_buffers())[buffer])
    if kind == "user":
        engine.backward(loss)
        ref.backward()
        original = "2.parametrizations.weight.original"
        assert torch.equal(zero3.safe_get_full_grad(dict(model.named_parameters())[original]),
                           dict(low.named_parameters())[original].grad.float())


@pytest.mark.parametrize("spelled, ds", [
    ("zero_optimization.contiguous_gradients", {"zero_optimization": {"stage": 3, "contiguous_gradients": "maybe"}}),
    ("zero_optimization.round_robin_gradients", {"zero_optimization": {"stage": 3, "round_robin_gradients": [1]}}),
    ("offload_optimizer.buffer_count", {"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu",
                                                                                                "buffer_count": "x"}}}),
    ("fp16.auto_cast", {"fp16": {"enabled": True, "auto_cast": 2}}),
])
def test_deepspeed_keys_without_effect_still_get_deepspeeds_type_checked(spelled, ds):
    """They were accepted with any value (a probe session): a value DeepSpeed refuses is a mistake."""
    with pytest.raises(ZeroConfigError, match=rf"{spelled} must be a (boolean|whole number >= 0) as DeepSpeed reads"):
        ZeroConfig.from_dict(ds)


@pytest.mark.parametrize("value", [True, 0, 1, "true", "Yes", "off", "auto", None])
def test_deepspeed_keys_without_effect_take_what_deepspeed_takes(value):
    """DeepSpeed's config models read booleans leniently and drop "auto" (HF templates write it)."""
    ZeroConfig.from_dict({"zero_optimization": {"stage": 3, "contiguous_gradients": value,
                                                "stage3_gather_16bit_weights_on_model_save": value,
                                                "offload_optimizer": {"device": "cpu", "buffer_count": 4.0}},
                          "aio": {"single_submit": value, "block_size": "1M"}})


def test_communication_data_type_is_read_in_any_case_as_deepspeed_reads_it():
    cfg = ZeroConfig.from_dict({"communication_data_type": "BF16", "zero_optimization": {"stage": 3}})
    assert cfg.precision.reduce_dtype == "bf16"


def _gan(g_dtype: str, d_dtype: str, g_power: int = 10, d_power: int = 4):
    """A generator and a discriminator, each its own engine, and plain copies in the engines' dtypes."""
    torch.manual_seed(0)
    G = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 8))
    D = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    dt = {"fp32": torch.float32, "fp16": torch.float16}
    ref_g, ref_d = copy.deepcopy(G).to(dt[g_dtype]), copy.deepcopy(D).to(dt[d_dtype])
    engines = []
    for model, dtype, power in ((G, g_dtype, g_power), (D, d_dtype, d_power)):
        cfg = {**NO_PERSIST, "dtype": dtype, **({"initial_scale_power": power} if dtype == "fp16" else {})}
        engines.append(zero3.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), cfg))
    return engines, ref_g, ref_d, dt


@pytest.mark.parametrize("g_dtype,d_dtype", [("fp16", "fp32"), ("fp32", "fp16"), ("fp16", "fp16")])
def test_a_backward_through_another_engines_model_gives_it_torchs_gradients(g_dtype, d_dtype):
    """A GAN's generator loss runs through the discriminator: ``eG.backward`` reaches D's parameters.
    An fp32 D used to keep G's loss scale in its gradients (1024 times torch's, stepped so by a loop
    that does not zero them), and an fp16 D refused the backward as not engine.backward's. Now each
    engine's gradient carries its own factor (precision.py [Note: a backward that crosses engines]):
    D's true gradient equals torch's of the same loss, and D steps on it."""
    (eG, eD), ref_g, ref_d, dt = _gan(g_dtype, d_dtype)
    z = torch.randn(4, 8)
    loss = eD(eG(z.to(dt[g_dtype])).to(dt[d_dtype])).float().mean()
    eG.backward(loss)
    # torch: the same loss, unscaled in fp32 parts; scaled by G's 1024 where G is fp16, as the engine does
    g_scale = 1024.0 if g_dtype == "fp16" else 1.0
    ref_loss = ref_d(ref_g(z.to(dt[g_dtype])).to(dt[d_dtype])).float().mean()
    (ref_loss * g_scale).backward()
    assert torch.equal(loss.detach(), ref_loss.detach())
    for p, r in zip(eD.params, ref_d.parameters()):
        want = r.grad.float() / g_scale
        torch.testing.assert_close(zero3.safe_get_full_grad(p), want, rtol=1e-3 if d_dtype == "fp16" else 1e-6,
                                   atol=1e-6, msg=p._zero.name)
    for p, r in zip(eG.params, ref_g.parameters()):
        torch.testing.assert_close(zero3.safe_get_full_grad(p), r.grad.float() / g_scale, rtol=1e-6, atol=0,
                                   msg=p._zero.name)
    before = [zero3.safe_get_full_fp32_param(p).clone() for p in eD.params]
    eG.step()
    assert eD.step()  # D steps on the gradient G's backward left it (no zero_grad between), as torch would
    for p, b, r in zip(eD.params, before, ref_d.parameters()):
        torch.testing.assert_close(zero3.safe_get_full_fp32_param(p), b - 0.1 * r.grad.float() / g_scale,
                                   rtol=1e-3 if d_dtype == "fp16" else 1e-6, atol=1e-6, msg=p._zero.name)


def test_a_backward_crossing_into_an_fp16_engine_after_its_clip_is_refused_and_loses_nothing():
    """Clipping unscaled D's window (its overflow check and norm taken); a generator backward crossing
    into D afterwards then joined the unscaled shards unchecked: an inf there stepped D's weights to
    inf where its own step would have been skipped. Refused now, like D's own backward after a clip."""
    (eG, eD), _, _, dt = _gan("fp16", "fp16", g_power=30)
    z = torch.randn(4, 8)
    eD.backward(eD(torch.randn(4, 8).half()).float().mean())
    zero3.clip_grad_norm_(eD, 1.0)
    kept = [zero3.safe_get_full_grad(p).clone() for p in eD.params]
    with pytest.raises(ZeroStateError, match=r"after clip_grad_norm_ unscaled this engine's gradients"):
        eG.backward(eD(eG(z.half())).float().mean())
    assert all(torch.equal(zero3.safe_get_full_grad(p), k) for p, k in zip(eD.params, kept))
    assert eD.step()
    assert all(torch.isfinite(zero3.safe_get_full_fp32_param(p)).all() for p in eD.params)


@pytest.mark.parametrize("scale_wrt_gas", [True, False])
def test_fp16_backward_carries_the_scale_over_the_accumulation_steps_as_deepspeeds(scale_wrt_gas):
    """Probe 36I: the fp16 backward carried the whole loss scale and the gradients were divided by
    the accumulation steps N only after the reduction, so its fp16 gradients were N times DeepSpeed's
    (whose engine.backward divides the loss by N before scaling it): a static scale that trains there
    overflowed at every step here, skipped in silence. A bias gradient of 4 per micro-batch under a
    static scale of 4096 and N = 4 carries 4096 (16384 unscaled by N) in fp16, not 16384 (65536: inf)."""
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    engine = zero3.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), {
        **NO_PERSIST, "dtype": "fp16", "loss_scale": 4096 if scale_wrt_gas else 1024, "gradient_accumulation_steps": 4})
    with zero3.GatheredParameters([model.bias]):
        bias = model.bias.detach().float().clone()
    carried = []
    handle = model.bias.register_hook(lambda g: carried.append(float(g)))
    for micro in range(4):
        engine.backward(engine(torch.ones(4, 4, dtype=torch.float16)).sum(), scale_wrt_gas=scale_wrt_gas)
        assert engine.step() == (micro == 3)
    handle.remove()
    assert carried == [4096.0] * 4  # DeepSpeed's: 4 * 4096 / 4, or 4 * 1024 without the division
    with zero3.GatheredParameters([model.bias]):  # mean gradient 4, or the sum 16 without scale_wrt_gas
        torch.testing.assert_close(model.bias.detach().float(), bias - 0.1 * (4.0 if scale_wrt_gas else 16.0),
                                   rtol=0, atol=1e-3)


def test_a_step_post_hook_that_raises_leaves_the_step_taken_in_the_bf16_shards():
    """Probe 36M: a raise from an optimizer step post-hook (after the update) skipped the cast of the
    stepped masters into the bf16 shards, so the next forward ran on the old weights."""
    runs = []
    for raising in (False, True):
        _, engine = pair("bf16")
        calls = []

        def hook(opt, args, kwargs):
            calls.append(1)
            if raising and len(calls) == 2:
                raise RuntimeError("a post-hook's error")

        engine.optimizer.register_step_post_hook(hook)
        losses = []
        for step in range(3):
            x, y = synthetic_batch(step, BATCH, CFG)
            loss = lossf(engine, x, y)
            losses.append(loss.item())
            engine.backward(loss)
            try:
                engine.step()
            except RuntimeError:
                assert raising and step == 1
                engine.zero_grad()  # the gradients stay after a raise, as torch's after its optimizer's
        runs.append((losses, masters_of(engine)))
    assert runs[0][0] == runs[1][0]
    assert all(torch.equal(runs[0][1][k], v) for k, v in runs[1][1].items())
