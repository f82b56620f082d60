"""A module's extra state (``get_extra_state``/``set_extra_state``, the ``<prefix>._extra_state`` key of
``state_dict()``: Transformer Engine's FP8 metadata, a counter) goes where torch's ``state_dict`` takes
it: into ``consolidated_state_dict``, the checkpoint (``save_checkpoint``/``load_checkpoint``), the
offline consolidator's ``.pt``, and back through ``zero3.pretrained.load_state_dict``. zero3 dropped
it everywhere, so a resumed run started from the freshly built value and a consolidated state dict
failed a strict ``load_state_dict``. Checked at world size 1 against plain torch.
"""

from __future__ import annotations

import io
import json
import logging
from typing import Any

import pytest
import torch
from torch import nn

import zero3
from _reference import snapshot
from zero3.checkpoint import save as save_module
from zero3.checkpoint.consolidate import main as consolidate_main
from zero3.errors import CheckpointMismatchError

STEPS = 3


class Counted(nn.Module):
    """A linear layer with extra state that changes every forward, as FP8 metadata does: a call count
    and the running amax of its inputs."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.calls = 0
        self.amax = torch.zeros(())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        self.amax = torch.maximum(self.amax, x.detach().abs().max())
        return self.lin(x)

    def get_extra_state(self) -> Any:
        return {"calls": self.calls, "amax": self.amax.clone()}

    def set_extra_state(self, state: Any) -> None:
        self.calls = state["calls"]
        self.amax = state["amax"].clone()


class Plain(nn.Module):
    """`Counted`'s parameters without extra state."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)


class Net(nn.Module):
    """Extra state on a submodule and on the root (key ``_extra_state``, a tuple), beside a buffer."""

    def __init__(self, inner: type[nn.Module] = Counted) -> None:
        super().__init__()
        self.a = inner()
        self.out = nn.Linear(4, 1)
        self.register_buffer("scale", torch.ones(1))
        self.version = 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.version += 1
        return self.out(self.a(x)) * self.scale

    def get_extra_state(self) -> Any:
        return ("version", self.version)

    def set_extra_state(self, state: Any) -> None:
        self.version = state[1]


def _batch(step: int) -> torch.Tensor:
    return torch.randn(2, 4, generator=torch.Generator().manual_seed(step)) * (step + 1)


def make_engine(inner: type[nn.Module] = Counted) -> zero3.Engine:
    torch.manual_seed(0)
    with zero3.Init():
        model = Net(inner)
    return zero3.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-2),
                            {"param_persistence_threshold": 0})


def train(engine: zero3.Engine) -> None:
    for step in range(STEPS):
        loss = engine(_batch(step)).sum()
        engine.backward(loss)
        engine.step()


def make_reference() -> Net:
    """Plain torch, trained as `train` trains the engine."""
    torch.manual_seed(0)
    ref = Net()
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    for step in range(STEPS):
        ref(_batch(step)).sum().backward()
        opt.step()
        opt.zero_grad()
    return ref


