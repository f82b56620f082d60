"""Checkpoint format, atomic writes, corruption detection, consolidation and pretrained loading at world
size 1 (no process group: zero3 runs single-process), against a plain single-process reference."""

from __future__ import annotations

import logging

import hashlib
import io
import json
import os
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint
from gpt import GPT, GPTConfig, synthetic_batch

import zero3
from _reference import snapshot
from zero3.checkpoint import format as ck
from zero3.checkpoint.safetensors import SafetensorsWriter
from zero3.checkpoint.consolidate import main as consolidate_main

CFG = GPTConfig()
BATCH = 4


def make_engine(seed: int = 0, cfg: GPTConfig = CFG, lr: float = 3e-3) -> zero3.Engine:
    torch.manual_seed(seed)
    with zero3.Init():
        model = GPT(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, eps=1e-6, weight_decay=0.1)
    return zero3.initialize(model, opt, {"param_persistence_threshold": 0})


def make_reference(seed: int = 0) -> tuple[GPT, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    ref = GPT(CFG)
    return ref, torch.optim.AdamW(ref.parameters(), lr=3e-3, eps=1e-6, weight_decay=0.1)


def train(engine: zero3.Engine, steps: range) -> list[float]:
    losses = []
    for step in steps:
        x, y = synthetic_batch(step, BATCH, CFG)
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def train_reference(ref: GPT, opt: torch.optim.Optimizer, steps: range) -> list[float]:
    losses = []
    for step in steps:
        x, y = synthetic_batch(step, BATCH, CFG)
        loss = ref(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny models: intra-op threads only add contention (10x slower on a loaded 2-core machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A world-1 engine trained 3 steps and saved (tag step3), with a reference trained identically."""
    root = tmp_path_factory.mktemp("ckpt")
    engine = make_engine()
    train(engine, range(3))
    engine.save_checkpoint(root, tag="step3", client_state={"epoch": 1})
    ref, ref_opt = make_reference()
    train_reference(ref, ref_opt, range(3))
    return root, engine, ref, ref_opt


# -- format -----------------------------------------------------------------------------------------
def test_save_writes_one_rank_file_metadata_with_sizes_and_checksums_and_latest(trained):
    root, engine, _, _ = trained
    assert (root / "latest").read_text().strip() == "step3"
    tag_dir = root / "step3"
    assert sorted(os.listdir(tag_dir)) == ["metadata.json", "rank_00000-of-00001.safetensors"]
    assert not [n for n in os.listdir(root) if n.startswith(".")], "staging left behind"
    meta = json.loads((tag_dir / "metadata.json").read_text())
    assert meta["format_version"] == ck.FORMAT_VERSION and meta["world_size"] == 1 and meta["global_steps"] == 3
    assert [pm["name"] for pm in meta["params"]] == [p._zero.name for p in engine.params]
    wte = next(pm for pm in meta["params"] if pm["name"] == "wte.weight")
    assert wte["aliases"] == ["lm_head.weight"] and wte["shape"] == [256, 32] and wte["ranges"] == [[0, 8192]]
    assert set(wte["optimizer_state"]) == {"step", "exp_avg", "exp_avg_sq"}
    f = meta["files"][0]
    data = (tag_dir / f["file"]).read_bytes()
    # the recorded sha256 is of the file as written: with the placeholder where metadata.json's own
    # checksum is stamped afterwards (integrity.py [Note: metadata checksum])
    stamped = hashlib.sha256((tag_dir / "metadata.json").read_bytes()).hexdigest().encode()
    assert data.count(stamped) == 1
    written = data.replace(stamped, b"0" * 64)
    assert f["bytes"] == len(data) and f["sha256"] == hashlib.sha256(written).hexdigest()
    assert meta["client_state"] == {"epoch": 1} and meta["config"]["param_persistence_threshold"] == 0
    assert meta["optimizer"]["class"] == "AdamW" and meta["optimizer"]["param_groups"][0]["lr"] == 3e-3


def test_rank_file_is_standard_safetensors_holding_master_weights_and_moments(trained):
    safetensors = pytest.importorskip("safetensors")
    root, engine, _, _ = trained
    p = next(p for p in engine.params if p._zero.name == "h.0.mlp.c_fc.weight")
    with safetensors.safe_open(str(root / "step3" / "rank_00000-of-00001.safetensors"), "pt") as f:
        assert torch.equal(f.get_tensor("param/h.0.mlp.c_fc.weight"), engine.master_shard(p))
        assert torch.equal(f.get_tensor("optim/h.0.mlp.c_fc.weight/exp_avg"), engine.optimizer_state(p)["exp_avg"])
        assert f.get_tensor("optim/h.0.mlp.c_fc.weight/step").item() == 3


def test_json_encoding_round_trips_tensors_tuples_and_non_string_keys():
    value = {"a": (1, 2.5, None), "t": torch.arange(4, dtype=torch.int16).view(2, 2), 3: [True, "x"],
             "nested": {"__tuple__": 1}, "dt": torch.bfloat16, "b": b"\x00\xff", "io": io.BytesIO(b"fp8")}
    back = ck.from_json(json.loads(json.dumps(ck.to_json(value))))
    assert back["b"] == b"\x00\xff" and back["io"].read() == b"fp8"  # a BytesIO comes back at position 0
    assert back["a"] == (1, 2.5, None) and back[3] == [True, "x"] and back["nested"] == {"__tuple__": 1}
    assert torch.equal(back["t"], value["t"]) and back["t"].dtype == torch.int16 and back["dt"] is torch.bfloat16
    with pytest.raises(TypeError, match=r"client_state\['obj'\]: cannot store a object"):
        ck.to_json({"obj": object()}, "client_state")



def test_a_fused_param_group_keeps_its_step_on_the_device_and_a_plain_one_does_not():
    """The groups a load keeps Adam's ``step`` on the parameter's device for, found once per load (a
    search per parameter made loads quadratic in the parameter count, probe 31L)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
    opt = torch.optim.AdamW([{"params": model[0].parameters(), "fused": True}, {"params": model[1].parameters()}],
                            lr=1e-3)
    engine = zero3.initialize(model, opt, {})
    fused = {id(p._zero.train_tensor) for p in model[0].parameters()}
    assert engine.context.optimizer.steps_on_device() == fused


def test_the_optimizer_hands_its_state_to_checkpoints_as_plain_tensors_and_dicts():
    engine = make_engine()
    train(engine, range(1))
    opt, p = engine.context.optimizer, engine.params[0]
    state = opt.shard_state(p)
    assert set(state) == {"step", "exp_avg", "exp_avg_sq"} and state["exp_avg"] is engine.optimizer_state(p)["exp_avg"]
    state.pop("step")  # a copy: the optimizer's own dict is untouched
    assert "step" in engine.optimizer_state(p)
    assert opt.class_name == "AdamW" and not opt.steps_on_device()
    assert [len(names) for names in opt.group_param_names()] == [len(g["params"]) for g in engine.optimizer.param_groups]
    assert opt.group_hyperparameters()[0]["lr"] == 3e-3 and "params" not in opt.group_hyperparameters()[0]
    opt.load_group_hyperparameters([{**g, "lr": 1e-4} for g in opt.group_hyperparameters()])
    assert engine.optimizer.param_groups[0]["lr"] == 1e-4
    opt.load_shard_state(p, {"exp_avg": state["exp_avg"]})
    assert set(engine.optimizer_state(p)) == {"exp_avg"}
    opt.load_shard_state(p, {})
    assert engine.optimizer_state(p) == {}

# -- round trip ---------------------------------------------------------------------------------------
def test_megatron_deepspeed_client_state_round_trips(tmp_path):
    """Megatron-DeepSpeed saves its argparse args and numpy's RNG state in client_state; the save
    refused both (TypeError: cannot store a Namespace / ndarray)."""
    import argparse

    import numpy as np
    np.random.seed(5)
    client = {"args": argparse.Namespace(lr=1e-4, num_layers=2, tokenizer=None, sizes=[1, 2]),
              "np_rng_state": np.random.get_state(), "iteration": np.int64(12), "loss": np.float32(2.5),
              "hist": np.arange(6, dtype=np.int32).reshape(2, 3), "f64": np.float64(0.25), "zero_d": np.array(3.5)}
    engine = make_engine()
    train(engine, range(1))
    engine.save_checkpoint(tmp_path, client_state=client)
    _, got = make_engine(seed=1).load_checkpoint(tmp_path)
    assert got["args"] == client["args"] and isinstance(got["args"], argparse.Namespace)
    assert type(got["iteration"]) is np.int64 and got["iteration"] == 12 and type(got["loss"]) is np.float32
    assert got["hist"].dtype == np.int32 and np.array_equal(got["hist"], client["hist"])
    assert type(got["f64"]) is np.float64 and got["zero_d"].shape == () and got["zero_d"] == 3.5
    np.random.set_state(got["np_rng_state"])
    resumed = np.random.rand(4)
    np.random.set_state(client["np_rng_state"])
    assert np.array_equal(resumed, np.random.rand(4))
    with pytest.raises(TypeError, match=r"client_state\['s'\]: cannot store a ndarray"):
        ck.to_json({"s": np.array(["text"])}, "client_state")  # only numeric arrays


def test_round_trip_restores_weights_moments_hyperparameters_scheduler_rng_and_client_state(tmp_path):
    engine = make_engine()
    sched = torch.optim.lr_scheduler.StepLR(engine.optimizer, step_size=1, gamma=0.5)
    train(engine, range(2))
    sched.step()
    client = {"epoch": 2, "best": (0.5, torch.tensor([1.0, 2.0])), 7: "seven"}
    engine.save_checkpoint(tmp_path, client_state=client, lr_scheduler=sched)
    expected, draws = snapshot(engine), torch.rand(3)

    fresh = make_engine(seed=1, lr=1.0)
    fresh_sched = torch.optim.lr_scheduler.StepLR(fresh.optimizer, step_size=1, gamma=0.5)
    path, got = fresh.load_checkpoint(tmp_path, lr_scheduler=fresh_sched)
    assert path == str(tmp_path / "global_step2")
    assert_same(snapshot(fresh), expected)
    assert torch.equal(torch.rand(3), draws), "RNG state not restored"
    assert fresh.global_steps == 2 and fresh.optimizer.param_groups[0]["lr"] == engine.optimizer.param_groups[0]["lr"]
    assert fresh_sched.state_dict() == sched.state_dict()
    assert got["epoch"] == 2 and got[7] == "seven" and got["best"][0] == 0.5
    assert torch.equal(got["best"][1], client["best"][1])
    assert train(fresh, range(2, 4)) == train(engine, range(2, 4)), "training does not continue identically"


def test_round_trip_restores_the_model_parallel_rng_trackers_states(tmp_path, monkeypatch):
    import zero3.activation.rng
    import zero3.checkpointing as ckpt

    monkeypatch.setattr(zero3.activation.rng, "_TRACKER", ckpt.RNGStatesTracker("cpu"))
    ckpt.get_cuda_rng_tracker().add(ckpt.MODEL_PARALLEL_RNG, 99)
    engine = make_engine()
    with ckpt.get_cuda_rng_tracker().fork():
        torch.rand(5)  # the tracked stream moved on
    engine.save_checkpoint(tmp_path)
    with ckpt.get_cuda_rng_tracker().fork():
        draws = torch.rand(3)
    make_engine(seed=1).load_checkpoint(tmp_path)
    with ckpt.get_cuda_rng_tracker().fork():
        assert torch.equal(torch.rand(3), draws), "tracker state not restored"


def test_saving_an_existing_tag_replaces_it(tmp_path):
    engine = make_engine()
    engine.save_checkpoint(tmp_path, tag="x")
    train(engine, range(1))
    engine.save_checkpoint(tmp_path, tag="x")
    fresh = make_engine(seed=1)
    fresh.load_checkpoint(tmp_path, tag="x")
    assert_same(snapshot(fresh), snapshot(engine))
    assert sorted(os.listdir(tmp_path)) == ["latest", "x"]


def test_failed_save_keeps_latest_on_the_previous_checkpoint(tmp_path, monkeypatch):
    engine = make_engine()
    train(engine, range(1))
    engine.save_checkpoint(tmp_path, tag="good")
    good = snapshot(engine)
    train(engine, range(1, 2))

    def disk_full(self):
        raise OSError(28, "No space left on device")

    with monkeypatch.context() as m:
        m.setattr(SafetensorsWriter, "close", disk_full)
        with pytest.raises(OSError, match="No space left"):
            engine.save_checkpoint(tmp_path, tag="bad")
    assert (tmp_path / "latest").read_text().strip() == "good" and not (tmp_path / "bad").exists()
    fresh = make_engine(seed=1)
    fresh.load_checkpoint(tmp_path)
    assert_same(snapshot(fresh), good)
    engine.save_checkpoint(tmp_path, tag="after")  # the next save clears the partial directory
    assert sorted(os.listdir(tmp_path)) == ["after", "good", "latest"]


def test_unstorable_client_state_fails_before_anything_is_written(tmp_path):
    engine = make_engine()
    with pytest.raises(TypeError, match=r"client_state\['net'\]: cannot store a GPT"):
        engine.save_checkpoint(tmp_path, client_state={"net": GPT(CFG)})
    assert not (tmp_path / "latest").exists() and not (tmp_path / "global_step0").exists()


def test_bad_tags_are_rejected():
    engine = make_engine()
    for tag in ("", ".hidden", "a/b", "latest"):
        with pytest.raises(ValueError, match="tag"):
            engine.save_checkpoint("/nonexistent-never-created", tag=tag)


# -- corruption and mismatch ------------------------------------------------------------------------
def _copy(src: Path, dst: Path) -> Path:
    import shutil

    shutil.copytree(src, dst)
    return dst


def _rank_file(root: Path) -> Path:
    return root / "step3" / "rank_00000-of-00001.safetensors"


def _truncate(root: Path) -> None:
    f = _rank_file(root)
    f.write_bytes(f.read_bytes()[:-100])


def _flip_byte(root: Path) -> None:
    f = _rank_file(root)
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0x10
    f.write_bytes(bytes(data))


def _set_version(root: Path) -> None:
    m = root / "step3" / "metadata.json"
    meta = json.loads(m.read_text())
    meta["format_version"] = 99
    m.write_text(json.dumps(meta))


CORRUPTIONS = {
    "missing rank file": (lambda r: _rank_file(r).unlink(), ck.CheckpointNotFoundError,
                          ["rank_00000-of-00001.safetensors", "missing"]),
    "truncated rank file": (_truncate, ck.CheckpointCorruptError, ["rank_00000-of-00001.safetensors", "truncated"]),
    "flipped byte": (_flip_byte, ck.CheckpointCorruptError, ["rank_00000-of-00001.safetensors", "sha256", "corrupted"]),
    "missing metadata": (lambda r: (r / "step3" / "metadata.json").unlink(), ck.CheckpointNotFoundError,
                         ["metadata.json", "missing"]),
    "metadata not json": (lambda r: (r / "step3" / "metadata.json").write_text("{oops"), ck.CheckpointCorruptError,
                          ["metadata.json", "not valid JSON"]),
    "unknown version": (_set_version, ck.CheckpointVersionError, ["metadata.json", "version 99", "not supported"]),
    "missing latest": (lambda r: (r / "latest").unlink(), ck.CheckpointNotFoundError, ["latest", "step3"]),
}


@pytest.mark.parametrize("case", sorted(CORRUPTIONS))
def test_bad_checkpoint_raises_a_clear_error_and_leaves_the_engine_untouched(trained, tmp_path, case):
    corrupt, exc_type, words = CORRUPTIONS[case]
    root = _copy(trained[0], tmp_path / "ckpt")
    corrupt(root)
    engine = make_engine(seed=1)
    train(engine, range(1))
    before, steps = snapshot(engine), engine.global_steps
    with pytest.raises(exc_type) as info:
        engine.load_checkpoint(root)
    for word in words:
        assert word in str(info.value), (word, str(info.value))
    assert isinstance(info.value, ValueError)
    assert_same(snapshot(engine), before)
    assert engine.global_steps == steps


@pytest.mark.parametrize("where", ["empty directory", "no directory", "only an unfinished save"])
def test_the_first_launch_of_an_auto_resume_script_loads_nothing_and_returns_none_as_deepspeed(tmp_path, caplog,
                                                                                                where):
    """``path, state = engine.load_checkpoint(dir)`` before anything was saved there: DeepSpeed warns and
    returns (None, None); zero3 raised CheckpointNotFoundError. Tags without `latest` still raise (above)."""
    root = tmp_path / "ckpt"
    if where != "no directory":
        root.mkdir()
    if where == "only an unfinished save":  # a crash before the save published: its metadata is there already
        (root / ".step3.partial").mkdir()
        (root / ".step3.partial" / "metadata.json").write_text("{}")
    engine = make_engine(seed=1)
    train(engine, range(1))
    before, steps = snapshot(engine), engine.global_steps
    assert engine.load_checkpoint(root) == (None, None)
    assert "holds no checkpoint yet" in caplog.text
    assert_same(snapshot(engine), before)
    assert engine.global_steps == steps
    with pytest.raises(ck.CheckpointNotFoundError):  # a tag named explicitly must be there
        engine.load_checkpoint(root, tag="step3")
    (tmp_path / "a_file").write_text("")
    with pytest.raises(ck.CheckpointNotFoundError, match="does not exist"):  # a wrong argument is not "nothing yet"
        engine.load_checkpoint(tmp_path / "no_such_dir", tag="step3")


def test_a_file_given_as_the_checkpoint_directory_is_named_a_file_with_the_entry_that_reads_it(tmp_path):
    """Probe 38C F1: ``load_checkpoint`` of a ``torch.save`` file said "checkpoint directory does not exist"
    (it exists); the message says it is a file and names the entry that reads a state-dict file."""
    engine = make_engine(seed=1)
    train(engine, range(1))
    before, steps = snapshot(engine), engine.global_steps
    sd_file = tmp_path / "sd.pt"
    torch.save(GPT(CFG).state_dict(), sd_file)
    for load in [lambda: engine.load_checkpoint(sd_file), lambda: engine.load_checkpoint(sd_file, tag="step3"),
                 lambda: consolidate_main([str(sd_file), str(tmp_path / "o.pt")])]:
        with pytest.raises(ck.CheckpointNotFoundError) as info:
            load()
        msg = str(info.value)
        assert "sd.pt: is a file, not a checkpoint directory" in msg and "does not exist" not in msg, msg
        assert "zero3.pretrained.load_state_dict(engine, path)" in msg, msg
    assert_same(snapshot(engine), before)
    assert engine.global_steps == steps
    assert zero3.pretrained.load_state_dict(engine, sd_file) == ([], [])  # the route it names works


WEIGHT_FILES = ["model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json",
                "pytorch_model-00001-of-00002.bin", "model-00001-of-00002.safetensors"]
NOT_WEIGHTS = ["training_args.bin", "optimizer.pt", "rng_state_0.pth", "train.bin", "vocab.bin"]
"""What a run directory holds beside its checkpoints (the Trainer's arguments, a user's optimizer, a
dataset's tokens): not weights, so a first launch there still gives (None, None) (review 38R3)."""


@pytest.mark.parametrize("name", WEIGHT_FILES)
def test_a_directory_of_weight_files_is_not_a_first_launch_it_is_refused_naming_them(tmp_path, name):
    """Probe 38C F5: ``load_checkpoint(dir)`` on what save_pretrained, save_16bit_model, zero_to_fp32 or
    torch.save write (no ``latest``) returned (None, None), so an auto-resume script trained from scratch,
    while a DCP directory is refused for that reason. Other files alone still give (None, None)."""
    root = tmp_path / "out"
    root.mkdir()
    (root / "config.json").write_text("{}")
    (root / "notes.txt").write_text("")
    for other in NOT_WEIGHTS:
        (root / other).write_bytes(b"")
    engine = make_engine(seed=1)
    train(engine, range(1))
    before, steps = snapshot(engine), engine.global_steps
    assert engine.load_checkpoint(root) == (None, None)  # other files: still the first launch
    (root / name).write_bytes(b"")
    with pytest.raises(ck.CheckpointError) as info:
        engine.load_checkpoint(root)
    msg = str(info.value)
    assert f"holds no zero3 checkpoint (no latest, no saved tag) but weight files ({name})" in msg, msg
    assert "zero3.pretrained.load_state_dict(engine, path)" in msg and "Nothing was loaded" in msg, msg
    assert_same(snapshot(engine), before)
    assert engine.global_steps == steps
    with pytest.raises(ck.CheckpointNotFoundError, match=f"it holds weight files \\({name}\\)"):  # the CLI too
        consolidate_main([str(root), str(tmp_path / "o.pt")])
    engine.save_checkpoint(root, tag="step1")  # a zero3 checkpoint beside weight files loads
    path, _ = engine.load_checkpoint(root)
    assert path is not None and path.endswith("step1")


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
@pytest.mark.parametrize("layout", ["dcp", "deepspeed"])
def test_another_frameworks_checkpoint_is_refused_naming_its_format_and_the_conversion(tmp_path, layout):
    """An FSDP2 (torch DCP) directory loaded as "no checkpoint yet" and returned (None, None), so an auto-resume
    script trained from scratch; DeepSpeed's layout raised "metadata.json: missing" (probe 32P repro_6)."""
    root = tmp_path / "ckpt"
    if layout == "dcp":
        torch.distributed.checkpoint.save({"model": GPT(CFG).state_dict()}, checkpoint_id=str(root))
        words, tagged = ["(DCP)", ".metadata", "dcp_to_torch_save", "saved under"], tmp_path
    else:
        (root / "global_step3").mkdir(parents=True)
        (root / "latest").write_text("global_step3")
        for name in ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt"):
            torch.save({}, root / "global_step3" / name)
        words, tagged = ["DeepSpeed ZeRO checkpoint", "mp_rank_00_model_states.pt", "zero_to_fp32.py"], root
    engine = make_engine(seed=1)
    train(engine, range(1))
    before, steps = snapshot(engine), engine.global_steps
    tag = "ckpt" if layout == "dcp" else "global_step3"
    for args in [(root,), (tagged, tag)]:
        with pytest.raises(ck.CheckpointError, match="not a zero3 one") as info:
            engine.load_checkpoint(*args)
        assert all(w in str(info.value) for w in words + ["pretrained.load_state_dict", "docs/api.md"]), info.value
    assert_same(snapshot(engine), before)
    assert engine.global_steps == steps
    with pytest.raises(ck.CheckpointError, match="not a zero3 one"):
        consolidate_main([str(root), str(tmp_path / "o.pt")])


def test_a_zero3_checkpoint_beside_another_frameworks_files_loads_and_one_a_level_down_is_named(tmp_path, caplog):
    """Review 32RC: with a DCP save (or a file named like DeepSpeed's) in the folder beside zero3's
    ``latest`` and tags, the valid zero3 checkpoint ``latest`` names was refused as foreign; and a DCP
    checkpoint a level down (``ckpt/step-10/.metadata``, no ``latest``) gave (None, None) with a warning
    that the directory holds no checkpoint, naming nothing."""
    root = tmp_path / "out"
    torch.distributed.checkpoint.save({"model": GPT(CFG).state_dict()}, checkpoint_id=str(root))
    torch.save({}, root / "zero_pp_rank_0_mp_rank_00_optim_states.pt")
    engine = make_engine(seed=1)
    train(engine, range(1))
    engine.save_checkpoint(str(root), tag="step1")
    saved = snapshot(engine)
    fresh = make_engine(seed=2)
    path, _ = fresh.load_checkpoint(str(root))
    assert path is not None and path.endswith("step1")
    assert_same(snapshot(fresh), saved)
    below = tmp_path / "ckpt"
    torch.distributed.checkpoint.save({"model": GPT(CFG).state_dict()}, checkpoint_id=str(below / "step-10"))
    with caplog.at_level(logging.WARNING, logger="zero3"):
        assert fresh.load_checkpoint(str(below)) == (None, None)
    said = caplog.text
    assert "holds no checkpoint yet" in said and "in step-10/ it holds a torch.distributed.checkpoint (DCP)" in said, said
    with pytest.raises(ck.CheckpointError, match=r"tags with metadata here: none\); in step-10/ it holds a torch"):
        consolidate_main([str(below), str(tmp_path / "o.pt")])  # review 32RE: it named nothing


def test_checkpoint_of_another_model_names_the_differences(trained):
    other = make_engine(cfg=GPTConfig(n_layer=3, vocab_size=128))
    before = snapshot(other)
    with pytest.raises(ck.CheckpointMismatchError) as info:
        other.load_checkpoint(trained[0])
    msg = str(info.value)
    assert "metadata.json" in msg and "another model" in msg
    assert "parameters missing from the checkpoint: h.2.ln_1.weight" in msg
    assert "wte.weight: shape [256, 32] in the checkpoint, [128, 32] in the model" in msg
    assert_same(snapshot(other), before)


def test_loading_weights_only_into_another_optimizer_needs_opting_out(trained):
    torch.manual_seed(0)
    with zero3.Init():
        model = GPT(CFG)
    engine = zero3.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), {"param_persistence_threshold": 0})
    with pytest.raises(ck.CheckpointMismatchError, match="optimizer AdamW in the checkpoint, SGD in the engine"):
        engine.load_checkpoint(trained[0])
    engine.load_checkpoint(trained[0], load_optimizer_states=False)
    assert torch.equal(engine.master_shard(engine.params[0]), trained[1].master_shard(trained[1].params[0]))


# -- consolidation ------------------------------------------------------------------------------------
def test_consolidate_cli_pt_equals_reference_state_dict_with_tied_weights_shared(trained, tmp_path):
    root, _, ref, _ = trained
    assert consolidate_main([str(root), str(tmp_path / "full.pt")]) == 0
    sd = torch.load(tmp_path / "full.pt", weights_only=True)
    expected = ref.state_dict()
    assert list(sd) == list(expected)
    for k in expected:
        assert torch.equal(sd[k], expected[k]), k
    assert sd["wte.weight"] is sd["lm_head.weight"]
    mm = torch.load(tmp_path / "full.pt", weights_only=True, mmap=True)
    assert torch.equal(mm["h.1.mlp.c_proj.weight"], expected["h.1.mlp.c_proj.weight"])


def test_consolidate_cli_safetensors_bf16_and_optimizer(trained, tmp_path):
    safetensors_torch = pytest.importorskip("safetensors.torch")
    root, _, ref, ref_opt = trained
    out = tmp_path / "full.safetensors"
    consolidate_main([str(root), str(out), "--tag", "step3", "--dtype", "bf16", "--include-optimizer"])
    sd = safetensors_torch.load_file(str(out))
    expected = ref.state_dict()
    assert "lm_head.weight" not in sd
    for k, v in expected.items():
        if k != "lm_head.weight":
            assert sd[k].dtype == torch.bfloat16 and torch.equal(sd[k], v.to(torch.bfloat16)), k
    for name, p in ref.named_parameters():
        state = ref_opt.state[p]
        assert torch.equal(sd[f"optimizer/{name}/exp_avg"], state["exp_avg"]), name
        assert torch.equal(sd[f"optimizer/{name}/exp_avg_sq"], state["exp_avg_sq"]), name
        assert sd[f"optimizer/{name}/step"].item() == state["step"].item()
    from safetensors import safe_open

    with safe_open(str(out), "pt") as f:
        assert json.loads(f.metadata()["zero3_aliases"]) == {"lm_head.weight": "wte.weight"}


def test_consolidate_pt_with_optimizer_nests_model_and_optimizer(trained, tmp_path):
    root, _, ref, ref_opt = trained
    consolidate_main([str(root), str(tmp_path / "o.pt"), "--include-optimizer"])
    obj = torch.load(tmp_path / "o.pt", weights_only=True)
    assert torch.equal(obj["model"]["ln_f.weight"], ref.state_dict()["ln_f.weight"])
    assert torch.equal(obj["optimizer"]["state"]["wte.weight"]["exp_avg"], ref_opt.state[ref.wte.weight]["exp_avg"])
    assert obj["optimizer"]["param_groups"][0]["betas"] == (0.9, 0.999)
    with pytest.raises(ValueError, match="unknown output format"):
        consolidate_main([str(root), str(tmp_path / "o.npz")])


def test_live_consolidated_state_dict_equals_reference_and_keeps_ties(trained):
    _, engine, ref, _ = trained
    sd = engine.consolidated_state_dict()
    expected = ref.state_dict()
    assert list(sd) == list(expected)
    for k in expected:
        assert torch.equal(sd[k], expected[k]), k
    assert sd["wte.weight"] is sd["lm_head.weight"]


def test_live_consolidated_state_dict_keeps_ties_of_gathered_persistent_parameters():
    """With the default persistence threshold the tied embedding stays gathered, and ``state_dict()``
    hands out copies of gathered parameters: the consolidated dict must still tie them."""
    torch.manual_seed(0)
    with zero3.Init():
        model = GPT(CFG)
    engine = zero3.initialize(model, torch.optim.AdamW(model.parameters(), lr=3e-3))
    assert model.wte.weight.ds_persist
    sd = engine.consolidated_state_dict()
    assert sd["wte.weight"] is sd["lm_head.weight"]
    torch.manual_seed(0)
    assert torch.equal(sd["wte.weight"], GPT(CFG).wte.weight.detach())


# -- pretrained ---------------------------------------------------------------------------------------
def _full_params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    params = list(model.parameters())
    with zero3.GatheredParameters(params):
        return {k: v.detach().clone() for k, v in model.named_parameters()}


def _init_model(seed: int = 7) -> GPT:
    torch.manual_seed(seed)
    with zero3.Init():
        return GPT(CFG)


def test_pretrained_loads_a_state_dict_or_safetensors_file_into_a_partitioned_model(trained, tmp_path):
    safetensors_torch = pytest.importorskip("safetensors.torch")
    ref = trained[2]
    expected = ref.state_dict()
    model = _init_model()
    assert zero3.pretrained.load_state_dict(model, expected) == ([], [])
    got = _full_params(model)
    for k in got:
        assert torch.equal(got[k], expected[k]), k
    # a file with the tied weight stored once, as Hugging Face writes it
    untied = {k: v.clone() for k, v in expected.items() if k != "lm_head.weight"}
    safetensors_torch.save_file(untied, str(tmp_path / "m.safetensors"))
    model = _init_model()
    zero3.pretrained.load_state_dict(model, tmp_path / "m.safetensors")
    got = _full_params(model)
    assert all(torch.equal(got[k], expected[k]) for k in got)


def test_pretrained_into_an_engine_updates_its_shards(trained, tmp_path):
    ref = trained[2]
    engine = make_engine(seed=3)
    zero3.pretrained.load_state_dict(engine, ref.state_dict())
    sd = engine.consolidated_state_dict()
    assert all(torch.equal(sd[k], v) for k, v in ref.state_dict().items())


def test_pretrained_errors_list_every_offender_and_change_nothing(trained):
    expected = trained[2].state_dict()
    model = _init_model()
    before = _full_params(model)
    bad = dict(expected)
    del bad["h.0.ln_1.bias"], bad["lm_head.weight"], bad["wte.weight"]
    bad["extra.weight"] = torch.zeros(3)
    bad["wpe.weight"] = torch.zeros(10, 32)
    with pytest.raises(zero3.CheckpointMismatchError) as info:
        zero3.pretrained.load_state_dict(model, bad)
    msg = str(info.value)
    assert "wpe.weight: [10, 32] in the source, [64, 32] in the model" in msg
    assert "missing keys: wte.weight, lm_head.weight, h.0.ln_1.bias" in msg and "unexpected keys: extra.weight" in msg
    got = _full_params(model)
    assert all(torch.equal(got[k], before[k]) for k in got)
    bad["wpe.weight"] = expected["wpe.weight"]
    result = zero3.pretrained.load_state_dict(model, bad, strict=False)
    assert result.missing_keys == ["wte.weight", "lm_head.weight", "h.0.ln_1.bias"]
    assert result.unexpected_keys == ["extra.weight"]
    got = _full_params(model)
    assert torch.equal(got["wpe.weight"], expected["wpe.weight"]) and torch.equal(got["wte.weight"], before["wte.weight"])


def test_pretrained_names_the_entry_of_a_nested_checkpoint_and_reports_its_entries_unexpected(trained, tmp_path, caplog):
    """``consolidate --include-optimizer`` writes ``{"model": sd, "optimizer": ...}``: handed whole, strict said
    every key was missing and to pass strict=False, which loaded nothing and returned unexpected_keys=[] (the
    non-tensor entries were dropped); torch lists 'model' and 'optimizer' as unexpected."""
    root, _, ref, _ = trained
    consolidate_main([str(root), str(tmp_path / "o.pt"), "--include-optimizer"])
    model = _init_model()
    before = _full_params(model)
    with pytest.raises(zero3.CheckpointMismatchError, match=r"under the source's 'model' entry .*pass sd\['model'\]"
                       ) as info:
        zero3.pretrained.load_state_dict(model, tmp_path / "o.pt")
    assert "unexpected keys: model, optimizer" in str(info.value) and "strict=False" not in str(info.value)
    nested = torch.load(tmp_path / "o.pt", weights_only=True)
    result = zero3.pretrained.load_state_dict(model, nested, strict=False)
    assert result.unexpected_keys == ["model", "optimizer"] == GPT(CFG).load_state_dict(nested, strict=False).unexpected_keys
    assert "loads nothing" in caplog.text and "sd['model']" in caplog.text
    got = _full_params(model)
    assert all(torch.equal(got[k], before[k]) for k in got)
    assert zero3.pretrained.load_state_dict(model, nested["model"]) == ([], [])
    got = _full_params(model)
    assert all(torch.equal(v, ref.state_dict()[k]) for k, v in got.items())


def test_pretrained_reads_a_sharded_safetensors_index_or_a_directory(trained, tmp_path):
    safetensors_torch = pytest.importorskip("safetensors.torch")
    expected = trained[2].state_dict()
    keys = [k for k in expected if k != "lm_head.weight"]
    halves = {"model-1.safetensors": keys[: len(keys) // 2], "model-2.safetensors": keys[len(keys) // 2:]}
    for fname, ks in halves.items():
        safetensors_torch.save_file({k: expected[k].clone() for k in ks}, str(tmp_path / fname))
    index = {"weight_map": {k: fname for fname, ks in halves.items() for k in ks}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    model = _init_model()
    zero3.pretrained.load_state_dict(model, tmp_path)
    got = _full_params(model)
    assert all(torch.equal(got[k], expected[k]) for k in got)
    (tmp_path / "empty").mkdir()
    with pytest.raises(zero3.CheckpointNotFoundError, match="empty: no model.safetensors"):
        zero3.pretrained.load_state_dict(model, tmp_path / "empty")
    with pytest.raises(zero3.CheckpointNotFoundError, match="nothing-here: file does not exist"):
        zero3.pretrained.load_state_dict(model, tmp_path / "nothing-here")


def test_pretrained_refuses_two_names_of_a_tied_parameter_with_different_values_naming_both(trained):
    """Probe 38C F2: a state dict holding ``wte.weight`` and ``lm_head.weight`` (one tied parameter) with
    different values loaded ``wte.weight``'s, silently; torch's ``load_state_dict`` keeps the last name's.
    zero3 refuses, naming both, and changes nothing; equal values (torch's own state dict) load."""
    expected = trained[2].state_dict()
    model = _init_model()
    before = _full_params(model)
    bad = dict(expected)
    bad["lm_head.weight"] = expected["wte.weight"].clone()
    bad["lm_head.weight"][-1, -1] += 1  # one element
    plain = GPT(CFG)
    plain.load_state_dict(bad)
    assert torch.equal(plain.wte.weight, bad["lm_head.weight"])  # torch: the last name wins, without a word
    for strict in (True, False):
        with pytest.raises(zero3.CheckpointMismatchError) as info:
            zero3.pretrained.load_state_dict(model, bad, strict=strict)
        msg = str(info.value)
        assert "wte.weight and lm_head.weight, names of one tied parameter of the model, with different values" in msg
        assert "Nothing was loaded" in msg, msg
        got = _full_params(model)
        assert all(torch.equal(got[k], before[k]) for k in got)
    engine = make_engine(seed=4)  # into an engine (fp32 masters) too
    snap = snapshot(engine)
    with pytest.raises(zero3.CheckpointMismatchError, match="wte.weight and lm_head.weight"):
        zero3.pretrained.load_state_dict(engine, bad)
    assert_same(snapshot(engine), snap)
    tied = dict(expected)
    assert tied["lm_head.weight"].data_ptr() == tied["wte.weight"].data_ptr()
    tied["lm_head.weight"] = tied["wte.weight"].clone()  # equal values under both names: loads
    assert zero3.pretrained.load_state_dict(model, tied) == ([], [])
    got = _full_params(model)
    assert all(torch.equal(got[k], expected[k]) for k in got)
    tied["wte.weight"] = tied["wte.weight"].clone()
    tied["wte.weight"][0, 0] = float("nan")  # the same NaN under both names is the same value
    tied["lm_head.weight"] = tied["wte.weight"].clone()
    assert zero3.pretrained.load_state_dict(model, tied) == ([], [])
    assert _full_params(model)["wte.weight"][0, 0].isnan()
    tied["wte.weight"][0, 1] = 0.0  # and 0.0 against -0.0 beside it: equal values too (review 38R3: refused)
    tied["lm_head.weight"] = tied["wte.weight"].clone()
    tied["lm_head.weight"][0, 1] = -0.0
    assert zero3.pretrained.load_state_dict(model, tied) == ([], [])


@pytest.mark.parametrize("bad_value,words", [(torch.zeros(7, 3), "lm_head.weight: [7, 3] in the source, [256, 32] "
                                                                 "in the model"),
                                             ([1, 2], "lm_head.weight: a list, not a tensor")])
def test_pretrained_checks_every_name_of_a_tied_parameter(trained, bad_value, words):
    """Probe 38C F4: the second name of a tied parameter was neither checked, loaded nor reported, so a
    [7, 3] tensor under ``lm_head.weight`` (tied to the [256, 32] ``wte.weight``) loaded without a word;
    torch reports a size mismatch for it."""
    expected = trained[2].state_dict()
    bad = dict(expected)
    bad["lm_head.weight"] = bad_value
    with pytest.raises(RuntimeError, match="lm_head.weight"):
        GPT(CFG).load_state_dict(bad)
    model = _init_model()
    before = _full_params(model)
    for strict in (True, False):
        with pytest.raises(zero3.CheckpointMismatchError) as info:
            zero3.pretrained.load_state_dict(model, bad, strict=strict)
        assert words in str(info.value) and "wte.weight:" not in str(info.value), info.value
        got = _full_params(model)
        assert all(torch.equal(got[k], before[k]) for k in got)


def test_consolidated_safetensors_warning_names_the_file_written_not_the_staged_one(tmp_path, caplog):
    """Probe 38C F3: the extra-state warning of zero_to_fp32's safetensors output named the hidden staged file
    (``.model.safetensors.zero3-staged``), gone after the call, instead of ``model.safetensors``."""
    from zero3.deepspeed.utils.zero_to_fp32 import convert_zero_checkpoint_to_fp32_state_dict

    class WithExtra(GPT):
        def get_extra_state(self):
            return {"epoch": 1}

        def set_extra_state(self, state):
            pass

    torch.manual_seed(0)
    with zero3.Init():
        model = WithExtra(CFG)
    engine = zero3.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-3), {"param_persistence_threshold": 0})
    engine.save_checkpoint(tmp_path / "ckpt", tag="t")
    for out, shard in [(tmp_path / "one", "5GB"), (tmp_path / "sharded", 20_000)]:
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="zero3"):
            convert_zero_checkpoint_to_fp32_state_dict(tmp_path / "ckpt", out, max_shard_size=shard,
                                                       safe_serialization=True)
        said = [r.getMessage() for r in caplog.records if "leaves out the extra state" in r.getMessage()]
        first = "model.safetensors" if shard == "5GB" else sorted(p.name for p in out.glob("model-*.safetensors"))[0]
        assert len(said) == 1 and said[0].startswith(f"zero3::consolidate {out / first} leaves out"), said
        assert "zero3-staged" not in said[0]


def test_from_pretrained_on_a_bin_directory_names_the_route_that_loads_it(tmp_path):
    """Probe 38C F6: a directory holding pytorch_model.bin got CheckpointNotFoundError "no model.safetensors ...
    in it", naming neither that .bin is not read nor the load_state_dict route that reads it."""
    transformers = pytest.importorskip("transformers")
    torch.save(GPT(CFG).state_dict(), tmp_path / "pytorch_model.bin")
    with pytest.raises(zero3.CheckpointError) as info:
        zero3.from_pretrained(transformers.AutoModelForCausalLM, tmp_path)
    msg = str(info.value)
    assert not isinstance(info.value, zero3.CheckpointNotFoundError)
    assert "holds pytorch_model.bin, and zero3.from_pretrained reads only safetensors weights" in msg, msg
    assert "zero3.pretrained.load_state_dict(model, path/'pytorch_model.bin')" in msg, msg
    model = _init_model()
    with pytest.raises(zero3.CheckpointError, match="holds pytorch_model.bin, no model.safetensors .* pass the .bin"):
        zero3.pretrained.load_state_dict(model, tmp_path)
    assert zero3.pretrained.load_state_dict(model, tmp_path / "pytorch_model.bin") == ([], [])


# -- persistent parameters (every parameter of a small model, by default) --------------------------------
def _persistent_engine(dtype: str = "bf16", seed: int = 0) -> zero3.Engine:
    torch.manual_seed(seed)
    model = GPT(CFG)
    engine = zero3.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-6), {"dtype": dtype})
    assert all(p.ds_persist for p in engine.params)  # the default threshold keeps this GPT's parameters gathered
    for step in range(2):
        x, y = synthetic_batch(step, BATCH, CFG)
        engine.backward(engine(x, y))
        engine.step()
    return engine


