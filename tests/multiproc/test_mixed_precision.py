"""Mixed precision on gloo ranks against a hand-built single-process reference of the same recipe.

The reference (`Recipe`) is written out here, independently of zero3, and runs in the test process
while the ranks run zero3: a bf16/fp16 copy of the model runs forward and backward on each rank's
rows of the batch in turn (data parallelism in one process: the gradient is the fp32 mean of the
per-row-block low-precision gradients); fp32 master copies of its weights hold the gradients
(accumulated in fp32), are stepped by ``AdamW(eps=1e-6)`` and copied back (rounded) after each
step. fp16 adds a dynamic loss scale (halve on overflow, double after ``window`` clean steps).

Without clipping zero3 must agree up to the order of fp32 additions (exactly at 2 ranks). Clipping
makes the comparison chaotic: the global norm is summed in another order, a master weight moves by
one fp32 ulp, its bf16 rounding flips now and then, and Adam turns a flipped near-zero gradient into
a full-size update. So runs that clip compare losses (1e-3 relative per step) and how far the
weights are from the reference's relative to how far both moved, and clipping itself is checked
against ``torch.nn.utils.clip_grad_norm_`` on the gathered gradients.
"""

from __future__ import annotations

import contextlib
import copy
import math
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from gpt import GPT, GPTConfig, synthetic_batch

import zero3
from zero3.optim.optimizer import ALIGN_ELEMENTS

pytestmark = pytest.mark.multiproc

CFG = GPTConfig()
PER_RANK = 2
LR = 1e-2
MAX_NORM = 0.3
NO_PERSIST = {"param_persistence_threshold": 0}
LOSS_RTOL = 1e-3
DRIFT = 0.05  # |zero3 - reference| / |reference - initial| over all weights, for runs that clip
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
FP16_SCALING = {"initial_scale_power": 8, "loss_scale_window": 5, "hysteresis": 1}


def lossf(model, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Low-precision logits, fp32 cross-entropy (a bf16 loss would carry only ~3 digits)."""
    logits = model(x)
    return F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), y.reshape(-1))


def batch(step: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The whole batch (the same on every rank); four batches repeat so the loss really falls."""
    return synthetic_batch(step % 4, PER_RANK * world, CFG)


def rows(t: torch.Tensor, r: int) -> torch.Tensor:
    return t[r * PER_RANK:(r + 1) * PER_RANK]


# -- the reference ---------------------------------------------------------------------------------
@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """The ranks run with one thread; so does the reference, for the same kernels."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


class Recipe:
    """Single-process mixed-precision training, written by hand."""

    def __init__(self, dtype: torch.dtype, world: int, *, frozen: tuple[str, ...] = (), scale: float = 1.0,
                 window: int = 10**9) -> None:
        torch.manual_seed(0)
        full = GPT(CFG)
        self.world = world
        self.names = [n for n, _ in full.named_parameters()]
        self.low = copy.deepcopy(full).to(dtype)
        self.low_params = list(self.low.parameters())
        trainable = [n not in frozen for n in self.names]
        # a frozen weight has no fp32 copy: only its low-precision value exists
        self.masters = [(p if t else q).detach().clone().float()
                        for p, q, t in zip(full.parameters(), self.low_params, trainable)]
        self.initial = [m.clone() for m in self.masters]
        for p, t in zip(self.low_params, trainable):
            p.requires_grad_(t)
        self.opt = torch.optim.AdamW([m for m, t in zip(self.masters, trainable) if t], lr=LR, eps=1e-6,
                                     weight_decay=0.1)
        self.sched = torch.optim.lr_scheduler.StepLR(self.opt, step_size=7, gamma=0.5)
        self.scale, self.window, self.clean = scale, window, 0

    def backward(self, x: torch.Tensor, y: torch.Tensor, divide: int = 1) -> float:
        """Forward/backward on each rank's rows; returns the mean loss over the whole batch."""
        total, grads = torch.zeros(()), [None] * len(self.masters)
        for r in range(self.world):
            loss = lossf(self.low, rows(x, r), rows(y, r))
            (loss * self.scale).backward()
            total += loss.detach()  # fp32, as the ranks' all-reduce adds
            for i, p in enumerate(self.low_params):
                if p.grad is not None:
                    g = p.grad.float()
                    grads[i] = g if grads[i] is None else grads[i] + g
                    p.grad = None
        for m, g in zip(self.masters, grads):
            if g is not None:
                g = g / self.world / divide
                m.grad = g if m.grad is None else m.grad + g
        return total.item() / self.world

    def step(self, *, clip: float = 0.0, overflow: bool = False) -> None:
        grads = [m for m in self.masters if m.grad is not None]
        if overflow:
            self.scale /= 2
            self.clean = 0
        else:
            for m in grads:
                m.grad /= self.scale
            if clip:
                torch.nn.utils.clip_grad_norm_(grads, clip)
            self.opt.step()
            self.clean += 1
            if self.clean % self.window == 0:
                self.scale *= 2
            with torch.no_grad():
                for m, p in zip(self.masters, self.low_params):
                    p.copy_(m)
        for m in self.masters:
            m.grad = None

    def named(self, tensors: list[torch.Tensor]) -> dict[str, torch.Tensor]:
        return dict(zip(self.names, tensors))

    def drift(self, params: dict[str, torch.Tensor]) -> float:
        """|params - masters| / |masters - initial| over all weights (L2)."""
        off = sum(((params[n] - m) ** 2).sum() for n, m in zip(self.names, self.masters))
        moved = sum(((m - i) ** 2).sum() for m, i in zip(self.masters, self.initial))
        return math.sqrt(off / moved)

    def max_error(self, params: dict[str, torch.Tensor]) -> float:
        return max((params[n] - m).abs().max().item() for n, m in zip(self.names, self.masters))


# -- the zero3 side (runs on every rank) ------------------------------------------------------------
def make_engine(dtype: str, frozen: tuple[str, ...] = (), **config) -> zero3.Engine:
    torch.manual_seed(0)
    with zero3.Init():
        model = GPT(CFG)
    for n, p in model.named_parameters():
        if n in frozen:
            p.requires_grad_(False)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, eps=1e-6, weight_decay=0.1)
    engine = zero3.initialize(model, opt, {**NO_PERSIST, "dtype": dtype, **config})
    assert engine.optimizer is opt
    return engine


