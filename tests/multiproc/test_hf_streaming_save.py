"""``engine.save_pretrained(dir)`` on 2 gloo ranks: the Hugging Face directory written one gathered
tensor at a time (zero3/checkpoint/hf_save.py).

For a tiny Llama (untied) and GPT-2 (tied embeddings), built under `zero3.Init` and trained 3 AdamW
steps with every parameter partitioned, a save with a small ``max_shard_size`` gives several
safetensors files, the index and the configs that transformers' own ``save_pretrained`` of the
consolidated state dict gives (same weight map, same ``config.json``);
``AutoModelForCausalLM.from_pretrained`` in one process reads values bit-equal to the gathered
parameters; loading the directory into a fresh `Init` model (`zero3.pretrained.load_state_dict`)
and saving again writes byte-identical files. A bf16 model is saved in bf16 (its fp32 masters
rounded, as HF's ``model.dtype``), or in fp32 with ``state_dict_dtype``. Mixtral's fused experts are
written per expert, as transformers writes them. Throughout, rank 0 holds one gathered tensor at a
time and rank 1 none; a save rank 0 cannot write fails on both ranks.
"""

from __future__ import annotations

import json
import os
import weakref

import pytest

# Before transformers is imported (huggingface_hub reads it then): nothing is ever downloaded.
os.environ["HF_HUB_OFFLINE"] = "1"
transformers = pytest.importorskip("transformers")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import zero3  # noqa: E402
from zero3.checkpoint import hf_save  # noqa: E402
from zero3.checkpoint.safetensors import read_safetensors_header  # noqa: E402

pytestmark = pytest.mark.multiproc

VOCAB, PER_RANK, SEQ, STEPS = 96, 2, 16, 3
SHARD_BYTES = 20_000  # the tiny models hold ~100 KB: 5 to 8 files
ZERO_CFG = {"param_persistence_threshold": 0}


def _arch(name: str) -> tuple[type, object]:
    t = transformers
    if name == "gpt2":  # lm_head tied to the token embedding
        return t.GPT2LMHeadModel, t.GPT2Config(vocab_size=VOCAB, n_positions=64, n_embd=32, n_layer=2, n_head=4,
                                               resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=1,
                                               eos_token_id=2)
    if name == "mixtral":  # experts fused in 3-D parameters, saved per expert as its hub checkpoints are
        return t.MixtralForCausalLM, t.MixtralConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                                     num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                                                     num_local_experts=4, num_experts_per_tok=2,
                                                     max_position_embeddings=64)
    return t.LlamaForCausalLM, t.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                             max_position_embeddings=64)


class FullTensorTracker:
    """Wraps `hf_save.full_tensor` to count the bytes of the gathered tensors alive at once on this
    rank (each counted from its return until its last reference is dropped)."""

    def __init__(self) -> None:
        self.now = self.peak = self.largest = 0
        self._orig = hf_save.full_tensor

    def __enter__(self) -> FullTensorTracker:
        def tracked(ctx, source):
            t = self._orig(ctx, source)
            if t is not None:
                n = t.untyped_storage().nbytes()
                self.now += n
                self.peak, self.largest = max(self.peak, self.now), max(self.largest, n)
                weakref.finalize(t, self._dropped, n)
            return t

        hf_save.full_tensor = tracked
        return self

    def _dropped(self, n: int) -> None:
        self.now -= n

    def __exit__(self, *exc: object) -> None:
        hf_save.full_tensor = self._orig


def _gathered(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter's full value (named as the state dict names it), gathered one at a time."""
    out = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        with zero3.GatheredParameters([p]):
            out[name] = p.detach().clone()
    return out


def _trained(name: str, zero_cfg: dict) -> tuple[torch.nn.Module, object]:
    rank = dist.get_rank()
    cls, cfg = _arch(name)
    torch.manual_seed(0)
    with zero3.Init(config=zero_cfg):
        model = cls(cfg)
    engine = zero3.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-2), zero_cfg)
    for step in range(STEPS):
        ids = torch.randint(4, VOCAB, (PER_RANK * dist.get_world_size(), SEQ),
                            generator=torch.Generator().manual_seed(step))[rank * PER_RANK:(rank + 1) * PER_RANK]
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        engine.step()
    return model, engine