def _consolidated(root: Path, out: Path) -> dict[str, torch.Tensor]:
    assert consolidate_main([str(root), str(out)]) == 0
    return torch.load(out, weights_only=True)


def test_persistent_parameters_are_saved_as_parameters_and_consolidate_to_their_fp32_masters(tmp_path):
    """They are always gathered, and the state dict hands out copies of gathered parameters: they used
    to be saved as buffers too, and consolidated from those, rounded to bf16."""
    engine = _persistent_engine()
    engine.save_checkpoint(tmp_path / "ck", tag="t")
    meta = json.loads((tmp_path / "ck" / "t" / "metadata.json").read_text())
    assert all(kind == "param" for _, kind, _ in meta["state_dict"]), meta["state_dict"]  # this GPT has no buffers
    sd = _consolidated(tmp_path / "ck", tmp_path / "full.pt")
    for n, p in engine.module.named_parameters():
        assert sd[n].dtype == torch.float32 and torch.equal(sd[n], zero3.safe_get_full_fp32_param(p)), n


def test_a_checkpoint_that_saved_persistent_parameters_as_buffers_too_loads_and_consolidates(tmp_path, monkeypatch):
    """What zero3 wrote before 2026-12-03: the loader reads their param/ entries, the consolidation too."""
    from zero3.checkpoint import layout

    engine = _persistent_engine()
    with monkeypatch.context() as m:
        m.setattr(layout, "state_tensors", lambda module: {  # its state_dict(keep_vars=True) copied them
            k: v.detach().clone() if getattr(v, "ds_persist", False) else v
            for k, v in module.state_dict(keep_vars=True).items()})
        engine.save_checkpoint(tmp_path / "ck", tag="t")
    masters = [zero3.safe_get_full_fp32_param(p).clone() for p in engine.params]
    sd = _consolidated(tmp_path / "ck", tmp_path / "full.pt")
    for (n, p), want in zip(engine.module.named_parameters(), masters):
        assert torch.equal(sd[n], want), n
    other = _persistent_engine(seed=1)
    other.load_checkpoint(tmp_path / "ck", tag="t")
    assert all(torch.equal(zero3.safe_get_full_fp32_param(p), w) for p, w in zip(other.params, masters))


