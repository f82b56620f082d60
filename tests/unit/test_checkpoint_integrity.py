"""metadata.json's checksum, recorded in the rank files (integrity.py [Note: metadata checksum]): an
edited metadata.json is refused by a load and by the offline consolidation, naming the file; a
checkpoint of format version 1 (without the checksum) still loads, with a warning. A ``latest`` file
that names no tag is refused; optimizer state saved under another precision config loads in the
dtype of the masters it updates."""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
from pathlib import Path

import pytest
import torch
from torch import nn

import zero3
from _reference import snapshot
from zero3.checkpoint import format as ck
from zero3.checkpoint.consolidate import main as consolidate_main
from zero3.checkpoint.integrity import STAMP_KEY


def make_engine(seed: int = 0) -> zero3.Engine:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    return zero3.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-3), {"param_persistence_threshold": 0})


def step(engine: zero3.Engine) -> None:
    engine.backward(engine(torch.ones(2, 16)).square().mean())
    engine.step()


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("ckpt")
    engine = make_engine()
    step(engine)
    step(engine)
    engine.save_checkpoint(root, tag="step2")
    return root


def _edit(root: Path, change) -> None:
    m = root / "step2" / "metadata.json"
    meta = json.loads(m.read_text())
    change(meta)
    m.write_text(json.dumps(meta, indent=1))


def _lr(meta):
    meta["optimizer"]["param_groups"][0]["lr"] = 0.0


def _steps(meta):
    meta["global_steps"] = 3


def _rename(meta):
    meta["client_statex"] = meta.pop("client_state")


EDITS = {"lr": _lr, "global_steps": _steps, "renamed key": _rename}


@pytest.mark.parametrize("case", sorted(EDITS))
def test_edited_metadata_is_refused_naming_it_and_the_engine_is_unchanged(saved, tmp_path, case):
    root = Path(shutil.copytree(saved, tmp_path / "ckpt"))
    _edit(root, EDITS[case])
    engine = make_engine(seed=1)
    step(engine)
    before, steps, lr = snapshot(engine), engine.global_steps, engine.get_lr()
    with pytest.raises(ck.CheckpointCorruptError) as info:
        engine.load_checkpoint(root)
    msg = str(info.value)
    assert "metadata.json" in msg and "does not match the checksum" in msg and "rank_00000-of-00001" in msg, msg
    after = snapshot(engine)
    assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)
    assert engine.global_steps == steps and engine.get_lr() == lr
    with pytest.raises(ck.CheckpointCorruptError, match="metadata.json"):
        consolidate_main([str(root), str(tmp_path / "full.pt")])


def test_an_unedited_copy_loads(saved, tmp_path):
    root = Path(shutil.copytree(saved, tmp_path / "ckpt"))
    engine = make_engine(seed=1)
    engine.load_checkpoint(root)
    assert engine.global_steps == 2


def _unstamp(root: Path, version: int) -> None:
    """Make ``root`` look as a zero3 without the checksum wrote it: no stamp, plain file sha256."""
    tag = root / "step2"
    meta = json.loads((tag / "metadata.json").read_text())
    for f in meta["files"]:
        path = tag / f["file"]
        data = path.read_bytes()
        n = int.from_bytes(data[:8], "little")
        header = json.loads(data[8: 8 + n])
        del header["__metadata__"][STAMP_KEY]
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (8 + n - 8 - len(raw))  # same length: the data offsets stay
        data = data[:8] + raw + data[8 + n:]
        path.write_bytes(data)
        f["sha256"] = hashlib.sha256(data).hexdigest()
    meta["format_version"] = version
    (tag / "metadata.json").write_text(json.dumps(meta, indent=1))


def test_a_version_1_checkpoint_without_the_checksum_loads_with_a_warning(saved, tmp_path, caplog):
    root = Path(shutil.copytree(saved, tmp_path / "ckpt"))
    _unstamp(root, version=1)
    engine = make_engine(seed=1)
    with caplog.at_level(logging.WARNING, logger="zero3"):
        engine.load_checkpoint(root)
    assert engine.global_steps == 2
    assert any("metadata.json is not verified" in r.getMessage() for r in caplog.records)


def test_a_version_2_checkpoint_without_the_checksum_is_refused(saved, tmp_path):
    root = Path(shutil.copytree(saved, tmp_path / "ckpt"))
    _unstamp(root, version=2)
    with pytest.raises(ck.CheckpointCorruptError, match="carries no checksum of the metadata"):
        make_engine(seed=1).load_checkpoint(root)


def test_claiming_version_1_does_not_skip_the_check(saved, tmp_path):
    root = Path(shutil.copytree(saved, tmp_path / "ckpt"))
    _edit(root, lambda meta: meta.update(format_version=1, global_steps=7))
    with pytest.raises(ck.CheckpointCorruptError, match="does not match the checksum"):
        make_engine(seed=1).load_checkpoint(root)


