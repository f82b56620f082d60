"""Hugging Face's ``resize_token_embeddings`` on a model built under ``zero3.Init`` (runtime/gathered.py
[Note: a new shape before initialize]): inside ``GatheredParameters(..., modifier_rank=0)`` over the
embeddings, before ``zero3.initialize``, the parameters are partitioned anew with their new shape and
train on 2 gloo ranks as the plain model resized the same way does; after ``initialize`` it is refused
and changes nothing; inside the Init block (where HF's assignment would lose the new values) it is
refused naming the way that works. Before, each of these failed with an unrelated shape error."""

from __future__ import annotations

import contextlib

import os

import pytest

os.environ["HF_HUB_OFFLINE"] = "1"
transformers = pytest.importorskip("transformers")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import zero3  # noqa: E402
from _reference import twins  # noqa: E402

pytestmark = pytest.mark.multiproc

VOCAB, NEW_VOCAB = 100, 120


def _gpt2(tied: bool = True) -> torch.nn.Module:
    cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=32, resid_pdrop=0.0,
                                  embd_pdrop=0.0, attn_pdrop=0.0, tie_word_embeddings=tied,
                                  bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(cfg)


def _embeddings(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    return [model.get_input_embeddings().weight, model.get_output_embeddings().weight]


def resize_and_train(tied: bool) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    ref, model = twins(lambda: _gpt2(tied))
    rng = torch.get_rng_state()
    ref.resize_token_embeddings(NEW_VOCAB, mean_resizing=False)
    torch.set_rng_state(rng)  # the new rows are drawn from the same state on both sides, on rank 0:
    if rank != 0:  # the other ranks draw others, so equal values need rank 0's broadcast (modifier_rank=0)
        torch.manual_seed(1000 + rank)
    with zero3.GatheredParameters(_embeddings(model), modifier_rank=0):
        model.resize_token_embeddings(NEW_VOCAB, mean_resizing=False)
    shapes = [tuple(p.shape) for p in _embeddings(model)]
    wte = model.get_input_embeddings().weight  # an untied lm_head is a new plain module: initialize partitions it
    shard_numels = [wte.ds_tensor.numel(), tuple(wte.ds_shape)]
    engine = zero3.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-6),
                              {"param_persistence_threshold": 0})  # adopts rank 0's values of a new plain lm_head
    with zero3.GatheredParameters(list(model.parameters())):
        same_values = all(torch.equal(p, r) for p, r in zip(model.parameters(), ref.parameters()))
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, eps=1e-6)
    losses, ref_losses = [], []
    for step in range(3):
        g = torch.Generator().manual_seed(step)
        ids = torch.randint(0, NEW_VOCAB, (2 * world, 8), generator=g)  # new tokens included
        mine = ids[2 * rank:2 * rank + 2]
        loss = engine(mine, labels=mine).loss
        engine.backward(loss)
        engine.step()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item() / world)
        ref_loss = sum(ref(ids[2 * r:2 * r + 2], labels=ids[2 * r:2 * r + 2]).loss for r in range(world)) / world
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        ref_losses.append(ref_loss.item())
    worst = max((zero3.safe_get_full_fp32_param(p) - r.detach()).abs().max().item()
                for p, r in zip(model.parameters(), ref.parameters()))
    engine.remove_hooks()
    return {"shapes": shapes, "shard_numels": shard_numels, "same_values": same_values, "losses": losses,
            "ref_losses": ref_losses, "vocab": model.config.vocab_size, "worst": worst}


@pytest.mark.parametrize("tied", [True, False])
def test_resize_before_initialize_trains_as_the_plain_model(pools, tied):
    for r in pools.get(2).run(resize_and_train, tied, timeout=180):
        assert r["shapes"] == [(NEW_VOCAB, 32)] * 2 and r["vocab"] == NEW_VOCAB, r
        assert r["shard_numels"] == [NEW_VOCAB * 32 // 2, (NEW_VOCAB, 32)], r
        assert r["same_values"], r
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(r["ref_losses"]), rtol=1e-5, atol=0)
        assert r["worst"] < 1e-5, r["worst"]  # the last step's update too


