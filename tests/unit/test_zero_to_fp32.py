"""DeepSpeed's ``deepspeed.utils.zero_to_fp32`` over zero3 checkpoints (zero3/deepspeed/utils): the fp32
weights of a checkpoint without a model or an engine, in memory, loaded into a plain model, or written
in Hugging Face's layout (one file, or shards and an index)."""

from __future__ import annotations

import json

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


def _trained(tmp_path, dtype: str) -> tuple[zero3.Engine, dict[str, torch.Tensor]]:
    """Two steps in ``dtype``, saved under tags t1 and t2 (latest: t2); the fp32 masters at t2."""
    torch.manual_seed(0)
    model = _Tied()
    engine = zero3.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-6),
                              {"param_persistence_threshold": 0, "dtype": dtype})
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
    with pytest.raises(ValueError, match="exclude_frozen_parameters=True: a zero3 checkpoint does not record"):
        get_fp32_state_dict_from_zero_checkpoint(tmp_path, exclude_frozen_parameters=True)
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


@pytest.mark.parametrize("safetensors", [False, True], ids=["bin", "safetensors"])
@pytest.mark.parametrize("limit", ["5GB", 3000], ids=["one file", "shards"])
def test_convert_writes_hugging_face_s_layout(tmp_path, safetensors, limit):
    _trained(tmp_path / "ckpt", "fp32")
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