def micro_batch(engine: zero3.Engine, step: int) -> float:
    """Forward and backward on this rank's rows; returns the loss averaged over all ranks."""
    rank, world = dist.get_rank(), dist.get_world_size()
    x, y = batch(step, world)
    loss = lossf(engine, rows(x, rank), rows(y, rank))
    engine.backward(loss)
    t = loss.detach().clone()
    dist.all_reduce(t)
    return t.item() / world


def full_params(engine: zero3.Engine) -> dict[str, torch.Tensor]:
    return {p._zero.name: zero3.safe_get_full_fp32_param(p) for p in engine.params}


def clip_like_torch(engine: zero3.Engine) -> float:
    """zero3.clip_grad_norm_; checked against torch.nn.utils.clip_grad_norm_ on the gathered gradients."""
    holders = []
    for p in engine.params:
        g = zero3.safe_get_full_grad(p)
        if g is not None:
            h = torch.zeros_like(g)
            h.grad = g
            holders.append((p, h))
    want = torch.nn.utils.clip_grad_norm_([h for _, h in holders], MAX_NORM)
    got = zero3.clip_grad_norm_(engine, MAX_NORM)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=0)
    for p, h in holders:
        torch.testing.assert_close(zero3.safe_get_full_grad(p), h.grad, rtol=1e-5, atol=1e-9)
    return got.item()


# -- bf16 / fp16 parity, with clipping and an LR scheduler --------------------------------------
def train_parity(dtype: str, steps: int, overflow_at: int = -1) -> dict:
    engine = make_engine(dtype, **(FP16_SCALING if dtype == "fp16" else {}))
    sched = torch.optim.lr_scheduler.StepLR(engine.optimizer, step_size=7, gamma=0.5)
    out: dict = {"losses": [], "scales": [], "lrs": [], "clipped": 0, "overflow": None}
    for step in range(steps):
        out["losses"].append(micro_batch(engine, step))
        out["scales"].append(engine.loss_scale)
        if step == overflow_at:
            if dist.get_rank() == dist.get_world_size() - 1:  # only the last rank sees an inf
                engine.master_shard(engine.params[3]).grad[0] = math.inf
            before = full_params(engine)
            shards = [p.ds_tensor.clone() for p in engine.params]
            norm = zero3.clip_grad_norm_(engine, MAX_NORM)
            stepped = engine.step()
            after = full_params(engine)
            out["overflow"] = {
                "stepped": stepped, "norm_finite": bool(torch.isfinite(norm)), "skipped": engine.skipped_steps,
                "scale_after": engine.loss_scale,
                "unchanged": all(torch.equal(before[n], after[n]) for n in before)
                and all(torch.equal(a, p.ds_tensor) for a, p in zip(shards, engine.params))}
        else:
            if step % 4 == 0:
                out["clipped"] += clip_like_torch(engine) > MAX_NORM
            else:
                zero3.clip_grad_norm_(engine, MAX_NORM)
            assert engine.step() is True
        sched.step()
        out["lrs"].append(engine.optimizer.param_groups[0]["lr"])
        assert engine.coordinator.live_params == []
    out["params"] = full_params(engine)
    return out


