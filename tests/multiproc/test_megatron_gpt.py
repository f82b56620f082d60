"""Model parallelism beside ZeRO-3, on 4 gloo ranks (2 tensor-parallel x 2 data-parallel) running
examples/megatron_gpt.py: the same losses and clipped gradient norms as the same model on one process,
saved activations split across the tensor-parallel ranks, and checkpoints with one set of files per
model-parallel rank that resume at another data-parallel size."""

from __future__ import annotations

import dataclasses
import json
import os

import pytest
import torch
import torch.distributed as dist

import megatron_gpt as m
import zero3
import zero3.checkpointing as ckpt
from zero3.checkpoint.consolidate import consolidate

pytestmark = pytest.mark.multiproc

TIMEOUT = 120


def reference(cfg: m.Config, run: m.RunConfig, dp: int) -> dict[str, list[float]]:
    """The same training on one process: the full model (``virtual_tp`` draws each head group's
    attention dropout from that tensor-parallel rank's stream), each data-parallel rank's rows run
    from the step's starting RNG states (every data-parallel rank starts there), gradients averaged."""
    m.seed_like_tensor_parallel(run.seed, run.tp)
    model = m.GPT(dataclasses.replace(cfg, virtual_tp=run.tp, checkpoint=False), m.TinyMPU(1))
    opt = torch.optim.AdamW(model.parameters(), lr=run.lr, weight_decay=0.1)
    tracker = ckpt.get_cuda_rng_tracker()
    out: dict[str, list[float]] = {"loss": [], "norm": []}
    for step in range(run.steps):
        x, y = m.synthetic_batch(step, run.per_rank_batch * dp, cfg)
        start = torch.get_rng_state(), tracker.get_states()
        total = 0.0
        for d in range(dp):
            torch.set_rng_state(start[0])
            tracker.set_states(start[1])
            rows = slice(d * run.per_rank_batch, (d + 1) * run.per_rank_batch)
            loss = model(x[rows], y[rows])
            (loss / dp).backward()
            total += loss.item() / dp
        out["norm"].append(torch.nn.utils.clip_grad_norm_(model.parameters(), run.clip).item())
        opt.step()
        opt.zero_grad()
        out["loss"].append(total)
    return out


def _train(cfg: m.Config, run: m.RunConfig) -> dict[str, list[float]]:
    torch.manual_seed(1)  # the example seeds itself; a different state here must not matter
    return m.train(cfg, run)


def _close(a: list[float], b: list[float], rtol: float = 1e-5) -> float:
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


@pytest.mark.parametrize("checkpoint,dropout,partition", [
    (False, 0.0, False),  # tensor parallelism + ZeRO-3 alone
    (True, 0.1, False),  # checkpointing with dropout in and outside the tensor-parallel region
    (True, 0.1, True),  # ... keeping half of every saved activation per rank
    (False, 0.1, False),  # dropout without checkpointing: the tracker alone
])
def test_two_by_two_trains_like_one_process(pools, checkpoint, dropout, partition):
    cfg = m.Config(dropout=dropout, checkpoint=checkpoint)
    run = m.RunConfig(steps=10, partition_activations=partition)
    results = pools.get(4).run(_train, cfg, run, timeout=TIMEOUT)
    ref = reference(cfg, run, dp=2)
    for r in results:
        assert _close(r["loss"], ref["loss"]) < 1e-5, (r["loss"], ref["loss"])
        assert _close(r["norm"], ref["norm"]) < 1e-5, (r["norm"], ref["norm"])
        assert r["divergences"] == [0] * run.steps, "a step left zero3's recorded trace"
        assert min(r["prefetch_hits"][2:]) > 0  # from the third step on (the second records the
        # trace again: the root picked up wte.weight as an external parameter in the first)
    if dropout:  # the masks matter: without the tensor-parallel streams the run would differ
        plain = reference(dataclasses.replace(cfg, dropout=0.0), run, dp=2)
        assert _close(plain["loss"], ref["loss"]) > 1e-3


