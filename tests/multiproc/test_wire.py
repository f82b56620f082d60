"""Bytes on the wire, hpZ, qwZ and qgZ on 4 gloo ranks laid out as 2 nodes x 2 ranks.

The ranks run in one machine's pool; each sets torchrun's ``GROUP_RANK`` (rank // 2) before the
engine is built, which is all zero3 reads to tell nodes apart (topology.py). The real launch, two
torchrun agents, is tests/multiproc/test_multinode.py.

Every step's bytes are checked three ways: zero3's own counts (``last_step_metrics.recv_bytes``),
an independent count of what torch.distributed received from each peer (tests/_wire.py), and the
formulas: an all-gather of a parameter of n elements brings (W - 1) / W * n * 4 bytes to each rank,
(L - 1) / W of it from its own node and (W - L) / W from the other (W = 4 ranks, L = 2 per node); a
gather from hpZ's secondary slices brings (L - 1) / L * n * 4, all of it from the own node; a
gradient reduction brings (W - 1) / W * n * 4.
"""

from __future__ import annotations

import os
from collections import Counter

import pytest
import torch
import torch.distributed as dist
from torch import nn

import zero3
from zero3.metrics import VERIFICATION

from _wire import BASE, Net, measure, numels

pytestmark = pytest.mark.multiproc

W, L = 4, 2  # ranks, ranks per node
STEPS = 3