def _read_dir(directory: str) -> dict:
    """Files, the index, config.json and each tensor's dtype as saved."""
    files = sorted(os.listdir(directory))
    dtypes = {}
    for f in files:
        if f.endswith(".safetensors"):
            dtypes.update({k: e.dtype for k, e in read_safetensors_header(os.path.join(directory, f)).entries.items()})
    index = os.path.join(directory, "model.safetensors.index.json")
    return {"files": files, "dtypes": dtypes, "config": json.load(open(os.path.join(directory, "config.json"))),
            "index": json.load(open(index)) if os.path.exists(index) else None}


def _file_bytes(directory: str) -> dict[str, bytes]:
    return {f: open(os.path.join(directory, f), "rb").read() for f in sorted(os.listdir(directory))
            if f.endswith(".safetensors")}


def save_and_read_back(name: str, workdir: str) -> dict:
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    rank = dist.get_rank()
    out, again, ref = (os.path.join(workdir, f"{name}-{k}") for k in ("streamed", "again", "hf"))
    model, engine = _trained(name, ZERO_CFG)
    with FullTensorTracker() as tracked:
        engine.save_pretrained(out, max_shard_size=SHARD_BYTES)
    report: dict = {"peak": tracked.peak, "largest": tracked.largest,
                    "padded_max": max(p.ds_tensor.numel() * p.element_size() * dist.get_world_size()
                                      for p in model.parameters())}
    truth = _gathered(model)
    consolidated = engine.consolidated_state_dict()  # {} off rank 0
    # Round trip: a fresh model (another seed) loads the directory, and saves it again.
    torch.manual_seed(1)
    with zero3.Init():
        fresh = _arch(name)[0](_arch(name)[1])
    report["loaded"] = tuple(zero3.pretrained.load_state_dict(fresh, out))
    fresh_values = _gathered(fresh)
    report["round_trip_differs"] = [k for k, v in truth.items() if not torch.equal(fresh_values[k], v)]
    fresh_engine = zero3.initialize(fresh, None, ZERO_CFG)
    fresh_engine.save_pretrained(again, max_shard_size=SHARD_BYTES)
    if rank == 0:
        model.save_pretrained(ref, state_dict=dict(consolidated), max_shard_size=SHARD_BYTES)
        report["streamed"], report["hf"] = _read_dir(out), _read_dir(ref)
        report["resaved_identical"] = _file_bytes(out) == _file_bytes(again)
        back = transformers.AutoModelForCausalLM.from_pretrained(out)
        report["reloaded_type"] = type(back).__name__
        back_state = back.state_dict()
        report["keys"] = sorted(back_state) == sorted(truth)
        report["reload_differs"] = [k for k, v in truth.items() if not torch.equal(back_state[k], v)]
        report["consolidated_differs"] = [k for k, v in consolidated.items() if not torch.equal(truth[k], v)]
    return report


@pytest.mark.parametrize("name", ["llama", "gpt2"])  # untied and tied embeddings
def test_streamed_save_pretrained_reads_back_bit_exact_and_round_trips(pools, tmp_path, name):
    reports = pools.get(2).run(save_and_read_back, name, str(tmp_path), timeout=180)
    r = reports[0]
    streamed, hf = r["streamed"], r["hf"]
    shards = [f for f in streamed["files"] if f.startswith("model-")]
    assert len(shards) >= 4 and "model.safetensors.index.json" in streamed["files"], streamed["files"]
    assert {"config.json", "generation_config.json"} <= set(streamed["files"])
    assert streamed["files"] == hf["files"] and streamed["index"] == hf["index"], "not what transformers writes"
    assert streamed["config"] == hf["config"]
    assert ("lm_head.weight" in streamed["index"]["weight_map"]) == (name == "llama"), "tied copy written"
    assert set(streamed["dtypes"].values()) == {torch.float32}
    assert r["reloaded_type"] == _arch(name)[0].__name__ and r["keys"]
    assert r["reload_differs"] == [] and r["consolidated_differs"] == []
    assert r["resaved_identical"]
    for rank, rep in enumerate(reports):
        assert rep["loaded"] == ([], []), rank
        assert rep["round_trip_differs"] == [], (rank, rep["round_trip_differs"])
    # One gathered tensor at a time on rank 0 (a view of its padded gather buffer), none on rank 1.
    assert 0 < r["peak"] == r["largest"] <= r["padded_max"], r
    assert reports[1]["peak"] == 0