def reference_parity(dtype: str, steps: int, world: int, overflow_at: int = -1) -> dict:
    with one_thread():
        fp16 = dtype == "fp16"
        ref = Recipe(DTYPES[dtype], world, scale=2.0 ** 8, window=5) if fp16 else Recipe(DTYPES[dtype], world)
        out: dict = {"losses": [], "scales": [], "lrs": []}
        for step in range(steps):
            out["losses"].append(ref.backward(*batch(step, world)))
            out["scales"].append(ref.scale)
            ref.step(clip=MAX_NORM, overflow=step == overflow_at)
            ref.sched.step()
            out["lrs"].append(ref.opt.param_groups[0]["lr"])
    out["ref"] = ref
    return out


def assert_losses_follow(got: list[float], want: list[float]) -> None:
    assert len(got) == len(want)
    for step, (a, b) in enumerate(zip(got, want)):
        assert abs(a - b) / b < LOSS_RTOL, (step, a, b)
    assert (want[0] - min(want)) / want[0] > 0.05, want  # the loss really falls: following it means something


@pytest.mark.parametrize("world", [2, 4])
def test_bf16_training_follows_the_fp32_master_recipe(pools, world):
    results = pools.get(world).run(train_parity, "bf16", 20)
    ref = reference_parity("bf16", 20, world)
    for r in results:
        assert_losses_follow(r["losses"], ref["losses"])
        assert r["lrs"] == ref["lrs"] and r["lrs"][-1] == LR * 0.5 ** 2  # StepLR on the user's optimizer
        assert r["clipped"] > 0, r["clipped"]
        assert ref["ref"].drift(r["params"]) < DRIFT


@pytest.mark.parametrize("world", [2, 4])
def test_fp16_with_loss_scaling_follows_the_recipe_and_skips_an_overflow_on_every_rank(pools, world):
    results = pools.get(world).run(train_parity, "fp16", 20, overflow_at=8)
    ref = reference_parity("fp16", 20, world, overflow_at=8)
    for r in results:
        ov = r["overflow"]
        assert ov["stepped"] is False and ov["skipped"] == 1 and not ov["norm_finite"], ov
        assert ov["unchanged"], "a skipped step changed masters or fp16 shards"
        assert r["scales"][8] == 512.0 and ov["scale_after"] == 256.0  # halved at once (hysteresis 1)
        # 256 doubles after 5 clean steps, halves at the overflow, doubles after 5 and 10 more
        assert r["scales"] == ref["scales"] and r["scales"][-1] == 1024.0, r["scales"]
        assert_losses_follow(r["losses"], ref["losses"])
        assert ref["ref"].drift(r["params"]) < DRIFT


# -- gradient accumulation, automatic clipping, frozen parameters -------------------------------
def train_accumulation(steps: int, frozen: tuple[str, ...], clip: float) -> dict:
    engine = make_engine("bf16", frozen=frozen, gradient_accumulation_steps=2, gradient_clipping=clip)
    frozen_before = {p._zero.name: zero3.safe_get_full_fp32_param(p) for p in engine.params if not p.requires_grad}
    out: dict = {"losses": [], "returned": [], "raised": False}
    for micro in range(2 * steps):
        out["losses"].append(micro_batch(engine, micro))
        if micro == 0:
            with contextlib.suppress(zero3.ZeroStateError):
                zero3.clip_grad_norm_(engine, MAX_NORM)
                out["raised"] = None
            out["raised"] = out["raised"] is not None
        if micro == 1:  # the first window's accumulated gradient, before the step clips it
            out["grads"] = {p._zero.name: zero3.safe_get_full_grad(p) for p in engine.params if p.requires_grad}
        out["returned"].append(engine.step())
    out["frozen"] = [{"master": p._zero.master is not None, "grad": zero3.safe_get_full_grad(p),
                      "state": engine.optimizer_state(p),
                      "same": torch.equal(zero3.safe_get_full_fp32_param(p), frozen_before[p._zero.name])}
                     for p in engine.params if not p.requires_grad]
    out["trainable_state"] = all(len(engine.optimizer_state(p)) > 0 for p in engine.params if p.requires_grad)
    out["steps"] = (engine.global_steps, engine.micro_steps)
    out["params"] = full_params(engine)
    return out


