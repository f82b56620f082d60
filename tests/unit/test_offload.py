"""Offload at world size 1: the config keys, the swap primitives, parameter and optimizer offload to
CPU and NVMe against training without offload (bit for bit), and offload_states/reload_states."""

from __future__ import annotations

import concurrent.futures
import logging
import re

import pytest
import torch
from torch import nn

import zero3
from zero3 import ZeroConfig, ZeroConfigError, ZeroStateError
from zero3.offload.nvme import StorageTier
from zero3.offload.pool import BufferPool
from zero3.offload.swapfile import ALIGN, AsyncIO, SwapFile, uint8_view
from zero3.offload.policy import PlacementPolicy
from zero3.partition import param as zparam
from zero3.partition.state import Residence

from _used_twice import UsedTwice
from gpt import GPT, GPTConfig, synthetic_batch

CFG = GPTConfig(block_size=16)
BASE = {"param_persistence_threshold": 100, "max_reuse_distance": 0, "prefetch_bucket_size": 3000}


def nvme(path, **kw):
    return {"device": "nvme", "nvme_path": str(path), **kw}


def _engine(cfg: dict, init: bool = False):
    torch.manual_seed(0)
    if init:
        with zero3.Init(config_dict_or_path=cfg):
            model = GPT(CFG)
    else:
        model = GPT(CFG)
    return zero3.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-6), cfg)


def _train(engine, steps, start=0) -> list[float]:
    losses = []
    for step in range(start, start + steps):
        x, y = synthetic_batch(step, 2, CFG)
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def _weights(engine) -> list[torch.Tensor]:
    out = []
    for p in engine.params:
        with zero3.GatheredParameters([p]):
            out.append(p.detach().clone())
    return out


# -- config -------------------------------------------------------------------------------------------
def test_deepspeed_offload_keys_map_onto_fields(tmp_path, caplog):
    ds = {"zero_optimization": {"stage": 3, "sub_group_size": 5e6,
                                "offload_param": {"device": "nvme", "nvme_path": str(tmp_path), "pin_memory": True,
                                                  "buffer_count": 4, "buffer_size": 1e6, "max_in_cpu": 0},
                                "offload_optimizer": {"device": "nvme", "nvme_path": str(tmp_path), "buffer_count": 4,
                                                      "pipeline_read": True, "ratio": 1}},
          "aio": {"thread_count": 2, "block_size": 1048576, "queue_depth": 8}}
    with caplog.at_level(logging.INFO, logger="zero3.config"):
        cfg = ZeroConfig.from_dict(ds)
    assert (cfg.offload.offload_param, cfg.offload.offload_param_nvme_path, cfg.offload.offload_param_pin_memory) == ("nvme", str(tmp_path), True)
    assert (cfg.offload.offload_param_buffer_count, cfg.offload.offload_param_buffer_size, cfg.offload.offload_param_max_in_cpu) == (4, 10**6, 0)
    assert (cfg.offload.offload_optimizer, cfg.offload.offload_optimizer_nvme_path) == ("nvme", str(tmp_path))
    assert (cfg.offload.sub_group_size, cfg.offload.aio_thread_count) == (5 * 10**6, 2)
    assert "offload_optimizer.buffer_count has no effect" in caplog.text and "aio.queue_depth" in caplog.text
    assert ZeroConfig.from_dict(cfg.to_dict()) == cfg
    ours = ZeroConfig.from_dict({"offload_param": {"device": "cpu", "pin_memory": False}})
    assert (ours.offload.offload_param, ours.offload.offload_param_pin_memory) == ("cpu", False)


def test_placement_policy_answers_where_everything_lives(tmp_path):
    cfg = ZeroConfig.from_dict({"dtype": "bf16", "aio": {"thread_count": 3},
                                "offload_param": nvme(tmp_path / "p", max_in_cpu=10, buffer_count=2),
                                "offload_optimizer": {"device": "cpu", "pin_memory": True}})
    placement = PlacementPolicy.from_config(cfg)
    assert placement.params_on_drive and not placement.params_on_host and placement.param_buffer_count == 2
    assert placement.optimizer_offloaded and not placement.optimizer_on_drive and placement.separate_masters
    assert placement.pin_masters == torch.cuda.is_available() and placement.aio_threads == 3
    assert placement.states_nvme_path(None) == str(tmp_path / "p") and placement.states_nvme_path("x") == "x"
    budget = placement.in_memory_budget()
    assert [budget.stays(False, n) for n in (4, 7, 6, 1)] == [True, False, True, False] and budget.budget == 0
    both_on_host = PlacementPolicy.from_config(ZeroConfig(offload_optimizer="cpu", offload_param="cpu"))
    only_optimizer = PlacementPolicy.from_config(ZeroConfig(offload_optimizer="cpu"))
    assert not both_on_host.separate_masters and only_optimizer.separate_masters