def test_pretrained_loads_into_persistent_parameters():
    """It read the state dict's copies of them and loaded nothing, reporting success."""
    engine = _persistent_engine(dtype="fp32")
    result = zero3.pretrained.load_state_dict(engine, {k: torch.full_like(v, 0.25)
                                                        for k, v in engine.consolidated_state_dict().items()})
    assert result.missing_keys == [] and result.unexpected_keys == []
    for p in engine.params:
        assert torch.all(zero3.safe_get_full_fp32_param(p) == 0.25) and torch.all(p.detach() == 0.25), p._zero.name


def test_load_checkpoint_after_a_forward_whose_backward_did_not_run_trains_as_torch(tmp_path):
    """DeepSpeed's recovery from a non-finite loss: save, a forward whose loss is not finite (no
    backward), ``engine.zero_grad()``, ``engine.load_checkpoint``. At threshold 0 the forward left the
    step open with parameters kept for its backward, and the load was refused ("while parameters are
    gathered"). The load ends that step now, keeps no trace of it (from the second step on the steps
    gather as after a plain load), and training goes on as torch's from the saved state; the lost
    forward's backward raises, as torch's does after a load."""
    from torch import nn

    def build():
        return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))

    g = torch.Generator().manual_seed(0)
    batches = [(torch.randn(4, 8, generator=g), torch.randn(4, 4, generator=g)) for _ in range(6)]

    def run(cut: bool):
        torch.manual_seed(0)
        ref = build()
        torch.manual_seed(0)
        model = build()
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, eps=1e-6)
        engine = zero3.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-6),
                                  {"param_persistence_threshold": 0, "max_reuse_distance": 0})

        def train(x, y):
            ref_opt.zero_grad()
            ((ref(x) - y) ** 2).mean().backward()
            ref_opt.step()
            engine.backward(((engine(x) - y) ** 2).mean())
            engine.step()
            return engine.last_step_metrics.demand_fetches

        train(*batches[0])
        train(*batches[1])
        engine.save_checkpoint(tmp_path / str(cut))
        if cut:
            x, y = batches[2]
            loss = ((engine(x * float("inf")) - y) ** 2).mean()
            assert not torch.isfinite(loss)
            engine.zero_grad()
        engine.load_checkpoint(tmp_path / str(cut))
        assert engine.coordinator.live_params == []
        if cut:
            with pytest.raises(RuntimeError, match="modified by an inplace operation"):
                engine.backward(loss)  # its forward ran on the weights before the load: torch raises too
        fetches = [train(x, y) for x, y in batches[3:]]
        for (name, p), r in zip(model.named_parameters(), ref.parameters()):
            torch.testing.assert_close(zero3.safe_get_full_fp32_param(p), r.detach(), rtol=1e-6, atol=1e-7,
                                       msg=name)
        return fetches

    cut, plain = run(cut=True), run(cut=False)
    # From the second step on as after a plain load (keeping the cut step's trace made it [12, 8, 2]
    # against [2, 2, 2]); the first still fetches some modules on demand (6), left open.
    assert cut[1:] == plain[1:] and cut[0] >= plain[0], (cut, plain)