def refused_after_initialize() -> dict:
    ref, model = twins(_gpt2)
    engine = zero3.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-6),
                              {"param_persistence_threshold": 0})
    out: dict = {"errors": []}
    head = model.get_output_embeddings()
    for block in (zero3.GatheredParameters(_embeddings(model), modifier_rank=0), contextlib.nullcontext()):
        try:
            with block:
                model.resize_token_embeddings(NEW_VOCAB, mean_resizing=False)
        except zero3.ZeroStateError as exc:
            out["errors"].append(str(exc))
    out["shape"] = tuple(model.get_input_embeddings().weight.shape)
    # transformers' own bookkeeping too (probe 37G: the refusal came after it had set the vocabulary size
    # and, for an untied head, built a new output embedding that never trained)
    out["hf"] = (model.config.vocab_size, model.get_input_embeddings().num_embeddings,
                 model.get_output_embeddings() is head)
    with zero3.GatheredParameters(list(model.parameters())):
        out["same_values"] = all(torch.equal(p, r) for p, r in zip(model.parameters(), ref.parameters()))
    ids = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(0))
    engine.backward(engine(ids, labels=ids).loss)
    engine.step()
    engine.remove_hooks()
    return out


def test_resize_after_initialize_is_refused_and_changes_nothing(pools):
    for r in pools.get(2).run(refused_after_initialize, timeout=180):
        assert len(r["errors"]) == 2, r
        for error in r["errors"]:
            assert "resize_token_embeddings after zero3.initialize" in error and "before zero3.initialize" in error \
                and "nothing was changed" in error, r
        assert r["shape"] == (VOCAB, 32) and r["same_values"] and r["hf"] == (VOCAB, VOCAB, True), r


def test_resize_inside_the_init_block_is_refused_naming_the_way_that_works():
    with pytest.raises(zero3.ZeroStateError, match=r"resize_token_embeddings.*Resize after the Init block"):
        with zero3.Init():
            model = _gpt2()
            model.resize_token_embeddings(NEW_VOCAB, mean_resizing=False)


def test_resize_without_modifier_rank_is_refused_and_the_parameter_keeps_its_shape():
    ref, model = twins(_gpt2)
    with pytest.raises(zero3.ZeroStateError, match=r"without modifier_rank.*modifier_rank=0\):` after the zero3.Init"):
        with zero3.GatheredParameters(_embeddings(model)):
            model.resize_token_embeddings(NEW_VOCAB, mean_resizing=False)
    with pytest.raises(zero3.ZeroStateError, match=r"while transformer.wte.weight is partitioned.*modifier_rank=0"):
        model.resize_token_embeddings(NEW_VOCAB, mean_resizing=False)  # the guard said only 'used by to'
    assert model.config.vocab_size == model.get_input_embeddings().num_embeddings == VOCAB
    wte = model.get_input_embeddings().weight
    assert tuple(wte.shape) == tuple(wte.ds_shape) == (VOCAB, 32)
    with zero3.GatheredParameters([wte]):
        assert torch.equal(wte, ref.get_input_embeddings().weight)


def test_a_resize_that_changes_nothing_is_let_through_and_one_after_remove_hooks_is_refused_before_it_changes_anything():
    """No size or the current size: transformers returns the embedding as it is, and the up-front refusal
    refused those calls too (review 37R3). After remove_hooks the block's exit still refuses a new shape, so
    the call is refused up front as after initialize (it had left config.vocab_size and the head changed)."""
    _, model = twins(_gpt2)
    for size, pad in ((None, None), (VOCAB, None), (VOCAB - 2, 4)):  # VOCAB - 2 rounds up to VOCAB
        assert model.resize_token_embeddings(size, pad_to_multiple_of=pad) is model.get_input_embeddings()
    engine = zero3.initialize(model, None)
    model.resize_token_embeddings()
    engine.remove_hooks()
    head = model.get_output_embeddings()
    with pytest.raises(zero3.ZeroStateError, match=r"resize_token_embeddings after zero3.initialize.*nothing was changed"):
        with zero3.GatheredParameters(_embeddings(model), modifier_rank=0):
            model.resize_token_embeddings(NEW_VOCAB, mean_resizing=False)
    assert model.config.vocab_size == model.get_input_embeddings().num_embeddings == VOCAB
    assert model.get_output_embeddings() is head