@pytest.mark.parametrize("d,pattern", [
    ({"zero_optimization": {"offload_param": {"device": "nvme"}}}, r"offload_param='nvme' needs offload_param_nvme_path"),
    ({"zero_optimization": {"offload_optimizer": {"device": "cpu", "ratio": 0.5}}}, r"ratio 0\.5 is not supported"),
    ({"zero_optimization": {"offload_param": {"device": "cpu", "buffer_szie": 1}}},
     r"unknown config key 'buffer_szie'; did you mean 'buffer_size'"),
    ({"aio": {"use_gds": True}}, r"aio\.use_gds \(GPUDirect Storage\) is not supported"),
    ({"offload_param": "disk"}, r"offload_param must be one of \('none', 'cpu', 'nvme'\), got 'disk'"),
    ({"offload_param_buffer_count": 0}, r"offload_param_buffer_count must be >= 1, got 0"),
    ({"offload_param_nvme_path": ""}, r"offload_param_nvme_path must be None or a non-empty path string"),
])
def test_invalid_offload_config_names_the_key_and_value(d, pattern):
    with pytest.raises(ZeroConfigError, match=pattern):
        ZeroConfig.from_dict(d)


# -- the swap primitives ------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype,numel,offset", [(torch.float32, 3000, 0), (torch.bfloat16, 5, 1), (torch.uint8, 3 * ALIGN, 7)])
def test_swap_file_round_trips_aligned_and_unaligned_memory(tmp_path, dtype, numel, offset):
    io = AsyncIO(2)
    f = SwapFile(str(tmp_path), "test")
    assert list(tmp_path.iterdir()) == []  # unlinked at once: nothing is left behind, even after a crash
    src = torch.arange(numel + offset).to(dtype)[offset:]  # offset: an unaligned start
    other = torch.full((100,), 3.0)
    off_a = f.region("a", src.numel() * src.element_size())
    off_b = f.region("b", other.numel() * 4)
    assert off_a % ALIGN == 0 and off_b % ALIGN == 0 and off_b >= off_a + src.numel() * src.element_size()
    io.write(f, off_a, uint8_view(src)).result()
    io.write(f, off_b, uint8_view(other)).result()
    back = torch.empty_like(src)
    io.read(f, off_a, uint8_view(back)).result()
    assert torch.equal(back, src)
    assert io.write_bytes == src.numel() * src.element_size() + 400 and io.read_bytes == src.numel() * src.element_size()


def test_buffer_pool_packs_slots_reuses_a_buffer_once_free_and_refuses_when_full():
    pool = BufferPool(2, 3 * ALIGN)
    a, b, c = pool.alloc(100), pool.alloc(ALIGN + 1), pool.alloc(ALIGN)  # 1 + 2 blocks fill buffer 0; c starts buffer 1
    assert (a.buffer, b.buffer, c.buffer) == (0, 0, 1) and a.data.data_ptr() % ALIGN == 0
    assert b.data.data_ptr() == a.data.data_ptr() + ALIGN
    assert pool.alloc(3 * ALIGN) is None  # buffer 0 is full and buffer 1 is in use
    assert pool.alloc(4 * ALIGN) is None  # never fits one buffer
    pool.free(a)
    pool.free(b)
    d = pool.alloc(3 * ALIGN)  # buffer 0 is free again: reused from its start
    assert d.buffer == 0 and d.data.data_ptr() == a.data.data_ptr()
    assert pool.in_use == 4 * ALIGN and pool.allocated_bytes == 6 * ALIGN
    pool.free(c)
    assert pool.release_memory() == 3 * ALIGN and pool.allocated_bytes == 3 * ALIGN


def test_storage_tier_frees_the_storage_and_brings_it_back_under_every_view(tmp_path):
    tier = StorageTier(AsyncIO(1), SwapFile(str(tmp_path), "test"))
    flat = torch.randn(1000)
    view = flat[10:20].view(2, 5)
    expected = flat.clone()
    tier.swap_out("flat", flat.untyped_storage())
    tier.wait()
    assert flat.untyped_storage().nbytes() == 0 and tier.state("flat") is Residence.DRIVE
    assert tier.nvme_bytes == 4000
    tier.swap_in("flat")
    tier.wait(["flat"])
    assert torch.equal(flat, expected) and torch.equal(view, expected[10:20].view(2, 5))
    assert tier.state("flat").in_memory and tier.nvme_bytes == 0


def test_a_failed_write_raises_and_leaves_the_bytes_in_memory(tmp_path, monkeypatch):
    tier = StorageTier(AsyncIO(1), SwapFile(str(tmp_path), "test"))
    t = torch.randn(100)
    keep = t.clone()

    def full_disk(*args, **kwargs):
        raise OSError(28, "zero3: writing 400 bytes ... failed: No space left on device")

    monkeypatch.setattr(SwapFile, "transfer", full_disk)
    tier.swap_out("t", t.untyped_storage())
    with pytest.raises(OSError, match="No space left on device"):
        tier.wait()
    assert tier.state("t").in_memory and torch.equal(t, keep)


def test_a_reserved_region_holds_its_blocks_before_it_is_written_and_a_full_drive_names_the_choice(
        tmp_path, monkeypatch):
    import errno
    import os

    f = SwapFile(str(tmp_path), "optimizer")
    at = f.reserve("k", 10 * ALIGN + 5)
    assert at == 0 and f.region("k", 10 * ALIGN + 5) == 0  # an ordinary region, with its blocks allocated now
    assert os.fstat(f.fd).st_blocks * 512 >= 11 * ALIGN
    assert f.reserve("j", 100) == 11 * ALIGN

    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "posix_fallocate", full)
    with pytest.raises(OSError, match=r"reserving 4096 bytes at offset 49152 of the optimizer swap file under .*"
                                      r"No space left on device\. A staged optimizer step keeps two regions of every "
                                      r"key on the drive; .*offload_optimizer_staged_step=False"):
        f.reserve("i", 1)

    def unsupported(fd, offset, length):
        raise OSError(errno.EOPNOTSUPP, os.strerror(errno.EOPNOTSUPP))

    monkeypatch.setattr(os, "posix_fallocate", unsupported)  # a filesystem without fallocate: the write allocates
    assert f.reserve("h", 1) == 13 * ALIGN


