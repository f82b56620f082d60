"""initialize's broadcast of adopted parameters is bucketed: few collectives for many parameters."""

from __future__ import annotations

import torch
from torch import nn

from zero3.runtime import adopt


def test_many_small_parameters_share_a_bucket_per_dtype_and_a_big_one_goes_alone(monkeypatch):
    monkeypatch.setattr(adopt, "BUCKET_NUMEL", 100)
    small = [nn.Parameter(torch.zeros(10)) for _ in range(25)]  # 250 elements: 3 buckets of <= 100
    half = [nn.Parameter(torch.zeros(10, dtype=torch.bfloat16)) for _ in range(3)]
    big = nn.Parameter(torch.zeros(500))
    buckets = adopt._buckets(small[:12] + [big] + small[12:] + half)
    assert [len(b) for b in buckets] == [10, 2, 1, 10, 3, 3]
    assert all(sum(p.numel() for p in b) <= 100 or len(b) == 1 for b in buckets)
    assert [p for b in buckets if b[0].dtype == torch.float32 for p in b] == small[:12] + [big] + small[12:]
