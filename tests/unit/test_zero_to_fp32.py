"""DeepSpeed's ``deepspeed.utils.zero_to_fp32`` over zero3 checkpoints (zero3/deepspeed/utils): the fp32
weights of a checkpoint without a model or an engine, in memory, loaded into a plain model, or written
in Hugging Face's layout (one file, or shards and an index)."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

import zero3
import zero3.deepspeed as deepspeed
from zero3.deepspeed.utils.zero_to_fp32 import (convert_zero_checkpoint_to_fp32_state_dict,
                                                get_fp32_state_dict_from_zero_checkpoint,
                                                load_state_dict_from_zero_checkpoint)


class _Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(32, 16)
        self.mid = nn.Linear(16, 16)
        self.norm = nn.BatchNorm1d(16)  # buffers
        self.head = nn.Linear(16, 32, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(torch.tanh(self.mid(self.emb(x)))))


def _trained(tmp_path, dtype: str, frozen: bool = False) -> tuple[zero3.Engine, dict[str, torch.Tensor]]:
    """Two steps in ``dtype``, saved under tags t1 and t2 (latest: t2); the fp32 masters at t2. With
    ``frozen``, ``mid`` is frozen and left out of the optimizer (as PEFT and the HF Trainer leave it)."""
    torch.manual_seed(0)
    model = _Tied()
    model.mid.requires_grad_(not frozen)
    engine = zero3.initialize(model, torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2,
                                                       eps=1e-6), {"param_persistence_threshold": 0, "dtype": dtype})
    g = torch.Generator().manual_seed(1)
    for tag in ("t1", "t2"):
        x = torch.randint(0, 32, (8,), generator=g)
        engine.backward(engine(x).float().logsumexp(-1).mean())
        engine.step()
        engine.save_checkpoint(tmp_path, tag=tag)
    masters = {n: zero3.safe_get_full_fp32_param(p).clone() for n, p in model.named_parameters()}
    return engine, masters


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_the_state_dict_holds_the_fp32_masters_and_buffers_under_every_name(tmp_path, dtype):
    engine, masters = _trained(tmp_path, dtype)
    sd = get_fp32_state_dict_from_zero_checkpoint(tmp_path)
    assert list(sd) == list(_Tied().state_dict())  # the model's keys, in its order, tied ones too
    for name, value in masters.items():
        assert sd[name].dtype == torch.float32 and torch.equal(sd[name], value), name
    assert sd["head.weight"] is sd["emb.weight"]  # tied: one tensor, as model.state_dict() gives it
    with zero3.GatheredParameters(list(engine.module.parameters())):
        assert torch.equal(sd["norm.running_mean"], engine.module.norm.running_mean)
    earlier = get_fp32_state_dict_from_zero_checkpoint(tmp_path, tag="t1")
    assert not torch.equal(earlier["mid.weight"], sd["mid.weight"])
    assert deepspeed.utils.zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint is \
        get_fp32_state_dict_from_zero_checkpoint  # the DeepSpeed spelling reaches it


def test_load_into_a_plain_model_and_refusals(tmp_path):
    engine, masters = _trained(tmp_path, "fp32")
    plain = _Tied()
    assert load_state_dict_from_zero_checkpoint(plain, tmp_path) is plain
    for name, p in plain.named_parameters():
        assert torch.equal(p.detach(), masters[name]), name
    with pytest.raises(ValueError, match="the model's parameters are partitioned by zero3.*engine.load_checkpoint"):
        load_state_dict_from_zero_checkpoint(engine.module, tmp_path)
    with pytest.raises(ValueError, match="lazy_mode=True: zero3 builds each full tensor once"):
        get_fp32_state_dict_from_zero_checkpoint(tmp_path, lazy_mode=True)
    with pytest.raises(ValueError, match="max_shard_size must be positive"):
        convert_zero_checkpoint_to_fp32_state_dict(tmp_path, tmp_path / "out", max_shard_size=0)


def _read_dir(out, safetensors: bool) -> tuple[dict[str, torch.Tensor], list[str]]:
    stem, suffix = ("model", ".safetensors") if safetensors else ("pytorch_model", ".bin")
    index = out / f"{stem}{suffix}.index.json"
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists() else [f"{stem}{suffix}"]
    merged: dict[str, torch.Tensor] = {}
    for f in files:
        merged.update(load_file(out / f) if safetensors else torch.load(out / f, weights_only=True))
    if index.exists():
        assert set(json.loads(index.read_text())["weight_map"]) == set(merged)  # every key, each in its file
    return merged, files


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("safetensors", [False, True], ids=["bin", "safetensors"])
@pytest.mark.parametrize("limit", ["5GB", 3000], ids=["one file", "shards"])
def test_convert_writes_hugging_face_s_layout(tmp_path, safetensors, limit, dtype):
    _trained(tmp_path / "ckpt", dtype)
    sd = get_fp32_state_dict_from_zero_checkpoint(tmp_path / "ckpt")
    written = convert_zero_checkpoint_to_fp32_state_dict(tmp_path / "ckpt", tmp_path / "out", max_shard_size=limit,
                                                         safe_serialization=safetensors)
    assert all(p.exists() for p in written)
    merged, files = _read_dir(tmp_path / "out", safetensors)
    assert (len(files) > 1) == (limit == 3000)  # the embedding alone is 2048 bytes
    expected = {k: v for k, v in sd.items() if not (safetensors and k == "head.weight")}  # an alias: in metadata
    assert set(merged) == set(expected)
    for k, v in expected.items():
        assert torch.equal(merged[k], v), k


def test_convert_to_a_file_path_writes_one_file_as_the_older_signature(tmp_path):
    _trained(tmp_path / "ckpt", "fp32")
    sd = get_fp32_state_dict_from_zero_checkpoint(tmp_path / "ckpt")
    [path] = convert_zero_checkpoint_to_fp32_state_dict(tmp_path / "ckpt", tmp_path / "lightning_model.pt", tag="t2")
    loaded = torch.load(path, weights_only=True)
    assert list(loaded) == list(sd) and all(torch.equal(loaded[k], sd[k]) for k in sd)


def test_convert_refuses_a_file_that_would_shadow_it_and_replaces_its_own_format_s(tmp_path):
    """Review 28Z2: a safetensors run, then a .bin run, left model.safetensors beside the new file, and
    Hugging Face's from_pretrained loads that one first: every weight stale. Deleting it instead
    (review 28Z3) deleted a user's export: now it is refused, and only this format's index and
    numbered files are replaced."""
    _trained(tmp_path / "ckpt", "fp32")
    out = tmp_path / "out"
    out.mkdir()
    (out / "config.json").write_text("{}")
    names = lambda: sorted(p.name for p in out.iterdir())  # noqa: E731
    convert_zero_checkpoint_to_fp32_state_dict(tmp_path / "ckpt", out, safe_serialization=True)
    with pytest.raises(ValueError, match=r"holds model.safetensors, which Hugging Face's from_pretrained loads before "
                                         r"the pytorch_model.bin this would write.*Nothing was written"):
        convert_zero_checkpoint_to_fp32_state_dict(tmp_path / "ckpt", out)
    assert names() == ["config.json", "model.safetensors"]
    (out / "model.safetensors").unlink()
    convert_zero_checkpoint_to_fp32_state_dict(tmp_path / "ckpt", out, max_shard_size=1200)
    many = [n for n in names() if "-of-" in n]
    convert_zero_checkpoint_to_fp32_state_dict(tmp_path / "ckpt", out, max_shard_size=3000)
    fewer = [n for n in names() if "-of-" in n]
    assert len(fewer) < len(many)  # the old numbered files the new index does not list are gone
    assert set(fewer) == set(json.loads((out / "pytorch_model.bin.index.json").read_text())["weight_map"].values())
    convert_zero_checkpoint_to_fp32_state_dict(tmp_path / "ckpt", out)  # one file: this format's index goes too
    assert names() == ["config.json", "pytorch_model.bin"]
    convert_zero_checkpoint_to_fp32_state_dict(tmp_path / "ckpt", out, safe_serialization=True)  # taken first
    assert names() == ["config.json", "model.safetensors", "pytorch_model.bin"]  # the other format stays


def test_the_older_signature_and_its_tag(tmp_path):
    """DeepSpeed before 0.14: (checkpoint_dir, output_file, tag=None, exclude_frozen_parameters=False). A
    tag passed third went into max_shard_size and was ignored, the latest tag written (review 28Z2);
    output_file= was a TypeError; a fourth True was read as safe_serialization (review 28Z4)."""
    _trained(tmp_path / "ckpt", "fp32", frozen=True)
    t1 = get_fp32_state_dict_from_zero_checkpoint(tmp_path / "ckpt", tag="t1")
    for kwargs, args in (({"output_file": tmp_path / "a.bin", "tag": "t1"}, ()), ({}, (tmp_path / "b.bin", "t1"))):
        [path] = convert_zero_checkpoint_to_fp32_state_dict(tmp_path / "ckpt", *args, **kwargs)
        loaded = torch.load(path, weights_only=True)
        assert list(loaded) == list(t1) and all(torch.equal(loaded[k], t1[k]) for k in t1)
    for target in ("c.bin", "c.safetensors"):
        [path] = convert_zero_checkpoint_to_fp32_state_dict(tmp_path / "ckpt", tmp_path / target, None, True)
        kept = set(load_file(path)) if target.endswith("safetensors") else set(torch.load(path, weights_only=True))
        assert kept == set(t1) - {"mid.weight", "mid.bias", "head.weight"} | (
            set() if target.endswith("safetensors") else {"head.weight"}), target  # the alias: in metadata
    with pytest.raises(ValueError, match=r"max_shard_size='1GB' with the output file .*a file is written whole"):
        convert_zero_checkpoint_to_fp32_state_dict(tmp_path / "ckpt", tmp_path / "m.bin", max_shard_size="1GB")
    with pytest.raises(TypeError, match=r"after the output file it takes tag, exclude_frozen_parameters by position"):
        convert_zero_checkpoint_to_fp32_state_dict(tmp_path / "ckpt", tmp_path / "m.bin", "t1", False, True)
    with pytest.raises(TypeError, match="give output_dir .* or output_file"):
        convert_zero_checkpoint_to_fp32_state_dict(tmp_path / "ckpt")
    for bad in (True, "abcGB", "nanGB", "infGB", 1.5e9, "-1GB", -5):
        with pytest.raises(ValueError, match=r"max_shard_size .*: give bytes as an int or a string ending in TB"):
            convert_zero_checkpoint_to_fp32_state_dict(tmp_path / "ckpt", tmp_path / "dir", max_shard_size=bad)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("in_optimizer", [False, True], ids=["left out of the optimizer", "given to it"])
def test_exclude_frozen_parameters_leaves_out_what_did_not_require_grad(tmp_path, dtype, in_optimizer, monkeypatch):
    """As DeepSpeed's: by requires_grad at the save, whatever the optimizer held (review 28Z3: the first
    version went by the saved param groups, which held a frozen parameter in fp32 and not in bf16)."""
    torch.manual_seed(0)
    model = _Tied()
    model.mid.requires_grad_(False)
    params = model.parameters() if in_optimizer else [p for p in model.parameters() if p.requires_grad]
    engine = zero3.initialize(model, torch.optim.AdamW(params, lr=1e-2), {"param_persistence_threshold": 0,
                                                                          "dtype": dtype})
    engine.backward(engine(torch.randint(0, 32, (8,))).float().logsumexp(-1).mean())
    engine.step()
    engine.save_checkpoint(tmp_path / "ckpt")
    whole = get_fp32_state_dict_from_zero_checkpoint(tmp_path / "ckpt")
    trained = get_fp32_state_dict_from_zero_checkpoint(tmp_path / "ckpt", exclude_frozen_parameters=True)
    assert set(whole) - set(trained) == {"mid.weight", "mid.bias"}
    out = convert_zero_checkpoint_to_fp32_state_dict(tmp_path / "ckpt", tmp_path / "out", exclude_frozen_parameters=True)
    assert set(torch.load(out[0], weights_only=True)) == set(trained)
    from zero3.checkpoint import consolidate as offline

    class _Older(offline.CheckpointReader):  # as a checkpoint saved before zero3 recorded requires_grad
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            self.params = {n: dataclasses.replace(pm, requires_grad=None) for n, pm in self.params.items()}

    monkeypatch.setattr(offline, "CheckpointReader", _Older)
    with pytest.raises(ValueError, match="was saved before zero3 recorded which parameters are frozen"):
        get_fp32_state_dict_from_zero_checkpoint(tmp_path / "ckpt", exclude_frozen_parameters=True)


def test_the_command_line_as_deepspeed_s_script(tmp_path, capsys):
    from zero3.deepspeed.utils.zero_to_fp32 import main

    _trained(tmp_path / "ckpt", "fp32")
    root = Path(zero3.__file__).resolve().parents[1]
    run = subprocess.run([sys.executable, "-m", "zero3.deepspeed.utils.zero_to_fp32", str(tmp_path / "ckpt"),
                          str(tmp_path / "cli")], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(root)})
    assert run.returncode == 0 and "wrote " in run.stdout and "Warning" not in run.stderr, run
    assert (tmp_path / "cli" / "pytorch_model.bin").exists()
    assert main([str(tmp_path / "ckpt"), str(tmp_path / "out"), "--safe_serialization", "-t", "t1"]) == 0
    assert "model.safetensors" in capsys.readouterr().out
    t1 = get_fp32_state_dict_from_zero_checkpoint(tmp_path / "ckpt", tag="t1")
    assert torch.equal(load_file(tmp_path / "out" / "model.safetensors")["mid.weight"], t1["mid.weight"])
    assert main([str(tmp_path / "missing"), str(tmp_path / "out")]) == 1
    assert "error: " in capsys.readouterr().err


def test_a_failure_halfway_leaves_the_directory_as_it_was(tmp_path, monkeypatch):
    """Review 28Z4: the index went first, so a failure left new shards beside another format's file,
    which Hugging Face then loaded, stale; the files are now staged and put in place at the end."""
    from zero3.checkpoint import consolidate as offline

    _trained(tmp_path / "ckpt", "fp32")
    out = tmp_path / "out"
    convert_zero_checkpoint_to_fp32_state_dict(tmp_path / "ckpt", out, max_shard_size=1200, tag="t1")
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    real, calls = offline._write_pt, []

    def failing(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise OSError("disk full")
        return real(*args, **kwargs)

    monkeypatch.setattr(offline, "_write_pt", failing)
    with pytest.raises(OSError, match="disk full"):
        convert_zero_checkpoint_to_fp32_state_dict(tmp_path / "ckpt", out, max_shard_size=1200)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


def test_zero3_s_loader_names_a_bin_index_instead_of_calling_it_corrupt(tmp_path):
    """Probe 28E: the .bin shards went to the safetensors header reader ("header length ... exceeds the
    file: truncated"); a CheckpointError, not CheckpointCorruptError (review 28Z5)."""
    from zero3 import CheckpointCorruptError, CheckpointError

    _trained(tmp_path / "ckpt", "fp32")
    convert_zero_checkpoint_to_fp32_state_dict(tmp_path / "ckpt", tmp_path / "out", max_shard_size=1200)
    torch.manual_seed(0)
    with zero3.Init():
        model = _Tied()
    with pytest.raises(CheckpointError, match=r"an index of pytorch_model.bin shards, not of safetensors files.*"
                                              r"safe_serialization=True") as caught:
        zero3.pretrained.load_state_dict(model, tmp_path / "out" / "pytorch_model.bin.index.json")
    assert not isinstance(caught.value, CheckpointCorruptError)