# -- parameter and optimizer offload --------------------------------------------------------------------
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_every_offload_combination_trains_like_no_offload_bit_for_bit(tmp_path, dtype):
    base = {**BASE, "dtype": dtype, "gradient_clipping": 0.5}
    refs = {init: _engine(base, init=init) for init in (False, True)}  # Init(bf16) seeds masters from bf16
    expected = {init: _train(ref, 4) for init, ref in refs.items()}
    params = nvme(tmp_path, max_in_cpu=3000, buffer_size=20000)
    for extra in ({"offload_param": {"device": "cpu"}},
                  {"offload_param": params},
                  {"offload_optimizer": nvme(tmp_path), "sub_group_size": 5000},
                  {"offload_param": params, "offload_optimizer": nvme(tmp_path), "sub_group_size": 5000}):
        for init in (False, True):
            engine = _engine({**base, **extra}, init=init)
            assert _train(engine, 4) == expected[init], (extra, init)
            for w, r in zip(_weights(engine), _weights(refs[init])):
                assert torch.equal(w, r), (extra, init)


def test_nvme_shards_hold_no_memory_between_gathers_and_are_read_ahead_along_the_trace(tmp_path):
    engine = _engine({**BASE, "offload_param": nvme(tmp_path, max_in_cpu=0, buffer_size=20000, buffer_count=2),
                      "offload_optimizer": nvme(tmp_path)})
    tier = engine.coordinator.shards
    on_nvme = [p for p in engine.params if p._zero.swap is not None]
    assert on_nvme and all(p.ds_persist for p in engine.params if p._zero.swap is None)  # only persistent ones stay
    peak = []
    real = tier.read

    def read(params, **kw):
        missed = real(params, **kw)
        peak.append(tier.pool.in_use)
        return missed

    tier.read = read
    _train(engine, 3)
    m = engine.last_step_metrics
    assert m.nvme_reads_ahead > 0  # the trace is followed from the second step: shards were read ahead
    assert max(peak) <= tier.pool.capacity and tier.pool.in_use == 0
    assert all(p._zero.shard.untyped_storage().nbytes() == 0 for p in on_nvme)
    report = engine.memory_report()
    assert report["param_shard_bytes"] == sum(p._zero.shard.numel() * 4 for p in engine.params if p.ds_persist)
    assert report["optimizer_state_bytes"] == 0  # AdamW's moments live on the drive between steps
    assert report["nvme_bytes"] == report["offloaded_bytes"] > 0


def test_init_writes_shards_to_nvme_as_the_model_is_built(tmp_path):
    cfg = {**BASE, "offload_param": nvme(tmp_path, max_in_cpu=0, buffer_size=20000)}
    torch.manual_seed(0)
    with zero3.Init(config_dict_or_path=cfg):
        model = GPT(CFG)
    big = [p for p in model.parameters() if p.ds_numel > 100]
    assert big and all(p._zero.swap is not None and p.ds_tensor.untyped_storage().nbytes() == 0 for p in big)
    with pytest.raises(ZeroConfigError, match=r"partitioned onto NVMe by zero3\.Init.*offload_param='none'"):
        zero3.initialize(model, None, BASE)
    torch.manual_seed(0)
    plain = dict(GPT(CFG).named_parameters())  # the same draws, never partitioned
    name = next(n for n, p in model.named_parameters() if p is big[0])
    with zero3.GatheredParameters(big[:1]):  # read back for the gather, released after
        assert torch.equal(big[0].detach(), plain[name].detach())
    assert big[0].ds_tensor.untyped_storage().nbytes() == 0


def test_init_remote_device_nvme_needs_a_path_and_shards_must_fit_one_pool_buffer(tmp_path):
    with pytest.raises(ZeroConfigError, match=r"remote_device='nvme'\) needs offload_param\.nvme_path"):
        zero3.Init(remote_device="nvme")
    cfg = {"param_persistence_threshold": 0, "offload_param": nvme(tmp_path, max_in_cpu=0, buffer_size=100)}
    with pytest.raises(ZeroConfigError, match=r"shard of Linear\.weight \(4096 elements.*buffer_size >= 4096"):
        with zero3.Init(remote_device="nvme", config_dict_or_path=cfg):
            nn.Linear(64, 64)