class _Filtered(torch.nn.Module):
    """A learnable layer behind a fixed complex filter kept as a buffer (an FFT filter)."""

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)
        self.register_buffer("filt", torch.randn(5, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        spectrum = torch.fft.rfft(self.lin(x)) * self.filt.to(torch.complex64)
        return torch.fft.irfft(spectrum, n=8)


def _filtered_engine(dtype: torch.dtype) -> zero3.Engine:
    torch.manual_seed(0)
    model = _Filtered(dtype)
    return zero3.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), {"param_persistence_threshold": 0})


def test_a_complex64_buffer_is_saved_and_loaded_and_a_complex128_one_is_refused_naming_it(tmp_path):
    """save_checkpoint raised a bare KeyError: torch.complex64 for a complex buffer (probe 31J)."""
    engine = _filtered_engine(torch.complex64)
    engine.backward(engine(torch.randn(2, 8)).square().mean())
    engine.step()
    saved = engine.module.filt.clone()
    engine.save_checkpoint(str(tmp_path), tag="a")
    engine.module.filt.zero_()
    engine.load_checkpoint(str(tmp_path), tag="a")
    assert engine.module.filt.dtype == torch.complex64 and torch.equal(engine.module.filt, saved)

    wide = _filtered_engine(torch.complex128)
    with pytest.raises(ValueError, match=r"'buffer/filt' of dtype torch.complex128 .* safetensors has no such dtype"):
        wide.save_checkpoint(str(tmp_path), tag="b")
    assert (tmp_path / "latest").read_text().strip() == "a"  # the last checkpoint stays, nothing half-written
    assert not (tmp_path / "b").exists() and not (tmp_path / ".b.partial").exists()  # the staging went (review 31RB)
    engine.load_checkpoint(str(tmp_path))
    assert torch.equal(engine.module.filt, saved)