def assert_same(a: Any, b: Any, where: str = "") -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and list(a) == list(b), where
        for k in a:
            assert_same(a[k], b[k], f"{where}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """(checkpoint directory, trained engine, reference), the engine saved after `STEPS` steps."""
    root = tmp_path_factory.mktemp("ckpt")
    engine = make_engine()
    train(engine)
    engine.save_checkpoint(root, tag="s")
    return root, engine, make_reference()


def test_consolidated_state_dict_holds_torchs_extra_state_and_loads_strictly(trained):
    _, engine, ref = trained
    sd = engine.consolidated_state_dict()
    expected = ref.state_dict()
    assert list(sd) == list(expected) == ["scale", "_extra_state", "a._extra_state", "a.lin.weight", "a.lin.bias",
                                          "out.weight", "out.bias"]
    assert_same(sd["a._extra_state"], {"calls": STEPS, "amax": expected["a._extra_state"]["amax"]})
    assert_same(sd["_extra_state"], ("version", 1 + STEPS))
    plain = Net()
    plain.load_state_dict(sd)  # strict
    assert_same(plain.state_dict(), expected)


def test_save_and_load_checkpoint_restore_extra_state(trained, tmp_path, monkeypatch):
    root, _, ref = trained
    meta = json.loads((root / "s" / "metadata.json").read_text())
    assert list(meta["extra_state"]) == ["_extra_state", "a._extra_state"]
    for load in ({}, {"load_module_only": True}, {"load_optimizer_states": False}):
        engine = make_engine()
        assert engine.module.a.calls == 0
        engine.load_checkpoint(root, "s", **load)
        assert engine.module.a.calls == STEPS and engine.module.version == 1 + STEPS, load
        assert torch.equal(engine.module.a.amax, ref.a.amax), load
        train(engine)  # training goes on from the loaded value
        assert engine.module.a.calls == 2 * STEPS

    # a checkpoint saved before extra state was (no "extra_state" in its metadata) loads as before
    build = save_module._build_metadata
    monkeypatch.setattr(save_module, "_build_metadata",
                        lambda *a: {k: v for k, v in build(*a).items() if k != "extra_state"})
    trained[1].save_checkpoint(tmp_path, tag="old")
    engine = make_engine()
    engine.load_checkpoint(tmp_path, "old")
    assert engine.module.a.calls == 0


def test_checkpoint_extra_state_of_no_module_with_set_extra_state_is_refused_before_loading(trained, tmp_path):
    engine = make_engine(Plain)
    before = snapshot(engine)
    with pytest.raises(CheckpointMismatchError, match="extra state of no module of the model that defines "
                                                      "set_extra_state: a._extra_state"):
        engine.load_checkpoint(trained[0], "s")
    assert engine.module.version == 1
    assert_same(snapshot(engine), before)
    engine.save_checkpoint(tmp_path, tag="plain")  # and the other way, as torch's strict load_state_dict
    with pytest.raises(CheckpointMismatchError, match="extra state missing from the checkpoint: a._extra_state"):
        make_engine().load_checkpoint(tmp_path, "plain")


def test_unstorable_extra_state_fails_the_save_naming_its_key(tmp_path, monkeypatch):
    engine = make_engine()
    monkeypatch.setattr(Counted, "get_extra_state", lambda self: {"fn": print})
    with pytest.raises(TypeError, match=r"extra state 'a._extra_state'\['fn'\]: cannot store a "
                                        "builtin_function_or_method"):
        engine.save_checkpoint(tmp_path, tag="bad")
    assert not (tmp_path / "bad").exists() and not (tmp_path / "latest").exists()


def test_extra_state_held_in_a_bytesio_round_trips_through_a_checkpoint(tmp_path, monkeypatch):
    """Older Transformer Engine layers return their FP8 metadata as an io.BytesIO that torch.save
    wrote; the save refused it (a BytesIO was not storable)."""
    def as_buffer(self: Counted) -> io.BytesIO:
        buf = io.BytesIO()
        torch.save({"calls": self.calls, "amax": self.amax.clone()}, buf)
        return buf

    def from_buffer(self: Counted, buf: io.BytesIO) -> None:
        buf.seek(0)
        state = torch.load(buf, weights_only=True)
        self.calls, self.amax = state["calls"], state["amax"]

    monkeypatch.setattr(Counted, "get_extra_state", as_buffer)
    monkeypatch.setattr(Counted, "set_extra_state", from_buffer)
    engine = make_engine()
    train(engine)
    engine.save_checkpoint(tmp_path, tag="buffered")
    resumed = make_engine()
    resumed.load_checkpoint(tmp_path, "buffered")
    assert resumed.module.a.calls == STEPS and torch.equal(resumed.module.a.amax, engine.module.a.amax)


def test_offline_consolidation_pt_holds_extra_state_and_safetensors_warns(trained, tmp_path, caplog):
    root, _, ref = trained
    assert consolidate_main([str(root), str(tmp_path / "full.pt")]) == 0
    sd = torch.load(tmp_path / "full.pt", weights_only=True)
    assert_same(sd, ref.state_dict())
    Net().load_state_dict(sd)  # strict
    with caplog.at_level(logging.WARNING, logger="zero3"):
        consolidate_main([str(root), str(tmp_path / "full.safetensors")])
    assert "leaves out the extra state of _extra_state, a._extra_state" in caplog.text


def test_pretrained_load_state_dict_sets_extra_state_and_reports_it_missing(trained):
    ref = trained[2]
    engine = make_engine()
    assert zero3.pretrained.load_state_dict(engine, ref.state_dict()) == ([], [])
    assert engine.module.a.calls == STEPS and engine.module.version == 1 + STEPS
    assert_same(engine.consolidated_state_dict(), ref.state_dict())

    without = {k: v for k, v in ref.state_dict().items() if k != "a._extra_state"}
    with pytest.raises(CheckpointMismatchError, match=r"missing keys: a\._extra_state\. Nothing was loaded"):
        zero3.pretrained.load_state_dict(make_engine(), without)
    fresh = make_engine()
    assert zero3.pretrained.load_state_dict(fresh, without, strict=False) == (["a._extra_state"], [])
    assert fresh.module.a.calls == 0 and fresh.module.version == 1 + STEPS
    plain = make_engine(Plain)  # torch's rule: extra state for a module without set_extra_state is unexpected
    with pytest.raises(CheckpointMismatchError, match=r"unexpected keys: a\._extra_state"):
        zero3.pretrained.load_state_dict(plain, ref.state_dict())