def test_checkpoints_and_accessors_read_and_write_state_that_lives_on_nvme(tmp_path):
    cfg = {**BASE, "offload_param": nvme(tmp_path, max_in_cpu=0, buffer_size=20000),
           "offload_optimizer": nvme(tmp_path)}
    engine = _engine(cfg)
    _train(engine, 2)
    i, p = next((i, q) for i, q in enumerate(engine.params) if q._zero.swap is not None)
    before = zero3.safe_get_full_optimizer_state(p, "exp_avg")
    assert p.ds_tensor.untyped_storage().nbytes() == 0  # read for the call only
    assert engine.context.optimizer_state(p)["exp_avg"].untyped_storage().nbytes() == 0
    with pytest.raises(zero3.ZeroStateError, match="live on NVMe between steps"):  # a read would crash
        engine.optimizer_state(p)
    with pytest.raises(zero3.ZeroStateError, match="live on NVMe between steps"):
        engine.master_shard(p)
    engine.save_checkpoint(tmp_path / "ckpt")
    other = _engine(cfg)
    other.load_checkpoint(tmp_path / "ckpt")
    assert torch.equal(zero3.safe_get_full_optimizer_state(other.params[i], "exp_avg"), before)
    assert _train(other, 2, start=2) == _train(engine, 2, start=2)
    zero3.safe_set_full_fp32_param(p, torch.zeros(p.ds_shape))
    assert torch.equal(zero3.safe_get_full_fp32_param(p), torch.zeros(p.ds_shape))


# -- offload_states / reload_states --------------------------------------------------------------------
@pytest.mark.parametrize("extra", [{}, {"dtype": "bf16"}], ids=["fp32", "bf16"])
def test_offload_states_round_trip_frees_the_storages_and_training_continues_exactly(tmp_path, extra):
    cfg = {**BASE, **extra}
    expected = _train(_engine(cfg), 8)
    engine = _engine(cfg)
    got = _train(engine, 3)
    x, y = synthetic_batch(99, 2, CFG)
    engine.backward(engine(x, y))  # leaves gradient shards: lp_grads has something to move
    grads = [p._zero.train_tensor.grad.clone() for p in engine.params]
    before = engine.memory_report()
    moved = engine.offload_states(device="nvme", nvme_path=str(tmp_path))
    after = engine.memory_report()
    held = before["param_shard_bytes"] + before["optimizer_state_bytes"] + before["grad_shard_bytes"]
    assert held <= moved <= held + before["gathered_param_bytes"]  # one rank: persistent params are views of shards
    for key in ("param_shard_bytes", "optimizer_state_bytes", "master_bytes", "grad_shard_bytes", "gathered_param_bytes"):
        assert after[key] == 0, key
    assert after["nvme_bytes"] == after["offloaded_bytes"] == moved
    assert all(p._zero.shard.untyped_storage().nbytes() == 0 for p in engine.params)
    engine.reload_states()
    assert engine.memory_report() == before
    assert all(torch.equal(p._zero.train_tensor.grad, g) for p, g in zip(engine.params, grads))
    engine.zero_grad()
    got += _train(engine, 5, start=3)
    assert got == expected


def test_offload_states_subset_non_blocking_and_cpu(tmp_path):
    engine = _engine(BASE)
    _train(engine, 2)
    state = engine.optimizer_state(engine.params[0])["exp_avg"]
    keep = state.clone()
    engine.offload_states(include=["optim_states"], device="nvme", nvme_path=str(tmp_path), non_blocking=True)
    assert engine.params[0]._zero.shard.untyped_storage().nbytes() > 0  # lp_params were not included
    engine.reload_states(non_blocking=True)
    x, y = synthetic_batch(2, 2, CFG)
    engine.backward(engine(x, y))  # waits for the reads when the step begins
    assert torch.equal(state, keep) and engine.optimizer_state(engine.params[0])["exp_avg"] is state
    engine.step()
    assert engine.offload_states(device="cpu") == 0  # CPU tensors are in CPU memory already: nothing to free
    with pytest.raises(ZeroStateError, match=r"moved lp_params, hp_params, optim_states, lp_grads \(0\.0 MiB\) to CPU "
                                             r"memory; call engine\.reload_states\(\) first"):
        engine.step()
    engine.reload_states()
    engine.reload_states()  # nothing offloaded: a no-op


class _FailingTransfers:
    """Swap-file transfers of one direction fail from the ``nth`` on (a drive that fills up part-way
    through, or a read that fails), while ``on``."""

    def __init__(self, monkeypatch, write: bool, nth: int) -> None:
        self.write, self.nth, self.calls, self.on = write, nth, 0, True
        real = SwapFile.transfer

        def transfer(file, write, offset, data, bounce):
            if write == self.write and self.on:
                self.calls += 1
                if self.calls >= self.nth:
                    raise OSError(28 if write else 5, f"zero3: transfer at offset {offset} failed (test)")
            return real(file, write, offset, data, bounce)

        monkeypatch.setattr(SwapFile, "transfer", transfer)


@pytest.mark.parametrize("non_blocking", [False, True], ids=["blocking", "non-blocking"])
def test_offload_states_onto_a_drive_that_fills_part_way_loses_nothing(tmp_path, monkeypatch, caplog, non_blocking):
    expected = _train(_engine(BASE), 5)
    engine = _engine(BASE)
    got = _train(engine, 3)
    before = engine.memory_report()
    fault = _FailingTransfers(monkeypatch, write=True, nth=4)  # the first three writes land on the drive
    with caplog.at_level(logging.WARNING, logger="zero3"):
        if non_blocking:  # the failure is known at reload_states, which brings back what did leave memory
            moved = engine.offload_states(device="nvme", nvme_path=str(tmp_path), non_blocking=True)
            tier = engine.context.offloaded._tier
            concurrent.futures.wait([r.future for r in tier._records.values() if r.future is not None])
            report = engine.memory_report()  # the three written: review 30X, the failed writes' bytes counted too
            assert 0 < report["offloaded_bytes"] == report["nvme_bytes"] < moved / 2
            engine.reload_states()
            assert re.search(r"transfers with NVMe \(.*\) failed \(the first: .*transfer at offset .* failed \(test\)\): "
                             r"what they wrote stayed in memory .* so nothing was lost", caplog.text)
        else:
            with pytest.raises(OSError, match=r"transfer at offset .* failed \(test\)"):
                engine.offload_states(device="nvme", nvme_path=str(tmp_path))
            assert "offload_states to NVMe" in caplog.text and "every state is back in memory" in caplog.text
            fault.on = False
            engine.reload_states()  # nothing is offloaded: a no-op
    assert fault.calls > 4  # writes after the failing one were tried too (some landed before it failed)
    assert engine.memory_report() == before
    assert all(p._zero.shard.untyped_storage().nbytes() > 0 for p in engine.params)
    got += _train(engine, 2, start=3)
    assert got == expected