def reference_accumulation(steps: int, world: int, frozen: tuple[str, ...], clip: float) -> dict:
    with one_thread():
        ref = Recipe(torch.bfloat16, world, frozen=frozen)
        losses, grads = [], {}
        for micro in range(2 * steps):
            losses.append(ref.backward(*batch(micro, world), divide=2))
            if micro == 1:
                grads = {n: m.grad.clone() for n, m in ref.named(ref.masters).items() if m.grad is not None}
            if micro % 2 == 1:
                ref.step(clip=clip)
    return {"losses": losses, "grads": grads, "ref": ref}


def test_gradient_accumulation_with_clipping_equals_a_reference_that_accumulates(pools):
    results = pools.get(2).run(train_accumulation, 6, (), MAX_NORM)
    ref = reference_accumulation(6, 2, (), MAX_NORM)
    for r in results:
        assert r["returned"] == [False, True] * 6, r["returned"]
        assert r["raised"], "clip_grad_norm_ inside an accumulation window must raise"
        assert r["steps"] == (6, 12), r["steps"]
        # each micro-batch's gradient counts 1/2 (clipping and Adam would hide a wrong factor)
        assert r["grads"].keys() == ref["grads"].keys()
        for n, g in ref["grads"].items():
            assert torch.equal(r["grads"][n], g), n
        assert_losses_follow(r["losses"], ref["losses"])
        assert ref["ref"].drift(r["params"]) < DRIFT


def test_frozen_params_get_no_master_grad_or_state_and_the_rest_trains_like_the_reference(pools):
    frozen = ("wpe.weight", "h.0.ln_1.weight", "h.0.attn.c_attn.weight")
    results = pools.get(2).run(train_accumulation, 3, frozen, 0.0)
    ref = reference_accumulation(3, 2, frozen, 0.0)
    for r in results:
        assert len(r["frozen"]) == len(frozen)
        for f in r["frozen"]:
            assert f == {"master": False, "grad": None, "state": {}, "same": True}, f
        assert r["trainable_state"]
        assert r["losses"] == ref["losses"]  # no clipping at 2 ranks: the same additions in the same order
        assert ref["ref"].max_error(r["params"]) == 0.0