@pytest.mark.parametrize("where", ["rank file", "its close too", "metadata"])
def test_a_save_that_fails_leaves_no_staging_and_the_last_checkpoint(tmp_path, monkeypatch, where):
    """A writer whose close flushed onto a full disk raised again out of the error path (that rank skipped
    the exchange the others waited in), and a failure after the rank files left the staging directory
    (review 31RD)."""
    from zero3.checkpoint import save as save_module

    engine = make_engine()
    train(engine, range(1))
    engine.save_checkpoint(str(tmp_path), tag="a")
    kept = snapshot(engine)

    def full(*args, **kwargs):
        raise OSError(28, "No space left on device (test)")

    if where == "metadata":
        monkeypatch.setattr(save_module, "atomic_write_bytes", full)
    else:
        monkeypatch.setattr(SafetensorsWriter, "write", full)
        if where == "its close too":
            real_init = SafetensorsWriter.__init__

            def failing_close(self, *args, **kwargs):
                real_init(self, *args, **kwargs)
                handle = self._fh
                real_close = handle.close

                class _Handle:
                    def __getattr__(self, name):
                        return getattr(handle, name)

                    @property
                    def closed(self):
                        return handle.closed

                    def close(self):
                        real_close()
                        raise OSError(27, "File too large (test)")

                self._fh = _Handle()

            monkeypatch.setattr(SafetensorsWriter, "__init__", failing_close)
    with pytest.raises(OSError, match="No space left on device"):
        engine.save_checkpoint(str(tmp_path), tag="b")
    monkeypatch.undo()
    assert sorted(os.listdir(tmp_path)) == ["a", "latest"]
    train(engine, range(1, 2))
    engine.load_checkpoint(str(tmp_path))
    now = snapshot(engine)
    assert now.keys() == kept.keys() and all(torch.equal(now[k], kept[k]) for k in kept)