def test_when_reading_back_a_failed_offload_fails_too_the_states_stay_offloaded_for_reload_states(tmp_path,
                                                                                                  monkeypatch):
    """Review 30X: a read failing while a failed blocking offload was undone left a 0-byte shard taken for
    resident (reload_states did nothing, the next step segfaulted)."""
    expected = _train(_engine(BASE), 5)
    engine = _engine(BASE)
    got = _train(engine, 3)
    writes = _FailingTransfers(monkeypatch, write=True, nth=4)
    reads = _FailingTransfers(monkeypatch, write=False, nth=1)
    with pytest.raises(OSError, match=r"transfer at offset .* failed \(test\)"):
        engine.offload_states(device="nvme", nvme_path=str(tmp_path))
    writes.on = reads.on = False
    report = engine.memory_report()
    assert 0 < report["nvme_bytes"] == report["offloaded_bytes"]  # what is on the drive, and only that
    with pytest.raises(ZeroStateError, match="call engine.reload_states"):
        engine.step()
    engine.reload_states()
    assert engine.memory_report()["nvme_bytes"] == 0
    got += _train(engine, 2, start=3)
    assert got == expected


def test_a_read_failing_at_reload_states_is_read_again_by_the_next_call(tmp_path, monkeypatch):
    expected = _train(_engine(BASE), 5)
    engine = _engine(BASE)
    got = _train(engine, 3)
    engine.offload_states(device="nvme", nvme_path=str(tmp_path))
    fault = _FailingTransfers(monkeypatch, write=False, nth=2)
    with pytest.raises(OSError, match=r"transfer at offset .* failed \(test\)"):
        engine.reload_states()
    fault.on = False
    engine.reload_states()
    assert all(p._zero.shard.untyped_storage().nbytes() > 0 for p in engine.params)
    got += _train(engine, 2, start=3)
    assert got == expected


def test_after_an_in_place_step_failed_on_a_full_drive_the_last_checkpoint_loads_and_training_goes_on(
        tmp_path, monkeypatch):
    """The error of a step not staged says to load the last checkpoint. Its other writes failed too (the
    drive stayed full) and each raised again at its key's next use, one per call, so loads kept failing
    and training went on from a half-loaded state (probe 30C: 1e-3 off torch)."""
    cfg = {**BASE, "offload_optimizer": {**nvme(tmp_path / "a"), "staged_step": False}, "sub_group_size": 5000}
    expected = _train(_engine({**cfg, "offload_optimizer": nvme(tmp_path / "b")}), 4)
    engine = _engine(cfg)
    got = _train(engine, 2)
    engine.save_checkpoint(str(tmp_path / "ck"))
    fault = _FailingTransfers(monkeypatch, write=True, nth=2)
    with pytest.raises(OSError, match="not staged.*load the last checkpoint"):
        _train(engine, 1, start=2)
    tier = engine.context.optimizer.states  # every write the failed step issued has ended (failed) before the fix
    concurrent.futures.wait([r.future for r in tier._records.values() if r.future is not None])
    fault.on = False  # the drive has room again
    engine.load_checkpoint(str(tmp_path / "ck"))
    got += _train(engine, 2, start=2)
    assert got == expected


def test_deepspeed_s_enum_members_are_taken_and_its_contiguous_grad_buffer_moves_nothing(tmp_path):
    """DeepSpeed's ``OffloadStateTypeEnum`` (a str enum): its fifth member names a buffer zero3 does not
    keep (probe 30C: refused as "not a state kind")."""
    import enum

    class OffloadStateTypeEnum(str, enum.Enum):  # DeepSpeed's, as deepspeed.runtime.zero.offload_states has it
        optim_states = "optim_states"
        contiguous_grad_buffer = "contiguous_grad_buffer"

    engine = _engine(BASE)
    _train(engine, 1)
    assert engine.offload_states(include=[OffloadStateTypeEnum.contiguous_grad_buffer], device="nvme",
                                 nvme_path=str(tmp_path)) == 0
    _train(engine, 1, start=1)  # nothing was moved: nothing to reload
    moved = engine.offload_states(include=list(OffloadStateTypeEnum), device="nvme", nvme_path=str(tmp_path))
    assert moved == engine.memory_report()["nvme_bytes"] > 0
    with pytest.raises(ZeroStateError, match=r"engine.step\(\) needs optim_states, but engine.offload_states\(\) moved "
                                             r"optim_states \("):
        engine.step()
    engine.reload_states()