def test_a_rank_file_of_another_save_is_refused(saved, tmp_path):
    root = Path(shutil.copytree(saved, tmp_path / "ckpt"))
    engine = make_engine()
    step(engine)
    engine.save_checkpoint(tmp_path / "other", tag="step2")  # same model and tag, another step
    name = "rank_00000-of-00001.safetensors"
    shutil.copy(tmp_path / "other" / "step2" / name, root / "step2" / name)
    with pytest.raises(ck.CheckpointCorruptError, match="does not match the checksum"):
        make_engine(seed=1).load_checkpoint(root, verify=False)


@pytest.mark.parametrize("content", ["\n", "../step2", ".step2.old", "latest"])
def test_a_latest_file_that_names_no_tag_is_refused_naming_it_and_the_tags_there(saved, tmp_path, content):
    """Written by hand or truncated: before, an empty one read as tag '' (an error about
    ``CKPT/metadata.json``) and a path was followed."""
    root = tmp_path / "ckpt"
    shutil.copytree(saved, root)
    (root / "latest").write_text(content)
    engine = make_engine(seed=1)
    step(engine)
    before = snapshot(engine)
    with pytest.raises(zero3.CheckpointNotFoundError, match=r"latest: names no checkpoint .*pass a tag .*tags "
                                                            r"with metadata here: \['step2'\]\)"):
        engine.load_checkpoint(root)
    after = snapshot(engine)
    assert sorted(before) == sorted(after) and all(torch.equal(before[k], after[k]) for k in before)
    engine.load_checkpoint(root, tag="step2")  # the checkpoint itself is fine


_PURE_BF16, _BF16_MASTERS, _FP32 = "pure bf16", "bf16 with fp32 masters", "fp32"


def _precision_engine(kind: str) -> zero3.Engine:
    """Pure bf16: built in bf16 under Init with an fp32 config (no masters, bf16 moments)."""
    cfg = {"param_persistence_threshold": 0, **({"bf16": {"enabled": True}} if kind == _BF16_MASTERS else {})}
    torch.manual_seed(0)
    with zero3.Init(dtype=torch.bfloat16) if kind == _PURE_BF16 else zero3.Init(config_dict_or_path=cfg):
        model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    return zero3.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-6), cfg)


def _precision_step(engine: zero3.Engine) -> None:
    x = torch.ones(2, 16, dtype=engine.module[0].weight.dtype)
    engine.backward(engine(x).float().square().mean())
    engine.step()


@pytest.mark.parametrize("saved_as, loaded_as", [(_PURE_BF16, _BF16_MASTERS), (_BF16_MASTERS, _PURE_BF16),
                                                 (_PURE_BF16, _FP32), (_FP32, _PURE_BF16)])
def test_optimizer_state_saved_in_another_precision_loads_in_the_masters_dtype(tmp_path, saved_as, loaded_as):
    """The moments come back in the dtype of the masters they update, as torch's load_state_dict
    casts them; before, a fresh engine kept the saved dtype and its first step raised in torch.
    Loaded fresh or into an engine that has stepped (its own tensors, cast into), the next steps agree."""
    engine = _precision_engine(saved_as)
    _precision_step(engine)
    engine.save_checkpoint(tmp_path, tag="t")
    fresh, warm = _precision_engine(loaded_as), _precision_engine(loaded_as)
    _precision_step(warm)
    for e in (fresh, warm):
        e.load_checkpoint(tmp_path, tag="t")
        for p in e.module.parameters():
            state = e.optimizer_state(p)
            assert state["exp_avg"].dtype == state["exp_avg_sq"].dtype == e.master_shard(p).dtype
        _precision_step(e)
        _precision_step(e)
    for p, q in zip(fresh.module.parameters(), warm.module.parameters()):
        assert torch.equal(fresh.master_shard(p), warm.master_shard(q))


class _HalfMomentum(torch.optim.Optimizer):
    """SGD with momentum kept in bf16 and an int32 step count: state of other dtypes than the weights'."""

    def __init__(self, params, lr: float = 0.1) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["m"] = torch.zeros_like(p, dtype=torch.bfloat16)
                    state["n"] = torch.zeros_like(p, dtype=torch.int32)
                state["m"].mul_(0.9).add_(p.grad.to(torch.bfloat16))
                state["n"].add_(1)
                p.add_(state["m"].float(), alpha=-group["lr"])


def test_a_load_makes_new_floating_state_in_the_masters_dtype_and_reuses_an_engine_s_own(tmp_path):
    """A fresh engine gets floating state in the masters' dtype (torch's load_state_dict casts it so)
    and integer state as saved; one that has stepped gets the values in its own tensors (their dtype,
    and on NVMe their swap regions' size). Both resume."""
    def build() -> zero3.Engine:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
        return zero3.initialize(model, _HalfMomentum(model.parameters()),
                                {"param_persistence_threshold": 0, "zero_allow_untested_optimizer": True})

    engine = build()
    step(engine)
    engine.save_checkpoint(tmp_path, tag="t")
    fresh, warm = build(), build()
    step(warm)
    for e, momentum in ((fresh, torch.float32), (warm, torch.bfloat16)):
        e.load_checkpoint(tmp_path, tag="t")
        state = e.optimizer_state(e.params[0])
        assert (state["m"].dtype, state["n"].dtype) == (momentum, torch.int32)
        assert torch.equal(state["m"].float(), engine.optimizer_state(engine.params[0])["m"].float())
        step(e)
