"""metadata.json's checksum, recorded in the rank files (integrity.py [Note: metadata checksum]): an
edited metadata.json is refused by a load and by the offline consolidation, naming the file; a
checkpoint of format version 1 (without the checksum) still loads, with a warning."""

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