def test_offload_states_misuse_raises_naming_what_to_reload(tmp_path):
    engine = _engine(BASE)
    _train(engine, 1)
    p = engine.params[3]
    with zero3.GatheredParameters([p]), pytest.raises(ZeroStateError, match=r"held by GatheredParameters"):
        engine.offload_states(device="nvme", nvme_path=str(tmp_path))
    with pytest.raises(ZeroConfigError, match=r"'weights' is not a state kind; use a subset of"):
        engine.offload_states(include=["weights"])
    with pytest.raises(ZeroConfigError, match=r"device must be 'cpu' or 'nvme'"):
        engine.offload_states(device="disk")
    with pytest.raises(ZeroConfigError, match=r"needs a directory for its swap file"):
        engine.offload_states(device="nvme")
    x, y = synthetic_batch(0, 2, CFG)
    loss = engine(x, y)
    with pytest.raises(ZeroStateError, match=r"between steps"):
        engine.offload_states(device="nvme", nvme_path=str(tmp_path))
    engine.backward(loss)
    engine.step()
    engine.offload_states(include=["lp_params"], device="nvme", nvme_path=str(tmp_path))
    where = re.escape("needs lp_params") + r".*moved lp_params \([0-9.]+ MiB\) to NVMe \(" + \
        re.escape(str(tmp_path)) + r"\); call engine\.reload_states\(\) first"
    for call in (lambda: engine(x, y), lambda: engine.module(x, y), engine.step,
                 lambda: zero3.GatheredParameters([p]).__enter__(), lambda: engine.save_checkpoint(tmp_path / "c"),
                 lambda: zero3.safe_get_full_fp32_param(p), lambda: engine.consolidated_state_dict()):
        with pytest.raises(ZeroStateError, match=where):
            call()
    with pytest.raises(ZeroStateError, match=r"lp_params are already offloaded to NVMe .*reload_states\(\) before"):
        engine.offload_states(device="cpu")
    engine.reload_states()
    assert engine.coordinator.live_params == []
    _train(engine, 1, start=1)


def test_with_optimizer_state_and_masters_offloaded_the_model_still_runs_forwards(tmp_path):
    """The RL pattern: during generation only the weights are needed."""
    engine = _engine({**BASE, "dtype": "bf16"})
    _train(engine, 2)
    x, y = synthetic_batch(5, 2, CFG)
    with torch.no_grad():
        before = engine(x, y)
    engine.offload_states(include=["optim_states", "hp_params", "lp_grads"], device="nvme", nvme_path=str(tmp_path))
    assert engine.memory_report()["optimizer_state_bytes"] == 0 and engine.memory_report()["param_shard_bytes"] > 0
    with torch.no_grad():
        assert torch.equal(engine(x, y), before)  # inference needs only lp_params
        with engine.generation():
            engine(x, y)
    with pytest.raises(ZeroStateError, match=r"a forward of the model needs lp_grads, but"):
        engine(x, y)  # with grad on, its backward would add into the gradient shards
    with pytest.raises(ZeroStateError, match=r"engine\.step\(\) needs optim_states, hp_params, lp_grads"):
        engine.step()
    with pytest.raises(ZeroStateError, match=r"safe_get_full_optimizer_state needs optim_states"):
        zero3.safe_get_full_optimizer_state(engine.params[0], "exp_avg")
    engine.reload_states()
    _train(engine, 1, start=2)


def test_offload_states_takes_the_shards_out_of_memory_and_reload_puts_them_back_where_they_were(tmp_path):
    engine = _engine({**BASE, "dtype": "bf16"})
    _train(engine, 1)
    where = [p._zero.residence for p in engine.params]
    persistent = [p for p in engine.params if p.ds_persist]
    assert persistent and all(p.ds_status is zero3.ParamStatus.AVAILABLE for p in persistent)
    engine.offload_states(include=["lp_params"], device="nvme", nvme_path=str(tmp_path))
    assert all(p._zero.residence is Residence.STATES_OUT for p in engine.params)
    assert all(p.ds_status is zero3.ParamStatus.AVAILABLE for p in persistent)  # taken while gathered, explicitly
    with pytest.raises(ZeroStateError, match="not in memory"):
        zparam.begin_gather(next(p for p in engine.params if not p.ds_persist), None)
    with pytest.raises(ZeroStateError, match="already offloaded"):
        engine.offload_states(device="cpu")
    engine.reload_states()
    assert [p._zero.residence for p in engine.params] == where


@pytest.mark.parametrize("checkpoint,optimizer", [(None, "nvme"), ("zero3", "nvme"), ("reentrant", "nvme"),
                                                  ("non_reentrant", "nvme"), (None, "none"), ("reentrant", "none")])