def _train_clipping_in_config(cfg: m.Config, run: m.RunConfig) -> list[float]:
    """The example's loop with ``gradient_clipping`` in the config instead of clip_grad_norm_."""
    engine, mpu = m.build(cfg, run)
    dp, dp_rank = mpu.get_data_parallel_world_size(), mpu.get_data_parallel_rank()
    losses = []
    for step in range(run.steps):
        x, y = m.synthetic_batch(step, run.per_rank_batch * dp, cfg)
        rows = slice(dp_rank * run.per_rank_batch, (dp_rank + 1) * run.per_rank_batch)
        loss = engine(x[rows], y[rows])
        engine.backward(loss)
        engine.step()
        loss = loss.detach()
        dist.all_reduce(loss, group=mpu.get_data_parallel_group())
        losses.append(loss.item() / dp)
    return losses


def test_config_gradient_clipping_counts_the_model_parallel_group_too(pools):
    cfg = m.Config()
    # Optimizer offload: the optimizer steps on flat fp32 master buffers, the path mixed precision takes.
    run = m.RunConfig(steps=6, zero={"param_persistence_threshold": 0, "gradient_clipping": 0.5,
                                     "offload_optimizer": "cpu"})
    results = pools.get(4).run(_train_clipping_in_config, cfg, run, timeout=TIMEOUT)
    ref = reference(cfg, run, dp=2)["loss"]
    for losses in results:
        assert _close(losses, ref) < 1e-5, (losses, ref)
    unclipped = reference(cfg, dataclasses.replace(run, clip=1e9), dp=2)["loss"]
    assert _close(unclipped, ref) > 1e-4  # clipping matters here: ten times the tolerance above


class _TensorNamesMPU(m.TinyMPU):
    """Megatron's newer names only (get_tensor_model_parallel_*)."""

    def __getattribute__(self, name: str):
        if name.startswith("get_model_parallel"):
            raise AttributeError(name)
        return super().__getattribute__(name)

    def get_tensor_model_parallel_group(self):
        return self._tp_group

    def get_tensor_model_parallel_rank(self):
        return self.rank % self.tp

    def get_tensor_model_parallel_world_size(self):
        return self.tp


