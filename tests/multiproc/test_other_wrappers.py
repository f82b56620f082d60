"""torch.distributed's other wrappers beside zero3 (probe 38F): a DTensor model is refused up front (it
was reported as a collective timeout and closed zero3's group), a one-dimensional DeviceMesh stands for
its group, and DDP, FSDP2 and torch's DCP state-dict helpers reading a partitioned model are refused
naming themselves and what works instead (the message named a 'detach' the user never wrote)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

import zero3

pytestmark = pytest.mark.multiproc

CFG = {"param_persistence_threshold": 0}


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


def dtensor_model() -> str:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    model = _mlp()
    parallelize_module(model, init_device_mesh("cpu", (dist.get_world_size(),)),
                       {"0": ColwiseParallel(), "2": RowwiseParallel()})
    try:
        zero3.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), CFG)
    except zero3.ZeroConfigError as exc:
        return str(exc)
    return "accepted"


def test_a_dtensor_model_is_refused_naming_the_parameter(pools):
    for said in pools.get(2).run(dtensor_model):
        assert "parameter 0.weight is a DTensor" in said and "mpu=" in said and "changed nothing" in said, said


def mesh_groups() -> list[str]:
    from torch.distributed.device_mesh import init_device_mesh
    world, out = dist.get_world_size(), []
    mesh = init_device_mesh("cpu", (world,))
    with zero3.Init(group=mesh, config=CFG):
        built = _mlp()
    engine = zero3.initialize(built, torch.optim.SGD(built.parameters(), lr=0.1), CFG, group=mesh)
    x = torch.randn(4, 8)
    engine.backward(engine(x).square().mean())
    engine.step()
    out.append(f"world {engine.world_size}")
    engine.remove_hooks()
    two = init_device_mesh("cpu", (1, world), mesh_dim_names=("pp", "dp"))
    try:
        zero3.initialize(_mlp(), None, CFG, group=two)
    except zero3.ZeroConfigError as exc:
        out.append(str(exc))
    return out


def test_a_one_dimensional_device_mesh_stands_for_its_group_and_a_wider_one_is_refused(pools):
    for said in pools.get(2).run(mesh_groups):
        assert said[0] == "world 2", said
        assert "2-dimensional DeviceMesh (1, 2)" in said[1] and 'mesh["dp"].get_group()' in said[1], said


def wrapped(how: str) -> str:
    model = _mlp()
    zero3.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), CFG)
    try:
        if how == "ddp":
            torch.nn.parallel.DistributedDataParallel(model)
        else:
            from torch.distributed.checkpoint.state_dict import get_model_state_dict
            get_model_state_dict(model)
    except zero3.ZeroStateError as exc:
        return str(exc)
    return "accepted"


@pytest.mark.parametrize("how,words", [
    ("ddp", "torch's DistributedDataParallel wrapping the zero3 model reads every parameter"),
    ("dcp", "torch.distributed.checkpoint reading the zero3 model's state dict reads every parameter"),
])
def test_torch_s_wrappers_reading_a_partitioned_model_are_refused_naming_themselves(pools, how, words):
    for said in pools.get(2).run(wrapped, how):
        assert words in said and "GatheredParameters" not in said, said


def ddp_student() -> str:
    """A DDP-wrapped plain student whose forward misuses a zero3 teacher's weight (distillation)."""
    teacher = _mlp()
    zero3.initialize(teacher, None, CFG)

    class Student(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, x):
            return torch.nn.functional.linear(self.lin(x), teacher[0].weight.t())

    student = torch.nn.parallel.DistributedDataParallel(Student())
    try:
        student(torch.randn(2, 8))
    except zero3.ZeroStateError as exc:
        return str(exc)
    return "accepted"


def test_a_ddp_wrapped_model_beside_a_zero3_one_gets_the_advice_for_the_zero3_model(pools):
    """Review 38R4: any DDP frame on the stack made the refusal say the zero3 model was wrapped in DDP."""
    for said in pools.get(2).run(ddp_student):
        assert "DistributedDataParallel" not in said and "register_external_parameter" in said, said
