"""`CommSettings`: the communicator's settings, built in one place from a `ZeroConfig`, frozen and validated;
and a world-size-1 `Communicator` built from them (every collective is local)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from zero3 import ZeroConfig, ZeroConfigError
from zero3.comm.communicator import Communicator, GradPiece, Kind, Tag
from zero3.comm.settings import CommSettings
from zero3.comm.verify import EpochMode
from zero3.metrics import StepMetrics


def test_from_config_maps_the_flat_fields():
    cfg = ZeroConfig(overlap_comm=False, allgather_bucket_size=1234, reduce_scatter_impl="all_reduce",
                     allgather_impl="p2p", verify_collectives=True, collective_timeout=7.5, max_traces=3,
                     zero_quantized_weights=True, zero_quantized_gradients=True, quantized_gradient_bits=4,
                     quantization_block_size=64, zero_hpz_partition_size=2)
    c = CommSettings.from_config(cfg)
    assert c == CommSettings(overlap=False, bucket_numel=1234, reduce_impl="all_reduce", allgather_impl="p2p",
                           verify=True, timeout_s=7.5, plans=8, quantize_weights=True, quantize_gradients=4,
                           quant_block=64, hpz_partition_size=2)


def test_from_config_without_own_group_sends_exact_values_on_the_callers_group():
    cfg = ZeroConfig(zero_quantized_weights=True, zero_quantized_gradients=True, zero_hpz_partition_size=-1)
    c = CommSettings.from_config(cfg, own_group=False)
    assert (c.timeout_s, c.quantize_weights, c.quantize_gradients, c.hpz_partition_size) == (0.0, False, 0, 1)
    assert CommSettings.from_config(ZeroConfig()).quantize_gradients == 0  # bits only when qgZ is on


def test_model_parallel_settings_block_and_verify_like_the_data_parallel_ones():
    c = CommSettings.model_parallel(ZeroConfig(verify_collectives=False, collective_timeout=9.0))
    assert (c.overlap, c.verify, c.timeout_s, c.plans) == (False, False, 9.0, 4)


@pytest.mark.parametrize("change", [{"reduce_impl": "ring"}, {"allgather_impl": "tree"}, {"quantize_gradients": 2},
                                    {"quant_block": 0}, {"timeout_s": -1.0}, {"hpz_partition_size": 0}])
def test_invalid_settings_are_refused(change):
    with pytest.raises(ZeroConfigError):
        CommSettings(**change)


def test_config_is_frozen_and_normalised():
    c = CommSettings(bucket_numel=0, plans=0, timeout_s=3)
    assert (c.bucket_numel, c.plans, c.timeout_s) == (1, 1, 3.0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.overlap = False  # type: ignore[misc]


def test_world_of_one_is_local_and_counts_nothing():
    metrics = StepMetrics()
    comm = Communicator(None, CommSettings(), metrics=metrics, world_size=1, rank=0)
    assert (comm.hpz, comm.secondary_span, comm.mode, comm.verify) == (1, 1, EpochMode.IDLE, False)
    g = torch.arange(6.0)
    out = comm.reduce_grads([GradPiece(6, 6, g, counted=True)], torch.float32, torch.device("cpu"),
                            Tag(Kind.GRAD_REDUCE, "test")).wait()
    assert out.tolist() == g.tolist() + [1.0]
    t = torch.ones(3)
    assert comm.all_reduce(t, Tag(Kind.ALL_REDUCE)) is t
    assert comm.exchange_objects({"a": 1}, Tag(Kind.OBJECTS)) == [{"a": 1}]
    assert metrics.recv_bytes == {} and metrics.reduce_calls == 1


@pytest.mark.parametrize("name, config, cuda, want", [
    ("gloo", "cpu:gloo,cuda:gloo", False, "gloo"),
    ("nccl", "cuda:nccl", True, "nccl"),
    ("undefined", "cpu:gloo,cuda:nccl", True, "nccl"),  # init_process_group() on a CUDA machine
    ("undefined", "cpu:gloo,cuda:nccl", False, "gloo"),
    ("undefined", "cpu:gloo", False, "gloo"),  # init_process_group() in a CPU-only torch
    ("cpu:gloo", "cpu:gloo", True, "gloo"),  # new_group(backend="cpu:gloo")
])
def test_a_group_of_one_backend_per_device_is_the_backend_its_tensors_meet(monkeypatch, name, config, cuda, want):
    from zero3.comm import process_group

    monkeypatch.setattr(process_group.dist, "get_backend", lambda group=None: name)
    monkeypatch.setattr(process_group.dist, "get_backend_config", lambda group=None: config)
    monkeypatch.setattr(process_group.torch.cuda, "is_available", lambda: cuda)
    assert process_group.backend_of(None) == want