@pytest.mark.parametrize("tag", ["a", "b"])
def test_a_save_whose_latest_write_fails_publishes_nothing_and_keeps_the_tag_it_replaced(tmp_path, monkeypatch, tag):
    """The tag was moved into place before ``latest`` was written: a failed write left the new tag
    published while every rank raised, and a tag saved again had replaced the last good one (review 31RE)."""
    from zero3.checkpoint import save as save_module

    engine = make_engine()
    train(engine, range(1))
    engine.save_checkpoint(str(tmp_path), tag="a")
    kept = snapshot(engine)
    train(engine, range(1, 2))
    real = save_module.atomic_write_bytes

    def no_latest(path, data):
        if Path(path).name == "latest":
            raise OSError(28, "No space left on device (test)")
        return real(path, data)

    monkeypatch.setattr(save_module, "atomic_write_bytes", no_latest)
    with pytest.raises(OSError, match="No space left on device"):
        engine.save_checkpoint(str(tmp_path), tag=tag)
    monkeypatch.undo()
    assert sorted(os.listdir(tmp_path)) == ["a", "latest"] and (tmp_path / "latest").read_text().strip() == "a"
    engine.load_checkpoint(str(tmp_path))
    now = snapshot(engine)
    assert all(torch.equal(now[k], kept[k]) for k in kept)


