"""Checkpoints on several gloo ranks: exact resume, resume at another world size, consolidation,
bad input raised on every rank, bounded reads, and a kill -9 during a save.

Every run trains the example GPT on the same global batch (split across ranks), so a world size 1,
2, 3 or 4 run follows the single-process reference within fp32 reduction-order tolerance.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint
from _reference import snapshot
from gpt import GPT, GPTConfig, synthetic_batch

import zero3
from zero3.checkpoint import safetensors as ck
from zero3.partition import sharding
from zero3.checkpoint.consolidate import main as consolidate_main

pytestmark = pytest.mark.multiproc

CFG = GPTConfig()
GLOBAL_BATCH = 12  # divisible by 1, 2, 3 and 4 ranks
N, M = 3, 3  # steps before the save, steps after it
ZERO_CFG = {"param_persistence_threshold": 0}
TOL = 1e-5


def _world() -> tuple[int, int]:
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def make_engine(seed: int, cfg: GPTConfig = CFG) -> zero3.Engine:
    torch.manual_seed(seed)
    with zero3.Init():
        model = GPT(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, eps=1e-6, weight_decay=0.1)
    return zero3.initialize(model, opt, ZERO_CFG)


def train(engine: zero3.Engine, steps: range) -> list[float]:
    """Train on this rank's part of each global batch; return the global mean losses."""
    rank, world = _world()
    per = GLOBAL_BATCH // world
    losses = []
    for step in steps:
        x, y = synthetic_batch(step, GLOBAL_BATCH, CFG)
        loss = engine(x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per])
        engine.backward(loss)
        engine.step()
        total = loss.detach().clone()
        if world > 1:
            dist.all_reduce(total)
        losses.append(total.item() / world)
    return losses


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# -- functions run on every rank ------------------------------------------------------------------
def train_save_continue(ckpt: str, save: bool = True) -> dict:
    engine = make_engine(seed=0)
    losses = train(engine, range(N))
    out: dict = {}
    if save:
        engine.save_checkpoint(ckpt, tag=f"step{N}", client_state={"losses": losses})
        out["shards"] = {p._zero.name: (engine.master_shard(p).clone(),
                                        engine.optimizer_state(p)["exp_avg"].clone()) for p in engine.params}
        out["live_sd"] = engine.consolidated_state_dict()  # rank0_only
        everywhere = engine.consolidated_state_dict(rank0_only=False)
        out["rank0_only_empty_elsewhere"] = out["live_sd"] == {} if _world()[0] else True
        out["everywhere"] = everywhere if _world()[0] == 1 else None
    losses += train(engine, range(N, N + M))
    out["losses"] = losses
    out["final_sd"] = engine.consolidated_state_dict()
    return out


def resume(ckpt: str, count_reads: bool = False) -> dict:
    engine = make_engine(seed=1)  # another init: everything must come from the checkpoint
    read = [0]
    if count_reads:
        original = ck._readinto_exact

        def counting(fh, path, offset, mv):
            read[0] += len(mv)
            return original(fh, path, offset, mv)

        ck._readinto_exact = counting
    try:
        _, client = engine.load_checkpoint(ckpt)
    finally:
        if count_reads:
            ck._readinto_exact = original
    owned = sum(4 * max(0, e - s) for p in engine.params for s, e in [p._zero.shard_range()])
    out = {"client": client, "global_steps": engine.global_steps, "bytes_read": read[0], "owned_bytes": owned}
    out["losses"] = train(engine, range(N, N + M))
    out["final_sd"] = engine.consolidated_state_dict()
    return out


def try_bad_loads(cases: dict[str, str]) -> dict:
    engine = make_engine(seed=1)
    train(engine, range(1))
    before, steps = snapshot(engine), engine.global_steps
    out = {}
    for case, path in cases.items():
        try:
            engine.load_checkpoint(path)
            out[case] = ("no error", "", True)
        except Exception as exc:  # noqa: BLE001 - reported to the test
            out[case] = (type(exc).__name__, str(exc), same(snapshot(engine), before) and engine.global_steps == steps)
    return out