def _tensor_names_and_wrong_units(directory: str) -> dict:
    mpu = _TensorNamesMPU(2)
    with zero3.Init(mpu=mpu):
        model = torch.nn.Linear(4, 4)
    engine = zero3.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), mpu=mpu)
    mp = engine.context.model_parallel
    seen = {"dp": engine.world_size, "mp": (mp.world_size, mp.rank), "dp_ranks":
            dist.get_process_group_ranks(engine.group)}

    class WrongRank(m.TinyMPU):
        def get_model_parallel_rank(self):
            return 1 - super().get_model_parallel_rank()

    class Crossed(m.TinyMPU):  # its "model-parallel" group is the data-parallel one
        def get_model_parallel_group(self):
            return self.get_data_parallel_group()

        def get_model_parallel_rank(self):
            return self.get_data_parallel_rank()

    class Diagonal(m.TinyMPU):  # data-parallel groups {0, 3} and {1, 2}: each pairs two different slices
        def __init__(self, tp: int) -> None:
            super().__init__(tp)
            groups = [dist.new_group([0, 3]), dist.new_group([1, 2])]
            self._dp_group = groups[0] if dist.get_rank() in (0, 3) else groups[1]

    class Singleton(m.TinyMPU):  # a data-parallel group of one rank, while the unit says 2
        def __init__(self, tp: int) -> None:
            super().__init__(tp)
            groups = [dist.new_group([r]) for r in range(dist.get_world_size())]
            self._dp_group = groups[dist.get_rank()]

        def get_data_parallel_world_size(self) -> int:
            return 2

    class Uneven(m.TinyMPU):  # data-parallel groups {0, 2}, {1}, {3}: ranks 0 and 2 alone see nothing wrong
        def __init__(self, tp: int) -> None:
            super().__init__(tp)
            groups = [dist.new_group([0, 2]), dist.new_group([1]), dist.new_group([3])]
            self._dp_group = groups[{0: 0, 2: 0, 1: 1, 3: 2}[dist.get_rank()]]

        def get_data_parallel_world_size(self) -> int:
            return dist.get_world_size(self._dp_group)

    errors = {}
    for unit in (WrongRank(2), Crossed(2), Diagonal(2), Singleton(2), Uneven(2)):  # the last three were accepted
        try:
            with zero3.Init(mpu=unit):
                small = torch.nn.Linear(4, 4)
            zero3.initialize(small, mpu=unit)
        except zero3.ZeroConfigError as exc:
            errors[type(unit).__name__] = str(exc)
    class Overlapping(m.TinyMPU):  # rank 0's data-parallel group is every rank, the others' themselves alone
        def __init__(self, tp: int) -> None:
            super().__init__(tp)
            groups = [dist.new_group([r]) for r in range(dist.get_world_size())]
            self._dp_group = dist.group.WORLD if dist.get_rank() == 0 else groups[dist.get_rank()]

        def get_data_parallel_world_size(self) -> int:
            return dist.get_world_size(self._dp_group)

    try:  # built without Init: initialize agreed on its config over each rank's data-parallel group before it
        zero3.initialize(torch.nn.Linear(4, 4), mpu=Overlapping(2))  # checked the unit: ValueError unpacking (35A)
    except zero3.ZeroConfigError as exc:
        errors["Overlapping"] = str(exc)
    alone = [dist.new_group([r]) for r in range(dist.get_world_size())]
    try:  # a group given beside the unit that is not its own: the refusal named neither (probe 35B2)
        with zero3.Init(mpu=m.TinyMPU(2), data_parallel_group=alone[dist.get_rank()]):
            torch.nn.Linear(4, 4)
    except zero3.ZeroConfigError as exc:
        errors["given group"] = str(exc)
    seen["errors"] = errors
    try:  # wrote model-parallel rank 0's slices alone, as if they were the model
        engine.save_16bit_model(os.path.join(directory, "out"))
    except zero3.ZeroConfigError as exc:
        seen["save_16bit_model"] = str(exc)
    seen["written"] = os.path.exists(os.path.join(directory, "out", "pytorch_model.bin"))
    return seen


def test_megatrons_tensor_names_are_read_and_a_wrong_unit_is_refused(pools, tmp_path):
    results = pools.get(4).run(_tensor_names_and_wrong_units, str(tmp_path), timeout=TIMEOUT)
    for rank, r in enumerate(results):
        assert r["dp"] == 2 and r["mp"] == (2, rank % 2)
        assert r["dp_ranks"] == [rank % 2, rank % 2 + 2]  # partitioned over the data-parallel group only
        assert "this process is rank" in r["errors"]["WrongRank"]
        assert "must share exactly that rank" in r["errors"]["Crossed"]
        assert "holds model-parallel ranks [0, 1]; every rank of a data-parallel group must hold the same" \
            in r["errors"]["Diagonal"]
        assert "mpu.get_data_parallel_world_size() = 2, but its data-parallel group has 1 ranks" in r["errors"]["Singleton"]
        assert "do not tile the 4 ranks" in r["errors"]["Uneven"]  # on every rank: ranks 0 and 2 waited before
        assert "rank 0: the data-parallel group (ranks [0, 1, 2, 3]) and the model-parallel group" in r["errors"]["Overlapping"]
        assert "rank 0: the data-parallel group given (ranks [0]: Init's data_parallel_group= or group=" \
            in r["errors"]["given group"]
        assert "save_16bit_model with tensor parallelism" in r["save_16bit_model"] and not r["written"]