# -- model-state bytes ------------------------------------------------------------------------------
def formula_bytes(world: int, frozen: tuple[str, ...], shared: bool) -> int:
    """docs/mixed_precision.md: per rank, with s = ceil(numel / world) and a(s) = s rounded up to
    ALIGN_ELEMENTS: trainable 2·a(s) (bf16 shard in its flat buffer; 2·s when ``shared``, in its
    shared-memory slot) + 4·s (fp32 gradient shard) + 4·a(s) (fp32 master in its flat buffer)
    + 8·s (AdamW moments); frozen 2·s (bf16 shard only)."""
    torch.manual_seed(0)
    total = 0
    for name, p in GPT(CFG).named_parameters():
        s = -(-p.numel() // world)
        a = -(-s // ALIGN_ELEMENTS) * ALIGN_ELEMENTS
        total += 2 * s if name in frozen else 2 * (s if shared else a) + 4 * s + 4 * a + 8 * s
    return total


def measure_memory(frozen: tuple[str, ...], impl: str) -> dict:
    engine = make_engine("bf16", frozen=frozen, allgather_impl=impl)
    for step in range(2):
        micro_batch(engine, step)
        report = engine.memory_report()  # at step 1: gradient shards and moments both exist
        engine.step()
    return {**report, "shared": engine.comm.shared is not None and bool(engine.comm.shared.params)}


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("impl", ["p2p", "shm"])
def test_model_state_bytes_per_rank_equal_the_documented_formula(pools, world, impl):
    frozen = ("wpe.weight",)
    torch.manual_seed(0)
    full_numel = sum(p.numel() for p in GPT(CFG).parameters())
    for m in pools.get(world).run(measure_memory, frozen, impl):
        assert m["shared"] == (impl == "shm")
        held = m["param_shard_bytes"] + m["grad_shard_bytes"] + m["optimizer_state_bytes"]
        assert held == formula_bytes(world, frozen, m["shared"]), (held, formula_bytes(world, frozen, m["shared"]), m)
        assert m["gathered_param_bytes"] == 0
        assert m["full_param_bytes"] == 2 * full_numel  # bf16 parameters
        # alignment of this tiny model's small shards aside: 18/N bytes per parameter, 2 (bf16 weight)
        # + 4 (fp32 gradient) + 12 (fp32 master, two fp32 moments)
        assert held / full_numel < 18 / world * 1.25, held / full_numel


# -- optimizer offload --------------------------------------------------------------------------
def reduce_dtype_seen() -> list[str]:
    engine = make_engine("bf16", reduce_dtype="bf16")
    seen = []
    real = engine.comm.reduce_grads
    engine.comm.reduce_grads = lambda pieces, dtype, device, tag: (seen.append(str(dtype)),
                                                                   real(pieces, dtype, device, tag))[1]
    micro_batch(engine, 0)
    assert all(engine.master_shard(p).grad.dtype == torch.float32 for p in engine.params if p.requires_grad)
    return seen


def test_reduce_dtype_is_the_dtype_of_the_reduced_gradients(pools):
    for seen in pools.get(2).run(reduce_dtype_seen):
        assert seen and set(seen) == {"torch.bfloat16"}


def train_offload(steps: int) -> dict:
    out = {}
    for mode in ("none", "cpu"):
        engine = make_engine("bf16", offload_optimizer=mode, gradient_clipping=MAX_NORM)
        losses = []
        for step in range(steps):
            losses.append(micro_batch(engine, step))
            assert engine.step() is True
        fg = engine.sharded_optimizer.groups[0]
        state = {p._zero.name: engine.optimizer_state(p) for p in engine.params}
        out[mode] = {"losses": losses, "params": full_params(engine),
                     "state": {n: s["exp_avg_sq"].clone() for n, s in state.items()},
                     "distinct": fg.master.untyped_storage().data_ptr() not in  # masters apart from the shards
                     {p._zero.shard.untyped_storage().data_ptr() for p in fg.params},
                     "devices": {str(fg.master.device)} | {str(s["exp_avg"].device) for s in state.values()}}
    return out


def test_optimizer_offload_to_cpu_trains_exactly_like_no_offload(pools):
    for r in pools.get(2).run(train_offload, 6):
        a, b = r["none"], r["cpu"]
        assert b["distinct"] and b["devices"] == {"cpu"}, b
        assert a["losses"] == b["losses"]
        for n in a["params"]:
            assert torch.equal(a["params"][n], b["params"][n]), n
            assert torch.equal(a["state"][n], b["state"][n]), n


# -- accessors ----------------------------------------------------------------------------------------
NEW_VALUES = ("h.1.mlp.c_fc.weight", "ln_f.bias")


def new_value(shape: torch.Size) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(7)) * 0.05


def train_with_accessors(steps: int) -> dict:
    engine = make_engine("bf16")
    named = {p._zero.name: p for p in engine.params}
    out: dict = {"losses": []}

    def run(k0: int, k1: int) -> None:
        for step in range(k0, k1):
            out["losses"].append(micro_batch(engine, step))
            engine.step()

    run(0, steps)
    out["params"] = full_params(engine)
    out["exp_avg"] = {n: zero3.safe_get_full_optimizer_state(p, "exp_avg") for n, p in named.items()}
    out["local"] = all(
        torch.equal(zero3.safe_get_local_fp32_param(p), out["params"][n].reshape(-1)[slice(*p._zero.shard_range())])
        and torch.equal(zero3.safe_get_local_optimizer_state(p, "exp_avg"),
                        out["exp_avg"][n].reshape(-1)[slice(*p._zero.shard_range())])
        for n, p in named.items())
    for n in NEW_VALUES:
        zero3.safe_set_full_fp32_param(named[n], new_value(named[n].ds_shape))
    out["set_exact"] = all(torch.equal(zero3.safe_get_full_fp32_param(named[n]), new_value(named[n].ds_shape))
                           for n in NEW_VALUES)
    with zero3.GatheredParameters([named["ln_f.bias"]]):
        out["low_exact"] = torch.equal(named["ln_f.bias"].detach(), new_value((CFG.n_embd,)).to(torch.bfloat16))
    run(steps, 2 * steps)
    out["after"] = full_params(engine)
    micro_batch(engine, 0)
    out["grads"] = {n: zero3.safe_get_full_grad(p) for n, p in named.items()}
    out["local_grad"] = all(torch.equal(zero3.safe_get_local_grad(p),
                                        out["grads"][n].reshape(-1)[slice(*p._zero.shard_range())])
                            for n, p in named.items())
    return out


def test_accessors_read_and_write_the_fp32_masters_like_the_reference(pools):
    steps = 5
    results = pools.get(2).run(train_with_accessors, steps)
    with one_thread():
        ref = Recipe(torch.bfloat16, 2)
        losses = []
        for step in range(steps):
            losses.append(ref.backward(*batch(step, 2)))
            ref.step()
        params = {n: m.clone() for n, m in ref.named(ref.masters).items()}
        exp_avg = {n: ref.opt.state[m]["exp_avg"].clone() for n, m in ref.named(ref.masters).items()}
        with torch.no_grad():
            for n in NEW_VALUES:
                ref.named(ref.masters)[n].copy_(new_value(ref.named(ref.masters)[n].shape))
                ref.named(ref.low_params)[n].copy_(new_value(ref.named(ref.masters)[n].shape))
        for step in range(steps, 2 * steps):
            losses.append(ref.backward(*batch(step, 2)))
            ref.step()
        ref.backward(*batch(0, 2))
    for r in results:
        # 2 ranks, no clipping: zero3 adds the same numbers in the same order as the reference
        assert r["losses"] == losses
        for n, want in params.items():
            assert torch.equal(r["params"][n], want), n
            assert torch.equal(r["exp_avg"][n], exp_avg[n]), n
            assert torch.equal(r["grads"][n], ref.named(ref.masters)[n].grad), n
        assert r["local"] and r["local_grad"]
        assert r["set_exact"] and r["low_exact"]
        assert ref.max_error(r["after"]) == 0.0


# -- a local set of persistent parameters (WGAN weight clipping) -----------------------------------------
CLIP = 0.05


def clip_mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 16), torch.nn.Tanh(),
                               torch.nn.Linear(16, 3))