def _bf16_engine(frozen: str = "", split: bool | int = False, dtype: str = "bf16") -> zero3.Engine:
    torch.manual_seed(0)
    with zero3.Init():
        model = GPT(CFG)
    for n, p in model.named_parameters():
        p.requires_grad_(not (frozen and n.startswith(frozen)))
    ps = list(model.parameters())
    cut = 3 if split is True else int(split)
    groups = [{"params": ps[:cut]}, {"params": ps[cut:]}] if split else [{"params": ps}]
    return zero3.initialize(model, torch.optim.AdamW(groups, lr=1e-3, eps=1e-6),
                            {"param_persistence_threshold": 0, "dtype": dtype})


def test_a_frozen_parameter_moved_to_another_param_group_is_refused_under_fp32_as_torch_refuses_it(tmp_path):
    """fp32 keeps a frozen parameter in its param group, so the groups are compared with it: one frozen at
    the save and moved to another group (trainable there) is refused, as torch's load_state_dict refuses
    it (review 33RC: the comparison left out every parameter frozen in either run, and this loaded
    silently, the moved parameter training with its new group's hyperparameters)."""
    names = [n for n, _ in GPT(CFG).named_parameters()]
    moved = names[3]  # in group 1 at the save (frozen), group 0 at the load (trainable)
    _bf16_engine(frozen=moved, split=3, dtype="fp32").save_checkpoint(tmp_path, tag="t")
    other = _bf16_engine(split=4, dtype="fp32")
    before = snapshot(other)
    with pytest.raises(ck.CheckpointMismatchError, match="param groups differ") as info:
        other.load_checkpoint(tmp_path, tag="t")
    assert moved in str(info.value)
    assert_same(snapshot(other), before)