# -- saved activations ---------------------------------------------------------------------------------
def _saved_bytes(partition: bool) -> dict:
    """Bytes a checkpointed tensor-parallel block saves for backward, counted by autograd's pack hook,
    and the gradients it produces."""
    mpu = m.TinyMPU(2)
    ckpt.configure(mpu, partition_activations=partition)
    torch.manual_seed(0)
    block = m.Block(m.Config(), mpu)
    x = torch.randn(2, 16, 32, requires_grad=True)
    saved = []

    def pack(t):
        saved.append(t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = ckpt.checkpoint(block, x)
    out.pow(2).sum().backward()
    ckpt.configure(None)
    return {"bytes": sum(saved), "input_bytes": x.numel() * x.element_size(), "grads":
            [x.grad] + [p.grad for p in block.parameters()]}


def test_partitioned_activations_keep_one_mp_th_of_the_saved_bytes_per_rank(pools):
    plain = pools.get(4).run(_saved_bytes, False, timeout=TIMEOUT)
    split = pools.get(4).run(_saved_bytes, True, timeout=TIMEOUT)
    for p, s in zip(plain, split):
        assert p["bytes"] == p["input_bytes"]  # the one saved input, whole
        assert s["bytes"] * 2 == p["bytes"]  # this rank's half of it
        for a, b in zip(p["grads"], s["grads"]):  # gathered back exactly for the recompute
            assert torch.equal(a, b)


def _inputs_partitioned(how: str) -> str:
    """Partitioned activations given: ``own``, each tensor-parallel rank its own input (its part of the
    sequence, as Megatron's sequence parallelism gives it); ``half``, inputs equal but in the half rank
    1 keeps, which differs on rank 1; ``view``, the same input on every rank, a view at a 4-byte offset."""
    mpu = m.TinyMPU(2)
    ckpt.configure(mpu, partition_activations=True)
    torch.manual_seed(0)
    block = m.Block(m.Config(), mpu)
    mp_rank = mpu.get_model_parallel_rank()
    x = torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(dist.get_rank() if how == "own" else 0))
    if how == "half":
        x.view(-1)[x.numel() // 2:] += mp_rank
    elif how == "view":
        x = torch.cat([torch.zeros(1), x.reshape(-1)])[1:].view(2, 8, 32)
    x.requires_grad_(True)
    out = ckpt.checkpoint(block, x)
    try:
        out.pow(2).sum().backward()
    except zero3.ZeroStateError as exc:
        return str(exc)
    finally:
        ckpt.configure(None)
    return "no error"


@pytest.mark.parametrize("how", ["own", "half"])
def test_partitioned_activations_refuse_inputs_that_differ_across_the_tensor_parallel_ranks(pools, how):
    """The recompute gathered the ranks' slices of their different inputs into an input no rank had:
    on 2 x 2 ranks with sequence parallelism, weights 0.13 relative off the full model after 4 steps,
    silently (probe 28A). Every rank refuses, also the one whose own half matched (review 28X: it
    recomputed on, and hung in the block's next collective)."""
    for message in pools.get(4).run(_inputs_partitioned, how, timeout=TIMEOUT):
        assert "the 2 model-parallel ranks passed different values as input 0 (shape (2, 8, 32))" \
               in message and "Set partition_activations false" in message


def test_partitioned_activations_take_the_same_input_from_a_view_at_any_offset(pools):
    """The fingerprint summed 64-bit words from an 8-byte boundary and bytes elsewhere, so an input
    viewed at a 4-byte offset was refused though every rank passed it (review 28X)."""
    assert pools.get(4).run(_inputs_partitioned, "view", timeout=TIMEOUT) == ["no error"] * 4


# -- checkpoints ---------------------------------------------------------------------------------------
def _train_save_resume(path: str, phase: str) -> dict:
    """``save``: 2 x 2 ranks train 3 steps and save. ``resume``: 2 x 1 ranks (another data-parallel
    size, the same global batch) load and train 3 more. ``wrong``: 1 x 2 ranks try to load."""
    cfg = m.Config()
    if phase == "save":
        engine, mpu = m.build(cfg, m.RunConfig(tp=2))
        per, steps = 2, range(3)
    else:
        engine, mpu = m.build(cfg, m.RunConfig(tp=2 if phase == "resume" else 1))
        try:
            engine.load_checkpoint(path)
        except zero3.CheckpointMismatchError as exc:
            return {"error": str(exc)}
        per, steps = 4, range(3, 6)
    dp, dp_rank = mpu.get_data_parallel_world_size(), mpu.get_data_parallel_rank()
    losses = []
    for step in steps:
        x, y = m.synthetic_batch(step, per * dp, cfg)
        loss = engine(x[dp_rank * per:(dp_rank + 1) * per], y[dp_rank * per:(dp_rank + 1) * per])
        engine.backward(loss)
        zero3.clip_grad_norm_(engine, 0.5)
        engine.step()
        loss = loss.detach()
        if dp > 1:
            dist.all_reduce(loss, group=mpu.get_data_parallel_group())
        losses.append(loss.item() / dp)
    if phase == "save":
        engine.save_checkpoint(path, tag="t3")
    return {"losses": losses}


def test_checkpoints_keep_a_directory_per_model_parallel_rank_and_resume_at_another_dp_size(pools, tmp_path):
    path = str(tmp_path / "ckpt")
    saved = pools.get(4).run(_train_save_resume, path, "save", timeout=TIMEOUT)
    assert sorted(os.listdir(tmp_path / "ckpt" / "t3")) == ["model_parallel.json", "mp_rank_00", "mp_rank_01"]
    assert json.loads((tmp_path / "ckpt" / "t3" / "model_parallel.json").read_text())["model_parallel_world_size"] == 2
    for r in range(2):
        meta = json.loads((tmp_path / "ckpt" / "t3" / f"mp_rank_{r:02d}" / "metadata.json").read_text())
        assert meta["world_size"] == 2 and meta["model_parallel"] == {"rank": r, "world_size": 2}
    resumed = pools.get(2).run(_train_save_resume, path, "resume", timeout=TIMEOUT)
    ref = reference(m.Config(), m.RunConfig(steps=6), dp=2)
    for r in saved:
        assert _close(r["losses"], ref["loss"][:3]) < 1e-5
    for r in resumed:
        assert _close(r["losses"], ref["loss"][3:]) < 1e-5, (r["losses"], ref["loss"][3:])
    wrong = pools.get(2).run(_train_save_resume, path, "wrong", timeout=TIMEOUT)
    for r in wrong:
        assert "saved by 2 model-parallel ranks" in r["error"]
    # Offline, each model-parallel rank's slices consolidate into the state dict its model code holds.
    out = consolidate(path, tmp_path / "mp1.pt", model_parallel_rank=1)
    sd = torch.load(out)
    assert tuple(sd["h.0.attn.q.weight"].shape) == (16, 32) and tuple(sd["h.0.mlp.proj.weight"].shape) == (32, 64)
    with pytest.raises(zero3.CheckpointMismatchError, match="pass model_parallel_rank"):
        consolidate(path, tmp_path / "all.pt")


def overflow_on_one_tensor_parallel_rank() -> dict:
    """fp16 with an mpu (2 tensor-parallel ranks, data-parallel size 1): an inf in one rank's gradient
    of its tensor-parallel slice. Both ranks must skip the step , or the
    slices of one weight step apart, and their loss scalers must stay alike."""
    cfg = m.Config(checkpoint=False)
    engine, mpu = m.build(cfg, m.RunConfig(zero={"param_persistence_threshold": 0, "fp16": {"enabled": True, "initial_scale_power": 4}}))
    x, y = m.synthetic_batch(0, 2, cfg)
    engine.backward(engine(x, y))
    before = [zero3.safe_get_local_fp32_param(p).clone() for p in engine.module.parameters()]
    if mpu.get_model_parallel_rank() == 0:
        p = next(p for p in engine.module.parameters() if getattr(p, "tensor_model_parallel", False))
        p._zero.train_tensor.grad.view(-1)[0] = float("inf")
    engine.step()
    after = [zero3.safe_get_local_fp32_param(p) for p in engine.module.parameters()]
    return {"skipped": engine.skipped_steps, "unchanged": all(torch.equal(a, b) for a, b in zip(after, before)),
            "scaler": engine.context.optimizer.scaler.state_dict()}


def test_an_fp16_overflow_on_one_tensor_parallel_rank_skips_the_step_on_every_rank(pools):
    results = pools.get(2).run(overflow_on_one_tensor_parallel_rank, timeout=TIMEOUT)
    for r in results:
        assert r["skipped"] == 1 and r["unchanged"], r
    assert results[0]["scaler"] == results[1]["scaler"]
