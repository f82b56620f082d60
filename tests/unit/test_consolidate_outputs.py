"""`zero3.consolidate` of a world-1 checkpoint: what the ``.pt`` and ``.safetensors`` outputs hold of
the optimizer (non-tensor state, parameters excluded as frozen) and of dtypes ``torch.save`` writes
through an untyped storage (probe 35C)."""

from __future__ import annotations

import json

import torch
from safetensors import safe_open
from torch import nn

import zero3
from zero3.checkpoint.consolidate import consolidate


class _Counting(torch.optim.SGD):
    """SGD keeping a step count as a Python int, as transformers' Adafactor keeps its step."""

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    self.state[p]["count"] = self.state[p].get("count", 0) + 1
        return super().step(closure)


def _saved(tmp_path, optimizer_cls=torch.optim.Adam, freeze_first=False) -> str:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    model.register_buffer("rope", torch.polar(torch.ones(3), torch.arange(3.0)))
    model.register_buffer("f8", torch.tensor([0.5, 1.0, -2.0]).to(torch.float8_e4m3fn))
    model.register_buffer("u16", torch.tensor([1, 2, 60000], dtype=torch.uint16))
    engine = zero3.initialize(model, optimizer_cls(model.parameters(), lr=1e-2),
                              {"param_persistence_threshold": 0, "zero_allow_untested_optimizer": True})
    for step in range(3):
        if step == 2 and freeze_first:
            model[0].weight.requires_grad_(False)
        engine.backward(engine(torch.randn(4, 6)).pow(2).mean())
        engine.step()
    engine.save_checkpoint(str(tmp_path), tag="t")
    return str(tmp_path)


def test_parameters_excluded_as_frozen_leave_the_optimizer_state_and_groups_too(tmp_path):
    """Before: the ``.pt`` kept ``0.weight``'s entry, every tensor None, and its name in the groups."""
    ckpt = _saved(tmp_path, freeze_first=True)
    out = torch.load(consolidate(ckpt, tmp_path / "o.pt", exclude_frozen=True, include_optimizer=True),
                     weights_only=True)
    assert "0.weight" not in out["model"] and sorted(out["optimizer"]["state"]) == ["0.bias", "2.bias", "2.weight"]
    assert all(v is not None for state in out["optimizer"]["state"].values() for v in state.values())
    assert [g["params"] for g in out["optimizer"]["param_groups"]] == [["0.bias", "2.weight", "2.bias"]]
    with safe_open(consolidate(ckpt, tmp_path / "o.safetensors", exclude_frozen=True, include_optimizer=True),
                   "pt") as f:
        groups = json.loads(f.metadata()["zero3_optimizer"])["param_groups"]
        assert not any(k.startswith("optimizer/0.weight/") for k in f.keys())
    assert [g["params"] for g in groups] == [["0.bias", "2.weight", "2.bias"]]


def test_state_that_is_no_tensor_goes_into_both_outputs(tmp_path):
    """Before: the ``.safetensors`` output left a Python-number state out without a word."""
    ckpt = _saved(tmp_path, _Counting)
    out = torch.load(consolidate(ckpt, tmp_path / "o.pt", include_optimizer=True), weights_only=True)
    assert {name: s["count"] for name, s in out["optimizer"]["state"].items()} == dict.fromkeys(
        ["0.weight", "0.bias", "2.weight", "2.bias"], 3)
    with safe_open(consolidate(ckpt, tmp_path / "o.safetensors", include_optimizer=True), "pt") as f:
        values = json.loads(f.metadata()["zero3_optimizer_values"])
    assert {name: v["count"] for name, v in values.items()} == dict.fromkeys(["0.weight", "0.bias", "2.weight", "2.bias"], 3)


def test_dtypes_torch_saves_through_untyped_storage_are_written_to_pt(tmp_path):
    """Before: complex64, float8 and uint16 were refused ("cannot write dtype ... to a .pt file"), which
    torch.save writes (the first through its typed storage, the others as bytes and a dtype)."""
    ckpt = _saved(tmp_path)
    pt = torch.load(consolidate(ckpt, tmp_path / "o.pt"), weights_only=True)
    with safe_open(consolidate(ckpt, tmp_path / "o.safetensors"), "pt") as f:
        for key in ("rope", "f8", "u16"):
            ref = f.get_tensor(key)
            assert pt[key].dtype == ref.dtype and torch.equal(pt[key].view(torch.uint8), ref.view(torch.uint8))