def train(extra: dict) -> dict:
    """`measure` with this rank's node set the way torchrun would: GROUP_RANK = rank // L."""
    rank = dist.get_rank()
    saved = {k: os.environ.get(k) for k in ("GROUP_RANK", "LOCAL_WORLD_SIZE")}
    os.environ.update(GROUP_RANK=str(rank // L), LOCAL_WORLD_SIZE=str(L))
    try:
        return measure({**BASE, **extra}, STEPS)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _scoped(independent: dict, rank: int) -> dict[str, int]:
    """Bytes by scope from bytes by global peer (node = rank // L)."""
    out = Counter()
    for peer, n in independent.items():
        out["intra" if int(peer) // L == rank // L else "inter"] += n
    return {"intra": out["intra"], "inter": out["inter"]}


def _total(recv: dict, scope: str) -> int:
    return sum(scopes.get(scope, 0) for scopes in recv.values())


def _close(measured: int, expected: float, tol: float = 0.01) -> bool:
    return abs(measured - expected) <= tol * expected


@pytest.fixture(scope="module")
def runs(pools):
    pool = pools.get(W)
    variants = {"exact": {}, "hpz": {"zero_hpz_partition_size": -1}, "qwz": {"zero_quantized_weights": True},
                "qgz": {"zero_quantized_gradients": True}, "hpz_qwz": {"zero_hpz_partition_size": 2,
                                                                       "zero_quantized_weights": True},
                "unverified": {"verify_collectives": False},
                "hpz_collective": {"zero_hpz_partition_size": -1, "allgather_impl": "all_gather"}}
    return {name: pool.run(train, extra) for name, extra in variants.items()}


def test_zero3s_counts_equal_an_independent_count_of_what_arrived(runs):
    for name, results in runs.items():
        for rank, r in enumerate(results):
            assert {s: _total(r["recv"], s) for s in ("intra", "inter")} == _scoped(r["independent"], rank), name
            assert _scoped(r["backward_independent"], rank) == \
                {s: _total(r["backward_recv"], s) for s in ("intra", "inter")}, name
    for r in runs["unverified"]:  # every byte went in a pairwise message: p2p_recv_bytes is all of it
        assert r["p2p"] == sum(r["independent"].values()) and VERIFICATION not in r["recv"]


def test_gather_and_reduction_bytes_equal_the_formulas_intra_and_inter_node(runs):
    sizes = numels()
    everything = sum(sizes.values())
    backward = everything - sizes["d.weight"] - sizes["d.bias"]  # d is kept: used again right away
    for name in ("exact", "unverified"):
        for r in runs[name]:
            gathered = 4 * (everything + backward)  # bytes gathered per step, forward and backward
            assert _close(r["recv"]["all-gather"]["intra"], gathered * (L - 1) / W)
            assert _close(r["recv"]["all-gather"]["inter"], gathered * (W - L) / W)
            assert _close(r["recv"]["gradient reduction"]["intra"], 4 * everything * (L - 1) / W)
            assert _close(r["recv"]["gradient reduction"]["inter"], 4 * everything * (W - L) / W)


def test_hpz_keeps_backward_gathers_inside_the_node_and_changes_no_number(runs):
    sizes = numels()
    everything = sum(sizes.values())
    backward = everything - sizes["d.weight"] - sizes["d.bias"]
    for exact, hpz in zip(runs["exact"], runs["hpz"]):
        assert hpz["nodes"] == (0, 0, 1, 1) and hpz["hpz"] == L  # -1: the ranks per node
        assert hpz["losses"] == exact["losses"]  # the secondary slices are the very weights
        gather = hpz["recv"]["all-gather"]  # from primary shards: the forward only
        assert _close(gather["intra"], 4 * everything * (L - 1) / W)
        assert _close(gather["inter"], 4 * everything * (W - L) / W)
        secondary = hpz["recv"]["secondary all-gather"]
        assert secondary["inter"] == 0 and _close(secondary["intra"], 4 * backward * (L - 1) / L)
        bwd = hpz["backward_recv"]
        assert bwd["all-gather"]["inter"] == 0 and bwd["secondary all-gather"]["inter"] == 0
        assert bwd["gradient reduction"]["inter"] == exact["recv"]["gradient reduction"]["inter"]
        assert hpz["recv"]["gradient reduction"] == exact["recv"]["gradient reduction"]


def test_hpz_on_the_backends_all_gather_trains_like_pairwise_and_stays_inside_the_node(runs):
    """allgather_impl="all_gather" (NCCL's choice): the secondary gather is one all-gather of every
    rank's padded slices over the secondary group; the same numbers, the bytes inside the node."""
    sizes = numels()
    backward = sum(sizes.values()) - sizes["d.weight"] - sizes["d.bias"]
    padded = sum(W * -(-sizes[name] // W) for name in sizes if not name.startswith("d."))  # N whole shards a slice
    for pairwise, collective in zip(runs["hpz"], runs["hpz_collective"]):
        assert collective["hpz"] == L and collective["losses"] == pairwise["losses"]
        secondary = collective["recv"]["secondary all-gather"]
        assert secondary["inter"] == 0 and secondary["intra"] == 4 * padded * (L - 1) / L
        assert _close(secondary["intra"], 4 * backward * (L - 1) / L)
        assert collective["backward_recv"]["secondary all-gather"]["inter"] == 0


def test_hpz_memory_is_a_secondary_slice_of_every_gathered_weight_until_the_step_ends(runs):
    sizes = numels()
    shard = {name: -(-n // W) for name, n in sizes.items()}
    expected = sum(4 * (W // L) * s for s in shard.values())  # N = W / L whole primary shards each
    for r in runs["hpz"]:
        assert r["forward_secondary"] == r["peak_secondary"] == expected
        assert r["after_secondary"] == 0
    for r in runs["exact"]:
        assert r["peak_secondary"] == 0
    for r in runs["hpz_qwz"]:  # the int8 bytes as they arrived, with their scales: about a quarter
        assert r["peak_secondary"] < 0.27 * expected


def test_qwz_weight_gathers_carry_at_most_027_of_fp32s_bytes(runs):
    for exact, qwz, both in zip(runs["exact"], runs["qwz"], runs["hpz_qwz"]):
        fp32 = exact["recv"]["all-gather"]
        for scope in ("intra", "inter"):
            assert qwz["recv"]["all-gather"][scope] <= 0.27 * fp32[scope]
        assert both["losses"] == qwz["losses"]  # backward uses forward's dequantized weights either way
        assert both["recv"]["secondary all-gather"]["inter"] == 0
        assert max(abs(a - b) / abs(b) for a, b in zip(qwz["losses"], exact["losses"])) < 0.01
        assert _off_course(qwz, exact) < 0.1  # trained as the exact run did, to int8's rounding


def test_qgz_gradient_messages_carry_at_most_027_of_fp32s_bytes(runs):
    for exact, qgz in zip(runs["exact"], runs["qgz"]):
        for scope in ("intra", "inter"):
            assert qgz["recv"]["gradient reduction"][scope] <= 0.27 * exact["recv"]["gradient reduction"][scope]
        assert qgz["recv"]["all-gather"] == exact["recv"]["all-gather"]
        assert max(abs(a - b) / abs(b) for a, b in zip(qgz["losses"], exact["losses"])) < 0.01
        assert _off_course(qgz, exact) < 0.1  # trained as the exact run did, to int8's rounding


def _off_course(run: dict, exact: dict) -> float:
    """How far ``run``'s weights ended from the exact run's, relative to how far training moved the
    exact run's (the losses of these few steps barely move: a run that skipped its steps, or stepped
    with gradients zeroed, doubled or of the wrong sign, ends at 1 or more)."""
    assert torch.equal(run["start_weights"], exact["start_weights"])
    moved = (exact["weights"] - exact["start_weights"]).norm()
    assert moved > 0
    return ((run["weights"] - exact["weights"]).norm() / moved).item()


def quantization_errors() -> dict:
    """One backward of `Net` exact, under qwZ and under qgZ from the same weights and batch: the
    largest error of the weights a qwZ gather hands out and of the qgZ-reduced gradient shards, each
    against its bound (half an int8 step of the largest magnitude: per sender, summed over the W - 1
    senders and averaged for gradients)."""
    rank = dist.get_rank()
    g = torch.Generator().manual_seed(rank)
    x, y = torch.randn(16, 64, generator=g), torch.randn(16, 8, generator=g)
    torch.manual_seed(0)
    plain = Net()
    nn.functional.mse_loss(plain(x), y).backward()
    biggest = {name: p.grad.abs().max().reshape(1) for name, p in plain.named_parameters()}
    for t in biggest.values():
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    shards, out = {}, {}
    for name, extra in (("exact", {}), ("qgz", {"zero_quantized_gradients": True}),
                        ("qwz", {"zero_quantized_weights": True})):
        torch.manual_seed(0)
        model = Net()
        engine = zero3.initialize(model, None, {**BASE, **extra})
        got: dict[str, torch.Tensor] = {}  # the weights forward computes with (user gathers are exact)
        for mn, m in model.named_children():
            m.register_forward_pre_hook(lambda mod, args, mn=mn: got.update(
                {f"{mn}.{pn}": q.detach().clone() for pn, q in mod.named_parameters()}))
        nn.functional.mse_loss(engine(x), y).backward()
        shards[name] = {n: p.ds_tensor.grad.clone() for n, p in model.named_parameters()}
        if name == "qwz":
            ref = {n: p.detach() for n, p in plain.named_parameters()}
            out["weights"] = [(float((got[n] - ref[n]).abs().max()), float(ref[n].abs().max()) / 254) for n in got]
        engine.remove_hooks()
    out["grads"] = [(float((shards["qgz"][n] - shards["exact"][n]).abs().max()),
                     float(biggest[n]) / 254 * (W - 1) / W) for n in shards["exact"]]
    return out


def test_quantized_weights_and_gradients_stay_within_half_an_int8_step(pools):
    for r in pools.get(W).run(quantization_errors):
        for what in ("weights", "grads"):
            for error, bound in r[what]:
                assert error <= bound * (1 + 1e-4) + 1e-12, (what, error, bound)
            assert any(error > 0 for error, _ in r[what])  # it is quantized
