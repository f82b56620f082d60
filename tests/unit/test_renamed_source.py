"""`zero3.pretrained.RenamedSource`: a checkpoint read under other key names (how `zero3.from_pretrained`
applies transformers' renamings), loaded into a model built under `zero3.Init` at world size 1."""

from __future__ import annotations

import torch
from torch import nn

import zero3
from zero3.checkpoint.pretrained import RenamedSource, match_keys, open_source


def test_renamed_keys_load_and_report_missing_and_unexpected_under_the_new_names():
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))
    state = {f"base.{k}": v for k, v in plain.state_dict().items()}
    state["base.extra"] = torch.ones(2)
    with zero3.Init():
        model = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))
    names = {k.removeprefix("base."): k for k in state if k != "base.1.bias"}
    source = RenamedSource(open_source(state), names)
    assert source.shape("0.weight") == (3, 4) and open_source(source) is source
    assert match_keys(model, source) == (["1.bias"], ["extra"])
    assert zero3.pretrained.load_state_dict(model, source, strict=False) == (["1.bias"], ["extra"])
    for name, p in model.named_parameters():
        if name != "1.bias":
            with zero3.GatheredParameters([p]):
                assert torch.equal(p, plain.get_parameter(name)), name
