"""Embeddings whose forward or gradient zero3's sharding cannot carry are refused at ``initialize``
(runtime/refusals.py `refuse_unshardable_embeddings`), before it changes anything: ``sparse=True``
(sparse gradients used to fail inside the reduction: "reshape is not implemented for sparse
tensors") and ``max_norm`` (its in-place renormalization of the gathered copy was lost, and training
differed from torch's by 2.7 after two steps on 2 ranks, silently; FSDP2 differed the same)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import zero3
from zero3 import ZeroConfigError


def _model(**embedding: object) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(20, 8, **embedding), nn.Linear(8, 2))


@pytest.mark.parametrize("embedding, message", [
    ({"sparse": True}, r"0 \(Embedding\) has sparse=True.*Build it with sparse=False"),
    ({"max_norm": 1.0}, r"0 \(Embedding\) has max_norm=1.0.*renormalization would be lost"),
])
def test_an_unshardable_embedding_is_refused_before_anything_changes(embedding, message):
    model = _model(**embedding)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with pytest.raises(ZeroConfigError, match=message):
        zero3.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), {"param_persistence_threshold": 0})
    assert not any(zero3.is_partitioned(p) for p in model.parameters())
    assert all(torch.equal(before[n], p) for n, p in model.named_parameters())
    bag = nn.EmbeddingBag(20, 8, **embedding)
    with pytest.raises(ZeroConfigError, match="EmbeddingBag"):
        zero3.initialize(bag, torch.optim.SGD(bag.parameters(), lr=0.1))


def test_a_plain_embedding_with_padding_trains_as_in_torch():
    ref, model = _model(padding_idx=0), _model(padding_idx=0)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    engine = zero3.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), {"param_persistence_threshold": 0})
    for step in range(2):
        x = torch.randint(0, 20, (3, 5), generator=torch.Generator().manual_seed(step))
        engine.backward(engine(x).pow(2).mean())
        engine.step()
        ref(x).pow(2).mean().backward()
        ref_opt.step()
        ref_opt.zero_grad()
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(zero3.safe_get_full_fp32_param(p), q.detach(), rtol=0, atol=1e-6)
    engine.remove_hooks()


class _FunctionalSparse(nn.Module):
    """A sparse lookup in a module's own forward: no nn.Embedding for initialize to see."""

    def __init__(self) -> None:
        super().__init__()
        self.table = nn.Parameter(torch.randn(20, 8))
        self.out = nn.Linear(8, 2)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.out(nn.functional.embedding(idx, self.table, sparse=True))


def test_a_sparse_gradient_from_a_functional_lookup_is_refused_naming_the_parameter():
    """Before: 'reshape is not implemented for sparse tensors' from inside zero3's reduction."""
    model = _FunctionalSparse()
    engine = zero3.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), {"param_persistence_threshold": 0})
    with pytest.raises(zero3.ZeroStateError, match=r"table got a torch.sparse_coo gradient.*sparse=False"):
        engine.backward(engine(torch.tensor([1, 2, 3])).sum())


class _FunctionalMaxNorm(nn.Module):
    """``F.embedding(..., max_norm=)`` on the module's own parameter: not refused (nothing cheap sees
    the renormalization, docs/api.md); ``in_forward=False`` leaves it to the caller."""

    def __init__(self, in_forward: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.table = nn.Parameter(torch.randn(12, 4) * 2)
        self.out = nn.Linear(4, 2)
        self.max_norm = 1.0 if in_forward else None

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.out(nn.functional.embedding(idx, self.table, max_norm=self.max_norm).mean(1))


def _renorm(table: torch.Tensor, idx: torch.Tensor) -> None:
    with torch.no_grad():  # what F.embedding(max_norm=1.0) does to the rows it looks up
        torch.embedding_renorm_(table, idx.reshape(-1), 1.0, 2.0)


@pytest.mark.parametrize("way", ["persistent at world 1", "renormalized inside GatheredParameters"])
def test_the_documented_ways_to_a_functional_max_norm_train_as_torch(way):
    """With a non-persistent table the renormalization of the gathered copy was lost: row norms 6.4
    against torch's 1.0, 3.9 off after 3 SGD steps (probe 32O). The two ways docs/api.md gives."""
    ref, model = _FunctionalMaxNorm(True), _FunctionalMaxNorm(way.startswith("persistent"))
    threshold = 10**6 if way.startswith("persistent") else 0
    engine = zero3.initialize(model, torch.optim.SGD(model.parameters(), lr=0.5), {"param_persistence_threshold": threshold})
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    for step in range(3):
        idx = torch.randint(0, 12, (3, 5), generator=torch.Generator().manual_seed(step))
        if model.max_norm is None:
            with zero3.GatheredParameters([model.table], modifier_rank=0):
                _renorm(model.table, idx)
        engine.backward(engine(idx).pow(2).mean())
        engine.step()
        ref(idx).pow(2).mean().backward()
        ref_opt.step()
        ref_opt.zero_grad()
    table = zero3.safe_get_full_fp32_param(model.table)
    assert ref.table.detach().norm(dim=1).max() < 1.01 and torch.equal(table, ref.table.detach())


class _Complex(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(8, 6, dtype=torch.complex64))
        self.out = nn.Linear(12, 2)


def test_a_complex_parameter_is_refused_by_init_and_initialize():
    """Before: its gradient lost its imaginary part on 2 ranks (torch only warned: 0.02 away from
    torch after one SGD step) and save_checkpoint raised KeyError: 'torch.complex64'."""
    model = _Complex()
    before = model.w.detach().clone()
    with pytest.raises(ZeroConfigError, match=r"parameter w is complex.*view_as_complex.*changed nothing"):
        zero3.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1))
    assert not zero3.is_partitioned(model.w) and torch.equal(model.w, before)
    with pytest.raises(ZeroConfigError, match=r"parameter _Complex.w is complex"):
        with zero3.Init():
            _Complex()


class _Sparse(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.eye(4).to_sparse())
        self.out = nn.Linear(4, 2)


def test_a_sparse_parameter_is_refused_by_init_and_initialize():
    """Review 29Z1: initialize failed inside torch ("reshape is not implemented for sparse tensors")."""
    model = _Sparse()
    with pytest.raises(ZeroConfigError, match=r"parameter w is a torch.sparse_coo tensor.*dense.*changed nothing"):
        zero3.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1))
    assert not zero3.is_partitioned(model.w) and not zero3.is_partitioned(model.out.weight)
    with pytest.raises(ZeroConfigError, match=r"parameter _Sparse.w is a torch.sparse_coo tensor"):
        with zero3.Init():
            _Sparse()
