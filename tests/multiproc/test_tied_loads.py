"""Loads on 2 ranks of what a rank alone sees differently, or what is no zero3 checkpoint at all.

A state dict naming one tied parameter twice with values that differ only in one rank's slice: that
rank alone finds the difference, and every rank refuses it, naming both keys, with nothing changed
(probe 38C F2: the first name's values loaded silently; torch keeps the last name's). A directory of
weight files without a zero3 checkpoint is refused on every rank, not "no checkpoint yet" (F5).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from _reference import snapshot
from gpt import GPT, GPTConfig

import zero3

pytestmark = pytest.mark.multiproc

CFG = GPTConfig(block_size=16, n_layer=2, n_embd=32, n_head=2)


def _engine(seed: int) -> zero3.Engine:
    torch.manual_seed(seed)
    with zero3.Init():
        model = GPT(CFG)
    return zero3.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-3),
                            {"param_persistence_threshold": 0})


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def tied_loads() -> dict:
    torch.manual_seed(0)
    sd = GPT(CFG).state_dict()  # wte.weight and lm_head.weight: one tensor
    engine = _engine(seed=1)
    p = engine.module.wte.weight
    start, end = p._zero.shard_range()
    last_rank = end >= p._zero.numel  # the last element lies in this rank's slice only
    before = snapshot(engine)
    bad = dict(sd)
    bad["lm_head.weight"] = sd["wte.weight"].clone()
    bad["lm_head.weight"].view(-1)[-1] += 1
    said = None
    try:
        zero3.pretrained.load_state_dict(engine, bad)
    except zero3.CheckpointMismatchError as exc:
        said = str(exc)
    untouched = _same(snapshot(engine), before)
    equal = dict(sd)
    equal["lm_head.weight"] = sd["wte.weight"].clone()  # the same values under both names: loads
    result = zero3.pretrained.load_state_dict(engine, equal)
    loaded = engine.consolidated_state_dict(rank0_only=False)
    return {"said": said, "untouched": untouched, "last_rank": last_rank, "result": tuple(result),
            "loaded": all(torch.equal(loaded[k], v) for k, v in sd.items())}


def test_tied_names_that_differ_in_one_ranks_slice_are_refused_on_every_rank_naming_both(pools):
    results = pools.get(2).run(tied_loads, timeout=120)
    assert [r["last_rank"] for r in results] == [False, True]
    for rank, r in enumerate(results):
        assert r["said"] is not None, rank
        assert "wte.weight and lm_head.weight, names of one tied parameter of the model, with different values" in \
            r["said"], (rank, r["said"])
        assert "Nothing was loaded" in r["said"], r["said"]
        assert r["untouched"], rank
        assert r["result"] == ([], []) and r["loaded"], rank
    assert "[raised on rank 1]" in results[0]["said"]  # rank 0 learned it from rank 1


def weight_dir_load(root: str) -> dict:
    engine = _engine(seed=2)
    before, steps = snapshot(engine), engine.global_steps
    if dist.get_rank() == 0:
        torch.save(GPT(CFG).state_dict(), f"{root}/pytorch_model.bin")
    dist.barrier()
    try:
        engine.load_checkpoint(root)
        said = None
    except zero3.CheckpointError as exc:
        said = f"{type(exc).__name__}: {exc}"
    return {"said": said, "untouched": _same(snapshot(engine), before) and engine.global_steps == steps}


def test_a_directory_of_weights_is_refused_on_every_rank(pools, tmp_path):
    results = pools.get(2).run(weight_dir_load, str(tmp_path), timeout=120)
    for rank, r in enumerate(results):
        assert r["said"] is not None and r["said"].startswith("CheckpointError: "), (rank, r["said"])
        assert "weight files (pytorch_model.bin)" in r["said"] and "pretrained.load_state_dict" in r["said"], r["said"]
        assert r["untouched"], rank