def test_the_step_in_backward_trains_a_tied_gpt_as_the_step_after_it_at_world_size_1(tmp_path, checkpoint, optimizer):
    """GPT ties its embedding to its output (one parameter used twice) and, with ``checkpoint``,
    recomputes each block inside the backward (a nested backward for "zero3" and "reentrant"): every
    gradient still lands once, so the sub-groups stepped in backward give the same model, bit for bit."""
    global CFG
    saved, CFG = CFG, GPTConfig(block_size=16, checkpoint=checkpoint)
    try:
        runs = {}
        for in_backward in (False, True):
            cfg = {**BASE, "param_persistence_threshold": 0, "sub_group_size": 400, "reduce_bucket_size": 500,
                   "offload_optimizer": {"device": "none", "step_in_backward": in_backward}}
            if optimizer == "nvme":
                cfg.update(offload_param=nvme(tmp_path / f"{in_backward}", max_in_cpu=0),
                           offload_optimizer=nvme(tmp_path / f"{in_backward}", step_in_backward=in_backward))
            engine = _engine(cfg, init=True)
            losses = _train(engine, 3)
            bstep = engine.context.optimizer.backward_step
            runs[in_backward] = (losses, _weights(engine), bstep.steps_in_backward if bstep else 0,
                                 len(engine.context.optimizer.streamer.subgroups))
        (l0, w0, _, _), (l1, w1, stepped, subs) = runs[False], runs[True]
        assert l0 == l1 and all(torch.equal(a, b) for a, b in zip(w0, w1))
        assert subs > 3 and stepped == 3 * subs, (stepped, subs)  # every sub-group of every step, inside backward
    finally:
        CFG = saved


def test_a_checkpoint_or_remove_hooks_between_a_backward_that_stepped_and_engine_step_is_refused(tmp_path):
    """remove_hooks there left weights stepped and counters not (review 30Z2)."""
    cfg = {**BASE, "offload_optimizer": nvme(tmp_path / "swap", step_in_backward=True)}
    engine = _engine(cfg)
    _train(engine, 1)
    engine.save_checkpoint(str(tmp_path / "ckpt"), tag="one")
    x, y = synthetic_batch(1, 2, CFG)
    engine.backward(engine(x, y))
    for call in (lambda: engine.save_checkpoint(str(tmp_path / "ckpt"), tag="two"),
                 lambda: engine.load_checkpoint(str(tmp_path / "ckpt"), tag="one"), engine.remove_hooks):
        with pytest.raises(ZeroStateError, match=r"between a backward that stepped the optimizer .* call engine.step\(\) "
                                                 "first"):
            call()
    engine.step()  # nothing was lost: the step is agreed and taken, and checkpoints work again
    engine.save_checkpoint(str(tmp_path / "ckpt"), tag="two")
    assert engine.global_steps == 2
    reference = _engine({**BASE, "offload_optimizer": nvme(tmp_path / "ref")})
    _train(reference, 2)
    assert all(torch.equal(a, b) for a, b in zip(_weights(engine), _weights(reference)))


def test_with_the_step_in_backward_a_setting_changed_before_engine_step_fails_the_step_and_a_scheduler_works(
        tmp_path):
    """The sub-groups step with the lr in force during the backward. A change between that backward and
    engine.step() would apply to a step already taken: staged, the step is refused and undone, and the
    gradient accessors refuse the gradients it used; a scheduler given to initialize (it steps after
    engine.step()) and an lr set before the backward train as without the option."""
    def lr_at(step):
        return 1.0 / (1 + step)

    cfg = {**BASE, "sub_group_size": 400}

    def build(in_backward):
        torch.manual_seed(0)
        model = GPT(CFG)
        c = {**cfg, "offload_optimizer": nvme(tmp_path / f"swap{in_backward}", step_in_backward=in_backward)}
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-6)
        return zero3.initialize(model, opt, c, lr_scheduler=lambda o: torch.optim.lr_scheduler.LambdaLR(o, lr_at))

    reference, engine = build(False), build(True)
    for e in (reference, engine):
        _train(e, 2)
    assert _weights(engine) and all(torch.equal(a, b) for a, b in zip(_weights(engine), _weights(reference)))
    before = _weights(engine)
    x, y = synthetic_batch(2, 2, CFG)
    engine.backward(engine(x, y))
    p = next(q for q in engine.params if q.numel() > 100)
    with pytest.raises(ZeroStateError, match=r"safe_get_full_grad\(.*used by the optimizer step taken in this backward"):
        zero3.safe_get_full_grad(p)
    with pytest.raises(ZeroStateError, match=r"param.grad\(.*used by the optimizer step taken in this backward"):
        torch.nn.utils.clip_grad_norm_(engine.module.parameters(), 1.0)  # not a silent 0
    engine.optimizer.param_groups[0]["lr"] = 1e-3
    with pytest.raises(ZeroStateError, match=r"taken on no rank.*param group 0's 'lr' changed from 0\.003.* to 0\.001"):
        engine.step()
    assert all(torch.equal(a, b) for a, b in zip(_weights(engine), before))  # undone
    for e in (reference, engine):  # the lr set before the backward: both step with it
        e.optimizer.param_groups[0]["lr"] = 1e-3
        _train(e, 1, start=2)
    assert all(torch.equal(a, b) for a, b in zip(_weights(engine), _weights(reference)))


def test_the_step_in_backward_with_one_sub_group_warns_that_it_holds_every_gradient(tmp_path, caplog):
    cfg = {**BASE, "offload_optimizer": nvme(tmp_path, step_in_backward=True)}  # default sub_group_size: 1e9
    with caplog.at_level(logging.WARNING, logger="zero3.optim.optimizer"):
        engine = _engine(cfg)
    assert len(engine.context.optimizer.streamer.subgroups) == 1
    assert "with one sub-group (sub_group_size 1000000000" in caplog.text and "set sub_group_size below" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="zero3.optim.optimizer"):
        _engine({**cfg, "sub_group_size": 400})
    assert "with one sub-group" not in caplog.text