def save_bf16(workdir: str) -> dict:
    """A bf16 model: saved in bf16 by default (the fp32 masters rounded once, as the bf16 shards are),
    in fp32 with ``state_dict_dtype`` (the masters themselves)."""
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    zero_cfg = {"bf16": {"enabled": True}, **ZERO_CFG}
    model, engine = _trained("llama", zero_cfg)
    with FullTensorTracker() as tracked:
        engine.save_pretrained(os.path.join(workdir, "bf16"), max_shard_size=SHARD_BYTES)
    engine.save_pretrained(os.path.join(workdir, "fp32"), max_shard_size=SHARD_BYTES,
                           state_dict_dtype=torch.float32)
    truth = _gathered(model)
    masters = engine.consolidated_state_dict()
    report: dict = {"peak": tracked.peak, "largest": tracked.largest,
                    "largest_bf16": max(p.ds_numel for p in model.parameters()) * 2}
    if dist.get_rank() == 0:
        bf16, fp32 = (_read_dir(os.path.join(workdir, k)) for k in ("bf16", "fp32"))
        report["dtypes"] = (set(bf16["dtypes"].values()), set(fp32["dtypes"].values()))
        report["config_dtype"] = (bf16["config"]["dtype"], fp32["config"]["dtype"])
        back = transformers.AutoModelForCausalLM.from_pretrained(os.path.join(workdir, "bf16"))
        report["reloaded_dtype"] = back.dtype
        state = back.state_dict()
        report["bf16_differs"] = [k for k, v in truth.items() if not torch.equal(state[k], v)]
        state = transformers.AutoModelForCausalLM.from_pretrained(os.path.join(workdir, "fp32")).state_dict()
        report["fp32_differs"] = [k for k, v in masters.items() if not torch.equal(state[k], v)]
        report["masters_round_to_shards"] = all(torch.equal(masters[k].to(torch.bfloat16), v) for k, v in truth.items())
    return report


def test_bf16_model_is_saved_in_bf16_and_in_fp32_on_request(pools, tmp_path):
    reports = pools.get(2).run(save_bf16, str(tmp_path), timeout=180)
    r = reports[0]
    assert r["dtypes"] == ({torch.bfloat16}, {torch.float32})
    assert r["config_dtype"] == ("bfloat16", "float32")
    assert r["reloaded_dtype"] == torch.bfloat16
    assert r["bf16_differs"] == [] and r["fp32_differs"] == [] and r["masters_round_to_shards"]
    assert r["peak"] == r["largest"] == r["largest_bf16"], r  # the bf16 copy of one gathered master
    assert reports[1]["peak"] == 0


def save_mixtral_then_fail(workdir: str) -> dict:
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    model, engine = _trained("mixtral", ZERO_CFG)
    out, blocked = os.path.join(workdir, "mixtral"), os.path.join(workdir, "a-file")
    engine.save_pretrained(out, max_shard_size=SHARD_BYTES)
    truth = _gathered(model)
    report: dict = {}
    if dist.get_rank() == 0:
        open(blocked, "w").close()
        report["keys"] = sorted(_read_dir(out)["dtypes"])
        ref = os.path.join(workdir, "mixtral-hf")
        model.save_pretrained(ref, state_dict=dict(engine.consolidated_state_dict()), max_shard_size=SHARD_BYTES)
        report["hf_keys"] = sorted(_read_dir(ref)["dtypes"])
        state = transformers.AutoModelForCausalLM.from_pretrained(out).state_dict()
        report["reload_differs"] = [k for k, v in truth.items() if not torch.equal(state[k], v)]
    else:
        engine.consolidated_state_dict()  # the collective paired with rank 0's
    dist.barrier()
    try:  # rank 0 cannot create the directory: a file is in the way
        engine.save_pretrained(blocked)
    except Exception as exc:  # noqa: BLE001
        report["error"] = (type(exc).__name__, str(exc))
    return report