def load_pretrained_slices(path: str) -> dict:
    read = [0]
    original = ck._readinto_exact

    def counting(fh, p, offset, mv):
        read[0] += len(mv)
        return original(fh, p, offset, mv)

    ck._readinto_exact = counting
    try:
        torch.manual_seed(5)
        with zero3.Init():
            model = GPT(CFG)
        zero3.pretrained.load_state_dict(model, path)
    finally:
        ck._readinto_exact = original
    owned = sum(4 * max(0, e - s) for p in model.parameters() for s, e in [p._zero.shard_range()])
    params = list(model.parameters())
    with zero3.GatheredParameters(params):
        full = {k: v.detach().clone() for k, v in model.named_parameters()}
    return {"bytes_read": read[0], "owned_bytes": owned, "full": full if _world()[0] == 0 else None}


# -- references ------------------------------------------------------------------------------------
@pytest.fixture(scope="module", autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def reference() -> dict:
    """Single-process training on the full global batch: losses of N + M steps, states after N and N + M."""
    torch.manual_seed(0)
    ref = GPT(CFG)
    opt = torch.optim.AdamW(ref.parameters(), lr=3e-3, eps=1e-6, weight_decay=0.1)
    losses, saved = [], None
    for step in range(N + M):
        x, y = synthetic_batch(step, GLOBAL_BATCH, CFG)
        loss = ref(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        if step == N - 1:
            saved = {k: v.clone() for k, v in ref.state_dict().items()}
            saved_opt = {name: opt.state[p]["exp_avg"].clone() for name, p in ref.named_parameters()}
    return {"losses": losses, "at_save": saved, "exp_avg_at_save": saved_opt, "final": ref.state_dict()}


@pytest.fixture(scope="module")
def saved(pools, tmp_path_factory) -> dict:
    """World sizes 2 and 4 each train N steps, save, train M more; world size 1 runs in this process."""
    runs = {}
    for world in (2, 4):
        ckpt = str(tmp_path_factory.mktemp(f"ckpt{world}"))
        runs[world] = (ckpt, pools.get(world).run(train_save_continue, ckpt))
    ckpt1 = str(tmp_path_factory.mktemp("ckpt1"))
    runs[1] = (ckpt1, [train_save_continue(ckpt1)])
    return runs


def assert_close_losses(got: list[float], want: list[float]) -> None:
    for a, b in zip(got, want, strict=True):
        assert abs(a - b) <= TOL * abs(b), (got, want)


def assert_close_sd(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], tol: float = TOL) -> None:
    assert list(got) == list(want)
    for k in want:
        assert got[k].shape == want[k].shape and got[k].dtype == want[k].dtype, k
        assert (got[k] - want[k]).abs().max().item() <= tol, k
    assert got["wte.weight"] is got["lm_head.weight"]


# -- tests -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("world", [2, 4])
def test_resume_at_the_same_world_size_is_bit_exact(pools, saved, reference, world):
    ckpt, straight = saved[world]
    resumed = pools.get(world).run(resume, ckpt)
    for s, r in zip(straight, resumed):
        assert r["losses"] == s["losses"][N:], (r["losses"], s["losses"])
        assert r["global_steps"] == N and r["client"] == {"losses": s["losses"][:N]}
    final, got = straight[0]["final_sd"], resumed[0]["final_sd"]
    assert final.keys() == got.keys() and all(torch.equal(final[k], got[k]) for k in final)
    assert_close_losses(straight[0]["losses"], reference["losses"])


def test_saving_does_not_perturb_training(pools, saved):
    ckpt, straight = saved[2]
    unsaved = pools.get(2).run(train_save_continue, ckpt + "-unused", False)
    assert unsaved[0]["losses"] == straight[0]["losses"]
    assert all(torch.equal(unsaved[0]["final_sd"][k], v) for k, v in straight[0]["final_sd"].items())


@pytest.mark.parametrize("src,dst", [(2, 4), (4, 2), (1, 3)])
def test_resume_at_another_world_size_continues_the_reference_run(pools, saved, reference, src, dst):
    ckpt, _ = saved[src]
    results = pools.get(dst).run(resume, ckpt, True)
    for r in results:
        assert r["global_steps"] == N
        assert_close_losses(r["losses"], reference["losses"][N:])
        # each rank read only the elements it owns now: weights and two moments (+ 0-d steps)
        assert r["bytes_read"] <= 3 * r["owned_bytes"] + 4 * 64, r
    assert_close_sd(results[0]["final_sd"], reference["final"])


def test_resume_from_two_ranks_on_one_process(saved, reference):
    ckpt, _ = saved[2]
    r = resume(ckpt)
    assert_close_losses(r["losses"], reference["losses"][N:])
    assert_close_sd(r["final_sd"], reference["final"])


def test_consolidation_cli_and_live_method_equal_the_gathered_model_and_reference(saved, reference, tmp_path):
    ckpt, results = saved[4]
    live = results[0]["live_sd"]
    assert all(r["rank0_only_empty_elsewhere"] for r in results)
    everywhere = results[1]["everywhere"]
    assert list(everywhere) == list(live) and all(torch.equal(everywhere[k], live[k]) for k in live)
    assert_close_sd(live, reference["at_save"])
    consolidate_main([ckpt, str(tmp_path / "full.pt"), "--tag", f"step{N}", "--include-optimizer"])
    obj = torch.load(tmp_path / "full.pt", weights_only=True)
    assert list(obj["model"]) == list(live) and all(torch.equal(obj["model"][k], live[k]) for k in live)
    assert obj["model"]["wte.weight"] is obj["model"]["lm_head.weight"]
    for name, (_, shape) in [(n, (None, t.shape)) for n, t in live.items() if n != "lm_head.weight"]:
        exp_avg = sharding.unshard([r["shards"][name][1] for r in results], shape)
        assert torch.equal(obj["optimizer"]["state"][name]["exp_avg"], exp_avg), name
        assert (exp_avg - reference["exp_avg_at_save"][name]).abs().max() <= TOL, name
    consolidate_main([ckpt, str(tmp_path / "full.safetensors"), "--dtype", "bf16"])
    st = pytest.importorskip("safetensors.torch").load_file(str(tmp_path / "full.safetensors"))
    assert set(st) == set(live) - {"lm_head.weight"}
    assert all(torch.equal(st[k], live[k].to(torch.bfloat16)) for k in st)


def _bad_copies(ckpt: str, other_ckpt: str, root: Path) -> dict[str, str]:
    cases = {}

    def copy(name: str) -> Path:
        dst = root / name
        shutil.copytree(ckpt, dst)
        cases[name] = str(dst)
        return dst / f"step{N}"

    (copy("missing") / "rank_00001-of-00002.safetensors").unlink()
    f = copy("truncated") / "rank_00001-of-00002.safetensors"
    f.write_bytes(f.read_bytes()[:-8])
    f = copy("corrupted") / "rank_00001-of-00002.safetensors"
    data = bytearray(f.read_bytes())
    data[-20] ^= 0xFF
    f.write_bytes(bytes(data))
    m = copy("version") / "metadata.json"
    meta = json.loads(m.read_text())
    meta["format_version"] = 3  # 2 (the metadata checksum) is read since issue 19
    m.write_text(json.dumps(meta))
    edits = {"edited_lr": lambda meta: meta["optimizer"]["param_groups"][0].update(lr=0.0),
             "edited_steps": lambda meta: meta.update(global_steps=N + 1),
             "renamed_key": lambda meta: meta.update(client_statex=meta.pop("client_state"))}
    for name, edit in edits.items():  # metadata.json's checksum is in the rank files (issue 19, item 5)
        m = copy(name) / "metadata.json"
        meta = json.loads(m.read_text())
        edit(meta)
        m.write_text(json.dumps(meta, indent=1))
    cases["other_model"] = other_ckpt
    cases["dcp"] = str(root / "dcp")  # FSDP2's save: load_checkpoint said "no checkpoint yet", returned (None, None)
    torch.distributed.checkpoint.save({"model": GPT(CFG).state_dict()}, checkpoint_id=cases["dcp"])
    step = root / "deepspeed" / "global_step3"  # DeepSpeed's layout: "metadata.json: missing"
    step.mkdir(parents=True)
    (root / "deepspeed" / "latest").write_text("global_step3")
    for name in ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt"):
        torch.save({}, step / name)
    cases["deepspeed"] = str(root / "deepspeed")
    return cases


BAD = {
    "missing": ("CheckpointNotFoundError", ["rank_00001-of-00002.safetensors", "rank file missing"]),
    "truncated": ("CheckpointCorruptError", ["rank_00001-of-00002.safetensors", "truncated"]),
    "corrupted": ("CheckpointCorruptError", ["rank_00001-of-00002.safetensors", "sha256", "corrupted"]),
    "version": ("CheckpointVersionError", ["metadata.json", "format version 3 is not supported"]),
    "edited_lr": ("CheckpointCorruptError", ["metadata.json", "does not match the checksum"]),
    "edited_steps": ("CheckpointCorruptError", ["metadata.json", "does not match the checksum"]),
    "renamed_key": ("CheckpointCorruptError", ["metadata.json", "does not match the checksum"]),
    "other_model": ("CheckpointMismatchError", ["another model", "h.2.attn.c_attn.weight", "wte.weight: shape"]),
    "dcp": ("CheckpointError", ["torch.distributed.checkpoint (DCP)", "dcp_to_torch_save", "pretrained.load_state_dict"]),
    "deepspeed": ("CheckpointError", ["global_step3: a DeepSpeed ZeRO checkpoint", "zero_to_fp32.py",
                                      "pretrained.load_state_dict"]),
}


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_bad_checkpoints_raise_the_same_clear_error_on_every_rank_and_change_nothing(pools, saved, tmp_path):
    torch.manual_seed(0)
    other = make_engine(seed=0, cfg=GPTConfig(n_layer=3, vocab_size=128))
    other.save_checkpoint(tmp_path / "other")
    cases = _bad_copies(saved[2][0], str(tmp_path / "other"), tmp_path)
    results = pools.get(2).run(try_bad_loads, cases)
    for case, (kind, words) in BAD.items():
        for rank, r in enumerate(results):
            name, msg, untouched = r[case]
            assert name == kind, (case, rank, name, msg)
            assert all(w in msg for w in words), (case, rank, msg)
            assert untouched, (case, rank)
    # the checksum of rank file 1 is verified by rank 1; rank 0 learns of it through the agreement
    assert "[raised on rank 1]" in results[0]["corrupted"][1]


def test_pretrained_safetensors_each_rank_reads_only_its_slices(pools, saved, tmp_path):
    save_file = pytest.importorskip("safetensors.torch").save_file
    live = saved[2][1][0]["live_sd"]
    save_file({k: v for k, v in live.items() if k != "lm_head.weight"}, str(tmp_path / "m.safetensors"))
    results = pools.get(2).run(load_pretrained_slices, str(tmp_path / "m.safetensors"))
    for r in results:
        assert r["bytes_read"] == r["owned_bytes"], r
    full = results[0]["full"]
    assert all(torch.equal(full[k], live[k]) for k in full)


KILL_CHILD = textwrap.dedent("""
    import sys, time, torch, zero3
    from torch import nn
    from zero3.checkpoint import safetensors as ck

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(4)])
    engine = zero3.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-3), {"param_persistence_threshold": 0})

    def step():
        engine(torch.ones(4, 1024)).square().mean().backward()
        engine.step()

    step()
    engine.save_checkpoint(sys.argv[1], tag="good")
    step()
    write = ck.SafetensorsWriter._write_chunk

    def slow_write(self, data):  # give the parent time to kill us in the middle of the file
        time.sleep(0.05)
        write(self, data)

    ck.SafetensorsWriter._write_chunk = slow_write
    engine.save_checkpoint(sys.argv[1], tag="bad")
    print("finished", flush=True)
""")


def test_kill_9_during_a_save_leaves_the_previous_checkpoint_loadable(tmp_path):
    from torch import nn

    ckpt = tmp_path / "ckpt"
    proc = subprocess.Popen([sys.executable, "-c", KILL_CHILD, str(ckpt)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env={**os.environ, "OMP_NUM_THREADS": "1"})
    partial = ckpt / ".bad.partial" / "rank_00000-of-00001.safetensors.tmp"
    deadline = time.monotonic() + 120
    try:
        while not (partial.exists() and partial.stat().st_size > 0):
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "the child never started the second save"
            time.sleep(0.005)
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.wait()
    assert proc.returncode == -signal.SIGKILL
    assert (ckpt / "latest").read_text().strip() == "good" and not (ckpt / "bad").exists()

    def build() -> zero3.Engine:
        model = nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(4)])
        return zero3.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-3), ZERO_CFG)

    torch.manual_seed(0)
    expected = build()
    expected(torch.ones(4, 1024)).square().mean().backward()
    expected.step()
    torch.manual_seed(1)
    engine = build()
    engine.load_checkpoint(ckpt)
    assert same(snapshot(engine), snapshot(expected))
    engine.save_checkpoint(ckpt, tag="next")  # and saving works again: the partial directory is gone
    assert sorted(os.listdir(ckpt)) == ["good", "latest", "next"]