def test_param_groups_that_differ_beyond_the_frozen_set_are_refused_naming_the_way_out(tmp_path, monkeypatch):
    """Under bf16 frozen parameters are in no param group; the groups are compared without those frozen
    in either run (tests/multiproc/test_trainable.py loads across frozen sets), and what differs beyond
    them is refused naming load_optimizer_states=False; a checkpoint that does not record which
    parameters were frozen at the save (before 2026-12-06) says so."""
    _bf16_engine().save_checkpoint(tmp_path, tag="t")
    other = _bf16_engine(split=True)
    before = snapshot(other)
    with pytest.raises(ck.CheckpointMismatchError, match="frozen parameters that one run's groups leave out") as info:
        other.load_checkpoint(tmp_path, tag="t")
    assert "load_optimizer_states=False" in str(info.value) and "2026-12-06" not in str(info.value)
    assert_same(snapshot(other), before)
    other.load_checkpoint(tmp_path, tag="t", load_optimizer_states=False)
    _bf16_engine(frozen="h.0.").save_checkpoint(tmp_path, tag="old")
    from zero3.checkpoint import reader

    unrecorded = reader.ParamMeta  # read as a checkpoint saved before the metadata held requires_grad
    monkeypatch.setattr(reader, "ParamMeta", lambda **kw: unrecorded(**dict(kw, requires_grad=None)))
    with pytest.raises(ck.CheckpointMismatchError, match="does not record which were frozen") as info:
        _bf16_engine().load_checkpoint(tmp_path, tag="old")
    assert "h.0." in str(info.value) and "load_optimizer_states=False" in str(info.value)
    _bf16_engine(frozen="h.0.").load_checkpoint(tmp_path, tag="old")  # the same frozen set: as before