def test_mixtral_experts_saved_per_expert_and_a_failed_save_raises_on_every_rank(pools, tmp_path):
    reports = pools.get(2).run(save_mixtral_then_fail, str(tmp_path), timeout=180)
    r = reports[0]
    assert "model.layers.0.block_sparse_moe.experts.3.w2.weight" in r["keys"] and r["keys"] == r["hf_keys"]
    assert r["reload_differs"] == []
    for rank, rep in enumerate(reports):
        assert rep["error"][0] == "FileExistsError" and "a-file" in rep["error"][1], (rank, rep["error"])


class _FullDisk(hf_save.SafetensorsWriter):
    """What a full disk raises while rank 0 writes the last tensor of a save."""
    key = ""

    def write(self, key: str, tensor: torch.Tensor) -> None:
        if key == _FullDisk.key:
            raise OSError(28, "No space left on device")
        super().write(key, tensor)


def resave_over_earlier(workdir: str) -> dict:
    """Probe 35C: a sharded save over a single-file one left ``model.safetensors``, which transformers
    loads before the index (the old weights), and a save that failed part-way left the earlier save's
    files replaced by the new ones written so far (a mix that loaded without a word)."""
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    model, engine = _trained("llama", ZERO_CFG)
    out, rank = os.path.join(workdir, "resaved"), dist.get_rank()
    ids = torch.randint(4, VOCAB, (PER_RANK, SEQ), generator=torch.Generator().manual_seed(rank))

    def step() -> None:
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        engine.step()

    report: dict = {}
    engine.save_pretrained(out)  # one file
    step()
    engine.save_pretrained(out, max_shard_size=SHARD_BYTES)  # shards over it
    truth = _gathered(model)
    if rank == 0:
        report["sharded_files"] = sorted(os.listdir(out))
        state = transformers.AutoModelForCausalLM.from_pretrained(out).state_dict()
        report["hf_differs"] = [k for k, v in truth.items() if not torch.equal(state[k], v)]
        before = _file_bytes(out)
    step()
    _FullDisk.key = sorted(_read_dir(out)["dtypes"])[-1] if rank == 0 else ""
    hf_save.SafetensorsWriter = _FullDisk
    try:
        engine.save_pretrained(out, max_shard_size=SHARD_BYTES)
    except OSError as exc:
        report["error"] = str(exc)
    finally:
        hf_save.SafetensorsWriter = _FullDisk.__mro__[1]
    if rank == 0:
        report["after_failure"] = sorted(os.listdir(out)) == report["sharded_files"] and _file_bytes(out) == before
    renames, replace = [], os.replace

    def failing_replace(src, dst):  # review 35R1: a rename that failed part-way left new and old shards mixed
        renames.append(src)
        if str(src).endswith(".zero3-staged") and sum(str(s).endswith(".zero3-staged") for s in renames) == 3:
            raise OSError(5, "Input/output error")
        replace(src, dst)

    hf_save.os.replace = failing_replace if rank == 0 else replace
    try:
        engine.save_pretrained(out, max_shard_size=SHARD_BYTES)
    except OSError as exc:
        report["commit_error"] = str(exc)
    finally:
        hf_save.os.replace = replace
    if rank == 0:
        report["after_commit_failure"] = sorted(os.listdir(out)) == report["sharded_files"] and _file_bytes(out) == before
    engine.save_pretrained(out)  # one file again: the index and the shards go
    if rank == 0:
        report["single_files"] = sorted(os.listdir(out))
    return report


def test_a_save_over_an_earlier_one_leaves_one_set_of_files_and_a_failed_save_leaves_it_whole(pools, tmp_path):
    reports = pools.get(2).run(resave_over_earlier, str(tmp_path), timeout=180)
    r = reports[0]
    assert "model.safetensors" not in r["sharded_files"] and "model.safetensors.index.json" in r["sharded_files"], r
    assert r["hf_differs"] == [], r
    assert all("No space left" in rep["error"] for rep in reports), reports
    assert r["after_failure"] is True, r
    assert all("Input/output error" in rep["commit_error"] for rep in reports), reports
    assert r["after_commit_failure"] is True, r
    assert [f for f in r["single_files"] if "safetensors" in f] == ["model.safetensors"], r