def clip_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(8, 6, generator=g), torch.randn(8, 3, generator=g)


def half(t: torch.Tensor, r: int) -> torch.Tensor:
    return t[4 * r:4 * r + 4]


def train_clipped_locally(threshold: int | None, refresh: bool, steps: int) -> dict:
    """Each step, then every weight clamped through this rank's slice only (the local accessors)."""
    rank = dist.get_rank()
    model = clip_mlp()
    config = {} if threshold is None else {"param_persistence_threshold": threshold}
    engine = zero3.initialize(model, torch.optim.Adam(model.parameters(), lr=LR, eps=1e-6), config)
    out: dict = {"losses": [], "refreshed": [], "persistent": sum(p._zero.numel for p in engine.params
                                                                  if p._zero.persistent)}
    for step in range(steps):
        x, y = clip_batch(step)
        loss = F.mse_loss(engine(half(x, rank)), half(y, rank))
        engine.backward(loss)
        engine.step()
        out["losses"].append(loss.item())
        out["refreshed"].append(engine.last_step_metrics.persistent_refresh_numel)
        for p in model.parameters():
            zero3.safe_set_local_fp32_param(p, zero3.safe_get_local_fp32_param(p).clamp_(-CLIP, CLIP))
        if refresh:
            engine.refresh_from_masters()
    out["consolidated"] = engine.consolidated_state_dict(rank0_only=False)  # right after the last sets
    with zero3.GatheredParameters(list(model.parameters())):
        out["gathered"] = {n: p.detach().clone() for n, p in model.named_parameters()}
    x, y = clip_batch(steps)
    with torch.no_grad():
        out["eval"] = F.mse_loss(engine(half(x, rank)), half(y, rank)).item()
    engine.remove_hooks()
    return out


