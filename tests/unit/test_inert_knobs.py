"""A knob that the rest of the config makes unread is refused, naming it and what it needs, or, where
DeepSpeed's own templates carry it (so refusing would break them), said in the log: never accepted
and dropped without a word."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

import zero3
from zero3 import ZeroConfig, ZeroConfigError
from zero3.runtime.init import _effective_config


@pytest.mark.parametrize("knobs, match", [
    ({"max_live_bytes": 10**9, "max_live_parameters": 10}, r"max_live_parameters=10 is not used beside max_live_bytes"),
    ({"max_live_bytes": 10**9, "max_reuse_distance_bytes": 8, "max_reuse_distance": 5},
     r"max_reuse_distance=5 is not used beside max_reuse_distance_bytes=8"),
    ({"max_live_bytes": 10**9, "prefetch_bucket_bytes": 8, "prefetch_bucket_size": 5},
     r"prefetch_bucket_size=5 is not used beside prefetch_bucket_bytes=8"),
    ({"dtype": "bf16", "loss_scale": 128}, r"loss_scale=128.*dtype='bf16' scales no loss"),
    ({"hysteresis": 5, "min_loss_scale": 2}, r"hysteresis=5, min_loss_scale=2.*dtype='fp32'"),
    ({"quantized_gradient_bits": 4}, r"quantized_gradient_bits=4 applies only with zero_quantized_gradients"),
    ({"quantization_block_size": 64}, r"quantization_block_size=64 applies only with zero_quantized_weights"),
    ({"zero_quantized_gradients": True, "reduce_dtype": "bf16"}, r"reduce_dtype='bf16'.*not used with zero_quantized"),
])
def test_a_knob_the_rest_of_the_config_leaves_unread_is_refused(knobs, match):
    with pytest.raises(ZeroConfigError, match=match):
        ZeroConfig(**knobs)


@pytest.mark.parametrize("d, match", [
    ({"bf16": {"enabled": True}, "zero_optimization": {"stage": 3, "loss_scale": 128}}, r"loss_scale=128"),
    ({"dtype": "fp16", "fp16": {"enabled": False, "loss_scale": 128}}, r"dtype='fp16' contradicts fp16.enabled=false"),
    ({"dtype": "bf16", "bfloat16": {"enabled": False}}, r"dtype='bf16' contradicts bfloat16.enabled=false"),
    ({"communication_data_type": "bf16", "zero_optimization": {"stage": 3, "zero_quantized_gradients": True}},
     r"reduce_dtype='bf16' \(DeepSpeed's communication_data_type\)"),
])
def test_deepspeed_dicts_with_unread_keys_are_refused(d, match):
    with pytest.raises(ZeroConfigError, match=match):
        ZeroConfig.from_dict(d)


def test_what_is_read_or_at_its_default_is_accepted():
    assert ZeroConfig(max_live_bytes=1024, max_reuse_distance=17).budget.max_reuse_distance == 17  # 4 bytes each
    assert ZeroConfig(dtype="fp16", loss_scale=128).precision.loss_scale == 128
    assert ZeroConfig(dtype="fp16", hysteresis=5).precision.hysteresis == 5
    assert ZeroConfig(zero_quantized_weights=True, quantization_block_size=64).comm.quantization_block_size == 64
    # DeepSpeed's templates: a disabled fp16 section with its scaling keys beside bf16; the defaults
    # of the nvme pool keys beside device cpu; static fp16 with the template's dynamic defaults
    cfg = ZeroConfig.from_dict({"bf16": {"enabled": True}, "fp16": {"enabled": False, "loss_scale": 0,
                                                                    "loss_scale_window": 1000, "hysteresis": 7}})
    assert cfg.precision.dtype == "bf16" and cfg.precision.hysteresis == 2
    cfg = ZeroConfig.from_dict({"zero_optimization": {"stage": 3, "offload_param": {
        "device": "cpu", "buffer_count": 5, "buffer_size": 1e8, "max_in_cpu": 1e9}}})
    assert cfg.offload.offload_param == "cpu"
    cfg = ZeroConfig.from_dict({"fp16": {"enabled": True, "loss_scale": 512, "initial_scale_power": 16,
                                         "loss_scale_window": 1000, "hysteresis": 2, "min_loss_scale": 1}})
    assert cfg.precision.loss_scale == 512


@pytest.mark.parametrize("d, said", [
    ({"fp16": {"enabled": True, "loss_scale": 1024, "hysteresis": 7, "loss_scale_window": 500}},
     "loss_scale_window=500, hysteresis=7: dynamic loss scaling, but loss_scale=1024.0 selects a static scale"),
    ({"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu", "buffer_count": 4, "max_in_cpu": 0}}},
     "offload_param_buffer_count=4, offload_param_max_in_cpu=0: read only with offload_param='nvme' (got "
     "offload_param='cpu')"),
])
def test_unread_keys_templates_carry_are_said_once(d, said, caplog, monkeypatch):
    """Megatron-DeepSpeed's fp16 templates keep the dynamic keys beside a static scale, and a template
    switched from nvme to cpu keeps its pool keys: refusing would stop them, so they are said."""
    monkeypatch.setattr("zero3.config.sections._WARNED", set())
    with caplog.at_level(logging.WARNING, logger="zero3"):
        cfg = ZeroConfig.from_dict(d)
        cfg.replace(gradient_clipping=1.0)  # a copy of the same config does not say it again
    assert caplog.text.count(said) == 1, caplog.text


def test_bf16_beside_a_disabled_bfloat16_section_is_bf16():
    assert ZeroConfig.from_dict({"bf16": {"enabled": True}, "bfloat16": {"enabled": False}}).precision.dtype == "bf16"


def test_init_off_the_drive_drops_the_drive_pool_settings_of_an_nvme_config(tmp_path):
    cfg = {"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": str(tmp_path),
                                                               "buffer_count": 3, "max_in_cpu": 0}}}
    mine, device = _effective_config(cfg, "cpu")
    assert device == "cpu" and mine.offload.offload_param == "none"
    assert mine.offload.offload_param_buffer_count == 5 and mine.offload.offload_param_max_in_cpu == 10**9
    mine, device = _effective_config(cfg, None)
    assert device == "nvme" and mine.offload.offload_param_buffer_count == 3


def test_pin_memory_with_nothing_offloaded_is_said(caplog):
    with caplog.at_level(logging.INFO, logger="zero3"):
        ZeroConfig.from_dict({"zero_optimization": {"stage": 3, "offload_param": {"device": "none",
                                                                                  "pin_memory": True}}})
    assert "offload_param.pin_memory has no effect with device 'none'" in caplog.text


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))


def _train(cfg: dict, steps: int = 1) -> zero3.Engine:
    model = _model()
    engine = zero3.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), cfg)
    for _ in range(steps):
        engine.backward(engine(torch.randn(2, 16)).sum())
        engine.step()
    return engine


def test_sub_group_size_where_the_step_takes_every_parameter_at_once_is_said(caplog, tmp_path):
    with caplog.at_level(logging.WARNING, logger="zero3"):
        _train({"sub_group_size": 100})
    assert "sub_group_size=100 has no effect here" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="zero3"):  # streamed from the drive: read, nothing said
        _train({"sub_group_size": 100, "offload_optimizer": "nvme", "offload_optimizer_nvme_path": str(tmp_path)})
    assert "sub_group_size" not in caplog.text


def test_nvme_offload_that_keeps_every_shard_in_memory_is_said(caplog, tmp_path):
    nvme = {"offload_param": "nvme", "offload_param_nvme_path": str(tmp_path), "param_persistence_threshold": 0}
    with caplog.at_level(logging.WARNING, logger="zero3"):
        engine = _train(nvme)
    assert "every parameter shard of this rank (340 elements) stays in CPU memory" in caplog.text
    assert engine.last_step_metrics.nvme_read_bytes == 0
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="zero3"):  # every parameter persistent: that is the reason
        _train({**nvme, "param_persistence_threshold": 10**6, "offload_param_max_in_cpu": 0})
    assert "every parameter is persistent" in caplog.text and "set max_in_cpu" not in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="zero3"):
        engine = _train({**nvme, "offload_param_max_in_cpu": 0})
    assert "stays in CPU memory" not in caplog.text and engine.last_step_metrics.nvme_read_bytes > 0


def test_partition_activations_without_model_parallelism_is_said(caplog):
    try:
        with caplog.at_level(logging.WARNING, logger="zero3"):
            zero3.checkpointing.configure(None, partition_activations=True)
        assert "partition_activations with no model parallelism (no mpu)" in caplog.text
    finally:
        zero3.checkpointing.configure(None)


def test_steps_per_print_logs_deepspeed_s_progress_line(caplog):
    with caplog.at_level(logging.INFO, logger="zero3.engine"):
        engine = _train({"steps_per_print": 2}, steps=4)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("zero3: step=")]
    assert lines == ["zero3: step=2, skipped=0, lr=[0.1]", "zero3: step=4, skipped=0, lr=[0.1]"]
    assert engine.global_steps == 4


def test_a_disabled_bf16_beside_an_enabled_bfloat16_section_is_refused():
    """Probe 36K2: taken as bf16, where DeepSpeed reads the bf16 section alone and trains in fp32."""
    with pytest.raises(ZeroConfigError, match=r"bf16\.enabled is false and bfloat16\.enabled .* is true"):
        ZeroConfig.from_dict({"bf16": {"enabled": False}, "bfloat16": {"enabled": True}})


@pytest.mark.parametrize("value", [0.0, 1.0])
def test_a_bool_key_written_as_a_float_is_refused_naming_the_float(value):
    """Probe 36K2: 0.0 was turned into the int 0 first, and the refusal named a value the file did not hold."""
    with pytest.raises(ZeroConfigError, match=rf"overlap_comm must be a bool, got {value} \(float\)"):
        ZeroConfig.from_dict({"zero_optimization": {"stage": 3, "overlap_comm": value}})