def test_a_weight_gathered_again_after_its_sub_group_stepped_fails_the_step_in_backward(tmp_path):
    def run(in_backward: bool):
        torch.manual_seed(0)
        model = UsedTwice()
        cfg = {"param_persistence_threshold": 0, "sub_group_size": 72,  # m's weight and bias: one sub-group
               "max_reuse_distance": 0,  # m is released after its backward: the recompute gathers it again
               "offload_optimizer": {"device": "none", "step_in_backward": in_backward}}
        engine = zero3.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-6), cfg)
        torch.manual_seed(1)
        engine.backward(engine(torch.randn(4, 8, requires_grad=True)))
        engine.step()

    run(False)  # the step after the backward trains it
    with pytest.raises(ZeroStateError, match=r"m.weight was used after the optimizer stepped it in this backward"):
        run(True)  # without the check it trains on, with n's gradient computed from the new m


def test_with_the_step_in_backward_a_training_forward_needs_the_optimizer_state_back(tmp_path):
    """offload_states lets a training forward run with the optimizer state out (engine.step() needs
    it back); with the step in backward that forward's backward steps, so the forward asks for it."""
    for in_backward in (False, True):
        engine = _engine({**BASE, "offload_optimizer": {"device": "none", "step_in_backward": in_backward}})
        _train(engine, 1)
        engine.offload_states(include=["optim_states"], device="cpu")
        x, y = synthetic_batch(1, 2, CFG)
        if in_backward:
            with pytest.raises(ZeroStateError, match=r"a forward of the model needs .*optim_states.* call "
                                                     r"engine\.reload_states\(\) first"):
                engine(x, y)
        else:
            engine.backward(engine(x, y))  # the state is needed only by engine.step()
        engine.reload_states()
        if in_backward:
            engine.backward(engine(x, y))  # nothing was lost: after the reload it trains on
        engine.step()


@pytest.mark.parametrize("where", ["parameters", "optimizer", "both"])
def test_a_rollout_under_inference_mode_with_state_on_nvme_equals_torch_and_training_goes_on(tmp_path, where):
    """The swap pool's buffers and the byte views the swap threads write through, made under
    ``torch.inference_mode()``, were inference tensors that the threads could not fill: the rollout
    failed ('Inplace update to inference tensor outside InferenceMode') at the first forward, in
    offload_states/reload_states, consolidated_state_dict and load_checkpoint inside the mode."""
    cfg = dict(BASE)
    if where != "optimizer":
        cfg["offload_param"] = nvme(tmp_path / "p", max_in_cpu=0)
    if where != "parameters":
        cfg["offload_optimizer"] = nvme(tmp_path / "o")
    engine = _engine(cfg)
    engine.save_checkpoint(tmp_path / "ck", tag="t0")
    torch.manual_seed(0)
    ref = GPT(CFG)
    x, _ = synthetic_batch(0, 2, CFG)
    for _ in range(2):
        with torch.inference_mode():
            got = engine(x)
        with torch.no_grad():
            assert torch.equal(got, ref(x))
    _train(engine, 1)
    with torch.inference_mode():
        engine.offload_states(device="nvme", nvme_path=str(tmp_path / "states"))
        engine.reload_states()
        after = engine(x)
        full = engine.consolidated_state_dict()
        engine.load_checkpoint(tmp_path / "ck", tag="t0")
        loaded = engine(x)
    with torch.no_grad():
        assert torch.equal(loaded, ref(x))
    assert not torch.equal(after, loaded) and set(full) == set(ref.state_dict())
    _train(engine, 1, start=1)


@pytest.mark.parametrize("staged", [True, False])
def test_loading_a_checkpoint_saved_before_the_first_step_with_the_optimizer_on_nvme(tmp_path, staged):
    """A checkpoint saved before any step holds no optimizer state; loading it left the moments that
    the engine had on the drive read into memory and unknown to the optimizer, and the next staged
    step failed ('swap (0, exp_avg): staged while HOST'). It must train as a fresh engine does."""
    cfg = {**BASE, "offload_optimizer": nvme(tmp_path / "o", staged_step=staged)}
    engine = _engine(cfg)
    engine.save_checkpoint(tmp_path / "ck", tag="start")
    _train(engine, 2)
    engine.load_checkpoint(tmp_path / "ck", tag="start")
    resumed = _train(engine, 2)
    fresh = _engine({**BASE, "offload_optimizer": nvme(tmp_path / "o2", staged_step=staged)})
    assert resumed == _train(fresh, 2)
    assert all(torch.equal(a, b) for a, b in zip(_weights(engine), _weights(fresh)))


def test_master_shard_and_optimizer_state_of_offloaded_states_are_refused_not_read(tmp_path):
    """Their storages are empty while offload_states holds them: reading one crashed the process."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 4))
    engine = zero3.initialize(model, torch.optim.AdamW(model.parameters(), eps=1e-6), {"param_persistence_threshold": 0})
    engine.backward(engine(torch.randn(3, 8)).pow(2).mean())
    engine.step()
    p = engine.params[0]
    engine.offload_states(device="nvme", nvme_path=str(tmp_path))
    with pytest.raises(ZeroStateError, match="reload_states"):
        engine.master_shard(p)
    with pytest.raises(ZeroStateError, match="reload_states"):
        engine.optimizer_state(p)
    engine.reload_states()
    assert engine.master_shard(p).untyped_storage().nbytes() > 0 and "exp_avg" in engine.optimizer_state(p)