@pytest.mark.parametrize("threshold,refresh", [(None, False), (None, True), (0, False)])
def test_a_local_set_of_persistent_parameters_reaches_every_ranks_next_forward(pools, threshold, refresh):
    """A local set used to reach only this rank's slice of a persistent parameter's gathered copy: the
    next forward mixed new and old slices (probe 33T: losses 1.2595/1.1816/1.2428 against torch's
    1.2348/1.1769/1.2345 at steps 2-4, weights 1.2e-2 off). Now the forward gathers the stale copies
    first, once: with refresh_from_masters() after the sets it gathers nothing more."""
    steps = 4
    results = pools.get(2).run(train_clipped_locally, threshold, refresh, steps, timeout=120)
    with one_thread():
        ref = clip_mlp()
        opt = torch.optim.Adam(ref.parameters(), lr=LR, eps=1e-6)
        losses: list[list[float]] = [[], []]
        for step in range(steps + 1):
            x, y = clip_batch(step)
            halves = [F.mse_loss(ref(half(x, r)), half(y, r)) for r in range(2)]
            for r in range(2):
                losses[r].append(halves[r].item())
            if step == steps:
                break
            ((halves[0] + halves[1]) / 2).backward()
            opt.step()
            opt.zero_grad()
            with torch.no_grad():
                for p in ref.parameters():
                    p.clamp_(-CLIP, CLIP)
    want = dict(ref.named_parameters())
    for rank, r in enumerate(results):
        assert r["losses"] == pytest.approx(losses[rank][:steps], rel=1e-5, abs=1e-7), (rank, r["losses"])
        assert r["eval"] == pytest.approx(losses[rank][steps], rel=1e-5, abs=1e-7)
        for n, w in want.items():
            torch.testing.assert_close(r["consolidated"][n], w.detach(), rtol=0, atol=1e-6, msg=n)
            torch.testing.assert_close(r["gathered"][n], w.detach(), rtol=0, atol=1e-6, msg=n)
        total = r["persistent"]
        assert total == (sum(w.numel() for w in want.values()) if threshold is None else 0)
        # each step after the first: the step's own refresh, and one more of every (stale or refreshed) copy
        assert r["refreshed"][1:] == [2 * total] * (steps - 1), r["refreshed"]


# -- spectral norm's power-iteration vectors ------------------------------------------------------------
def sn_model(api: str) -> torch.nn.Module:
    torch.manual_seed(0)
    sn = torch.nn.utils.spectral_norm if api == "old" else torch.nn.utils.parametrizations.spectral_norm
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), sn(torch.nn.Linear(8, 8)), torch.nn.Linear(8, 2))


def sn_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(16, 6, generator=g), torch.randn(16, 2, generator=g)


def sn_vectors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: b.clone() for n, b in model.named_buffers() if n.endswith(("_u", "_v"))}


def train_spectral_norm(api: str, steps: int) -> dict:
    """The whole batch on every rank: the mean of equal gradients is the one rank's, exactly."""
    model = sn_model(api)
    engine = zero3.initialize(model, torch.optim.AdamW(model.parameters(), lr=LR, eps=1e-6),
                              {**NO_PERSIST, "dtype": "bf16"})
    losses = []
    for step in range(steps):
        x, y = sn_batch(step)
        loss = F.mse_loss(engine(x.bfloat16()).float(), y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return {"losses": losses, "params": full_params(engine), "vectors": sn_vectors(model)}


@pytest.mark.parametrize("api", ["old", "new"])
def test_spectral_norm_under_bf16_on_two_ranks_follows_torch_with_fp32_masters(pools, api):
    """The vectors stayed fp32 beside the bf16 weight: torch's first forward raised (addmv dtype)."""
    full = sn_model(api)
    low = copy.deepcopy(full).to(torch.bfloat16)
    masters = [p.detach().clone().float() for p in full.parameters()]
    opt = torch.optim.AdamW(masters, lr=LR, eps=1e-6)
    losses = []
    with one_thread():
        for step in range(4):
            x, y = sn_batch(step)
            loss = F.mse_loss(low(x.bfloat16()).float(), y)
            loss.backward()
            losses.append(loss.item())
            for m, p in zip(masters, low.parameters()):
                m.grad, p.grad = p.grad.float(), None
            opt.step()
            with torch.no_grad():
                for m, p in zip(masters, low.parameters()):
                    p.copy_(m)
    names = [n for n, _ in full.named_parameters()]
    for r in pools.get(2).run(train_spectral_norm, api, 4):
        assert r["losses"] == losses
        assert all(torch.equal(r["params"][n], m) for n, m in zip(names, masters)), names
        ref_vectors = sn_vectors(low)
        assert r["vectors"].keys() == ref_vectors.keys() and len(ref_vectors) == 2
        assert all(torch.equal(r["vectors"][n], v) for n, v in ref_vectors.items())
